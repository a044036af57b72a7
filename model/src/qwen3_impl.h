// Private state of Qwen3Model and the building blocks its .cpp files share: the parameter table,
// per-layer parameter pointers, RoPE tables, attention masks, the decoder-layer forward and the
// layer's two slots, the linear backend (linear_backend.h) and the FFN (ffn.h).
// Parameters live in a vector that is sized once at construction, so the raw Parameter pointers
// handed to autograd functions stay valid for the model's lifetime (Impl never moves).
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ffn.h"
#include "moe_routing.h"
#include "q4/model/linear_backend.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_params.h"

namespace q4::model {

// The adapted linear's short name ("q_proj", ..., "lm_head") of an HF parameter name, or "".
std::string linear_short_name(const std::string& name);

struct LayerParams {
  Parameter* q_proj;
  Parameter* k_proj;
  Parameter* v_proj;
  Parameter* o_proj;
  Parameter* q_norm;
  Parameter* k_norm;
  Parameter* input_layernorm;
  Parameter* post_attention_layernorm;
  std::vector<Parameter*> ffn;    // the FFN slot's tensors, in Ffn::param_specs order
  const Ffn* ffn_slot = nullptr;  // the layer's FFN (ffn_for(cfg, layer))
};

// Attention mask for one forward. kNone: every query sees every key (decode of 1 token).
// kCausal: plain causal, queries and keys aligned (no cache). kExplicit: `allowed`.
// kVarlen: causal within each segment of `allowed` = cu_seqlens over the flattened B*T tokens
// (FlashAttention varlen, CUDA only).
struct AttnMask {
  enum class Kind { kNone, kCausal, kExplicit, kVarlen } kind = Kind::kCausal;
  at::Tensor allowed;  // kExplicit: (B or 1, 1, T, S) bool, true = the query may attend the key;
                       // kVarlen: (S + 1) int32 cu_seqlens on the device
  int64_t max_seqlen = 0;  // kVarlen: longest segment
};

struct RopeTables {
  at::Tensor cos;  // (B, T, D) compute dtype
  at::Tensor sin;  // (B, T, D) compute dtype
};

struct Qwen3Model::Impl {
  Qwen3Config cfg;
  ModelOptions opt;
  at::ScalarType grad_dtype;
  bool tied = false;
  std::vector<Parameter> params;             // HF order; never resized after construction
  std::vector<std::vector<int64_t>> shapes;  // expected shape of params[i]
  std::unordered_map<std::string, size_t> index;
  Parameter* embed = nullptr;
  Parameter* final_norm = nullptr;
  Parameter* lm_head = nullptr;  // == embed when tied
  std::vector<LayerParams> layers;
  std::vector<Parameter>
      adapters;  // LoRA A, B per adapted linear; never resized after construction
  std::vector<std::vector<int64_t>> adapter_shapes;
  at::Tensor trigger;  // () fp32 leaf with requires_grad when anything trains (graph anchor)
  Qwen3Model::GradReadyHook grad_ready;  // in-backward updates (empty: keep Parameter::grad)
  Qwen3Model::MasterFence master_fence;  // masters in flight (empty: always current)
  at::Tensor inv_freq;                   // (D/2) fp32 on the device, HF formula
  // The slots, chosen once at construction: every linear of the decoder layers goes through
  // linear_backend (ModelOptions::linear_backend, else the device's), each layer's FFN block
  // through its LayerParams::ffn_slot (ffn_for(cfg, layer)).
  std::shared_ptr<const LinearBackend> linear_backend;
  // What the mixture-of-experts routers of the current forward recorded (moe_routing.h).
  mutable RouterRecord router;

  // Parameter table (names, shapes, trainable flags) without masters.
  Impl(const Qwen3Config& c, const ModelOptions& o, bool tied_lm_head);

