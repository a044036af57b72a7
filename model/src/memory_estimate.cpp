// Analytic device-memory budget of one training step, used by the trainer's --dry-run and VRAM
// probe next to the allocator's measurements. Persistent terms (trainable masters, frozen weights
// in the compute dtype) plus the largest of the step's phases, each counted from what this
// implementation allocates: checkpointed layer inputs alive at that point (or every layer's saved
// tensors without checkpointing, or one block's for a layer that keeps it), the loss chunk's
// logits block and the lm_head's compute weight and gradient (loss phases), one recomputed
// layer's graph (layer backward), and the gradients that exist then (all of them on the buffered
// path, one at a time with in-backward updates). layer_keep_costs prices keeping one block.
#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <string>
#include <utility>
#include <vector>

#include "ffn.h"
#include "q4/io/enum_names.h"
#include "q4/model/qwen3.h"
#include "q4/quant/nvfp4.h"

Q4_ENUM_NAMES(q4::model::MemoryPhaseKind, {"forward", q4::model::MemoryPhaseKind::kForward},
              {"loss forward", q4::model::MemoryPhaseKind::kLossForward},
              {"loss backward", q4::model::MemoryPhaseKind::kLossBackward},
              {"layer backward", q4::model::MemoryPhaseKind::kLayerBackward},
              {"embedding backward", q4::model::MemoryPhaseKind::kEmbeddingBackward},
              {"optimizer step", q4::model::MemoryPhaseKind::kOptimizerStep});

namespace q4::model {
namespace {

// Whether adapted linears keep their dequantized frozen weight (counted with the frozen bytes;
// the graphs save that tensor itself).
bool caches_weight(const ModelOptions& opt) {
  return opt.cache_adapted_weights && !opt.lora.merge_aware;
}

// Whether trained NVFP4 linears keep their compute-dtype forward weight for the run
// (ForwardWeights::kKept; offloaded masters compute from codes). Their taps then hand the
// graphs aliases of it, which save nothing more.
bool keeps_forward_weight(const ModelOptions& opt) {
  return opt.fake_quant && !opt.offload_masters && opt.forward_weights == ForwardWeights::kKept;
}

// Whether linear parameter `p` reaches a layer's graph as a compute-dtype weight that its linear
// saves beyond what the model stores: a trainable NVFP4 linear's tap output (unless kept), an
// adapted linear's dequantized or merged weight. Frozen weights are saved as the stored tensors
// themselves.
bool saves_compute_weight(const ParamSpec& p, const ModelOptions& opt, int64_t num_layers,
                          bool tied) {
  if (opt.lora.adapts(p, opt.trainable, num_layers)) return !caches_weight(opt);
  return p.kind == ParamKind::kQuantizedLinear && opt.trainable.trains(p, num_layers, tied) &&
         !keeps_forward_weight(opt);
}

// Bytes per token that one decoder layer's graph saves besides its input, by block, as this
// implementation allocates them. Attention: the input norm's output, then the attention's
// tensors; fp32 per-row RMSNorm scales (input norm, q/k per head) and the attention log-sum-exp
// (attention probabilities are never kept). The FFN block: its slot's costs (Ffn::costs).
struct LayerActivations {
  // The trainer's batches carry cu_seqlens: on CUDA with 16-bit compute (LibTorch >= 2.4) the
  // layers take the variable-length FlashAttention path with the fused RMSNorm/RoPE kernels.
  bool varlen = false;
  bool gqa = false;  // fewer KV heads than query heads
  int64_t attn_per_token = 0;
  FfnCosts ffn;
};

LayerActivations layer_activations(const Qwen3Config& cfg, const ModelOptions& opt) {
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t H = cfg.hidden_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), D = cfg.head_dim;
  const int64_t NH = cfg.num_attention_heads, KVH = cfg.num_key_value_heads;
  const bool cuda = opt.device.is_cuda();
  LayerActivations a;
  a.varlen = cuda && cs == 2 && D % 8 == 0 && D <= 256;
  a.gqa = KVH != NH;
  int64_t attn = 0;
  if (a.varlen) {
    // q and k: projection output (the norm's input) and RoPE output; v; the attention output.
    attn = 3 * QD + 3 * KVD;
  } else {
    // ATen RoPE keeps its input and rotate_half(x) too; SDPA sees K/V repeated to every query
    // head (GQA) and keeps its output beside the (tokens, q_dim) copy o_proj reads.
    attn = 6 * QD + 3 * KVD + (a.gqa ? 2 * QD : 2 * KVD);
  }
  a.attn_per_token = cs * (H + attn) + 4 * (1 + 2 * NH + KVH);
  if (!cuda) {
    // The ATen reference RMSNorm also keeps its fp32 input and its normalized value (in fp32
    // compute, the input itself and the fp32 product).
    a.attn_per_token += 4 * (H + QD + KVD) + (cs == 4 ? 0 : cs * (H + QD + KVD));
  }
  // Every layer is budgeted as the largest FFN among its kinds (an MoE model's dense layers
  // are smaller than its expert layers).
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    const FfnCosts c = ffn_for(cfg, l).costs(cfg, opt);
    a.ffn.graph_per_token = std::max(a.ffn.graph_per_token, c.graph_per_token);
    a.ffn.forward_per_row = std::max(a.ffn.forward_per_row, c.forward_per_row);
    a.ffn.chunk_per_row = std::max(a.ffn.chunk_per_row, c.chunk_per_row);
    a.ffn.inner_per_token = std::max(a.ffn.inner_per_token, c.inner_per_token);
    a.ffn.recompute_macs_per_token =
        std::max(a.ffn.recompute_macs_per_token, c.recompute_macs_per_token);
  }
  return a;
}

