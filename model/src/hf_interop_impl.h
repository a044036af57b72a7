// Names shared by hf_export.cpp and hf_import.cpp (private to q4_model).
#pragma once

#include <cstdint>

#include "q4/model/hf_interop.h"

namespace q4::model {

// Sidecar written next to an export whose .dat stores lm_head as NVFP4: its block scales, so
// that import_hf restores the exact pair from the BF16 lm_head. Not in the index: vLLM and
// transformers never open it.
inline constexpr const char* kHfLmHeadScaleFile = "q4train_lm_head_scale.safetensors";
// safetensors __metadata__ keys of an export: who wrote it, the .dat's qdata element type.
inline constexpr const char* kHfMetaSource = "q4train.source";
inline constexpr const char* kHfMetaQdataElem = "q4train.qdata_elem";
// Elements converted at a time (whole rows) when tensors stream between the two formats.
inline constexpr int64_t kHfChunkElems = int64_t{1} << 22;

}  // namespace q4::model
