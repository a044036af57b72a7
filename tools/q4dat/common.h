// Helpers shared by the q4dat sub-commands: NVFP4 pair discovery (X.qdata elem 0/100 next to
// X.scale elem 101 with consistent shapes), shape printing, one-line error text.
#pragma once

#include <string>
#include <vector>

#include "q4/model/dat_file.h"

namespace q4::tools {

using Nvfp4Pair = q4::model::DatNvfp4Pair;

// All NVFP4 pairs (DatReader::nvfp4_pairs); errors in strict mode are InputErrors.
std::vector<Nvfp4Pair> find_nvfp4_pairs(const q4::model::DatReader& r, bool strict);

std::string shape_str(const std::vector<int64_t>& shape);  // "[2, 3]"
std::string one_line(std::string s);                       // newlines -> spaces

}  // namespace q4::tools
