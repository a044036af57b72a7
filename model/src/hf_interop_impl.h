// Names shared by hf_export.cpp and hf_import.cpp (private to q4_model).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "q4/model/hf_interop.h"

namespace q4::model {

// Sidecar written next to an export whose .dat stores lm_head as NVFP4: its block scales, so
// that import_hf restores the exact pair from the BF16 lm_head. Not in the index: vLLM and
// transformers never open it.
inline constexpr const char* kHfLmHeadScaleFile = "q4train_lm_head_scale.safetensors";
// safetensors __metadata__ keys of an export: who wrote it, the .dat's qdata element type.
inline constexpr const char* kHfMetaSource = "q4train.source";
inline constexpr const char* kHfMetaQdataElem = "q4train.qdata_elem";
// The module of a weight: "x.q_proj.weight" -> "x.q_proj" (HF names a linear's other tensors
// after it: weight_scale, weight_packed, ...).
inline std::string module_of(const std::string& weight_name) {
  const std::string suffix = ".weight";
  TORCH_INTERNAL_ASSERT(weight_name.size() > suffix.size());
  return weight_name.substr(0, weight_name.size() - suffix.size());
}

// Elements converted at a time (whole rows) when tensors stream between the two formats.
inline constexpr int64_t kHfChunkElems = int64_t{1} << 22;

}  // namespace q4::model
