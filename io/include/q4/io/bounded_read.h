// Bounded input: what a user names as a file or pipes in is read with a size limit, so
// /dev/zero, a FIFO or a multi-gigabyte file given by mistake is an error naming it instead of
// a read that never ends. read_regular_file() refuses anything but a regular file (directories,
// FIFOs, devices, sockets) before reading; read_line_bounded() stops a line at a stated length.
// The positioned reads of the containers (.dat, safetensors) are here too: bounds-checked pread
// loops over an open descriptor.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>

namespace q4::io {

// The whole of the regular file `path`, at most `max_bytes` bytes. `what` names the file's role
// in errors ("config file"): missing, unreadable, not a regular file (its kind is named) or
// larger than `max_bytes` throw naming `what`, the path and the limit.
std::string read_regular_file(const std::string& path, size_t max_bytes, const std::string& what);

// The same checks without reading, for files a library loader opens itself: `path` is a regular
// file of at most `max_bytes` bytes (stat only, so a FIFO is refused without blocking).
void check_regular_file(const std::string& path, size_t max_bytes, const std::string& what);

enum class LineRead {
  kLine,     // `line` holds the next line, without its '\n' (the last line may lack one)
  kEof,      // nothing left
  kTooLong,  // the line has more than `max_bytes` bytes; `line` holds its first `max_bytes`
};
// The next '\n'-terminated line of `in`, reading at most `max_bytes` + 1 bytes of it.
LineRead read_line_bounded(std::istream& in, std::string& line, size_t max_bytes);

// "16 MiB", "512 KiB", "100 bytes": a byte limit as an error message states it.
std::string format_byte_limit(size_t bytes);

// An owned file descriptor (-1: none), closed when the object goes away or is reset.
class ScopedFd {
 public:
  ScopedFd() = default;
  explicit ScopedFd(int fd) : fd_(fd) {}
  ~ScopedFd() { reset(); }
  ScopedFd(const ScopedFd&) = delete;
  ScopedFd& operator=(const ScopedFd&) = delete;

  int get() const { return fd_; }
  void reset(int fd = -1) noexcept;  // closes the descriptor held, then holds `fd`

 private:
  int fd_ = -1;
};

// Exactly `n` bytes at `offset` of `fd` into `dst` (pread, looping over partial reads and EINTR,
// at most 1 GiB per call). False at end of file (*err = 0) or on a read error (*err = errno).
bool pread_full(int fd, void* dst, uint64_t n, uint64_t offset, int* err);

// Bytes [offset, offset + n) of the indexed file `path` (`file_size` bytes when indexed) into
// `dst`; a range past the end, a read error or a file that shrank throws naming `path`.
void read_file_range(int fd, const std::string& path, uint64_t file_size, uint64_t offset,
                     uint64_t n, void* dst);

}  // namespace q4::io
