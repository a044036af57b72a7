// Bounded input: what a user names as a file or pipes in is read with a size limit, so
// /dev/zero, a FIFO or a multi-gigabyte file given by mistake is an error naming it instead of
// a read that never ends. read_regular_file() refuses anything but a regular file (directories,
// FIFOs, devices, sockets) before reading; read_line_bounded() stops a line at a stated length.
#pragma once

#include <cstddef>
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

}  // namespace q4::io
