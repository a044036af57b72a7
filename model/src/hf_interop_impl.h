// Names shared by hf_export.cpp and hf_import.cpp (private to q4_model).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <string>

#include "q4/model/hf_interop.h"
#include "q4/model/qwen3_params.h"

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

// The expert count of a stacked expert matrix of the parameter table (qwen3_params.h:
// "model.layers.N.mlp.experts.gate_proj.weight" of a sparse layer, expert e's rows at
// [e·out, (e+1)·out)); 0 for every other parameter.
inline int64_t stacked_experts(const Qwen3Config& cfg, const ParamSpec& p) {
  const bool stacked = p.kind == ParamKind::kQuantizedLinear && p.layer >= 0 &&
                       cfg.is_moe_layer(p.layer) &&
                       p.name.find(".mlp.experts.") != std::string::npos;
  return stacked ? cfg.moe.num_experts : 0;
}
// The per-expert tensor Hugging Face checkpoints store for expert `e` of a stacked matrix:
// "model.layers.N.mlp.experts.gate_proj.weight" ->
// "model.layers.N.mlp.experts.<e>.gate_proj.weight".
inline std::string expert_tensor_name(const std::string& stacked, int64_t e) {
  const std::string key = ".mlp.experts.";
  const size_t i = stacked.find(key);
  TORCH_INTERNAL_ASSERT(i != std::string::npos);
  return stacked.substr(0, i + key.size()) + std::to_string(e) + "." +
         stacked.substr(i + key.size());
}

// Elements converted at a time (whole rows) when tensors stream between the two formats.
inline constexpr int64_t kHfChunkElems = int64_t{1} << 22;

}  // namespace q4::model
