// Qwen3 decoder (HF transformers Qwen3ForCausalLM, module for module) built from plain ATen
// tensors: masters loaded from an NVFP4 .dat, straight-through fake-quantized linears, per-layer
// gradient checkpointing, a token-chunked cross-entropy that never materializes [tokens, vocab]
// logits, export back to .dat, and greedy KV-cache generation. Gradients of trainable masters
// are accumulated by the model into Parameter::grad (dtype ModelOptions::grad_dtype, which may
// differ from the master dtype); masters never require grad themselves.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "q4/io/enum_names.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/quant/block_rule.h"

namespace q4::model {

class LinearBackend;  // the linear slot (linear_backend.h)

// How a trained NVFP4 linear's forward weight, fake_quant(master) in the compute dtype, is
// obtained (docs/design.md#training-numerics, "Forward weights"). All three give the same bits.
enum class ForwardWeights : uint8_t {
  kSweep,  // fake-quantized from the master by every forward and every recompute
  kCodes,  // quantize(master) kept on the device (Parameter::qdata/scale, 0.56 bytes an element),
           // refreshed after each update; each forward dequantizes them
  kKept,   // fake_quant(master) itself kept in the compute dtype (Parameter::kept_weight),
           // refreshed after each update; each forward uses it as it is
};

// Where a trainable NVFP4 linear's master starts when it is loaded from NVFP4 codes
// (docs/design.md#dithered-masters).
enum class MasterInit : uint8_t {
  kCodes,   // the dequantized code itself: every master on its grid point
  kDither,  // moved uniformly inside its code's rounding cell (quant::dither_nvfp4): the same
            // fake_quant(master), but small updates flip codes in proportion to their size
};

// Which parameter groups train. Frozen parameters get no gradient and must get no optimizer
// state. With tied embeddings (no lm_head in the file) embed_tokens trains when either
// `embeddings` or `lm_head` is set.
struct TrainableSpec {
  bool projections = true;      // q/k/v/o/gate/up/down (and MoE experts) of the selected layers
  bool router = true;           // the MoE router (mlp.gate.weight) of the selected layers
  int64_t last_n_layers = -1;   // >= 0: only the last N layers are selected; -1: every layer
  std::vector<int64_t> layers;  // non-empty: exactly these layers (overrides last_n_layers)
  bool lm_head = false;         // lm_head.weight (or embed_tokens when tied)
  bool norms = false;           // RMSNorm weights of the selected layers, plus model.norm
  bool embeddings = false;      // model.embed_tokens.weight

