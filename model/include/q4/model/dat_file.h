// The .dat container is q4_io's (q4/io/dat_file.h); the model library loads and exports models
// through it and names its types in q4::model too.
#pragma once

#include "q4/io/dat_file.h"

namespace q4::model {

using io::DatEntry;
using io::DatNvfp4Pair;
using io::DatReader;
using io::DatWriter;
using io::elem_scalar_type;
using io::elem_size_bytes;
using io::elem_type_for;
using io::elem_type_name;
using io::ElemType;
using io::is_known_elem_type;
using io::kDatMaxKeyBytes;
using io::kDatMaxNdim;
using io::kDatQdataSuffix;
using io::kDatScaleSuffix;

}  // namespace q4::model
