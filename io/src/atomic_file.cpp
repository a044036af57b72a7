// AtomicFile, AppendFile and stale-temp cleanup (see atomic_file.h).
#include "q4/io/atomic_file.h"

#include <c10/util/Exception.h>
#include <dirent.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "posix_common.h"

namespace q4::io {
namespace {

std::atomic<uint64_t> g_tmp_seq{0};

std::string parent_dir(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void write_fd(int fd, const void* data, size_t n, const std::string& name) {
  const auto* c = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd, c, std::min<size_t>(n, kIoChunkBytes));
    if (w < 0 && errno == EINTR) continue;
    TORCH_CHECK(w > 0, name,
                ": write failed: ", w == 0 ? std::string("no progress") : errno_text(errno));
    c += w;
    n -= static_cast<size_t>(w);
  }
}

bool all_digits(const std::string& s) {
  return !s.empty() &&
         std::all_of(s.begin(), s.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

// The pid of a temp file name, or -1 when the name is not one.
long temp_pid(const std::string& name) {
  const size_t at = name.rfind(".tmp.");
  if (at == std::string::npos || at == 0) return -1;
  std::string rest = name.substr(at + 5);
  const size_t dot = rest.find('.');
  const std::string pid = rest.substr(0, dot);
  if (!all_digits(pid) || pid.size() > 9) return -1;
  if (dot != std::string::npos && !all_digits(rest.substr(dot + 1))) return -1;
  return std::stol(pid);
}

std::string kind_of_mode(mode_t m) { return S_ISREG(m) ? "" : non_regular_mode_name(m); }

void check_regular_target(const std::string& path) {
  const std::string kind = non_regular_kind(path);
  TORCH_CHECK(kind.empty(), path, " is ", kind,
              "; an output is written only as a regular file or a new path");
}

std::vector<std::string> remove_temps(const std::string& dir, const std::string& only_for,
                                      bool own_is_stale);

}  // namespace

std::string non_regular_kind(const std::string& path) {
  struct stat st {};
  if (::lstat(path.c_str(), &st) != 0) return "";  // absent (or unreachable: open will say)
  if (!S_ISLNK(st.st_mode)) return kind_of_mode(st.st_mode);
  if (::stat(path.c_str(), &st) != 0) return "";  // a dangling link: the rename replaces the link
  const std::string target = kind_of_mode(st.st_mode);
  return target.empty() ? "" : "a symbolic link to " + target;
}

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  TORCH_CHECK(!path_.empty(), "AtomicFile: empty output path");
  check_regular_target(path_);
  // A writer of this path killed before commit() (kill -9) left its temp file: it goes now, so
  // that repeated crashes never accumulate them. A live writer's (another process) stays.
  const size_t slash = path_.find_last_of('/');
  remove_temps(parent_dir(path_), slash == std::string::npos ? path_ : path_.substr(slash + 1),
               /*own_is_stale=*/false);
  tmp_path_ = path_ + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(g_tmp_seq++);
  fd_ = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  TORCH_CHECK(fd_ >= 0, path_, ": cannot create temp file ", tmp_path_, ": ", errno_text(errno));
}

AtomicFile::~AtomicFile() {
  if (!committed_) abort();
}

void AtomicFile::abort() noexcept {
  if (fd_ >= 0) {
    ::close(fd_);
    fd_ = -1;
  }
  if (!committed_ && !tmp_path_.empty()) ::unlink(tmp_path_.c_str());
  failed_ = !committed_;
}

void AtomicFile::write(const void* data, size_t nbytes) {
  TORCH_CHECK(fd_ >= 0 && !failed_, path_, ": write after commit(), abort() or a failed write");
  try {
    write_fd(fd_, data, nbytes, tmp_path_);
  } catch (...) {
    failed_ = true;
    throw;
  }
}

void AtomicFile::commit() {
  TORCH_CHECK(fd_ >= 0 && !failed_, path_, ": commit() after commit(), abort() or a failed write");
  try {
    TORCH_CHECK(::fsync(fd_) == 0, tmp_path_, ": fsync failed: ", errno_text(errno));
    const int fd = fd_;
    fd_ = -1;
    TORCH_CHECK(::close(fd) == 0, tmp_path_, ": close failed: ", errno_text(errno));
    check_regular_target(path_);  // again: it may have changed while the bytes were written
    TORCH_CHECK(::rename(tmp_path_.c_str(), path_.c_str()) == 0, path_, ": rename from ", tmp_path_,
                " failed: ", errno_text(errno));
  } catch (...) {
    abort();
    throw;
  }
  committed_ = true;
  fsync_directory(parent_dir(path_));
}

void write_file_atomic(const std::string& path, const std::string& bytes) {
  AtomicFile f(path);
  f.write(bytes);
  f.commit();
}

void fsync_directory(const std::string& dir) {
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  TORCH_CHECK(dfd >= 0, dir, ": cannot open directory to fsync: ", errno_text(errno));
  const int rc = ::fsync(dfd);
  const int err = errno;
  ::close(dfd);
  TORCH_CHECK(rc == 0, dir, ": directory fsync failed: ", errno_text(err));
}

bool is_temp_file_name(const std::string& file_name) { return temp_pid(file_name) >= 0; }

namespace {

// remove_stale_temp_files; `own_is_stale`: this process's own temps count as dead writers'.
std::vector<std::string> remove_temps(const std::string& dir, const std::string& only_for,
                                      bool own_is_stale) {
  std::vector<std::string> removed;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return removed;
  std::vector<std::string> names;
  while (const dirent* e = ::readdir(d)) names.emplace_back(e->d_name);
  ::closedir(d);
  for (const auto& name : names) {
    const long pid = temp_pid(name);
    if (pid < 0) continue;
    if (!only_for.empty() && name.rfind(only_for + ".tmp.", 0) != 0) continue;
    // A live writer other than this process keeps its temp file (kill(pid, 0) fails with ESRCH
    // only when no such process exists; EPERM means it exists).
    const bool alive = pid == ::getpid()
                           ? !own_is_stale
                           : ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM;
    if (alive) continue;
    const std::string p = dir + "/" + name;
    if (::unlink(p.c_str()) == 0) removed.push_back(p);
  }
  return removed;
}

}  // namespace

std::vector<std::string> remove_stale_temp_files(const std::string& dir,
                                                 const std::string& only_for) {
  return remove_temps(dir, only_for, /*own_is_stale=*/true);
}

AppendFile::~AppendFile() {
  if (fd_ >= 0) ::close(fd_);
}

void AppendFile::open(const std::string& path, bool truncate) {
  if (fd_ >= 0) close();
  path_ = path;
  // Appending never replaces the target, so a character device (/dev/full in the full-disk
  // tests, /dev/null) is written into, not over; a FIFO would block and a directory fails.
  const std::string kind = non_regular_kind(path);
  TORCH_CHECK(kind.empty() || kind.find("device") != std::string::npos, path, " is ", kind,
              "; a log is appended only to a regular file or a new path");
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC | (truncate ? O_TRUNC : 0),
               0644);
  TORCH_CHECK(fd_ >= 0, path, ": cannot open for writing: ", errno_text(errno));
}

void AppendFile::write(const std::string& bytes) {
  TORCH_CHECK(fd_ >= 0, path_, ": write to a closed file");
  write_fd(fd_, bytes.data(), bytes.size(), path_);
}

void AppendFile::sync() {
  TORCH_CHECK(fd_ < 0 || ::fsync(fd_) == 0, path_, ": fsync failed: ", errno_text(errno));
}

void AppendFile::close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  TORCH_CHECK(::close(fd) == 0, path_, ": close failed: ", errno_text(errno));
}

}  // namespace q4::io