  static TrainableSpec everything();  // all groups, all layers
  static TrainableSpec nothing();     // inference only
  bool layer_selected(int64_t layer, int64_t num_layers) const;
  // Whether parameter `p` of a num_layers model trains; `tied`: lm_head is embed_tokens.
  bool trains(const ParamSpec& p, int64_t num_layers, bool tied) const;
  // Errors (naming the field) for layer indices out of [0, num_layers) or last_n_layers > L.
  void validate(int64_t num_layers) const;
};

// Low-rank adapters (LoRA, docs/design.md#adapters) on NVFP4 linears: the linear's weight becomes
// W + (alpha/rank)·B·A with A (rank, in) and B (out, rank) trained and W frozen, kept as the
// file's NVFP4 codes. Merge-aware: the forward computes with fake_quant(W + (alpha/rank)·B·A)
// (straight-through to A and B), so the merged NVFP4 export is what was trained. Plain:
// y = x·Wᵀ + (alpha/rank)·(x·Aᵀ)·Bᵀ. A starts as PEFT's kaiming_uniform(a=√5) draw, B at zero.
struct LoraSpec {
  int64_t rank = 0;     // 0: no adapters
  double alpha = 16.0;  // the update is scaled by alpha / rank
  // Adapted linears by short name: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
  // (in every selected layer) and lm_head.
  std::vector<std::string> targets;
  bool merge_aware = true;
  uint64_t seed = 0;  // A's initial draw
  bool enabled() const { return rank > 0; }
  double scale() const { return alpha / static_cast<double>(rank); }
  // Whether parameter `p` of a num_layers model gets an adapter: an NVFP4 linear named in
  // targets, in a layer `trainable` selects (lm_head: always when named).
  bool adapts(const ParamSpec& p, const TrainableSpec& trainable, int64_t num_layers) const;
  void validate() const;  // errors naming the field
  // validate() and rank against the model: at most the smallest dimension (in or out) of a
  // linear in targets, the largest rank B·A can have (an error naming lora.rank).
  void validate(const Qwen3Config& cfg) const;
};
// The adapter parameters' names of the linear `linear` ("model.layers.0.self_attn.q_proj.weight"):
// part "lora_A" -> "model.layers.0.self_attn.q_proj.lora_A.weight" (PEFT's, without its prefix).
std::string lora_param_name(const std::string& linear, const char* part);

// What a decoder layer keeps from its forward for its backward (ModelOptions::layer_recompute).
// A layer is two blocks: attention, h -> hs = h + o_proj(attention(input_layernorm(h))), and
// MLP, hs -> hs + down(swiglu(gate(y), up(y))) with y = post_attention_layernorm(hs).
enum class LayerRecompute {
  kNone,       // every activation (no recompute)
  kLayer,      // its input h; both blocks recompute
  kAttention,  // its input h and the MLP block's activations; the attention block recomputes
  kMlp,        // the attention block's activations and hs; the MLP block recomputes
};

struct ModelOptions {
  at::ScalarType master_dtype = at::kHalf;    // trainable masters: fp16 (default), bf16, fp32
  at::ScalarType compute_dtype = at::kFloat;  // activations / matmuls: fp32 (CPU), bf16 (GPU)
  // Gradient storage of trainable parameters; nullopt = default_grad_dtype(master, compute).
  std::optional<at::ScalarType> grad_dtype;
  at::Device device = at::kCPU;
  TrainableSpec trainable;
  bool gradient_checkpointing = true;  // recompute decoder layers in backward
  // With checkpointing, how many decoder layers recompute: the first N (the last L - N keep
  // their activations; their backward runs first, so that memory is freed before any layer is
  // recomputed). -1: every layer. Chosen from a memory budget by the trainer.
  int64_t recompute_layers = -1;
  // Of the recomputed layers, the last `recompute_keep_mlp` keep their MLP block's activations
  // and recompute only the attention block (LayerRecompute::kAttention), and the
  // `recompute_keep_attention` below them keep the attention block's activations and recompute
  // only the MLP block (kMlp); the others recompute both. Chosen from a memory budget by the
  // trainer: a block kept saves its recompute at the cost of its activations.
  int64_t recompute_keep_attention = 0;
  int64_t recompute_keep_mlp = 0;
  // CUDA: a recomputed layer keeps its input in pinned host memory (copied out in the forward,
  // back before its recompute) instead of on the device: long context, where the L layer inputs
  // are the largest activation term. No effect on the CPU or on layers that keep activations.
  bool offload_layer_inputs = false;
  // A recomputed layer's MLP block runs over row chunks of this many of the layer's B*T tokens,
  // in its forward (no graph) and in its recompute, when the layer has more tokens than that
  // (0: never). The MLP is token-wise: each chunk's post_attention_layernorm -> gate/up ->
  // SwiGLU -> down projection is run and back-propagated alone, so only one chunk's (chunk, I)
  // tensors and their gradients exist, not the layer's (tokens, I) ones; the MLP weights'
  // gradients are summed over the chunks in fp32 and each delivered once through its tap
  // (docs/model.md#gradient-checkpointing). Results equal the unchunked ones up to the order of
  // those sums.
  int64_t mlp_chunk_tokens = 0;
  // NVFP4 linears compute with fake_quant(master) and train straight through it (QAT). false:
  // plain precision, every weight computes as its master (a model trained this way is a
  // full-precision model; its NVFP4 export is the export quantizer's rounding of it, a PTQ).
  bool fake_quant = true;
  // How every scale derived from values picks its E4M3 byte (q4/quant/block_rule.h): the fake
  // quantizer of the forward, the codes of offloaded masters, merge-aware adapters and the
  // export's quantization all use this one rule, so the exported codes are what the forward
  // computed with. Files and dequantization do not depend on it.
  q4::quant::BlockRule block_rule = q4::quant::BlockRule::kMax6;
  // Trainable NVFP4 linears loaded from packed NVFP4 entries (load(), so also an imported HF
  // folder) start at their codes' values or dithered inside their rounding cells, drawn from
  // master_init_seed and the parameter's position in the table (deterministic, any device).
  // Needs fake_quant. Adapted linears keep their codes; raw (16/32-bit) entries and random_init
  // are not on a grid and load as they are.
  MasterInit master_init = MasterInit::kCodes;
  uint64_t master_init_seed = 0;
  // Each trainable NVFP4 linear computes from NVFP4 codes kept on the device, quantize(master)
  // (Parameter::qdata/scale), dequantized by its forward: the weights fake_quant(master) gives,
  // bit for bit. On CUDA its master then lives in pinned host memory, where the optimizer updates
  // it (PackedAdamW::add_host_param), so the GPU holds 0.56 bytes per such parameter instead of
  // 2 (docs/design.md#training-numerics). After a master changes, refresh_forward_weights(). On the
  // CPU masters stay where they are (the same forward; tests). Needs fake_quant.
  bool offload_masters = false;
  // How trained NVFP4 linears whose masters stay on the device get their forward weight. kCodes
  // and kKept need fake_quant; offload_masters computes from codes whatever this says (kKept is
  // an error there). With kCodes or kKept, after a master changes, refresh_forward_weights().
  ForwardWeights forward_weights = ForwardWeights::kSweep;
  // Adapters; with them the adapted linears are frozen (TrainableSpec::projections is ignored
  // for them) and only A, B and whatever else `trainable` selects train.
  LoraSpec lora;
  // Plain adapters: each adapted linear's frozen weight, dequantize(codes) in the compute dtype,
  // is computed once and kept (Parameter::dequantized) instead of in every forward and
  // recompute: 2 bytes a frozen element on the device, which a layer that keeps its activations
  // holds from its forward to its backward anyway. The codes never change, so neither does it.
  bool cache_adapted_weights = false;
  int64_t loss_chunk_tokens = 512;  // rows of logits computed at once in loss()
  // Mixture-of-experts models: the weight of the routers' load-balancing loss in loss()
  // (LossOutput::aux_loss); nullopt: the config's router_aux_loss_coef. 0 leaves it out.
  std::optional<double> router_aux_loss_coef;
  // Mixture-of-experts models: the weight of the router z-loss in loss() (LossOutput::z_loss):
  // the mean over the valid rows of every MoE layer of logsumexp(router logits)², ST-MoE's
  // penalty on large router logits. 0 (the default, as HF): not computed.
  double router_z_loss_coef = 0.0;
  // CUDA: the fused kernels for RMSNorm, RoPE, SwiGLU and the loss's softmax cross-entropy,
  // where the layout allows them. false: the ATen reference ops everywhere (the tests compare
  // the two). No effect on the CPU.
  bool fused_cuda_kernels = true;
  // Mixture-of-experts layers on CUDA with bf16 compute: each expert projection of all experts
  // in one grouped GEMM (at::_grouped_mm, LibTorch >= 2.9) instead of one GEMM per expert.
  // false: the per-expert GEMMs everywhere (the tests compare the two).
  bool moe_grouped_gemm = true;
  // The linear slot (linear_backend.h): how the decoder layers' linears compute. Null (default):
  // make_linear_backend() for the device, chosen when the model is built.
  std::shared_ptr<const LinearBackend> linear_backend;

