// What the io sources share about POSIX calls: the largest transfer one read/write/
// copy_file_range call is given (Linux moves at most 0x7ffff000 bytes per call), errno as text
// for messages, and what a file that is not a regular file is, for messages.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace q4::io {

inline constexpr uint64_t kIoChunkBytes = uint64_t{1} << 30;

inline std::string errno_text(int err) { return std::strerror(err); }

// The kind of a file of mode `mode` that is not a regular file ("a directory", "a FIFO", ...).
inline const char* non_regular_mode_name(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

}  // namespace q4::io
