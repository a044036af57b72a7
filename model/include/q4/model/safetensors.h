// The safetensors container is q4_io's (q4/io/safetensors.h); the Hugging Face import and export
// read and write through it and name its types in q4::model too.
#pragma once

#include "q4/io/safetensors.h"

namespace q4::model {

using io::kStMaxHeaderBytes;
using io::SafetensorsFile;
using io::SafetensorsModel;
using io::SafetensorsWriter;
using io::st_dtype_from_name;
using io::st_dtype_name;
using io::st_dtype_size;
using io::st_storage_scalar_type;
using io::StDtype;
using io::StTensor;

}  // namespace q4::model