  at::ScalarType resolved_grad_dtype() const;
  // Trained NVFP4 linears compute from device codes (offload_masters or ForwardWeights::kCodes).
  bool computes_from_codes() const {
    return offload_masters || forward_weights == ForwardWeights::kCodes;
  }
  // Whether decoder layer `layer` recomputes anything in backward (checkpointed).
  bool recomputes(int64_t layer) const {
    return gradient_checkpointing && (recompute_layers < 0 || layer < recompute_layers);
  }
  // What decoder layer `layer` of a `num_layers`-layer model keeps for its backward.
  LayerRecompute layer_recompute(int64_t layer, int64_t num_layers) const;
  void validate() const;  // dtype / device / chunk checks with messages naming the field
  // validate() and the checks that need the model's depth (recompute_layers and the kept
  // blocks against the layers).
  void validate(int64_t num_layers) const;
};

// The measured choice (docs/model.md): fp32 when masters are fp32, else bf16 (fp16 grads
// underflow; bf16 keeps fp32 range at the size of fp16).
at::ScalarType default_grad_dtype(at::ScalarType master_dtype, at::ScalarType compute_dtype);

// One model step's token inputs. Only input_ids is required; all tensors are (B, T) on any
// device (moved to the model's device).
struct ModelInputs {
  at::Tensor input_ids;       // (B, T) int64
  at::Tensor labels;          // (B, T) int64, -100 = not supervised; needed by loss() only
  at::Tensor attention_mask;  // (B, T) optional; 1 = real token, 0 = padding (right padding)
  at::Tensor position_ids;    // (B, T) int64 optional; default arange(T) (+ cache length)
  at::Tensor segment_ids;     // (B, T) int64 optional; packing: attend only within equal ids,
                              // 0 = padding. Combined with attention_mask when both are given.
  // Optional variable-length layout of the same segments over the flattened B*T tokens
  // (data::Batch::cu_seqlens: every example and every padding tail is one segment, last entry
  // B*T) and its longest segment. Used on CUDA with fp16/bf16 compute, where attention runs
  // FlashAttention's varlen kernels (no [B,1,T,T] mask, GQA without copying K/V); elsewhere
  // the mask built from segment_ids/attention_mask gives the same result.
  at::Tensor cu_seqlens;   // (S + 1) int32
  int64_t max_seqlen = 0;  // host int (no device sync)
};

struct LossOutput {
  at::Tensor loss;  // () fp32: loss_sum / num_tokens (0 when there are none)
  // () fp32, differentiable: the summed CE, or with a LossTerm of weight w,
  // (1 - w) * CE sum + w * term sum (same graph; for token-weighted accumulation)
  at::Tensor loss_sum;
  at::Tensor num_tokens;  // () int64: supervised positions (labels[:, 1:] != -100), on device
  at::Tensor ce_sum;      // () fp32, detached: the summed CE
  at::Tensor term_sum;    // () fp32, detached: the LossTerm's sum (undefined without one)
  // Mixture-of-experts models: () fp32, detached, the routers' load-balancing loss (HF's
  // load_balancing_loss_func over the forward's valid rows); loss and loss_sum include it times
  // ModelOptions::router_aux_loss_coef (loss_sum once per supervised token). Undefined: dense.
  at::Tensor aux_loss;
  // () fp32, detached: the router z-loss, included like aux_loss with
  // ModelOptions::router_z_loss_coef. Undefined: dense, or that coefficient is 0.
  at::Tensor z_loss;
};

// How the routers of a mixture-of-experts model's last forward spread its valid tokens
// (Qwen3Model::router_stats; docs/model.md#mixture-of-experts). Loads are tokens routed to an
// expert over the mean per expert (1: perfectly balanced).
struct RouterStats {
  double aux_loss = 0;  // the load-balancing loss, without its coefficient
  struct Layer {
    int64_t layer = 0;
    double max_load = 0, min_load = 0;  // the busiest and the idlest expert
    double entropy = 0;                 // mean routing entropy per token, nats
  };
  std::vector<Layer> layers;   // the MoE layers, ascending
  int64_t dropped_tokens = 0;  // routes not computed: 0 (every route is computed)
  double max_load() const;     // over layers
  double min_load() const;
  double mean_entropy() const;
};

// A term added to the cross-entropy inside the chunked loss, chunk by chunk, so that no
// (rows, V) logits block of any model exists (a distillation divergence; docs/model.md#loss).
// loss() gathers the supervised rows (flat positions of the (B, T) inputs, ascending; on CUDA
// padded at the end with unsupervised copies) and calls `prepare` once with those positions
// (int64 (N), on the model's device). Then for each chunk of rows [row_begin, row_begin + n)
// `chunk` gets the student's fp32 logits (n, V), which it may overwrite, and `valid` (n) bool,
// false on padded rows; it returns the chunk's term summed over valid rows, () fp32, and when
// `want_grad` leaves d(term)/d(logits) in `logits` (0 on invalid rows). Called with autograd off.
// A chunk's per-row values from LossTerm::fused: CE and term, (n) fp32 each, 0 on unsupervised
// rows. Undefined: the term's fused form does not apply to the chunk.
struct LossRows {
  at::Tensor ce, term;
};

struct LossTerm {
  double weight = 1.0;  // w: loss_sum = (1 - w) * CE + w * term
  std::function<void(const at::Tensor& rows)> prepare;
  std::function<at::Tensor(at::Tensor& logits, const at::Tensor& valid, int64_t row_begin,
                           bool want_grad)>
      chunk;
  // Optional: the term and the CE in one pass (a fused CUDA kernel, q4/model/fused_divergence.h),
  // tried first for each chunk when the loss runs its fused kernels. It gets the chunk's logits
  // (n, V) as the lm_head GEMM left them (compute dtype) and labels (n) (-100: unsupervised);
  // it returns the chunk's LossRows and, when want_grad, leaves
  // d((1 - weight) * CE + weight * term)/d(logits) in `logits`; `chunk` is then not called. It
  // returns undefined LossRows without touching `logits` where it does not apply (the chunk then
  // takes `chunk` and the CE's own path).
  std::function<LossRows(at::Tensor& logits, const at::Tensor& labels, int64_t row_begin,
                         bool want_grad)>
      fused;
};

struct Parameter {
  std::string name;   // HF name, e.g. "model.layers.0.self_attn.q_proj.weight"
  at::Tensor master;  // trainable: master_dtype master (requires_grad false; update in place
                      // under NoGradGuard). Frozen: the weight the forward uses, in the
                      // compute dtype (fake-quantized once for quantized linears).
  at::Tensor grad;    // trainable: grad_dtype, master's shape; undefined until a backward
                      // reaches it and after zero_grad(). Frozen: always undefined.
  bool trainable = false;
  bool quantized = false;  // NVFP4 linear (.weight.qdata/.scale): forward uses fake_quant(master)
  // ModelOptions::offload_masters, a trainable NVFP4 linear: quantize(master) on the model's
  // device, (rows, cols/2) and (rows, cols/16) uint8, what the forward dequantizes. The master is
  // then in pinned host memory on CUDA (read it there; kernels reach it through an alias).
  at::Tensor qdata, scale;
  // A linear with a LoRA adapter (ModelOptions::lora): its frozen weight is the file's NVFP4
  // codes in qdata/scale (master undefined) and these are the adapter's A and B, trainable
  // parameters named "<base without .weight>.lora_A.weight" / ".lora_B.weight".
  Parameter* lora_a = nullptr;
  Parameter* lora_b = nullptr;
  // ModelOptions::cache_adapted_weights: dequantize(qdata, scale) in the compute dtype, made by
  // the first forward that needs it.
  at::Tensor dequantized;
  // Qwen3Model::InferenceWeights: the forward weight (fake_quant(master), a merged adapter's
  // weight, ...) in the compute dtype, made by the first forward without autograd that needs it
  // and dropped when the scope ends.
  at::Tensor inference_weight;
  // ModelOptions::forward_weights kKept, a trainable NVFP4 linear: fake_quant(master) in the
  // compute dtype, what each forward hands its linear (as a fresh alias per use), rewritten in
  // place by refresh_forward_weights once the master changes (after the last use of the step's
  // graph: the optimizer updates a parameter after its gradient is complete).
  at::Tensor kept_weight;
  int64_t pending_uses = 0;  // uses in the current graph whose gradient has not arrived yet
};

// Per-layer key/value cache for generation. Holds (B, kv_heads, capacity, head_dim) tensors in
// the compute dtype; `length` tokens are valid.
struct KvCache {
  std::vector<at::Tensor> k;  // per layer (B, KVH, capacity, D)
  std::vector<at::Tensor> v;  // per layer (B, KVH, capacity, D)
  // (B, capacity) bool on the model's device, optional: false marks a slot no query may attend
  // (the left padding of a batch of prompts, sampling.h); undefined: every slot is valid.
  at::Tensor key_valid;
  int64_t length = 0;
  int64_t capacity() const { return k.empty() ? 0 : k[0].size(2); }
};

struct GenerateOptions {
  int64_t max_new_tokens = 128;
  std::vector<int64_t> stop_ids = {151645, 151643};  // Qwen3 <|im_end|>, <|endoftext|>
};

// A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), as
// Qwen3Model::export_adapter writes it or peft saves it for a Qwen3 model.
struct AdapterConfig {
  LoraSpec lora;                // rank, alpha, targets; merge_aware false (a PEFT adapter is plain)
  std::vector<int64_t> layers;  // layers_to_transform (empty: every layer)
  // PEFT's modules_to_save: modules whose weights the adapter replaces whole; a module is
  // listed when its path ends with the entry (PEFT's matching).
  std::vector<std::string> modules_to_save;
  std::string base_model;  // base_model_name_or_path ("" when absent)
};
// Reads `dir`/adapter_config.json; errors name the file and the key (LoRA only: no DoRA,
// rsLoRA, bias, fan_in_fan_out, rank_pattern or alpha_pattern).
AdapterConfig read_adapter_config(const std::string& dir);
// What Qwen3Model::load_adapter applied.
struct AdapterLoad {
  int64_t lora_pairs = 0;    // adapted linears (a stacked expert projection counts once)
  int64_t full_tensors = 0;  // weights replaced whole (modules_to_save)
};
// `opt` with the adapter of `dir` in it (fp32 adapter masters), ready for Qwen3Model::load and
// then load_adapter().
ModelOptions with_adapter(ModelOptions opt, const AdapterConfig& adapter);

// Analytic device-memory budget (bytes) for the trainer's --dry-run and VRAM probe. A step
// goes through phases whose transient tensors never coexist (the loss's backward frees its
// logits before the layers' backward recomputes a layer): the budget is the persistent tensors
// plus the largest phase, not the sum of every term.
enum class MemoryPhaseKind {
  kForward,            // the decoder layers' forward (checkpointed inputs accumulate)
  kLossForward,        // final norm + chunked cross-entropy: logits block, lm_head weight + grad
  kLossBackward,       // the loss's gradients handed on: lm_head grad stored, hidden grad scattered
  kLayerBackward,      // one decoder layer recomputed (checkpointing) and back-propagated
  kEmbeddingBackward,  // the embedding's row gradients, at the very end of the backward
  kOptimizerStep,      // buffered updates: every gradient at once, after the backward
};
const char* memory_phase_name(MemoryPhaseKind kind);  // "loss backward", ...

// What exists in one phase besides the persistent masters and frozen weights.
struct MemoryPhase {
  MemoryPhaseKind kind = MemoryPhaseKind::kForward;
  int64_t grad_bytes = 0;        // gradients alive (stored and freshly computed)
  int64_t activation_bytes = 0;  // saved activations, layer graphs and their gradients
  int64_t loss_bytes = 0;        // lm_head compute weight, one logits block, hidden rows + grad
  int64_t total_bytes() const { return grad_bytes + activation_bytes + loss_bytes; }
};

// How the step around the model keeps gradients (the trainer's optimizer settings).
struct GradientLifetime {
  bool applied_in_backward = false;  // each gradient is applied and freed once complete
  int64_t accumulation_steps = 1;    // micro-batches per update; > 1 keeps the buffer across them
  // Device bytes the step stages gradients through, for the whole run, when offloaded masters'
  // gradients add up in host memory (accumulation_steps > 1).
  int64_t host_staging_bytes = 0;
};

struct MemoryEstimate {
  int64_t master_bytes = 0;  // trainable masters (whole run); offloaded: the linears' codes
  int64_t frozen_bytes = 0;  // frozen weights held in the compute dtype (whole run)
  // Trained NVFP4 linears' forward weights kept from resident masters (whole run;
  // ModelOptions::forward_weights): codes 0.5625 B an element, kept the compute dtype's size.
  // Kept ones replace the tap copies the phases would otherwise count.
  int64_t forward_weight_bytes = 0;
  int64_t host_bytes = 0;    // pinned host memory: offloaded layer inputs, masters and their
                             // accumulated gradients (not in the total)
  // The peak phase's terms (phases[peak_phase]).
  int64_t grad_bytes = 0;
  int64_t activation_bytes = 0;
  int64_t loss_bytes = 0;
  int64_t grad_buffer_bytes = 0;    // every trainable gradient at once (the buffered path)
  std::vector<MemoryPhase> phases;  // in step order; only the phases this run goes through
  size_t peak_phase = 0;            // index into phases of the largest one
  // Persistent terms + the peak phase.
  int64_t total_bytes() const {
    return master_bytes + frozen_bytes + forward_weight_bytes + grad_bytes + activation_bytes +
           loss_bytes;
  }
  const MemoryPhase* phase(MemoryPhaseKind kind) const;  // nullptr when the run skips it
};
// `include_lm_head`: whether the weights file stores a separate lm_head (the shipped 4B file
// does; pass !cfg.tie_word_embeddings for a file written by HF conventions). Supervised rows
// are taken to be every token (an upper bound: only they go through the lm_head).
MemoryEstimate estimate_memory(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                               int64_t seq_len, bool include_lm_head,
                               const GradientLifetime& grads = {});

// GRPO rollouts (docs/trainer.md#grpo, "Memory"): what sampling one generation batch holds
// besides the persistent weights, as sample_completions allocates it.
struct RolloutShape {
  int64_t rows = 0;               // completions sampled together (prompts x num_generations)
  int64_t prompt_tokens = 0;      // the longest prompt
  int64_t completion_tokens = 0;  // max_new_tokens (grpo.max_completion_length)
  int64_t top_k = 0;              // 0: off
  double top_p = 1.0;             // 1: off
};
struct RolloutMemory {
  // k and v of every layer: (rows, kv heads, prompt + completion tokens, head_dim), compute dtype.
  int64_t kv_cache_bytes = 0;
  // The prefill's widest transient: one layer's forward without a graph over rows x prompt tokens
  // (the attention's q/k/v and norm output, or the FFN's no-graph forward) beside the layer's
  // input and output hidden states.
  int64_t prefill_bytes = 0;
  // The last position's (rows, V) logits in the compute dtype and the sampler's fp32 (rows, V)
  // blocks: the fp32 copy over the temperature, probabilities, CDF, the log-probabilities' copy;
  // top_p adds its sort (values, int64 indices) and cumulative sum, top_k its filtered copy.
  int64_t sampling_bytes = 0;
  // Qwen3Model::InferenceWeights: every trained or adapted linear's forward weight (lm_head
  // included) in the compute dtype, kept for the rollout. The rollout keeps at most half the
  // device memory free when it starts (the linears met first), so this is the most it holds.
  int64_t weights_bytes = 0;
  int64_t total_bytes() const {
    return kv_cache_bytes + prefill_bytes + sampling_bytes + weights_bytes;
  }
};
RolloutMemory estimate_rollout_memory(const Qwen3Config& cfg, const ModelOptions& opt,
                                      const RolloutShape& shape, bool include_lm_head);

// Keeping one block's activations in a recomputed decoder layer (LayerRecompute::kMlp keeps the
// attention block's, kAttention the MLP block's) instead of recomputing the whole layer: the
// device bytes held from the layer's forward to its backward (as estimate_memory counts them)
// and the recompute saved, in multiply-accumulates of one batch x seq_len step.
struct BlockKeepCost {
  int64_t kept_bytes = 0;
  double saved_macs = 0;
  double macs_per_byte() const {
    return kept_bytes > 0 ? saved_macs / static_cast<double>(kept_bytes) : 0.0;
  }
};
struct LayerKeepCosts {
  BlockKeepCost attention;  // keep the attention block, recompute the MLP
  BlockKeepCost mlp;        // keep the MLP block, recompute the attention
};
LayerKeepCosts layer_keep_costs(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                                int64_t seq_len, bool include_lm_head, int64_t layer);

class Qwen3Model {
 public:
  // One pass over `weights` in file order; peak host memory about one tensor. Quantized pairs
  // (qdata elem 0/100 + scale elem 101) are dequantized on the device; raw fp16/bf16/fp32
  // entries are cast. No lm_head in the file requires tie_word_embeddings (lm_head = embed).
  // Missing/mis-shaped/ill-typed entries are errors naming the file, key and both shapes.
  // Entries that are not Qwen3 parameters are ignored at load and copied by export_to().
  static Qwen3Model load(const Qwen3Config& cfg, const DatReader& weights, ModelOptions opt);
  // Random weights: linears and embeddings ~ N(0, std), norms 1. Linears count as quantized
  // (fake-quant in forward); lm_head is separate unless cfg.tie_word_embeddings.
  static Qwen3Model random_init(const Qwen3Config& cfg, ModelOptions opt, uint64_t seed,
                                double std = 0.02);

