// Scratch folders of the tests: a ScopedTempDir per test (removed with its files), a per-binary
// and per-user work root shared by the processes ctest starts for one binary, and a fresh
// (emptied) folder below it.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

namespace q4::test {

// One folder per test, removed with it; not copyable.
class ScopedTempDir {
 public:
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  // Creates <gtest TempDir>/<prefix>XXXXXX; ok() is false when that failed.
  explicit ScopedTempDir(const std::string& prefix);
  // Removes the folder's files and the folder (it holds no subfolders).
  ~ScopedTempDir();

  bool ok() const { return !dir_.empty(); }
  const std::string& dir() const { return dir_; }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }
  // Names of the entries, sorted, without "." and "..".
  std::vector<std::string> list() const;

 private:
  std::string dir_;
};

// temp_directory_path()/q4_<tag>_<uid>_<build tree hash>, created if missing: one folder per test
// binary, user and build tree (tests of one binary run in parallel processes under ctest and share
// it, with file locks where they share a run).
std::filesystem::path work_root(const std::string& tag);

// `dir` emptied (removed without following links, then created); returns it.
std::filesystem::path fresh_dir(const std::filesystem::path& dir);

}  // namespace q4::test
