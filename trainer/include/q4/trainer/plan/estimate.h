// The analytic memory budget printed by --dry-run and placed beside the measured values in the
// VRAM probe report, for the library options of options.h. The model library's
// estimate_memory() supplies masters, frozen weights and each phase's gradients, activations and
// loss chunk; the moments come from the optimizer's packed storage sizes for every trainable
// tensor.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/plan/options.h"

namespace q4::trainer {

// Shape of one parameter as the model names it, with its trainability under `c`.
struct ParamShape {
  std::string name;
  std::vector<int64_t> shape;
  bool trainable = false;
  bool decay = true;  // weight decay applies (matrices yes, norms no)
};
// Every parameter of a Qwen3 model in the model library's order (Qwen3Model::parameters());
// `separate_lm_head`: lm_head is its own tensor.
// train.method lora: one line naming the adapters and what trains, e.g. "LoRA (merge-aware)
// rank 16, alpha 32 on q_proj, ...: 252 adapter tensors, 33.0M elements (0.82% of the model's
// 4.02B), plus 0.0M other trainable elements"; empty for full fine-tuning.
std::string lora_summary(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head);
// Mixture-of-experts models (docs/model.md#mixture-of-experts): one line with the experts, top-k,
// the sparse layers, the parameters in all and active per token, whether the routers train and
// the load-balancing loss's coefficient, e.g. "mixture of experts: 48 of 48 layers sparse, 128
// experts of width 768, top 8 (renormalised); 30.53B parameters, 3.35B active per token; routers
// train (train.trainable.router), load-balancing loss coefficient 0.001 (config.json)"; empty for
// a dense model.
std::string moe_summary(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head);
// train.method lora on a mixture-of-experts model whose lora.targets name gate_proj, up_proj or
// down_proj: those adapt only the dense layers' MLPs, never the stacked experts; one line saying
// so (empty otherwise).
std::string moe_lora_note(const model::Qwen3Config& mc, const Config& c);
std::vector<ParamShape> parameter_shapes(const model::Qwen3Config& mc, const Config& c,
                                         bool separate_lm_head);

// One phase of a step (model::MemoryPhaseKind): what exists besides the whole-run terms.
struct BudgetPhase {
  std::string name;  // model::memory_phase_name()
  int64_t gradients_bytes = 0;
  int64_t activations_bytes = 0;
  int64_t logits_bytes = 0;
  int64_t optimizer_bytes = 0;  // the optimizer's scratch (CPU chunk arena; none on CUDA)
  // GRPO's rollout phase (model::estimate_rollout_memory): the generation batch's KV cache and
  // the linears' forward weights kept while it samples (its prefill transient is in
  // activations_bytes, the sampler's (rows, V) blocks in logits_bytes).
  int64_t kv_cache_bytes = 0;
  int64_t weights_bytes = 0;
  int64_t total_bytes() const {
    return gradients_bytes + activations_bytes + logits_bytes + optimizer_bytes + kv_cache_bytes +
           weights_bytes;
  }
};

// Whole-run terms (masters, frozen, moments) plus the largest phase of a step: the phases'
// transients never coexist (the loss's logits are gone when the layers' backward runs).
struct MemoryBudget {
  int64_t masters_bytes = 0;  // trainable masters
  int64_t frozen_bytes = 0;   // frozen weights as the forward holds them
  // model.forward_weights codes or kept: the trained NVFP4 linears' forward weights kept on the
  // device (model::MemoryEstimate::forward_weight_bytes)
  int64_t forward_weights_bytes = 0;
  int64_t moments_bytes = 0;  // AdamW m and v as stored (packed)
  // train.objective distill with a teacher model: its weights in the compute dtype (whole run);
  // its forward's transients and the divergence's fp32 blocks are in the loss forward phase.
  int64_t teacher_bytes = 0;
  // train.objective grpo with grpo.beta > 0: the reference model (the starting weights, frozen)
  // in the compute dtype (whole run).
  int64_t reference_bytes = 0;
  // The peak phase's terms (phases[peak_phase]).
  int64_t gradients_bytes = 0;    // gradients alive
  int64_t activations_bytes = 0;  // saved activations, layer graph and working tensors
  int64_t logits_bytes = 0;       // lm_head compute weight, one logits block, hidden rows
  int64_t optimizer_bytes = 0;    // optimizer scratch
  int64_t kv_cache_bytes = 0;     // GRPO rollout: the KV cache
  int64_t weights_bytes = 0;      // GRPO rollout: the linears' forward weights kept
  int64_t trainable_elements = 0;
  // Pinned host memory (offloaded masters, moments, gradients and layer inputs), not device memory.
  int64_t host_bytes = 0;
  bool moments_on_host = false;     // optim.offload: moments or all (moments_bytes is then 0)
  bool masters_on_host = false;     // optim.offload: all (masters_bytes holds the linears' codes)
  std::vector<BudgetPhase> phases;  // in step order, the phases this run goes through
  size_t peak_phase = 0;            // index into phases
  int64_t persistent_bytes() const {
    return masters_bytes + frozen_bytes + forward_weights_bytes + moments_bytes + teacher_bytes +
           reference_bytes;
  }
  int64_t total_bytes() const {
    return persistent_bytes() + gradients_bytes + activations_bytes + logits_bytes +
           optimizer_bytes + kv_cache_bytes + weights_bytes;
  }
  const std::string& peak_phase_name() const;
  // Every field above; "total_bytes" is the phase-aware total, "peak_phase" its phase's name.
  nlohmann::json to_json() const;
  std::string to_table() const;  // whole-run rows, a row per phase, the peak phase and total
};

// Budget for one micro-batch of train.batch_size x train.seq_len tokens, with the recompute as
// configured or `recompute`. `needs`: the objective's (a teacher's forward counts; prompt
// records: GRPO, whose step starts with a rollout phase before the training phases: the KV cache
// of this rank's generation batch, train.batch_size x train.grad_accum rows of train.seq_len
// tokens (the longest prompt allowed + grpo.max_completion_length), and with grpo.beta > 0 the
// reference model). The rollout holds nothing of the training phases (no gradients between
// steps), so the peak is the larger of the two, not their sum.
MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head,
                             const ObjectiveNeeds& needs = {});
MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head,
                             const ObjectiveNeeds& needs, const RecomputePlan& recompute);

// What the estimate does not count, taken off the device budget before the estimate is compared
// with it: the CUDA context and the libraries' workspaces (cuBLAS, cuDNN), about 1 GiB ...
inline constexpr int64_t kCudaContextReserveBytes = int64_t{1} << 30;
// ... and, on what is left, the caching allocator's block rounding and fragmentation, about 8%
// of what is allocated: usable = (budget - reserve) / margin.
inline constexpr double kAllocatorMargin = 1.08;

// The device memory a CUDA run plans with: guard.max_gpu_gb when set, else `free_bytes` (the
// device's free memory before the model loads); usable: less what the estimate does not count
// (kCudaContextReserveBytes, kAllocatorMargin).
struct DeviceBudget {
  int64_t budget_bytes = 0;
  int64_t usable_bytes = 0;  // the estimate must fit it
  std::string source;        // "guard.max_gpu_gb" or "free device memory"
};
DeviceBudget device_budget(const Config& c, int64_t free_bytes);

// A placement: settings changed from the config (as --set takes them) and the estimate with
// them (with gradient_checkpointing auto: with the recompute auto would choose).
struct Placement {
  std::vector<std::string> settings;  // "optim.offload=moments", ...
  int64_t estimate_bytes = 0;
  int64_t host_bytes = 0;  // pinned host memory (offloaded state and layer inputs)
  // "optim.offload=moments (estimate 20.1 GiB, 8.7 GiB in pinned host memory)".
  std::string describe() const;
};

// What fits the device when the config does not (docs/gpu-guide.md#what-fits): the placements
// that change only what the config does not already set (train.gradient_checkpointing auto,
// optim.state int8 or 4bit, optim.offload moments or all, train.batch_size 1 and halved
// train.seq_len down to 128), each combination checked with the estimate and the config rules;
// listed are those whose every smaller set of changes does not fit, fewest changes first (then
// recompute before the moments' format before offload before fewer tokens), the mildest value
// of each. When none fits, `smallest` is the combination with the smallest estimate.
struct PlacementAdvice {
  DeviceBudget budget;
  int64_t config_bytes = 0;  // the estimate as configured (auto: with its choice)
  bool config_fits = true;
  std::vector<Placement> fitting;
  Placement smallest;  // set when `fitting` is empty
  bool lora = false;   // train.method lora already (not suggested again)
  // One line: "fits with: A (estimate ...); B (...)" or "nothing fits: the smallest estimate,
  // X GiB (with A), is over the Y GiB usable".
  std::string summary() const;
};
PlacementAdvice advise_placements(const model::Qwen3Config& mc, const Config& c,
                                  bool separate_lm_head, int64_t free_bytes,
                                  const ObjectiveNeeds& needs = {});

