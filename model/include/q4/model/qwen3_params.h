// The Qwen3 parameter table: every tensor of Qwen3ForCausalLM or Qwen3MoeForCausalLM (HF name,
// shape, kind) in the order of the shipped NVFP4 .dat (embed, per layer q/k/v/o, q_norm, k_norm,
// the FFN's tensors, input/post-attention norms, final norm, lm_head). A mixture-of-experts
// layer's FFN is its router, mlp.gate.weight (E, H), kept in 16/32 bits as releases ship it, and
// each projection of its E experts stacked into one NVFP4 matrix, expert e's rows at
// [e·out, (e+1)·out): mlp.experts.gate_proj.weight (E·I, H), .up_proj (E·I, H), .down_proj
// (E·H, I). NVFP4 scales are per row block, so stacking changes no bit; the HF import/export
// map it to and from the per-expert tensors checkpoints store (mlp.experts.<e>.gate_proj.weight).
// Defined once here and iterated by the model, the memory estimates, `q4dat init`, and the Hugging
// Face import/export, so the list cannot drift between them (llm.c's ParameterTensors).
#pragma once

#include <cstdint>
#include <iterator>
#include <string>
#include <vector>

#include "q4/model/qwen3_config.h"

namespace q4::model {

enum class ParamKind {
  kQuantizedLinear,  // 2-D linear weight, stored as an NVFP4 pair in the .dat (lm_head included)
  kEmbedding,        // model.embed_tokens.weight, raw
  kRaw,              // stored unquantized: RMSNorm weights (1-D), an MoE router (2-D)
};

enum class ParamGroup {
  kEmbedding,   // model.embed_tokens.weight
  kProjection,  // q/k/v/o/gate/up/down of a layer, and an MoE layer's stacked experts
  kRouter,      // an MoE layer's router (mlp.gate.weight)
  kNorm,        // input/post-attention/q/k norms of a layer, or model.norm
  kLmHead,      // lm_head.weight
};

struct ParamSpec {
  std::string name;            // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  std::vector<int64_t> shape;  // (out, in) for linears, (V, H) embedding, (n) norms
  ParamKind kind;
  ParamGroup group;
  int64_t layer = -1;  // decoder layer index; -1 for embed, final norm and lm_head
  int64_t numel() const;
};

// Whether `p` is a mixture-of-experts layer's stacked expert projection
// (mlp.experts.{gate,up,down}_proj.weight: E experts' blocks, of which a token uses k).
bool is_expert_stack(const ParamSpec& p);
// Elements of `p` that one token's forward multiplies with: k / E of a stacked expert
// projection (its k routed experts' blocks), all of any other parameter.
int64_t active_elements(const ParamSpec& p, const Qwen3Config& cfg);

// Every parameter in .dat / HF order. `include_lm_head`: a separate lm_head.weight (the shipped
// file stores one even when config.json says tied); false when lm_head is embed_tokens.
std::vector<ParamSpec> qwen3_parameters(const Qwen3Config& cfg, bool include_lm_head);

// The linears a LoRA adapter can target, by short name, in parameter-table order: a decoder
// layer's projections, a mixture-of-experts layer's stacked experts (one adapter per expert on
// each of its three projections, docs/model.md#lora-on-experts), then lm_head. The one list of
// them: LoraSpec and the trainer's lora.targets check against it.
inline constexpr const char* kLoraTargets[] = {"q_proj",    "k_proj",  "v_proj",
                                               "o_proj",    "gate_proj", "up_proj",
                                               "down_proj", "experts", "lm_head"};
// How many of kLoraTargets are the dense projections (the first ones).
inline constexpr size_t kLoraProjectionTargets = 7;
// Header-only, so that the trainer's config (and its fuzz target) need no model library.
// The dense projections of kLoraTargets: every decoder-layer projection but the experts
// (lora.targets' default).
inline std::vector<std::string> lora_projection_targets() {
  return std::vector<std::string>(std::begin(kLoraTargets),
                                  std::begin(kLoraTargets) + kLoraProjectionTargets);
}
// kLoraTargets joined by ", ", the last one by `last_sep` (", " or " or "): for messages.
inline std::string lora_target_list(const char* last_sep) {
  std::string out;
  const size_t n = std::size(kLoraTargets);
  for (size_t i = 0; i < n; ++i) {
    if (i > 0) out += i + 1 == n ? last_sep : ", ";
    out += kLoraTargets[i];
  }
  return out;
}

}  // namespace q4::model
