// NFC with HF tokenizers' Unicode 9.0 behaviour (see normalize.h). The text is cut at every
// post-9.0 normalization-relevant character; each run between them is normalized by utf8proc
// and the character itself is copied unchanged. The table below was generated from utf8proc
// 2.8 (Unicode 15.0: characters with ccc != 0 or in a canonical decomposition) minus those that
// Perl's Unicode::UCD (Unicode 14.0) dates to Age <= 9.0.
#include "normalize.h"

#include <c10/util/Exception.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

namespace q4::data {
namespace {

struct Range {
  int32_t first, last;
};

constexpr Range kPostUnicode9Normalizing[] = {
    {0x7FD, 0x7FD},     {0x898, 0x89F},     {0x8CA, 0x8D3},     {0x9FE, 0x9FE},
    {0xC3C, 0xC3C},     {0xD3B, 0xD3C},     {0xEBA, 0xEBA},     {0x1715, 0x1715},
    {0x1ABF, 0x1ACE},   {0x1DF6, 0x1DFA},   {0xA82C, 0xA82C},   {0x10D24, 0x10D27},
    {0x10EAB, 0x10EAC}, {0x10EFD, 0x10EFF}, {0x10F46, 0x10F50}, {0x10F82, 0x10F85},
    {0x11070, 0x11070}, {0x1133B, 0x1133B}, {0x1145E, 0x1145E}, {0x11839, 0x1183A},
    {0x11930, 0x11930}, {0x11935, 0x11935}, {0x11938, 0x11938}, {0x1193D, 0x1193E},
    {0x11943, 0x11943}, {0x119E0, 0x119E0}, {0x11A34, 0x11A34}, {0x11A47, 0x11A47},
    {0x11A99, 0x11A99}, {0x11D42, 0x11D42}, {0x11D44, 0x11D45}, {0x11D97, 0x11D97},
    {0x11F41, 0x11F42}, {0x16FF0, 0x16FF1}, {0x1E08F, 0x1E08F}, {0x1E130, 0x1E136},
    {0x1E2AE, 0x1E2AE}, {0x1E2EC, 0x1E2EF}, {0x1E4EC, 0x1E4EF}};

bool post_unicode9_normalizing(int32_t cp) {
  const auto* end = std::end(kPostUnicode9Normalizing);
  const auto* it = std::upper_bound(std::begin(kPostUnicode9Normalizing), end, cp,
                                    [](int32_t c, const Range& r) { return c < r.first; });
  return it != std::begin(kPostUnicode9Normalizing) && cp <= (it - 1)->last;
}

void append_nfc(std::string_view run, std::string* out) {
  if (run.empty()) return;
  utf8proc_uint8_t* dst = nullptr;
  const utf8proc_ssize_t len =
      utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(run.data()),
                   static_cast<utf8proc_ssize_t>(run.size()), &dst,
                   static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  TORCH_CHECK(len >= 0, "NFC normalization failed: ", utf8proc_errmsg(len));
  out->append(reinterpret_cast<const char*>(dst), static_cast<size_t>(len));
  std::free(dst);
}

}  // namespace

std::string nfc_like_hf(std::string_view s) {
  if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<uint8_t>(c) < 0x80; })) {
    return std::string(s);
  }
  std::string out;
  out.reserve(s.size());
  size_t run = 0, i = 0;
  while (i < s.size()) {
    int32_t cp = 0;
    const utf8proc_ssize_t n =
        utf8proc_iterate(reinterpret_cast<const utf8proc_uint8_t*>(s.data() + i),
                         static_cast<utf8proc_ssize_t>(s.size() - i), &cp);
    TORCH_CHECK(n > 0, "NFC normalization: invalid UTF-8 at byte ", i);
    if (cp >= 0x7FD && post_unicode9_normalizing(cp)) {
      append_nfc(s.substr(run, i - run), &out);
      out.append(s.data() + i, static_cast<size_t>(n));
      run = i + static_cast<size_t>(n);
    }
    i += static_cast<size_t>(n);
  }
  append_nfc(s.substr(run), &out);
  return out;
}

}  // namespace q4::data