  Qwen3Model(Qwen3Model&&) noexcept;
  Qwen3Model& operator=(Qwen3Model&&) noexcept;
  ~Qwen3Model();

  const Qwen3Config& config() const;
  const ModelOptions& options() const;
  bool tied() const;  // lm_head is embed_tokens
  // Which decoder layers (and blocks) recompute in backward (ModelOptions::
  // gradient_checkpointing, recompute_layers, recompute_keep_attention, recompute_keep_mlp),
  // between steps: the trainer picks it from a memory budget once the model is loaded. Results
  // do not depend on it.
  void set_recompute(bool gradient_checkpointing, int64_t recompute_layers,
                     bool offload_layer_inputs = false, int64_t recompute_keep_attention = 0,
                     int64_t recompute_keep_mlp = 0);
  // ModelOptions::cache_adapted_weights, between steps (the trainer decides it with the
  // recompute); false drops the kept weights. Results do not depend on it.
  void set_cache_adapted_weights(bool cache);

  // Hidden states after the final norm, (B, T, H) in the compute dtype. With a cache, the
  // inputs are appended after cache->length tokens (causal mask offset accordingly) and the
  // cache is extended; then attention_mask/segment_ids must be undefined.
  at::Tensor hidden_states(const ModelInputs& in, KvCache* cache = nullptr);
  // Whether a forward of `in` (no cache) takes the variable-length FlashAttention path.
  bool uses_varlen_attention(const ModelInputs& in) const;
  // Logits (B, T, V) in the compute dtype (materializes the full logits: parity/generation).
  at::Tensor forward(const ModelInputs& in, KvCache* cache = nullptr);
  // Chunked CE of logits[:, :-1] vs labels[:, 1:] (HF shift), mean over supervised positions.
  // Differentiable: loss.backward() accumulates into Parameter::grad of trainable parameters.
  // Only supervised positions go through the lm_head (their rows are gathered first). Pass
  // labels on the host to keep this free of device syncs; CUDA labels cost one (the count).
  // `term`: an extra term computed in the same chunks (LossTerm), borrowed for the call.
  LossOutput loss(const ModelInputs& in, const LossTerm* term = nullptr);
  // Per-token log-probabilities of the supervised labels (HF shift, as loss()): `positions` (N)
  // int64, the flat (B*T) positions whose next label is supervised, ascending, on the host when
  // the labels are; `logprobs` (N) fp32 on the model's device, differentiable (through the
  // chunked lm_head, chunked_token_logprobs). Per-sequence sums (preference objectives) are an
  // index_add of them.
  struct TokenLogprobs {
    at::Tensor positions;
    at::Tensor logprobs;
  };
  // `temperature`: log softmax(logits / temperature) (GRPO's policy, as TRL; 1: the model's).
  TokenLogprobs token_logprobs(const ModelInputs& in, double temperature = 1.0);

