// NVFP4 pair discovery (through DatReader) and small formatting helpers for q4dat.
#include "common.h"

#include <fmt/core.h>

#include "q4dat.h"

namespace q4::tools {

using q4::model::DatReader;

std::vector<Nvfp4Pair> find_nvfp4_pairs(const DatReader& r, bool strict) {
  return as_input([&] { return r.nvfp4_pairs(strict); });
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace q4::tools
