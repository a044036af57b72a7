#include "q4/io/remove_tree.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

namespace q4::io {
namespace {

// Removes `name` inside the directory `dirfd` (AT_FDCWD for a path relative to the working
// directory or absolute). On failure sets ec and `failed` to the entry's path.
std::uintmax_t remove_at(int dirfd, const std::string& name, const std::string& shown,
                         std::error_code& ec, std::string& failed) {
  struct stat st;
  if (::fstatat(dirfd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    if (errno == ENOENT) return 0;
    ec.assign(errno, std::generic_category());
    failed = shown;
    return 0;
  }
  std::uintmax_t n = 0;
  if (S_ISDIR(st.st_mode)) {
    const int fd = ::openat(dirfd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) {
      ec.assign(errno, std::generic_category());
      failed = shown;
      return 0;
    }
    DIR* d = ::fdopendir(fd);  // owns fd from here
    if (d == nullptr) {
      ec.assign(errno, std::generic_category());
      failed = shown;
      ::close(fd);
      return 0;
    }
    while (true) {
      errno = 0;
      const dirent* e = ::readdir(d);
      if (e == nullptr) {
        if (errno != 0) {
          ec.assign(errno, std::generic_category());
          failed = shown;
        }
        break;
      }
      const std::string child = e->d_name;
      if (child == "." || child == "..") continue;
      n += remove_at(::dirfd(d), child, shown + "/" + child, ec, failed);
      if (ec) break;
    }
    ::closedir(d);
    if (ec) return n;
    if (::unlinkat(dirfd, name.c_str(), AT_REMOVEDIR) != 0 && errno != ENOENT) {
      ec.assign(errno, std::generic_category());
      failed = shown;
      return n;
    }
  } else if (::unlinkat(dirfd, name.c_str(), 0) != 0 && errno != ENOENT) {
    ec.assign(errno, std::generic_category());
    failed = shown;
    return n;
  }
  return n + 1;
}

}  // namespace

std::uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec) noexcept {
  ec.clear();
  std::string failed;
  try {
    return remove_at(AT_FDCWD, path.string(), path.string(), ec, failed);
  } catch (...) {  // std::string allocation
    ec = std::make_error_code(std::errc::not_enough_memory);
    return 0;
  }
}

std::uintmax_t remove_tree(const std::filesystem::path& path) {
  std::error_code ec;
  std::string failed;
  const std::uintmax_t n = remove_at(AT_FDCWD, path.string(), path.string(), ec, failed);
  if (ec) {
    throw std::filesystem::filesystem_error("q4: cannot remove " + failed,
                                            std::filesystem::path(failed), ec);
  }
  return n;
}

}  // namespace q4::io