// The parameters by where their bytes are: persistent totals and, per decoder layer, what its
// graphs and its backward's gradients hold.
struct ParamTally {
  // Per decoder layer: trainable elements, their compute-dtype weights saved by the layer's
  // linears (tap outputs; frozen layers save the frozen tensors themselves) and the largest one.
  // The compute-dtype weights are split by block: attention (q/k/v/o) and FFN.
  std::vector<int64_t> layer_elems, layer_largest, attn_weight_elems, ffn_weight_elems;
  // Elements of the FFN block's weight taps (trainable weights, merge-aware merged weights,
  // plain adapters' A and B; the norm's too), and of the weight tap whose gradient the
  // recompute forms by hand (Ffn::hand_formed_grad).
  std::vector<int64_t> ffn_tapped, hand_tapped;
  int64_t head_elems = 0;  // gradients produced by the loss: lm_head (untied) and the final norm
  int64_t embed_elems = 0;
  int64_t resident_grad_bytes = 0;  // gradients of parameters whose master is on the device
  bool lm_trains = false;
  bool lm_kept = false;  // a trained NVFP4 lm_head whose forward weight is kept (no tap copy)
};

// The step's settings that the phases share.
struct StepTerms {
  int64_t ms = 0, cs = 0, gs = 0;  // master, compute and gradient element sizes
  int64_t L = 0, tokens = 0;
  bool cuda = false, in_backward = false, tied = false;
  bool offload = false;  // trainable NVFP4 linears: codes on the device, masters on the host
  // Trained NVFP4 linears with device masters keep their forward weight: as codes, or kept in
  // the compute dtype (ModelOptions::forward_weights).
  bool codes = false, kept = false;
  // Gradients of earlier micro-batches stay in the buffer through every phase of later ones
  // (with in-backward updates too: the last micro-batch's backward applies the sums); with
  // offloaded masters, those of the offloaded linears add up in pinned host memory instead
  // (each one freed on the device once complete, as with in-backward updates).
  bool carried = false, host_accum = false, buffer_carried = false;
  int64_t boundary = 0;  // a layer input/output
};

// The elements of p's adapter: r·(out + in) for a dense linear; a stacked expert projection's
// per-expert blocks, A (E·r, in) and B (E·out_e, r), its up_proj's B only (A is gate_proj's).
int64_t adapter_elements(const ParamSpec& p, const ModelOptions& opt, int64_t experts) {
  const int64_t r = opt.lora.rank;
  if (p.name.find(".mlp.experts.") == std::string::npos) return r * (p.shape[0] + p.shape[1]);
  const int64_t b = r * p.shape[0];  // E·out_e·r
  if (name_has_tail(p.name, ".up_proj.weight")) return b;
  return b + experts * r * p.shape[1];
}

