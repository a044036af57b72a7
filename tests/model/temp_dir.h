// A fresh, empty directory for one test (under gtest's TempDir), removed with its files when the
// object goes away. Shared by the .dat container and q4dat tool tests, which also use it to see
// that no temporary file is left behind.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace q4::model::test {

class ScopedTempDir {
 public:
  // Creates <TempDir>/<prefix>XXXXXX; ok() is false when that failed.
  explicit ScopedTempDir(const std::string& prefix) {
    std::string tmpl = ::testing::TempDir() + "/" + prefix + "XXXXXX";
    if (::mkdtemp(tmpl.data()) != nullptr) dir_ = tmpl;
  }
  ~ScopedTempDir() {
    if (dir_.empty()) return;
    for (const std::string& f : list()) std::remove(path(f).c_str());
    ::rmdir(dir_.c_str());
  }
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;

  bool ok() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Names of the entries, sorted, without "." and "..".
  std::vector<std::string> list() const {
    std::vector<std::string> out;
    DIR* d = ::opendir(dir_.c_str());
    if (!d) return out;
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") out.push_back(n);
    }
    ::closedir(d);
    std::sort(out.begin(), out.end());
    return out;
  }

 private:
  std::string dir_;
};

}  // namespace q4::model::test
