// Private: NFC exactly as HF tokenizers computes it. HF normalizes with the Rust crate
// unicode-normalization-alignments 0.1.12, whose tables are Unicode 9.0.0; utf8proc is newer.
// Characters assigned after 9.0 that carry a combining class or take part in a canonical
// decomposition are therefore treated as inert starters (HF neither reorders nor composes them).
#pragma once

#include <string>
#include <string_view>

namespace q4::data {

// NFC of valid UTF-8 `s` with Unicode 9.0 normalization behaviour; ASCII input is returned as is.
std::string nfc_like_hf(std::string_view s);

}  // namespace q4::data