  // Every parameter in HF order (embed, layers..., norm, lm_head when untied). These three
  // accessors call the master fence (below) for every master before they return.
  std::vector<Parameter>& parameters();
  const std::vector<Parameter>& parameters() const;
  std::vector<Parameter*> trainable_parameters();  // the HF parameters', then the adapters'
  std::vector<Parameter>& adapters();  // LoRA A and B of every adapted linear, in HF order
  Parameter& parameter(const std::string& name);  // error naming the key when absent
  const Parameter& parameter(const std::string& name) const;
  void zero_grad();  // grads -> undefined (freed)
  // In-backward optimizer updates: with a hook set, each trainable parameter is handed to it from
  // inside the backward as soon as its gradient for the step is complete (every use of the
  // parameter in the graph has delivered its part), and its grad is freed when the hook returns,
  // so no full-model gradient buffer exists. Call begin_grad_step() before each step's forward
  // (it resets the use counts). An empty hook: gradients stay in Parameter::grad (default).
  using GradReadyHook = std::function<void(Parameter&)>;
  void set_grad_ready_hook(GradReadyHook hook);
  void begin_grad_step();
  int64_t num_trainable_elements() const;  // total elements of trainable masters
  // The routing of the last forward (empty for a dense model); one device sync.
  RouterStats router_stats() const;
  // The master of `p` (nullptr: of every trainable parameter) has changed (an optimizer update,
  // a restore, a broadcast): re-derives what its forward computes from, the device codes
  // (offload_masters, ForwardWeights::kCodes) or the kept weight (kKept), in place and in the
  // current stream's order. Parameters without either are skipped.
  void refresh_forward_weights(const Parameter* p = nullptr);
  // The same for one parameter from `master` ((out, in), any device and float dtype), which holds
  // its master's current values (e.g. the optimizer's device copy of an offloaded master, so the
  // host copy is not read back over PCIe).
  void refresh_forward_weights(const Parameter& p, const at::Tensor& master);
  // Whether `p` has a forward weight kept from its master (codes or kept weight) that
  // refresh_forward_weights must follow.
  static bool keeps_forward_weight(const Parameter& p) {
    return p.trainable && (p.qdata.defined() || p.kept_weight.defined());
  }
  // ModelOptions::forward_weights for a loaded model (the trainer resolves `auto` once the
  // device's free memory is known): makes or drops the codes or kept weights of the trainable
  // NVFP4 linears whose masters are on the device. Not during a step.
  void set_forward_weights(ForwardWeights mode);

