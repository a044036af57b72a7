// Bounded reads of user-named files and stdin lines (see bounded_read.h).
#include "q4/io/bounded_read.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace q4::io {
namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

struct Fd {
  int fd = -1;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

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
  Fd f;
  f.fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (f.fd < 0) {
    const int e = errno;
    TORCH_CHECK(e != ENOENT, what, " ", path, ": no such file");
    TORCH_CHECK(false, what, " ", path, ": cannot open: ", std::strerror(e));
  }
  struct stat st {};
  TORCH_CHECK(::fstat(f.fd, &st) == 0, what, " ", path, ": cannot stat: ", std::strerror(errno));
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
    const ssize_t n = ::read(f.fd, dst, want);
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