  const Ffn& ffn_of(int64_t layer) const { return *layers[layer].ffn_slot; }
  // The load-balancing loss's weight in loss(): ModelOptions', else the config's.
  double router_aux_loss_coef() const {
    return opt.router_aux_loss_coef.value_or(cfg.moe.router_aux_loss_coef);
  }
  Parameter* find(const std::string& name);
  const std::vector<int64_t>& shape_of(const Parameter* p) const;
  // Qwen3Model::InferenceWeights: active, its byte budget and what it keeps.
  bool inference_weights = false;
  int64_t inference_budget = 0;
  int64_t inference_bytes = 0;
  bool any_trainable() const;
  // LoRA: whether parameter `s` gets an adapter; A and B's initial draw (after loading).
  bool adapted(const ParamSpec& s) const;
  void make_adapters(const std::vector<ParamSpec>& specs);  // construction: A and B entries
  void init_adapters();
  // An adapted linear's W + (alpha/rank)·B·A, fp32 on the device (no autograd).
  at::Tensor merged_weight(const Parameter* p) const;
  // The linear slot: x·weight(p)ᵀ, plus the plain LoRA term when p has a plain adapter.
  at::Tensor linear(const at::Tensor& x, Parameter* p) const;
  // The same from weights resolved before (linear_weights(p), or detached copies of them).
  at::Tensor linear(const at::Tensor& x, const LinearWeights& w) const;
  // x through two or three linears that share it (q/k/v, gate/up).
  std::vector<at::Tensor> linears(const at::Tensor& x,
                                  const std::vector<const LinearWeights*>& ws) const;
  LinearWeights linear_weights(Parameter* p) const;  // resolved by the linear backend
  at::Tensor plain_lora(const at::Tensor& x, const LinearWeights& w) const;  // (s·x·Aᵀ)·Bᵀ
  // A trainable NVFP4 linear just given its master: with ModelOptions::offload_masters derives
  // its codes and (CUDA) moves the master to pinned host memory; else makes the forward weight
  // that ModelOptions::forward_weights keeps (keep_forward_weight). No-op for other parameters.
  void offload_master(Parameter* p);
  // p's codes or kept weight as ModelOptions::forward_weights says (none: kSweep), from its
  // device master.
  void keep_forward_weight(Parameter* p, ForwardWeights mode);
  // p's master on the model's device: itself, or a device copy of an offloaded one.
  at::Tensor device_master(const Parameter* p) const;
  // Before a read of trainable master `p`, or of every master (nullptr): the master fence.
  void fence(const Parameter* p) const {
    if (master_fence) master_fence(p);
  }

  // Weight as the forward uses it, compute dtype: frozen -> master; trainable -> a
  // straight-through tap (fake-quantized when quantized) that accumulates into p->grad, after
  // the master fence for p. Every forward reads trainable masters through these two.
  // Inside a Qwen3Model::InferenceWeights scope without autograd: the kept forward weight.
  at::Tensor weight(Parameter* p) const;
  at::Tensor forward_weight(Parameter* p) const;  // weight() without the inference scope
  at::Tensor embed_lookup(const at::Tensor& ids) const;  // (B, T) -> (B, T, H)

  RopeTables rope(const at::Tensor& position_ids) const;  // position_ids (B, T) int64
  // One decoder layer: h (B, T, H) -> (B, T, H), the attention block then the FFN's. With a
  // cache, writes K/V at cache->length.
  at::Tensor layer_forward(int64_t layer, const at::Tensor& h, const RopeTables& rope,
                           const AttnMask& mask, KvCache* cache) const;
  // The attention block: h (B, T, H) -> hs = h + o_proj(attention(input_layernorm(h))).
  at::Tensor attention_block(int64_t layer, const at::Tensor& h, const RopeTables& rope,
                             const AttnMask& mask, KvCache* cache) const;
  // The layer through its checkpoints (ModelOptions::layer_recompute: the whole layer, or one
  // block with the other keeping its graph) when a graph is being built; plain layer_forward
  // otherwise.
  at::Tensor layer_maybe_checkpointed(int64_t layer, const at::Tensor& h, const RopeTables& rope,
                                      const AttnMask& mask, KvCache* cache) const;
  at::Tensor hidden_states(const ModelInputs& in, KvCache* cache);
  bool uses_varlen(const ModelInputs& in, const KvCache* cache) const;
};

// ---- ops (qwen3_ops.cpp) ----
// `fused` (ModelOptions::fused_cuda_kernels): the fused CUDA kernel where the inputs allow it.
// HF Qwen3RMSNorm: fp32 normalize, cast back to x's dtype, times weight.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool fused);
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& rope);  // x (B, heads, T, D)
// x (B, T, heads, D)
at::Tensor apply_rope_bthd(const at::Tensor& x, const RopeTables& rope, bool fused);
// q (B, NH, T, D), k/v (B, KVH, S, D) -> (B, NH, T, D). GQA by repeating KV heads.
at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const AttnMask& mask);
// Causal attention within segments: q (N, NH, D), k/v (N, KVH, D) with N the flattened tokens,
// cu_seqlens (S + 1) int32 on the device -> (N, NH, D). FlashAttention varlen (CUDA, fp16/bf16).
at::Tensor attention_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& cu_seqlens, int64_t max_seqlen);
bool varlen_attention_available(const at::Device& device, at::ScalarType compute_dtype,
                                int64_t head_dim);
// Mask for T new tokens after `past` cached ones, from the optional padding/segment inputs.
AttnMask build_attention_mask(const ModelInputs& in, int64_t past, int64_t T,
                              const at::Device& device);
// ---- generation (qwen3_generate.cpp) ----
// Mask for T new tokens after `past` cached ones when the cache has key_valid (a left-padded
// batch): causal, minus the invalid slots, plus each query's own slot (padded queries stay
// finite). `in` must have no attention_mask/segment_ids.
AttnMask cached_attention_mask(const ModelInputs& in, const KvCache& cache, int64_t past,
                               int64_t T);

