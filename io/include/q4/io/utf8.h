// The one UTF-8 decoder: strict validation (no overlongs, no surrogates, nothing above
// U+10FFFF) that reports the first bad byte offset, code points one at a time, and lossy repair
// that replaces each maximal invalid subpart by U+FFFD (the same rule as Rust's
// String::from_utf8_lossy, which HF tokenizers' decode uses). Header-only: the tokenizer's inner
// loops inline it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

namespace q4::io::utf8 {

// Length (1..4) of the valid UTF-8 sequence starting at s[i], or 0 when it is invalid; then
// *bad_len is the length of the maximal subpart to replace (>= 1).
inline size_t sequence_length(std::string_view s, size_t i, size_t* bad_len) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  const uint8_t b0 = p[i];
  *bad_len = 1;
  if (b0 < 0x80) return 1;
  size_t need = 0;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // no surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // <= U+10FFFF
  } else {
    return 0;
  }
  size_t k = 1;
  for (; k <= need; ++k) {
    if (i + k >= n) break;
    const uint8_t b = p[i + k];
    const bool ok = (k == 1) ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) break;
  }
  if (k > need) return need + 1;
  *bad_len = k;  // the lead byte plus the continuation bytes that were still valid
  return 0;
}

// The code point of the sequence starting at s[i] (i < s.size()) and its length; an invalid
// sequence is U+FFFD with the length of its maximal subpart.
inline std::pair<uint32_t, size_t> decode(std::string_view s, size_t i) {
  size_t bad = 0;
  const size_t len = sequence_length(s, i, &bad);
  if (len == 0) return {0xFFFD, bad};
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  if (len == 1) return {p[0], 1};
  uint32_t cp = p[0] & (0x7F >> len);
  for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (p[k] & 0x3F);
  return {cp, len};
}

// Offset of the first invalid byte, or npos when `s` is valid UTF-8.
inline size_t find_invalid(std::string_view s) {
  size_t i = 0;
  const size_t n = s.size();
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, s.data() + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    size_t bad = 0;
    const size_t len = sequence_length(s, i, &bad);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

// Copy of `s` with every maximal invalid subpart replaced by U+FFFD.
inline std::string repair(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    size_t bad = 0;
    const size_t len = sequence_length(s, i, &bad);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

}  // namespace q4::io::utf8