  // Masters whose current value may still be arriving from elsewhere (data parallelism: an
  // owner's broadcast of its updated master is in flight while the next step starts). With a
  // fence set, the model calls it before it reads a trainable master: fence(&p) right before a
  // forward's first use of p (the weight and embedding taps: training, evaluation, generation),
  // fence(nullptr) for every master in parameters(), parameter(), trainable_parameters(),
  // export_to() and compare_forward_weights(), the way every other reader reaches masters. The
  // fence returns once the master may be read (and written) in the current stream's order, and
  // must return at once when nothing is in flight. Empty (the default): masters are current.
  using MasterFence = std::function<void(const Parameter* p)>;
  void set_master_fence(MasterFence fence);

  // Writes `path` with the entries of `source` in source order: a trainable parameter whose
  // master differs from what load() produces from the source entry is requantized (NVFP4
  // rules, source element types) or cast back to its source element type; everything else is
  // copied byte-exactly. Atomic (DatWriter). `source` must match this model's shapes.
  // `dense_linears` (plain precision only): trainable NVFP4 linears are written as fp16 tensors
  // of their masters (the trained full-precision model) instead of their NVFP4 quantization.
  void export_to(const DatReader& source, const std::string& path,
                 bool dense_linears = false) const;
  // The LoRA adapters as a PEFT adapter folder `dir`: adapter_model.safetensors (A and B of
  // every adapted linear under PEFT's names, in the masters' dtype) and adapter_config.json
  // (r, lora_alpha, target_modules, layers_to_transform; `base_model` as
  // base_model_name_or_path). Every other trained tensor (norms, embedding, lm_head) goes in
  // as PEFT saves modules_to_save: its module path listed in modules_to_save, the weight the
  // forward computes with (fake_quant(master) for an NVFP4 linear) under
  // base_model.model.<name>; a tied lm_head is listed and saved too (peft unties it when it
  // wraps the embedding). peft loads it onto the dequantized base model. Each file is written
  // atomically.
  void export_adapter(const std::string& dir, const std::string& base_model = "") const;
  // Sets every adapter's A and B and replaces every modules_to_save weight from
  // `dir`/adapter_model.safetensors (PEFT names, with or without the ".default" adapter name).
  // Errors name the file and the tensor: a missing A or B, a shape that differs, a non-float or
  // non-finite tensor, and every tensor that would not be applied (a layer the model lacks, a
  // linear outside target_modules or layers_to_transform, a weight outside modules_to_save).
  // The model was built with with_adapter(read_adapter_config(dir)).
  AdapterLoad load_adapter(const std::string& dir);
  // An adapted linear's merged weight W + (alpha/rank)·B·A, fp32 on the model's device: what a
  // merge-aware forward fake-quantizes and the export quantizes.
  at::Tensor merged_weight(const Parameter& adapted) const;
  // Plain LoRA's merged export requantizes W + s·B·A: the RMS of that requantization's change,
  // relative to the RMS of the adapters' updates s·B·A, over every adapted linear (0 without
  // adapters). Merge-aware adapters trained through it, so for them it describes the grid only.
  double merged_requantization_error() const;
  // The parameters whose forward weight, as a model loaded from `exported` would compute it,
  // differs from this model's, each as "name (k of n elements)" (empty: the export reproduces
  // this model's forward exactly). Raw tensors are compared after rounding this model's weight
  // to the entry's stored element type (fp32 masters are exported to fp16 by design).
  // Streams one tensor at a time, in row ranges of about `chunk_elems` elements: no second
  // model in memory, device temporaries of ~100 MB at the default.
  std::vector<std::string> compare_forward_weights(const DatReader& exported,
                                                   int64_t chunk_elems = int64_t{1} << 24) const;

