// Helpers shared by the q4dat sub-commands: NVFP4 pair discovery (X.qdata elem 0/100 next to
// X.scale elem 101 with consistent shapes), shape printing, one-line error text.
#pragma once

#include <string>
#include <vector>

#include "q4/io/dat_file.h"

namespace q4::tools {

using Nvfp4Pair = q4::io::DatNvfp4Pair;

// All NVFP4 pairs (DatReader::nvfp4_pairs); errors in strict mode are InputErrors.
std::vector<Nvfp4Pair> find_nvfp4_pairs(const q4::io::DatReader& r, bool strict);

// A file a sub-command is about to write (OUT): refused with an InputError when it is one of
// `inputs` (by resolved path), a directory, or anything but a regular file (a device, a FIFO, a
// socket, or a link to one), and, unless `overwrite`, when it exists: no q4dat command replaces
// a model file it was not told to replace. `option` names the argument in the message.
void check_output_file(const std::string& out, const std::vector<std::string>& inputs,
                       bool overwrite, const std::string& option = "OUT");

std::string shape_str(const std::vector<int64_t>& shape);  // "[2, 3]"

}  // namespace q4::tools
