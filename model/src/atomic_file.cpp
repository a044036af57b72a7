// AtomicFile (atomic_file.h): temp file + fsync + rename + directory fsync.
#include "q4/model/atomic_file.h"

#include <c10/util/Exception.h>
#include <errno.h>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>

namespace q4::model {
namespace {

constexpr size_t kBufferBytes = size_t{4} << 20;
constexpr size_t kMaxWriteBytes = size_t{1} << 30;  // per write(2) call
std::atomic<uint64_t> g_seq{0};

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  TORCH_CHECK(!path_.empty(), "AtomicFile: empty output path");
  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(g_seq++);
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, path_, ": cannot create temp file ", tmp_path_, ": ",
              std::strerror(errno));
  buf_.reserve(kBufferBytes);
}

AtomicFile::~AtomicFile() {
  if (!committed_) abort();
}

void AtomicFile::abort() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  if (!committed_) ::unlink(tmp_path_.c_str());
}

void AtomicFile::flush() {
  const uint8_t* p = buf_.data();
  size_t n = buf_.size();
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, std::min(n, kMaxWriteBytes));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, tmp_path_, ": write failed: ", std::strerror(errno));
    p += w;
    n -= static_cast<size_t>(w);
  }
  buf_.clear();
}

void AtomicFile::write(const void* data, size_t nbytes) {
  TORCH_CHECK(fd_ >= 0 && !committed_, path_, ": AtomicFile written after commit or failure");
  const auto* c = static_cast<const uint8_t*>(data);
  bytes_ += nbytes;
  while (nbytes > 0) {
    const size_t take = std::min(nbytes, kBufferBytes - buf_.size());
    buf_.insert(buf_.end(), c, c + take);
    c += take;
    nbytes -= take;
    if (buf_.size() == kBufferBytes) flush();
  }
}

void AtomicFile::commit() {
  TORCH_CHECK(fd_ >= 0 && !committed_, path_, ": AtomicFile committed twice or after failure");
  flush();
  TORCH_CHECK(::fsync(fd_) == 0, tmp_path_, ": fsync failed: ", std::strerror(errno));
  const int fd = fd_;
  fd_ = -1;
  TORCH_CHECK(::close(fd) == 0, tmp_path_, ": close failed: ", std::strerror(errno));
  TORCH_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, path_, ": rename from ", tmp_path_,
              " failed: ", std::strerror(errno));
  committed_ = true;
  const std::string dir = parent_dir(path_);
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(dfd >= 0, dir, ": cannot open directory to fsync: ", std::strerror(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  TORCH_CHECK(rc == 0, dir, ": directory fsync failed: ", std::strerror(err));
}

void write_file_atomic(const std::string& path, const std::string& content) {
  AtomicFile f(path);
  f.write(content.data(), content.size());
  f.commit();
}

}  // namespace q4::model
