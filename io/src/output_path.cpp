// Output-path checks shared by the trainer and the tools (see output_path.h).
#include "q4/io/output_path.h"

#include <unistd.h>

#include <filesystem>

#include "q4/io/atomic_file.h"

namespace fs = std::filesystem;

namespace q4::io {
namespace {

fs::path resolved(const std::string& p) {
  std::error_code ec;
  const fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : c;
}

// Whether `inner` is `outer` or lies under it (both resolved).
bool is_within(const fs::path& inner, const fs::path& outer) {
  auto i = inner.begin();
  for (auto o = outer.begin(); o != outer.end(); ++o, ++i) {
    if (o->empty()) continue;  // a trailing separator
    if (i == inner.end() || *i != *o) return false;
  }
  return true;
}

}  // namespace

std::string output_input_relation(const std::string& output, const std::string& input) {
  if (output.empty() || input.empty()) return "";
  const fs::path out = resolved(output), in = resolved(input);
  const bool out_in = is_within(out, in), in_out = is_within(in, out);
  if (out_in && in_out) return "is";
  if (in_out) return "holds";
  if (out_in) return "lies inside";
  std::error_code ec;
  if (fs::exists(out, ec) && fs::exists(in, ec) && fs::equivalent(out, in, ec)) return "is";
  return "";
}

std::string output_file_problem(const std::string& path) {
  const std::string kind = non_regular_kind(path);
  if (!kind.empty()) return "is " + kind;
  // The temp file and the rename are in the directory that names `path` (a link is replaced).
  const fs::path dir = resolved(fs::absolute(path).lexically_normal().parent_path().string());
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return "is in a directory that does not exist (" + dir.string() + ")";
  }
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    return "is in a directory that is not writable (" + dir.string() + ")";
  }
  return "";
}

}  // namespace q4::io