// ---- fused CUDA ops (fused_ops.cpp); *_applies says whether the inputs allow them ----
bool fused_rms_norm_applies(const at::Tensor& x, const at::Tensor& w);
at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);
bool fused_rope_applies(const at::Tensor& x, const at::Tensor& cos);  // x (N, heads, D)
at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// silu(g) * u: with `fused`, one fused kernel forward and backward on CUDA; the two ATen ops
// elsewhere.
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u, bool fused);
// Softmax cross-entropy of logit rows in one kernel (CUDA, 16/32-bit floats): returns the
// per-row CE (fp32, 0 for labels outside [0, V)) and, with want_grad, overwrites `logits` with
// d(sum CE)/d(logits) in its dtype. fused_xent_applies says whether the inputs allow it.
bool fused_xent_applies(const at::Tensor& logits, const at::Tensor& labels);
at::Tensor fused_softmax_xent_(at::Tensor& logits, const at::Tensor& labels, bool want_grad);
// The ATen reference of rms_norm() (the path on CPU and where the fused op does not apply).
at::Tensor rms_norm_reference(const at::Tensor& x, const at::Tensor& weight, double eps);

// ---- mixture-of-experts routing (moe_routing.cpp) ----
// After the last decoder layer: h itself, and impl->router.aux set to the forward's
// load-balancing loss (with a graph: through the aux gate, whose backward gives the routers'
// taps d loss / d aux).
at::Tensor router_aux_gate(const Qwen3Model::Impl* impl, const at::Tensor& h);
// A router's logits (N, E) into the graph through the tap that adds the aux loss's gradient.
at::Tensor router_tap(const Qwen3Model::Impl* impl, const at::Tensor& logits);

// ---- autograd functions (qwen3_autograd.cpp) ----
at::Tensor tap_weight(const Qwen3Model::Impl* impl, Parameter* p, at::ScalarType compute_dtype,
                      at::ScalarType grad_dtype);
// An adapter's update B·A, fp32 (no autograd): b (out, r) and a (r, in) of a dense linear give
// (out, in); a stacked expert projection's per-expert adapters, b (E·out, r) and a (E·r, in) with
// expert e's rows in block e, give (E·out, in) with block e = b_e·a_e
// (docs/model.md#lora-on-experts). E = a.size(0) / b.size(1).
at::Tensor lora_delta(const at::Tensor& b, const at::Tensor& a);
// The gradients of A and B from dW, the gradient of W + s·B·A, block by block as lora_delta
// forms it: dA = s·Bᵀ·dW, dB = s·dW·Aᵀ (each expert's blocks alone).
std::pair<at::Tensor, at::Tensor> lora_delta_grads(const at::Tensor& b, const at::Tensor& a,
                                                   const at::Tensor& dw, double s);
// Merge-aware LoRA: fake_quant(W + s·B·A) in the compute dtype; backward hands s·Bᵀ·dW and
// s·dW·Aᵀ to A's and B's gradients (straight through the quantizer).
at::Tensor tap_lora_merged(const Qwen3Model::Impl* impl, Parameter* p, at::ScalarType compute_dtype,
                           at::ScalarType grad_dtype);
// The gradients of y = x·wᵀ + s·(x·aᵀ)·bᵀ from g = dy (tokens, out), x2 (tokens, in) and
// xa = x2·aᵀ: dx = s·(g·b)·a + g·w, da = s·(g·b)ᵀ·x2, db = s·gᵀ·xa (those wanted). The plain
// adapter's backward and the FFN recompute's hand-formed last projection share it, so both give
// the same bits.
struct PlainLoraGrads {
  at::Tensor dx, da, db;
};
PlainLoraGrads plain_lora_grads(const at::Tensor& x2, const at::Tensor& xa, const at::Tensor& w,
                                const at::Tensor& a, const at::Tensor& b, double s,
                                const at::Tensor& g, bool want_dx, bool want_da, bool want_db);
// Plain LoRA: x·wᵀ + scale·(x·aᵀ)·bᵀ for a frozen w, with a and b from their taps.
at::Tensor plain_lora_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& a,
                             const at::Tensor& b, double scale);
// Two or three plain adapted linears of one input, each as plain_lora_linear computes it, with
// the adapters' GEMMs shared and the input gradient summed in the GEMMs (q/k/v, gate/up).
std::vector<at::Tensor> plain_lora_linears(const at::Tensor& x,
                                           const std::vector<const LinearWeights*>& ws,
                                           double scale);
at::Tensor tap_embedding(const Qwen3Model::Impl* impl, Parameter* p, const at::Tensor& ids,
                         at::ScalarType compute_dtype, at::ScalarType grad_dtype);
// Checkpoints (recomputed in backward): the whole layer h -> out, keeping h; the attention block
// h -> hs, keeping h; the MLP block hs -> out, keeping hs.
at::Tensor checkpoint_layer(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& h,
                            const RopeTables& rope, const AttnMask& mask);
at::Tensor checkpoint_attention(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& h,
                                const RopeTables& rope, const AttnMask& mask);
at::Tensor checkpoint_mlp(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& hs);

// Classification of a .dat key: "P.weight.qdata" / "P.weight.scale" -> name "P.weight".
struct KeyRef {
  enum class Part { kRaw, kQData, kScale } part = Part::kRaw;
  std::string name;
};
KeyRef classify_key(const std::string& key);

}  // namespace q4::model