  // A scope in which forwards without autograd (generation, rollouts) compute each linear's
  // forward weight once and keep it (Parameter::inference_weight), instead of fake-quantizing
  // its master (or merging its adapter) again in every forward: a decode step then reads the
  // weights once. At most `max_bytes` are kept (the linears first met keep theirs; the rest are
  // computed per forward as outside the scope). The masters must not change inside the scope;
  // the kept weights are dropped when it ends.
  class InferenceWeights {
   public:
    InferenceWeights(Qwen3Model& model, int64_t max_bytes);
    ~InferenceWeights();
    InferenceWeights(const InferenceWeights&) = delete;
    InferenceWeights& operator=(const InferenceWeights&) = delete;
    int64_t bytes() const;  // kept so far

   private:
    Qwen3Model& model_;
  };

  // An empty cache for `batch` sequences of up to `capacity` tokens.
  KvCache make_cache(int64_t batch, int64_t capacity) const;
  // Logits (B, V) of the last position after appending `in` (B, T) to `cache`, in the compute
  // dtype (only that position goes through lm_head). The generation step of sampling.h.
  at::Tensor next_token_logits(const ModelInputs& in, KvCache& cache);
  // Greedy decoding of one prompt with a KV cache (prefill in one pass): q4::model::generate
  // (sampling.h) with temperature 0. Returns the new tokens only, ending with the stop token
  // when one was produced.
  std::vector<int64_t> generate(const std::vector<int64_t>& prompt_ids,
                                const GenerateOptions& gen = {});