// A LoRA-adapted linear: frozen as NVFP4 codes; the adapter's A and B train. The forward's
// weight (merged and fake-quantized, or dequantized) is a compute-dtype tensor like a trained
// linear's tap.
void tally_adapted(const ParamSpec& p, const ModelOptions& opt, const Ffn& ffn, const StepTerms& t,
                   int64_t experts, MemoryEstimate* est, ParamTally* tally) {
  const int64_t n = p.numel();
  const int64_t a = adapter_elements(p, opt, experts);
  est->frozen_bytes += n / 2 + n / q4::quant::kNvfp4BlockSize + (caches_weight(opt) ? n * t.cs : 0);
  est->master_bytes += a * t.ms;
  est->grad_buffer_bytes += a * t.gs;
  tally->resident_grad_bytes += a * t.gs;
  if (p.layer < 0) {
    tally->head_elems += a;
    tally->lm_trains = true;
    return;
  }
  tally->layer_elems[p.layer] += a;
  tally->layer_largest[p.layer] = std::max(tally->layer_largest[p.layer], a);
  // Merge-aware: the tap is the merged (out, in) weight; plain: A and B themselves.
  const int64_t tap = opt.lora.merge_aware ? n : a;
  if (ffn.owns(p)) tally->ffn_tapped[p.layer] += tap;
  if (opt.lora.merge_aware && ffn.hand_formed_grad(p)) tally->hand_tapped[p.layer] = n;
}

// A trained parameter: its master (or, offloaded, its codes) and its gradient.
void tally_trained(const ParamSpec& p, const Ffn& ffn, const StepTerms& t, MemoryEstimate* est,
                   ParamTally* tally) {
  const int64_t n = p.numel();
  est->grad_buffer_bytes += n * t.gs;
  const bool nvfp4 = p.kind == ParamKind::kQuantizedLinear;
  if (t.offload && nvfp4) {
    est->master_bytes += n / 2 + n / q4::quant::kNvfp4BlockSize;  // codes + E4M3 scales
    est->host_bytes += n * t.ms + (t.host_accum ? n * t.gs : 0);  // master (+ gradient buffer)
  } else {
    est->master_bytes += n * t.ms;
    tally->resident_grad_bytes += n * t.gs;
    if (nvfp4 && t.codes) est->forward_weight_bytes += n / 2 + n / q4::quant::kNvfp4BlockSize;
    if (nvfp4 && t.kept) est->forward_weight_bytes += n * t.cs;
  }
  if (p.layer >= 0) {
    tally->layer_elems[p.layer] += n;
    if (ffn.owns(p)) tally->ffn_tapped[p.layer] += n;
    if (ffn.hand_formed_grad(p)) tally->hand_tapped[p.layer] = n;
    tally->layer_largest[p.layer] = std::max(tally->layer_largest[p.layer], n);
  } else if (p.group == ParamGroup::kEmbedding) {
    tally->embed_elems = n;
    tally->lm_trains = tally->lm_trains || t.tied;
  } else {
    tally->head_elems += n;
    tally->lm_trains = tally->lm_trains || p.group == ParamGroup::kLmHead;
    tally->lm_kept = tally->lm_kept || (p.group == ParamGroup::kLmHead && nvfp4 && t.kept);
  }
}

ParamTally tally_parameters(const Qwen3Config& cfg, const ModelOptions& opt, bool include_lm_head,
                            const StepTerms& t, MemoryEstimate* est) {
  const size_t L = static_cast<size_t>(t.L);
  ParamTally tally;
  for (auto* v : {&tally.layer_elems, &tally.layer_largest, &tally.attn_weight_elems,
                  &tally.ffn_weight_elems, &tally.ffn_tapped, &tally.hand_tapped}) {
    v->assign(L, 0);
  }
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    const Ffn& ffn = ffn_for(cfg, std::max<int64_t>(p.layer, 0));
    if (p.layer >= 0 && saves_compute_weight(p, opt, t.L, t.tied)) {
      (ffn.owns(p) ? tally.ffn_weight_elems : tally.attn_weight_elems)[p.layer] += p.numel();
    }
    if (opt.lora.adapts(p, opt.trainable, t.L)) {
      tally_adapted(p, opt, ffn, t, cfg.moe.num_experts, est, &tally);
    } else if (!opt.trainable.trains(p, t.L, t.tied)) {
      est->frozen_bytes += p.numel() * t.cs;
    } else {
      tally_trained(p, ffn, t, est, &tally);
    }
  }
  return tally;
}

