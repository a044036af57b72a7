// Names from files in one-line messages (see message_text.h).
#include "q4/io/message_text.h"

#include <cstdint>
#include <cstdio>

#include "q4/io/utf8.h"

namespace q4::io {

std::string printable(const std::string& k) {
  const bool valid = utf8::find_invalid(k) == std::string::npos;
  std::string out;
  for (size_t i = 0; i < k.size(); ++i) {
    if (out.size() >= 200) {
      out += "...";
      break;
    }
    const unsigned char c = static_cast<unsigned char>(k[i]);
    if ((c >= 0x20 && c < 0x7F && c != '\\' && c != '\'') || (c >= 0x80 && valid)) {
      out.push_back(static_cast<char>(c));
    } else {
      char tmp[8];
      std::snprintf(tmp, sizeof(tmp), "\\x%02X", c);
      out += tmp;
    }
  }
  return out;
}

}  // namespace q4::io
