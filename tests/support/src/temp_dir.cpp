// Scratch folders of the tests (see q4/test/temp_dir.h).
#include "q4/test/temp_dir.h"

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <sstream>

#include "q4/io/remove_tree.h"

namespace fs = std::filesystem;

namespace q4::test {

ScopedTempDir::ScopedTempDir(const std::string& prefix) {
  std::string tmpl = ::testing::TempDir() + "/" + prefix + "XXXXXX";
  if (::mkdtemp(tmpl.data()) != nullptr) dir_ = tmpl;
}

ScopedTempDir::~ScopedTempDir() {
  if (dir_.empty()) return;
  for (const std::string& f : list()) std::remove(path(f).c_str());
  ::rmdir(dir_.c_str());
}

std::vector<std::string> ScopedTempDir::list() const {
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

fs::path work_root(const std::string& tag) {
  // The build tree's hash keeps two checkouts of one user, tested at once, apart.
  std::ostringstream tree;
  tree << std::hex << (std::hash<std::string>{}(Q4_BIN_DIR) & 0xffffffu);
  const fs::path p = fs::temp_directory_path() /
                     ("q4_" + tag + "_" + std::to_string(::getuid()) + "_" + tree.str());
  fs::create_directories(p);
  return p;
}

fs::path fresh_dir(const fs::path& dir) {
  q4::io::remove_tree(dir);
  fs::create_directories(dir);
  return dir;
}

}  // namespace q4::test