// The activations of the decoder layers: what each holds from its forward to its backward, and
// the transients of the blocks' forward and backward.
class LayerMemory {
 public:
  LayerMemory(const Qwen3Config& cfg, const ModelOptions& opt, const StepTerms& t,
              const ParamTally& tally)
      : opt_(opt), t_(t), tally_(tally), acts_(layer_activations(cfg, opt)) {
    const int64_t tokens = t.tokens, cs = t.cs;
    const int64_t H = cfg.hidden_size, QD = cfg.q_dim(), KVD = cfg.kv_dim();
    const int64_t NH = cfg.num_attention_heads;
    const bool varlen = acts_.varlen, gqa = acts_.gqa;
    chunked_ = opt.mlp_chunk_tokens > 0 && tokens > opt.mlp_chunk_tokens;
    chunk_rows_ = chunked_ ? opt.mlp_chunk_tokens : tokens;
    // Largest transient of a block's forward without grad (checkpointed), beyond its input: the
    // attention block's q/k (projection and norm or RoPE output), v and the input norm's output
    // (K/V also repeated for SDPA with GQA); the FFN's per row, per chunk when chunked (its
    // input and output then (tokens, H) each).
    attn_forward_work_ = tokens * cs * (H + 2 * QD + 2 * KVD + (!varlen && gqa ? 2 * QD : 0));
    ffn_forward_work_ = chunked_ ? 2 * t.boundary + chunk_rows_ * acts_.ffn.forward_per_row
                                 : tokens * acts_.ffn.forward_per_row;
    // The attention block's backward working tensors besides its saved graph: FlashAttention-2's
    // varlen backward takes the output's gradient and allocates dq, an fp32 dq accumulator and
    // per-row fp32 softmax sums, and with GQA dk/dv for every query head before reducing them
    // to the KV heads; elsewhere dout, dq and the repeated dk/dv (K/V were repeated for SDPA)
    // and the reduced ones.
    attn_backward_work_ =
        varlen ? tokens * (cs * (2 * QD + (gqa ? 2 * QD : 0) + 2 * KVD) + 4 * QD + 4 * NH)
               : tokens * cs * (2 * QD + (gqa ? 2 * QD : 2 * KVD) + 2 * KVD);
    // A checkpointed layer input (whole layer or attention block) offloaded to pinned host
    // memory takes no device memory.
    offload_inputs_ = t.cuda && opt.offload_layer_inputs;
    ckpt_input_ = offload_inputs_ ? 0 : t.boundary;
  }

  LayerRecompute mode(int64_t l) const { return opt_.layer_recompute(l, t_.L); }
  // A layer's block graphs: saved activations plus the compute-dtype weights its linears keep.
  int64_t attn_graph(int64_t l) const {
    return t_.tokens * acts_.attn_per_token + tally_.attn_weight_elems[l] * t_.cs;
  }
  int64_t ffn_graph(int64_t l) const {
    return t_.tokens * acts_.ffn.graph_per_token + tally_.ffn_weight_elems[l] * t_.cs;
  }
  // What layer l holds on the device from its forward until its backward: the whole graph and
  // its input; recomputed, its input alone; keeping one block, that block's graph with the
  // layer input (saved by the attention graph or the attention checkpoint) and, keeping the
  // attention block, hs (the FFN checkpoint's input).
  int64_t held(int64_t l) const {
    const int64_t boundary = t_.boundary;
    switch (mode(l)) {
      case LayerRecompute::kNone:
        return boundary + attn_graph(l) + ffn_graph(l);
      case LayerRecompute::kLayer:
        return ckpt_input_;
      case LayerRecompute::kAttention:
        return ckpt_input_ + ffn_graph(l);
      case LayerRecompute::kMlp:
        return boundary + attn_graph(l) + boundary;
    }
    return 0;
  }
  // Saved activations of layers [0, n).
  int64_t saved_below(int64_t n) const {
    int64_t s = 0;
    for (int64_t l = 0; l < n; ++l) s += held(l);
    return s;
  }
  // The largest checkpointed forward transient of any layer; adds the offloaded layer inputs
  // to `host_bytes`.
  int64_t forward_work(int64_t* host_bytes) const {
    int64_t work = 0;
    for (int64_t l = 0; l < t_.L; ++l) {
      const LayerRecompute m = mode(l);
      if (m == LayerRecompute::kLayer || m == LayerRecompute::kAttention) {
        work = std::max(work, attn_forward_work_);
        if (offload_inputs_) *host_bytes += t_.boundary;
      }
      if (m == LayerRecompute::kLayer || m == LayerRecompute::kMlp) {
        work = std::max(work, ffn_forward_work_);
      }
    }
    return work;
  }

