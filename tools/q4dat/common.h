// Helpers shared by the q4dat sub-commands: NVFP4 pair discovery (X.qdata elem 0/100 next to
// X.scale elem 101 with consistent shapes), shape printing, one-line error text.
#pragma once

#include <string>
#include <vector>

#include "q4/model/dat_file.h"

namespace q4::tools {

struct Nvfp4Pair {
  std::string name;    // X (without .qdata / .scale)
  size_t qdata_index;  // entry index of X.qdata: uint8 (rows, cols/2)
  size_t scale_index;  // entry index of X.scale: uint8 E4M3 (rows, cols/16)
  int64_t rows;
  int64_t cols;  // dense columns
};

// All NVFP4 pairs, in the order of their .qdata entries. strict: a .qdata (elem 0/100) without
// its .scale, a .scale (elem 101) without its .qdata, or inconsistent shapes is an InputError;
// otherwise such entries are just not pairs.
std::vector<Nvfp4Pair> find_nvfp4_pairs(const q4::model::DatReader& r, bool strict);

std::string shape_str(const std::vector<int64_t>& shape);  // "[2, 3]"
std::string one_line(std::string s);                       // newlines -> spaces

}  // namespace q4::tools
