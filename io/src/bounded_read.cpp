// Bounded reads of user-named files and stdin lines (see bounded_read.h).
#include "q4/io/bounded_read.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "posix_common.h"

namespace q4::io {
namespace {

const char* file_kind(mode_t mode) {
  return S_ISFIFO(mode) ? "a FIFO (named pipe)" : non_regular_mode_name(mode);
}

}  // namespace

void ScopedFd::reset(int fd) noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string format_byte_limit(size_t bytes) {
  if (bytes >= (size_t{1} << 20) && bytes % (size_t{1} << 20) == 0) {
    return std::to_string(bytes >> 20) + " MiB";
  }
  if (bytes >= (size_t{1} << 10) && bytes % (size_t{1} << 10) == 0) {
    return std::to_string(bytes >> 10) + " KiB";
  }
  return std::to_string(bytes) + " bytes";
}

std::string read_regular_file(const std::string& path, size_t max_bytes, const std::string& what) {
  // O_NONBLOCK: opening a FIFO without a writer would otherwise wait forever before fstat
  // could tell what it is. A regular file ignores the flag.
  const ScopedFd f(::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  if (f.get() < 0) {
    const int e = errno;
    TORCH_CHECK(e != ENOENT, what, " ", path, ": no such file");
    TORCH_CHECK(false, what, " ", path, ": cannot open: ", std::strerror(e));
  }
  struct stat st {};
  TORCH_CHECK(::fstat(f.get(), &st) == 0, what, " ", path, ": cannot stat: ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), what, " ", path, " is ", file_kind(st.st_mode),
              "; expected a regular file");
  TORCH_CHECK(static_cast<uint64_t>(st.st_size) <= max_bytes, what, " ", path, " has ", st.st_size,
              " bytes; the limit is ", format_byte_limit(max_bytes));
  std::string out;
  out.resize(static_cast<size_t>(st.st_size));
  size_t have = 0;
  // The size is checked again while reading: a file that grows after fstat stops at the limit.
  char extra = 0;
  while (true) {
    char* dst = have < out.size() ? &out[have] : &extra;
    const size_t want = have < out.size() ? out.size() - have : 1;
    const ssize_t n = ::read(f.get(), dst, want);
    if (n < 0 && errno == EINTR) continue;
    TORCH_CHECK(n >= 0, what, " ", path, ": read failed: ", std::strerror(errno));
    if (n == 0) break;
    if (have >= out.size()) {
      TORCH_CHECK(out.size() + 1 <= max_bytes, what, " ", path, " has more than ",
                  format_byte_limit(max_bytes), "; the limit is ", format_byte_limit(max_bytes));
      out.push_back(extra);
      ++have;
    } else {
      have += static_cast<size_t>(n);
    }
  }
  out.resize(have);
  return out;
}

void check_regular_file(const std::string& path, size_t max_bytes, const std::string& what) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int e = errno;
    TORCH_CHECK(e != ENOENT, what, " ", path, ": no such file");
    TORCH_CHECK(false, what, " ", path, ": cannot stat: ", std::strerror(e));
  }
  TORCH_CHECK(S_ISREG(st.st_mode), what, " ", path, " is ", file_kind(st.st_mode),
              "; expected a regular file");
  TORCH_CHECK(static_cast<uint64_t>(st.st_size) <= max_bytes, what, " ", path, " has ", st.st_size,
              " bytes; the limit is ", format_byte_limit(max_bytes));
}

bool pread_full(int fd, void* dst, uint64_t n, uint64_t offset, int* err) {
  constexpr uint64_t kChunkBytes = uint64_t{1} << 30;  // per pread call (< the 2 GiB limit)
  auto* p = static_cast<uint8_t*>(dst);
  while (n > 0) {
    const ssize_t got =
        ::pread(fd, p, static_cast<size_t>(std::min(n, kChunkBytes)), static_cast<off_t>(offset));
    if (got < 0) {
      if (errno == EINTR) continue;
      *err = errno;
      return false;
    }
    if (got == 0) {
      *err = 0;
      return false;
    }
    p += got;
    offset += static_cast<uint64_t>(got);
    n -= static_cast<uint64_t>(got);
  }
  return true;
}

void read_file_range(int fd, const std::string& path, uint64_t file_size, uint64_t offset,
                     uint64_t n, void* dst) {
  TORCH_CHECK(offset <= file_size && n <= file_size - offset, path, ": read of ", n,
              " bytes at offset ", offset, " is past the end (", file_size, " bytes)");
  int err = 0;
  TORCH_CHECK(pread_full(fd, dst, n, offset, &err), path, ": reading ", n, " bytes at offset ",
              offset, ": ", err ? std::strerror(err) : "file shrank after indexing");
}

LineRead read_line_bounded(std::istream& in, std::string& line, size_t max_bytes) {
  line.clear();
  std::streambuf* sb = in.rdbuf();
  if (sb == nullptr) {
    in.setstate(std::ios::badbit);
    return LineRead::kEof;
  }
  using Traits = std::char_traits<char>;
  while (true) {
    const Traits::int_type c = sb->sbumpc();
    if (Traits::eq_int_type(c, Traits::eof())) {
      in.setstate(std::ios::eofbit);
      return line.empty() ? LineRead::kEof : LineRead::kLine;
    }
    if (Traits::to_char_type(c) == '\n') return LineRead::kLine;
    if (line.size() >= max_bytes) return LineRead::kTooLong;
    line.push_back(Traits::to_char_type(c));
  }
}

}  // namespace q4::io
