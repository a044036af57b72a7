// Names read from files (.dat keys, safetensors tensor names) as they appear in one-line error
// messages: a hostile name cannot break the line or forge a quote.
#pragma once

#include <cstddef>
#include <string>

namespace q4::io {

// `s` for a message: printable ASCII kept, multi-byte UTF-8 kept when all of `s` is valid UTF-8,
// everything else (control bytes, DEL, quotes, backslashes, invalid bytes) as \xNN; cut at 200
// bytes ("...").
std::string printable(const std::string& s);

}  // namespace q4::io