  // Layer l's backward has two steps, the larger counts (each: activations, extra gradients):
  // - the FFN block's: the incoming and outgoing boundary gradients and the inner activation's
  //   gradients (its output's, held as a seed when recomputed, and its two inputs'). The
  //   recompute's hand-seeded last projection holds its weight gradient until the block is
  //   done. Chunked, hs, the incoming gradient and hs's, with one chunk's graph and gradients,
  //   and the fp32 sums of the FFN weights' gradients beside one chunk's.
  // - the attention block's: its graph with the attention backward's working tensors, the
  //   incoming gradient, hs and its gradient; after the whole layer's recompute, unchunked the
  //   inner activation and its gradient seed are still held, chunked the FFN taps' seeds (their
  //   sums in the compute dtype).
  // Each step also holds the layer's input and the graph of the block not in it, when that one
  // is still alive: the attention graph in the FFN step (kept, or recomputed with the layer),
  // the recomputed layer's FFN weights in its attention step.
  std::array<std::pair<int64_t, int64_t>, 2> backward_steps(int64_t l) const {
    const int64_t cs = t_.cs, boundary = t_.boundary, tokens = t_.tokens;
    const int64_t inner = tokens * acts_.ffn.inner_per_token;
    const int64_t ffn_weights = tally_.ffn_weight_elems[l] * cs;
    const int64_t tapped = tally_.ffn_tapped[l], hand = tally_.hand_tapped[l];
    const LayerRecompute m = mode(l);
    const bool ffn_recomputed = m == LayerRecompute::kLayer || m == LayerRecompute::kMlp;
    // The attention graph exists in the FFN step unless the attention block is checkpointed
    // (whose input may still be on the host then).
    const bool attn_ckpt = m == LayerRecompute::kAttention;
    const int64_t attn_held = attn_ckpt ? 0 : attn_graph(l);
    const int64_t input = attn_ckpt ? ckpt_input_ : boundary;
    int64_t ffn_step = 0, ffn_step_grads = 0, attn_step_grads = 0;
    if (ffn_recomputed && chunked_) {
      const int64_t chunk_graph = chunk_rows_ * acts_.ffn.chunk_per_row;  // hs rows are views
      ffn_step = input + attn_held + ffn_weights + 3 * boundary + chunk_graph;
      ffn_step_grads = 4 * tapped + cs * (tapped - hand);
    } else {
      ffn_step = input + attn_held + ffn_graph(l) + 2 * boundary + (ffn_recomputed ? 3 : 2) * inner;
      // The held last-projection seed when it is not the stored gradient itself.
      ffn_step_grads =
          ffn_recomputed && (t_.in_backward || t_.carried || t_.gs != cs) ? hand * cs : 0;
    }
    int64_t attn_step = boundary + attn_graph(l) + 3 * boundary + attn_backward_work_;
    if (m == LayerRecompute::kLayer) {
      // The whole layer's recompute holds its FFN part until its backward call returns.
      attn_step += ffn_weights + (chunked_ ? 0 : 2 * inner);
      attn_step_grads = chunked_ ? cs * tapped : ffn_step_grads;
    } else if (m == LayerRecompute::kNone) {
      attn_step += ffn_weights;
    }
    return {std::pair<int64_t, int64_t>{ffn_step, ffn_step_grads}, {attn_step, attn_step_grads}};
  }

 private:
  const ModelOptions& opt_;
  const StepTerms& t_;
  const ParamTally& tally_;
  LayerActivations acts_;
  bool chunked_ = false;  // the FFN runs over row chunks (ModelOptions::mlp_chunk_tokens)
  int64_t chunk_rows_ = 0;
  int64_t attn_forward_work_ = 0, ffn_forward_work_ = 0, attn_backward_work_ = 0;
  bool offload_inputs_ = false;
  int64_t ckpt_input_ = 0;
};

void add_phase(MemoryEstimate* est, MemoryPhaseKind kind, int64_t g, int64_t a, int64_t l) {
  MemoryPhase p;
  p.kind = kind;
  p.grad_bytes = g;
  p.activation_bytes = a;
  p.loss_bytes = l;
  est->phases.push_back(p);
}

// The gradient side of the step: what is carried between micro-batches and what a fresh
// gradient costs.
struct GradTerms {
  int64_t carry = 0;
  const StepTerms* t = nullptr;
  // Transient bytes of one freshly computed gradient of n elements (compute dtype) beyond the
  // stored one: kept as is when the dtypes agree and nothing is stored yet, else converted or
  // added into the buffer while the fresh one still exists.
  int64_t fresh(int64_t n) const {
    if (t->buffer_carried) return n * t->cs + (t->gs == t->cs ? 0 : n * t->gs);
    return t->gs == t->cs ? 0 : n * t->cs;
  }
};

