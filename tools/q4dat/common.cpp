// NVFP4 pair discovery (through DatReader) and small formatting helpers for q4dat.
#include "common.h"

#include <fmt/core.h>
#include <sys/stat.h>

#include <filesystem>

#include "q4dat.h"

namespace q4::tools {

using q4::io::DatReader;

std::vector<Nvfp4Pair> find_nvfp4_pairs(const DatReader& r, bool strict) {
  return as_input([&] { return r.nvfp4_pairs(strict); });
}

void check_output_file(const std::string& out, const std::vector<std::string>& inputs,
                       bool overwrite, const std::string& option) {
  namespace fs = std::filesystem;
  auto resolved = [](const std::string& p) {
    std::error_code ec;
    const fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
    return ec ? fs::absolute(p).lexically_normal() : c;
  };
  const fs::path o = resolved(out);
  for (const std::string& in : inputs) {
    if (!in.empty() && resolved(in) == o) {
      throw InputError(
          fmt::format("{} {} is also the input {}; write to another file", option, out, in));
    }
  }
  struct stat st {};
  if (::stat(out.c_str(), &st) != 0) return;  // a new file (its directory is checked on write)
  if (S_ISDIR(st.st_mode)) {
    throw InputError(fmt::format("{} {} is a directory; expected a file path", option, out));
  }
  if (!S_ISREG(st.st_mode)) {
    throw InputError(fmt::format(
        "{} {} exists and is not a regular file (a device, FIFO or socket); q4dat writes only "
        "regular files",
        option, out));
  }
  if (!overwrite) {
    throw InputError(
        fmt::format("{} {} already exists; pass --overwrite to replace it", option, out));
  }
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

}  // namespace q4::tools
