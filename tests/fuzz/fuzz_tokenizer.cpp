// libFuzzer target: tokenizer.json loading and encoding. The first byte picks the mode: even,
// the input is a tokenizer.json (loaded, then used to encode a fixed text); odd, the rest is
// text encoded by the real Qwen3 tokenizer (Q4_TOKENIZER_PATH) and decoded back, which must be
// stable (the first round trip normalizes to NFC, the second changes nothing). Errors must be
// c10::Error; crashes, UB and a failed round trip are findings.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "q4/data/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] % 2 == 0) {
    try {
      const auto tok = q4::data::Tokenizer::from_json_string(rest, "fuzz.json");
      (void)tok.encode("Hello, world! 你好 <|im_start|>");
    } catch (const c10::Error&) {
    }
    return 0;
  }
  static const auto qwen =
      std::make_unique<q4::data::Tokenizer>(q4::data::Tokenizer::from_file(Q4_TOKENIZER_PATH));
  try {
    // decode(encode(x)) is x after NFC (not x itself: "e\u0301" becomes "\u00e9"), so the
    // round trip must be stable from its first result on.
    const std::string once = qwen->decode(qwen->encode(rest));
    if (qwen->decode(qwen->encode(once)) != once) std::abort();
  } catch (const c10::Error&) {
    // invalid UTF-8 is rejected with an error naming the offset
  }
  return 0;
}