// Loss head: final-norm output rows gathered for the lm_head (every token is an upper bound of
// the supervised rows), the lm_head in the compute dtype (a fresh tap output when it trains; a
// frozen one is counted in frozen_bytes), and the logits of one chunk: on CUDA the matmul's
// (chunk, V) output only (the fused cross-entropy kernel writes the gradient over it);
// elsewhere also one fp32 block next to it or to the gradient's compute-dtype copy.
void add_loss_phases(const Qwen3Config& cfg, const ModelOptions& opt, const StepTerms& t,
                     const GradTerms& gr, const ParamTally& tally, int64_t all_saved,
                     MemoryEstimate* est) {
  const int64_t cs = t.cs, H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t rows = t.tokens;
  const int64_t chunk = std::min(opt.loss_chunk_tokens, rows);
  const int64_t logits_block = t.cuda ? chunk * V * cs : chunk * V * (cs == 4 ? 4 : 4 + cs);
  const int64_t lm_weight = tally.lm_trains && !tally.lm_kept ? V * H * cs : 0;
  const int64_t lm_elems = tally.lm_trains ? V * H : 0;
  // Loss forward: the chunked cross-entropy computes its gradients here, from the logits block
  // that gives the loss: the final norm's saved input and its output (alive in loss()), the
  // hidden rows and their gradient, the lm_head weight and its gradient being accumulated
  // (compute dtype), one logits block.
  add_phase(est, MemoryPhaseKind::kLossForward, gr.carry + lm_elems * cs,
            all_saved + 2 * t.boundary, 2 * rows * H * cs + lm_weight + logits_block);
  // Loss backward: the weight and logits are gone; the hidden rows' gradient is scattered into
  // a (tokens, H) one and the lm_head gradient stored (converted when the gradient dtype
  // differs, added into the buffer when one is carried).
  add_phase(est, MemoryPhaseKind::kLossBackward,
            gr.carry + std::max(lm_elems * cs,
                                (t.buffer_carried ? 0 : lm_elems * t.gs) + gr.fresh(lm_elems)),
            all_saved + 2 * t.boundary, rows * H * cs);
}

// Layer backward, layer l (from L-1 down to 0): activations of layers [0, l), layer l's input
// and graph (recomputed from its checkpoint when checkpointing), the backward's working tensors
// (LayerMemory::backward_steps), and the gradients alive: with in-backward updates the
// lm_head's is applied and freed already and a layer's weights are applied one by one;
// buffered, the lm_head's and every layer's above l plus all of layer l's.
MemoryPhase layer_backward_phase(const StepTerms& t, const GradTerms& gr, const ParamTally& tally,
                                 const LayerMemory& layers, int64_t tied_grad) {
  MemoryPhase best;
  best.kind = MemoryPhaseKind::kLayerBackward;
  int64_t above = 0;  // buffered gradients of layers above l
  const int64_t head_stored = t.in_backward || t.host_accum ? 0 : tally.head_elems * t.gs;
  for (int64_t l = t.L - 1; l >= 0; --l) {
    const int64_t largest = tally.layer_largest[l];
    int64_t g = tied_grad;
    if (t.buffer_carried) {
      g = gr.carry + gr.fresh(largest);
    } else if (t.in_backward || t.host_accum) {
      g = std::max(gr.carry, tied_grad) + largest * t.gs + gr.fresh(largest);
    } else {
      g += head_stored + above + tally.layer_elems[l] * t.gs + gr.fresh(largest);
    }
    const int64_t below = layers.saved_below(l);
    for (const auto& [acts, extra] : layers.backward_steps(l)) {
      if (g + extra + below + acts > best.total_bytes()) {
        best.grad_bytes = g + extra;
        best.activation_bytes = below + acts;
      }
    }
    above += tally.layer_elems[l] * t.gs;
  }
  return best;
}

StepTerms step_terms(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                     int64_t seq_len, bool include_lm_head, const GradientLifetime& grads) {
  StepTerms t;
  t.ms = static_cast<int64_t>(c10::elementSize(opt.master_dtype));
  t.cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  t.gs = static_cast<int64_t>(c10::elementSize(opt.resolved_grad_dtype()));
  t.L = cfg.num_hidden_layers;
  t.tokens = batch * seq_len;
  t.tied = !include_lm_head;
  t.in_backward = grads.applied_in_backward;
  t.cuda = opt.device.is_cuda();
  t.offload = t.cuda && opt.offload_masters;
  t.codes = !t.offload && opt.fake_quant && opt.computes_from_codes();
  t.kept = keeps_forward_weight(opt);
  t.carried = grads.accumulation_steps > 1;
  t.host_accum = t.carried && t.offload;
  t.buffer_carried = t.carried && !t.host_accum;
  t.boundary = t.tokens * cfg.hidden_size * t.cs;
  return t;
}

}  // namespace