  struct Impl;

 private:
  explicit Qwen3Model(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Writes every parameter of `model` as a .dat, in model (HF) order: the quantized linears (when
// `quantize_linears`) and lm_head (when `quantize_lm_head`) as NVFP4 pairs quantized from their
// masters (qdata elem 100, scale elem 101), an adapted linear as its merged weight's NVFP4 pair,
// everything else fp16. The file of a random init (dense for a plain-precision run), and the
// export of a model that has no source file. Atomic (DatWriter).
void write_dat(const Qwen3Model& model, const std::string& path, bool quantize_lm_head,
               bool quantize_linears = true);

// Mean CE of fp32(hidden @ weight^T) rows against `labels` (-100 ignored), computed over chunks
// of `chunk_tokens` rows; each chunk's gradients are computed in the forward from the same
// block, so no logits are saved for the backward.
//   hidden (N, H), weight (V, H) same dtype, labels (N) int64. Returns {sum, count}: sum () fp32
//   differentiable w.r.t. hidden and weight, count () int64. `fused_kernels`: on CUDA, the
//   fused softmax cross-entropy kernel where the inputs allow it (ModelOptions::
//   fused_cuda_kernels); false: the ATen ops.
std::pair<at::Tensor, at::Tensor> chunked_cross_entropy_sum(const at::Tensor& hidden,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& labels,
                                                            int64_t chunk_tokens,
                                                            bool fused_kernels = true);

// The same with a LossTerm: rows are handed to term.chunk in the given order (`row_begin`
// counts from 0; term.prepare is the caller's). Returns (1 - w) * CE sum + w * term sum,
// differentiable w.r.t. hidden and weight, and sets `ce_sum` and `term_sum` (detached).
at::Tensor chunked_loss_with_term(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& labels, int64_t chunk_tokens,
                                  const LossTerm& term, at::Tensor* ce_sum, at::Tensor* term_sum,
                                  bool fused_kernels = true);

// Log-probability of each row's label, log softmax(hidden · weightᵀ / temperature)[label] (the
// fp32 logits divided by the temperature, as the sampler divides them), in chunks of
// `chunk_tokens` rows: hidden (N, H), weight (V, H) same dtype, labels (N) int64 in [0, V).
// Returns (N) fp32, differentiable w.r.t. hidden and weight: the backward recomputes each chunk's
// logits (one more lm_head GEMM than the cross-entropy, whose upstream gradient is a scalar;
// here every row has its own), so no logits are saved.
at::Tensor chunked_token_logprobs(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& labels, int64_t chunk_tokens,
                                  double temperature = 1.0);

}  // namespace q4::model

Q4_ENUM_NAMES(q4::model::ForwardWeights, {"sweep", q4::model::ForwardWeights::kSweep},
              {"codes", q4::model::ForwardWeights::kCodes},
              {"kept", q4::model::ForwardWeights::kKept});
Q4_ENUM_NAMES(q4::model::MasterInit, {"codes", q4::model::MasterInit::kCodes},
              {"dither", q4::model::MasterInit::kDither});
// ModelOptions::block_rule's spellings (quant.block_rule in the config; quant/ is below q4_io).
Q4_ENUM_NAMES(q4::quant::BlockRule, {"max6", q4::quant::BlockRule::kMax6},
              {"4over6", q4::quant::BlockRule::kFourOverSix});