// train.gradient_checkpointing: auto (docs/trainer.md#recompute-by-memory-budget): what to
// recompute for the memory estimate to fit the usable budget. Nothing when that fits; else, from
// every layer recomputed (their inputs offloaded to the host when only that fits), the choice
// that fits with the most recompute saved (multiply-adds, model::layer_keep_costs): how many
// layers recompute (the others keep every activation) and how many of those keep their
// attention or their MLP block's activations, searched over every such combination. The budget
// left over thus goes to the block that saves more recompute per byte first; whole layers alone
// (the choice before blocks could be kept) are among the candidates.
struct RecomputeChoice {
  int64_t layers = 0;            // decoder layers of the model
  int64_t recompute_layers = 0;  // the first N recompute (0: none, `layers`: every one)
  // Of those, how many keep their attention block's activations (only the MLP recomputes) and
  // their MLP block's (only the attention recomputes).
  int64_t keep_attention = 0;
  int64_t keep_mlp = 0;
  // Recompute saved per byte kept (multiply-accumulates), by block; set when blocks are kept.
  double attention_macs_per_byte = 0;
  double mlp_macs_per_byte = 0;
  bool offload_layer_inputs = false;  // every layer recomputes and keeps its input on the host
  int64_t host_bytes = 0;             // pinned host memory of the offloaded inputs
  int64_t mlp_chunk_tokens = 0;       // recomputed layers' MLP chunks (0: one pass)
  int64_t estimate_bytes = 0;         // the estimate with that choice
  int64_t budget_bytes = 0;           // guard.max_gpu_gb or the device's free memory
  int64_t usable_bytes = 0;           // the budget less the margin; the estimate must fit it
  bool fits = true;                   // false: over the budget even with every layer recomputed
  std::string budget_source;          // "guard.max_gpu_gb" or "free device memory"
  // When over the budget: advise_placements' summary, what would fit instead.
  std::string advice;
  // "gradient checkpointing auto: the first 30 of 36 decoder layers recompute; of those, 30 keep
  // the attention block's activations (only the MLP recomputes) [...] (estimate ...)".
  std::string describe() const;
};
// The budget auto plans for: device_budget(c, free_bytes). RunPlan::with_recompute applies it.
RecomputeChoice choose_recompute(const model::Qwen3Config& mc, const Config& c,
                                 bool separate_lm_head, int64_t free_bytes,
                                 const ObjectiveNeeds& needs = {});

// Training FLOPs per token with every parameter trained: 6 x (matmul parameters: each layer's
// Qwen3Config::layer_active_linear_parameters, a mixture-of-experts layer's router and k routed
// experts, and the lm_head) + attention (12 x layers x seq_len x q_dim), as llm.c counts them
// (recomputation by checkpointing is not counted).
double train_flops_per_token(const model::Qwen3Config& mc, int64_t seq_len);
// The FLOPs per token the run of `c` computes (the MFU column; recompute not counted). Per linear
// of n = out x in weights (a stacked expert projection: the k of E experts a token uses; an MoE
// router counts as a linear): 2n forward; where the backward runs (every layer from the lowest one
// holding a trained parameter, the lowest counted whole; lm_head's input gradient when anything
// below it trains) 2n for the input gradient, and 2n for the weight gradient only when the weight
// trains or carries a merge-aware adapter (whose merged weight's gradient is formed; its merge and
// the factors' gradients add 6 x n x rank per micro-batch of batch_size x seq_len tokens). A
// plain adapter adds 6 x rank x (in + out); the attention core 4 x seq_len x q_dim forward and 8x
// backward per layer.
double train_flops_per_token(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head);

}  // namespace q4::trainer