const char* memory_phase_name(MemoryPhaseKind kind) { return io::enum_name(kind); }

const MemoryPhase* MemoryEstimate::phase(MemoryPhaseKind kind) const {
  for (const auto& p : phases) {
    if (p.kind == kind) return &p;
  }
  return nullptr;
}

MemoryEstimate estimate_memory(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                               int64_t seq_len, bool include_lm_head,
                               const GradientLifetime& grads) {
  opt.validate(cfg.num_hidden_layers);
  opt.trainable.validate(cfg.num_hidden_layers);
  TORCH_CHECK(grads.accumulation_steps >= 1,
              "GradientLifetime.accumulation_steps: expected >= 1, got ", grads.accumulation_steps);
  const StepTerms t = step_terms(cfg, opt, batch, seq_len, include_lm_head, grads);
  MemoryEstimate est;
  const ParamTally tally = tally_parameters(cfg, opt, include_lm_head, t, &est);
  GradTerms gr;
  gr.t = &t;
  gr.carry = t.buffer_carried ? est.grad_buffer_bytes
             : t.host_accum   ? tally.resident_grad_bytes + grads.host_staging_bytes
                              : 0;
  const LayerMemory layers(cfg, opt, t, tally);
  const int64_t layer_forward_work = layers.forward_work(&est.host_bytes);
  const int64_t all_saved = layers.saved_below(t.L);
  // Forward: every layer's saved activations (the last layer's output is the final norm's input)
  // and, checkpointed, one layer's forward transients.
  add_phase(&est, MemoryPhaseKind::kForward, gr.carry, all_saved + t.boundary + layer_forward_work,
            0);
  add_loss_phases(cfg, opt, t, gr, tally, all_saved, &est);
  // The tied lm_head's gradient is the embedding's: it lives on until the embedding backward.
  const int64_t tied_grad =
      (t.tied && tally.lm_trains) ? cfg.vocab_size * cfg.hidden_size * t.gs : 0;
  if (t.L > 0) est.phases.push_back(layer_backward_phase(t, gr, tally, layers, tied_grad));
  // Embedding backward (trainable embedding only): its gradient is allocated whole (zeros) and
  // the rows added from the incoming (tokens, H) gradient; on the CPU half-precision gradients
  // are added through an fp32 (V, H) buffer. Buffered, every other gradient exists too.
  const int64_t embed_elems = tally.embed_elems;
  if (embed_elems > 0) {
    const int64_t g = t.host_accum                         ? std::max(gr.carry, embed_elems * t.gs)
                      : t.in_backward && !t.buffer_carried ? embed_elems * t.gs
                                                           : est.grad_buffer_bytes;
    const int64_t cpu_acc = (!t.cuda && t.gs != 4) ? embed_elems * 4 : 0;
    add_phase(&est, MemoryPhaseKind::kEmbeddingBackward, g, t.boundary + cpu_acc, 0);
  }
  // Buffered updates: the complete gradient buffer while the optimizer runs (its scratch is
  // the optimizer's to count).
  if (!t.in_backward && est.grad_buffer_bytes > 0) {
    add_phase(
        &est, MemoryPhaseKind::kOptimizerStep,
        t.host_accum ? tally.resident_grad_bytes + grads.host_staging_bytes : est.grad_buffer_bytes,
        0, 0);
  }

  for (size_t i = 0; i < est.phases.size(); ++i) {
    if (est.phases[i].total_bytes() > est.phases[est.peak_phase].total_bytes()) est.peak_phase = i;
  }
  const MemoryPhase& peak = est.phases[est.peak_phase];
  est.grad_bytes = peak.grad_bytes;
  est.activation_bytes = peak.activation_bytes;
  est.loss_bytes = peak.loss_bytes;
  return est;
}

