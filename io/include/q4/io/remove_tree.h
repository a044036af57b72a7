// Recursive removal of a file or directory tree: the project's replacement for
// std::filesystem::remove_all. Every q4 binary that loads LibTorch 2.x (the GPU build: libtorch.so
// 2.11 exports its own copies of the std::filesystem functions, which the dynamic linker binds
// ahead of libstdc++'s) crashes inside remove_all, both overloads (SIGSEGV, a call through a null
// pointer; found through a test's TearDown, reproduced with a five-line program linked
// against libtorch.so). remove_tree uses POSIX calls only, so it works whatever is loaded.
#pragma once

#include <cstdint>
#include <filesystem>
#include <system_error>

namespace q4::io {

// Removes `path` and, when it is a directory, everything below it (symbolic links are removed,
// never followed). Returns the number of entries removed; a path that does not exist removes
// nothing and is not an error. Throws std::filesystem::filesystem_error naming the entry that could
// not be removed (entries removed before it stay removed).
std::uintmax_t remove_tree(const std::filesystem::path& path);
// The same, reporting the first failure in `ec` instead (then returns the count removed so far).
std::uintmax_t remove_tree(const std::filesystem::path& path, std::error_code& ec) noexcept;

}  // namespace q4::io
