// Names from files in one-line messages (see message_text.h).
#include "q4/io/message_text.h"

#include <cstdint>
#include <cstdio>

namespace q4::io {

size_t utf8_invalid_at(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned char c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    uint32_t cp;
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
      cp = c & 0x1F;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      cp = c & 0x0F;
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return i;
    }
    if (i + len > n) return i;
    for (size_t k = 1; k < len; ++k) {
      if ((p[i + k] & 0xC0) != 0x80) return i;
      cp = (cp << 6) | (p[i + k] & 0x3F);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) || cp > 0x10FFFF ||
        (cp >= 0xD800 && cp <= 0xDFFF)) {
      return i;
    }
    i += len;
  }
  return std::string::npos;
}

std::string printable(const std::string& k) {
  const bool valid = utf8_invalid_at(k) == std::string::npos;
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
