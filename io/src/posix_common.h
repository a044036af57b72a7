// What the io sources share about POSIX calls: the largest transfer one read/write/
// copy_file_range call is given (Linux moves at most 0x7ffff000 bytes per call), and errno as
// text for messages.
#pragma once

#include <cstdint>
#include <cstring>
#include <string>

namespace q4::io {

inline constexpr uint64_t kIoChunkBytes = uint64_t{1} << 30;

inline std::string errno_text(int err) { return std::strerror(err); }

}  // namespace q4::io