LayerKeepCosts layer_keep_costs(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                                int64_t seq_len, bool include_lm_head, int64_t layer) {
  const int64_t L = cfg.num_hidden_layers;
  TORCH_CHECK(layer >= 0 && layer < L, "layer_keep_costs: layer ", layer, " is outside [0, ", L,
              ")");
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t H = cfg.hidden_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim();
  const int64_t tokens = batch * seq_len;
  const LayerActivations acts = layer_activations(cfg, opt);
  const Ffn& ffn = ffn_for(cfg, layer);
  int64_t attn_weights = 0, ffn_weights = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    if (p.layer != layer || !saves_compute_weight(p, opt, L, !include_lm_head)) continue;
    (ffn.owns(p) ? ffn_weights : attn_weights) += p.numel();
  }
  const int64_t boundary = tokens * H * cs;
  LayerKeepCosts c;
  // Bytes, as estimate_memory holds them from the layer's forward to its backward, beyond what
  // the whole layer's checkpoint holds (its input, on the host when offloaded):
  //   attention kept: tokens x attention graph per token + its weights + hs (the FFN
  //   checkpoint's input) [+ the layer input, which stays on the device];
  //   FFN kept: tokens x FFN graph per token (hs included) + its weights.
  const bool offloaded = opt.device.is_cuda() && opt.offload_layer_inputs;
  c.attention.kept_bytes =
      tokens * acts.attn_per_token + attn_weights * cs + boundary + (offloaded ? boundary : 0);
  c.mlp.kept_bytes = tokens * acts.ffn.graph_per_token + ffn_weights * cs;
  // Multiply-accumulates the recompute of the block runs, per token:
  //   attention: H (q_dim + 2 kv_dim) for q/k/v, q_dim H for o_proj, and causal attention over
  //   seq_len-token rows, (seq_len + 1) / 2 keys a query on average, q_dim each for QK^T and PV:
  //   q_dim (seq_len + 1);
  //   FFN: its slot's (Ffn::costs; the dense MLP's gate and up, 2 H I).
  // Adapters' rank-r products, norms, RoPE and SwiGLU are left out (a few percent at most), as
  // are the weight taps' fake-quant passes (per layer, not per token). seq_len is taken as every
  // row's length: with packing, shorter examples attend over fewer keys.
  const double attn_macs = static_cast<double>(H) * static_cast<double>(QD + 2 * KVD) +
                           static_cast<double>(QD) * static_cast<double>(H) +
                           static_cast<double>(QD) * static_cast<double>(seq_len + 1);
  c.attention.saved_macs = static_cast<double>(tokens) * attn_macs;
  c.mlp.saved_macs = static_cast<double>(tokens) * acts.ffn.recompute_macs_per_token;
  return c;
}

}  // namespace q4::model

namespace q4::model {

RolloutMemory estimate_rollout_memory(const Qwen3Config& cfg, const ModelOptions& opt,
                                      const RolloutShape& shape, bool include_lm_head) {
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t R = shape.rows, P = shape.prompt_tokens;
  const int64_t H = cfg.hidden_size, QD = cfg.q_dim(), KVD = cfg.kv_dim();
  const int64_t V = cfg.vocab_size, L = cfg.num_hidden_layers;
  RolloutMemory m;
  m.kv_cache_bytes = 2 * L * R * cfg.num_key_value_heads * (P + shape.completion_tokens) *
                     cfg.head_dim * cs;
  const int64_t tokens = R * P;
  const int64_t attn = tokens * cs * (H + 2 * QD + 2 * KVD);
  const int64_t ffn = tokens * layer_activations(cfg, opt).ffn.forward_per_row;
  m.prefill_bytes = 2 * tokens * H * cs + std::max(attn, ffn);
  int64_t per_element = cs + 4 * 4;
  if (shape.top_p < 1.0) per_element += 4 + 8 + 4;
  if (shape.top_k > 0 && shape.top_k < V) per_element += 4;
  m.sampling_bytes = R * V * per_element;
  const bool tied = !include_lm_head;
  // Qwen3Model::Impl::weight: the linears (a tied lm_head is the embedding) and, plain, the
  // adapters' A and B.
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    const bool linear = p.group == ParamGroup::kProjection || p.group == ParamGroup::kLmHead ||
                        (tied && p.group == ParamGroup::kEmbedding);
    if (!linear) continue;
    if (opt.lora.adapts(p, opt.trainable, L)) {
      m.weights_bytes += (p.numel() + (opt.lora.merge_aware
                                           ? 0
                                           : adapter_elements(p, opt, cfg.moe.num_experts))) *
                         cs;
    } else if (opt.trainable.trains(p, L, tied)) {
      // A kept forward weight (ModelOptions::forward_weights) is the rollout's weight already.
      const bool kept = opt.forward_weights == ForwardWeights::kKept &&
                        p.kind == ParamKind::kQuantizedLinear;
      if (!kept) m.weights_bytes += p.numel() * cs;
    }
  }
  return m;
}

}  // namespace q4::model
