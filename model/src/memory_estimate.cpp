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
#include <string>

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

bool ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// Whether adapted linears keep their dequantized frozen weight (counted with the frozen bytes;
// the graphs save that tensor itself).
bool caches_weight(const ModelOptions& opt) {
  return opt.cache_adapted_weights && !opt.lora.merge_aware;
}

// Whether linear parameter `p` reaches a layer's graph as a compute-dtype weight that its linear
// saves beyond what the model stores: a trainable NVFP4 linear's tap output, an adapted linear's
// dequantized or merged weight. Frozen weights are saved as the stored tensors themselves.
bool saves_compute_weight(const ParamSpec& p, const ModelOptions& opt, int64_t num_layers,
                          bool tied) {
  if (opt.lora.adapts(p, opt.trainable, num_layers)) return !caches_weight(opt);
  return p.kind == ParamKind::kQuantizedLinear && opt.trainable.trains(p, num_layers, tied);
}

bool in_mlp_block(const ParamSpec& p) {
  return p.name.find(".mlp.") != std::string::npos ||
         ends_with(p.name, ".post_attention_layernorm.weight");
}

// Bytes per token that one decoder layer's graph saves besides its input, by block, as this
// implementation allocates them. Attention: the input norm's output, then the attention's
// tensors; fp32 per-row RMSNorm scales (input norm, q/k per head) and the attention log-sum-exp
// (attention probabilities are never kept). MLP: its input hs (the post-attention norm's input),
// that norm's output and the gate/up/product (2H + 3I), the norm's fp32 scale.
struct LayerActivations {
  // The trainer's batches carry cu_seqlens: on CUDA with 16-bit compute (LibTorch >= 2.4) the
  // layers take the variable-length FlashAttention path with the fused RMSNorm/RoPE kernels.
  bool varlen = false;
  bool gqa = false;  // fewer KV heads than query heads
  int64_t attn_per_token = 0;
  int64_t mlp_per_token = 0;
};

LayerActivations layer_activations(const Qwen3Config& cfg, const ModelOptions& opt) {
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
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
  a.mlp_per_token = cs * (2 * H + 3 * I) + 4;
  if (!cuda) {
    // The ATen reference RMSNorm also keeps its fp32 input and its normalized value (in fp32
    // compute, the input itself and the fp32 product), SwiGLU silu(gate).
    auto ref_norm = [&](int64_t width) { return 4 * width + (cs == 4 ? 0 : cs * width); };
    a.attn_per_token += ref_norm(H + QD + KVD);
    a.mlp_per_token += ref_norm(H) + cs * I;
  }
  return a;
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
  const int64_t ms = static_cast<int64_t>(c10::elementSize(opt.master_dtype));
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t gs = static_cast<int64_t>(c10::elementSize(opt.resolved_grad_dtype()));
  const TrainableSpec& ts = opt.trainable;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t L = cfg.num_hidden_layers;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim();
  const int64_t NH = cfg.num_attention_heads;
  const bool tied = !include_lm_head;
  const bool in_backward = grads.applied_in_backward;
  const bool cuda = opt.device.is_cuda();
  // Trainable NVFP4 linears keep codes on the device and their masters in pinned host memory.
  const bool offload = cuda && opt.offload_masters;
  // Gradients of earlier micro-batches stay in the buffer through every phase of later ones
  // (with in-backward updates too: the last micro-batch's backward applies the sums); with
  // offloaded masters, those of the offloaded linears add up in pinned host memory instead
  // (each one freed on the device once complete, as with in-backward updates).
  const bool carried = grads.accumulation_steps > 1;
  const bool host_accum = carried && offload;
  const bool buffer_carried = carried && !host_accum;

  MemoryEstimate est;
  // Per decoder layer: trainable elements, their compute-dtype weights saved by the layer's
  // linears (tap outputs; frozen layers save the frozen tensors themselves) and the largest one.
  // The compute-dtype weights are split by block: attention (q/k/v/o) and MLP (gate/up/down).
  std::vector<int64_t> layer_elems(L, 0), layer_largest(L, 0);
  std::vector<int64_t> attn_weight_elems(L, 0), mlp_weight_elems(L, 0);
  // Elements of the MLP block's weight taps (trainable weights, merge-aware merged weights,
  // plain adapters' A and B; the norm's too), and of the down projection's weight tap, whose
  // gradient the checkpoint forms by hand.
  std::vector<int64_t> mlp_tapped(L, 0), down_tapped(L, 0);
  int64_t head_elems = 0;  // gradients produced by the loss: lm_head (untied) and the final norm
  int64_t embed_elems = 0;
  int64_t resident_grad_bytes = 0;  // gradients of parameters whose master is on the device
  bool lm_trains = false;
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    const int64_t n = p.numel();
    if (p.layer >= 0 && saves_compute_weight(p, opt, L, tied)) {
      (in_mlp_block(p) ? mlp_weight_elems : attn_weight_elems)[p.layer] += n;
    }
    if (opt.lora.adapts(p, ts, L)) {
      // Frozen as NVFP4 codes; the adapter's A and B train. The forward's weight (merged and
      // fake-quantized, or dequantized) is a compute-dtype tensor like a trained linear's tap.
      const int64_t a = opt.lora.rank * (p.shape[0] + p.shape[1]);
      est.frozen_bytes +=
          n / 2 + n / q4::quant::kNvfp4BlockSize + (caches_weight(opt) ? n * cs : 0);
      est.master_bytes += a * ms;
      est.grad_buffer_bytes += a * gs;
      resident_grad_bytes += a * gs;
      if (p.layer >= 0) {
        layer_elems[p.layer] += a;
        layer_largest[p.layer] = std::max(layer_largest[p.layer], a);
        // Merge-aware: the tap is the merged (out, in) weight; plain: A and B themselves.
        const int64_t tap = opt.lora.merge_aware ? n : a;
        if (in_mlp_block(p)) mlp_tapped[p.layer] += tap;
        if (opt.lora.merge_aware && ends_with(p.name, ".mlp.down_proj.weight")) {
          down_tapped[p.layer] = n;
        }
      } else {
        head_elems += a;
        lm_trains = true;
      }
      continue;
    }
    if (!ts.trains(p, L, tied)) {
      est.frozen_bytes += n * cs;
      continue;
    }
    est.grad_buffer_bytes += n * gs;
    if (offload && p.kind == ParamKind::kQuantizedLinear) {
      est.master_bytes += n / 2 + n / q4::quant::kNvfp4BlockSize;  // codes + E4M3 scales
      est.host_bytes += n * ms + (host_accum ? n * gs : 0);  // master (+ gradient buffer)
    } else {
      est.master_bytes += n * ms;
      resident_grad_bytes += n * gs;
    }
    if (p.layer >= 0) {
      layer_elems[p.layer] += n;
      if (in_mlp_block(p)) mlp_tapped[p.layer] += n;
      if (ends_with(p.name, ".mlp.down_proj.weight")) down_tapped[p.layer] = n;
      layer_largest[p.layer] = std::max(layer_largest[p.layer], n);
    } else if (p.group == ParamGroup::kEmbedding) {
      embed_elems = n;
      lm_trains = lm_trains || tied;
    } else {
      head_elems += n;
      lm_trains = lm_trains || p.group == ParamGroup::kLmHead;
    }
  }
  // Transient bytes of one freshly computed gradient of n elements (compute dtype) beyond the
  // stored one: kept as is when the dtypes agree and nothing is stored yet, else converted or
  // added into the buffer while the fresh one still exists.
  auto fresh = [&](int64_t n) {
    if (buffer_carried) return n * cs + (gs == cs ? 0 : n * gs);
    return gs == cs ? 0 : n * cs;
  };
  const int64_t carry = buffer_carried ? est.grad_buffer_bytes
                        : host_accum   ? resident_grad_bytes + grads.host_staging_bytes
                                       : 0;

  const int64_t tokens = batch * seq_len;
  const int64_t boundary = tokens * H * cs;  // a layer input/output
  const LayerActivations acts = layer_activations(cfg, opt);
  const bool varlen = acts.varlen, gqa = acts.gqa;
  const int64_t attn_per_token = acts.attn_per_token, mlp_per_token = acts.mlp_per_token;
  // MLP chunks (ModelOptions::mlp_chunk_tokens) in a checkpoint's forward and recompute.
  const bool chunked = opt.mlp_chunk_tokens > 0 && tokens > opt.mlp_chunk_tokens;
  const int64_t chunk_rows = chunked ? opt.mlp_chunk_tokens : tokens;
  // Largest transient of a block's forward without grad (checkpointed), beyond its input: the
  // attention block's q/k (projection and norm or RoPE output), v and the input norm's output
  // (K/V also repeated for SDPA with GQA); the MLP's (rows, I) gate/up/product beside its input
  // and the norm output, per chunk when chunked (its input and output then (tokens, H) each).
  const int64_t attn_forward_work =
      tokens * cs * (H + 2 * QD + 2 * KVD + (!varlen && gqa ? 2 * QD : 0));
  const int64_t mlp_forward_work = chunked ? tokens * cs * 2 * H + chunk_rows * cs * (2 * H + 3 * I)
                                           : tokens * cs * (2 * H + 3 * I);
  // The attention block's backward working tensors besides its saved graph: FlashAttention-2's
  // varlen backward takes the output's gradient and allocates dq, an fp32 dq accumulator and
  // per-row fp32 softmax sums, and with GQA dk/dv for every query head before reducing them to
  // the KV heads; elsewhere dout, dq and the repeated dk/dv (K/V were repeated for SDPA) and
  // the reduced ones.
  const int64_t attn_backward_work =
      varlen ? tokens * (cs * (2 * QD + (gqa ? 2 * QD : 0) + 2 * KVD) + 4 * QD + 4 * NH)
             : tokens * cs * (2 * QD + (gqa ? 2 * QD : 2 * KVD) + 2 * KVD);
  // A layer's block graphs: saved activations plus the compute-dtype weights its linears keep.
  auto attn_graph = [&](int64_t l) { return tokens * attn_per_token + attn_weight_elems[l] * cs; };
  auto mlp_graph = [&](int64_t l) { return tokens * mlp_per_token + mlp_weight_elems[l] * cs; };
  auto mode = [&](int64_t l) { return opt.layer_recompute(l, L); };
  // A checkpointed layer input (whole layer or attention block) offloaded to pinned host memory
  // takes no device memory.
  const bool offload_inputs = cuda && opt.offload_layer_inputs;
  const int64_t ckpt_input = offload_inputs ? 0 : boundary;
  // What layer l holds on the device from its forward until its backward: the whole graph and
  // its input; recomputed, its input alone; keeping one block, that block's graph with the
  // layer input (saved by the attention graph or the attention checkpoint) and, keeping the
  // attention block, hs (the MLP checkpoint's input).
  auto held = [&](int64_t l) -> int64_t {
    switch (mode(l)) {
      case LayerRecompute::kNone:
        return boundary + attn_graph(l) + mlp_graph(l);
      case LayerRecompute::kLayer:
        return ckpt_input;
      case LayerRecompute::kAttention:
        return ckpt_input + mlp_graph(l);
      case LayerRecompute::kMlp:
        return boundary + attn_graph(l) + boundary;
    }
    return 0;
  };
  // Saved activations of layers [0, n).
  auto saved_below = [&](int64_t n) {
    int64_t s = 0;
    for (int64_t l = 0; l < n; ++l) s += held(l);
    return s;
  };
  // The largest checkpointed forward transient of any layer.
  int64_t layer_forward_work = 0;
  for (int64_t l = 0; l < L; ++l) {
    const LayerRecompute m = mode(l);
    if (m == LayerRecompute::kLayer || m == LayerRecompute::kAttention) {
      layer_forward_work = std::max(layer_forward_work, attn_forward_work);
      if (offload_inputs) est.host_bytes += boundary;
    }
    if (m == LayerRecompute::kLayer || m == LayerRecompute::kMlp) {
      layer_forward_work = std::max(layer_forward_work, mlp_forward_work);
    }
  }

  // Loss head: final-norm output rows gathered for the lm_head (every token is an upper bound
  // of the supervised rows), the lm_head in the compute dtype (a fresh tap output when it
  // trains; a frozen one is counted in frozen_bytes), and the logits of one chunk: on CUDA the
  // matmul's (chunk, V) output only (the fused cross-entropy kernel writes the gradient over
  // it); elsewhere also one fp32 block next to it or to the gradient's compute-dtype copy.
  const int64_t rows = tokens;
  const int64_t chunk = std::min(opt.loss_chunk_tokens, rows);
  const int64_t logits_block =
      opt.device.is_cuda() ? chunk * V * cs : chunk * V * (cs == 4 ? 4 : 4 + cs);
  const int64_t lm_weight = lm_trains ? V * H * cs : 0;
  const int64_t lm_elems = lm_trains ? V * H : 0;
  // The tied lm_head's gradient is the embedding's: it lives on until the embedding backward.
  const int64_t tied_grad = (tied && lm_trains) ? V * H * gs : 0;

  auto add = [&](MemoryPhaseKind kind, int64_t g, int64_t a, int64_t l) {
    MemoryPhase p;
    p.kind = kind;
    p.grad_bytes = g;
    p.activation_bytes = a;
    p.loss_bytes = l;
    est.phases.push_back(p);
  };
  const int64_t all_saved = saved_below(L);
  // Forward: every layer's saved activations (the last layer's output is the final norm's input)
  // and, checkpointed, one layer's forward transients.
  add(MemoryPhaseKind::kForward, carry, all_saved + boundary + layer_forward_work, 0);
  // Loss forward: the chunked cross-entropy computes its gradients here, from the logits block
  // that gives the loss: the final norm's saved input and its output (alive in loss()), the
  // hidden rows and their gradient, the lm_head weight and its gradient being accumulated
  // (compute dtype), one logits block.
  add(MemoryPhaseKind::kLossForward, carry + lm_elems * cs, all_saved + 2 * boundary,
      2 * rows * H * cs + lm_weight + logits_block);
  // Loss backward: the weight and logits are gone; the hidden rows' gradient is scattered into
  // a (tokens, H) one and the lm_head gradient stored (converted when the gradient dtype
  // differs, added into the buffer when one is carried).
  add(MemoryPhaseKind::kLossBackward,
      carry + std::max(lm_elems * cs, (buffer_carried ? 0 : lm_elems * gs) + fresh(lm_elems)),
      all_saved + 2 * boundary, rows * H * cs);
  // Layer backward, layer l (from L-1 down to 0): activations of layers [0, l), layer l's input
  // and graph (recomputed from its checkpoint when checkpointing), the backward's working
  // tensors, and the gradients alive: with in-backward updates the lm_head's is applied and
  // freed already and a layer's weights are applied one by one; buffered, the lm_head's and
  // every layer's above l plus all of layer l's. A layer's backward has two steps, the larger
  // counts:
  // - the MLP block's: the incoming and outgoing boundary gradients and the SwiGLU's (rows, I)
  //   gradients (its output's, held as a seed when recomputed, and its two inputs'). The
  //   recompute's hand-seeded down projection holds its weight gradient until the block is
  //   done. Chunked, hs, the incoming gradient and hs's, with one chunk's MLP graph and
  //   gradients, and the fp32 sums of the MLP weights' gradients beside one chunk's.
  // - the attention block's: its graph with the attention backward's working tensors, the
  //   incoming gradient, hs and its gradient; after the whole layer's recompute, unchunked the
  //   SwiGLU output and its gradient seed are still held, chunked the MLP taps' seeds (their
  //   sums in the compute dtype).
  // Each step also holds the layer's input and the graph of the block not in it, when that one
  // is still alive: the attention graph in the MLP step (kept, or recomputed with the layer),
  // the recomputed layer's MLP weights in its attention step.
  {
    MemoryPhase best;
    best.kind = MemoryPhaseKind::kLayerBackward;
    int64_t above = 0;  // buffered gradients of layers above l
    const int64_t head_stored = in_backward || host_accum ? 0 : head_elems * gs;
    for (int64_t l = L - 1; l >= 0; --l) {
      const LayerRecompute m = mode(l);
      const bool mlp_recomputed = m == LayerRecompute::kLayer || m == LayerRecompute::kMlp;
      // The attention graph exists in the MLP step unless the attention block is checkpointed
      // (whose input may still be on the host then).
      const bool attn_ckpt = m == LayerRecompute::kAttention;
      const int64_t attn_held = attn_ckpt ? 0 : attn_graph(l);
      const int64_t input = attn_ckpt ? ckpt_input : boundary;
      int64_t mlp_step = 0, attn_step = 0, mlp_step_grads = 0, attn_step_grads = 0;
      if (mlp_recomputed && chunked) {
        const int64_t chunk_graph =
            chunk_rows * (mlp_per_token - cs * H + 3 * I * cs);  // hs rows are views
        mlp_step = input + attn_held + mlp_weight_elems[l] * cs + 3 * boundary + chunk_graph;
        mlp_step_grads = 4 * mlp_tapped[l] + cs * (mlp_tapped[l] - down_tapped[l]);
      } else {
        mlp_step = input + attn_held + mlp_graph(l) + 2 * boundary +
                   (mlp_recomputed ? 3 : 2) * tokens * I * cs;
        // The held down-projection seed when it is not the stored gradient itself.
        mlp_step_grads =
            mlp_recomputed && (in_backward || carried || gs != cs) ? down_tapped[l] * cs : 0;
      }
      attn_step = boundary + attn_graph(l) + 3 * boundary + attn_backward_work;
      if (m == LayerRecompute::kLayer) {
        // The whole layer's recompute holds its MLP part until its backward call returns.
        attn_step += mlp_weight_elems[l] * cs + (chunked ? 0 : 2 * tokens * I * cs);
        attn_step_grads = chunked ? cs * mlp_tapped[l] : mlp_step_grads;
      } else if (m == LayerRecompute::kNone) {
        attn_step += mlp_weight_elems[l] * cs;
      }
      int64_t g = tied_grad;
      if (buffer_carried) {
        g = carry + fresh(layer_largest[l]);
      } else if (in_backward || host_accum) {
        g = std::max(carry, tied_grad) + layer_largest[l] * gs + fresh(layer_largest[l]);
      } else {
        g += head_stored + above + layer_elems[l] * gs + fresh(layer_largest[l]);
      }
      const int64_t below = saved_below(l);
      for (const auto& [acts, extra] :
           {std::pair<int64_t, int64_t>{mlp_step, mlp_step_grads}, {attn_step, attn_step_grads}}) {
        if (g + extra + below + acts > best.total_bytes()) {
          best.grad_bytes = g + extra;
          best.activation_bytes = below + acts;
        }
      }
      above += layer_elems[l] * gs;
    }
    if (L > 0) est.phases.push_back(best);
  }
  // Embedding backward (trainable embedding only): its gradient is allocated whole (zeros) and
  // the rows added from the incoming (tokens, H) gradient; on the CPU half-precision gradients
  // are added through an fp32 (V, H) buffer. Buffered, every other gradient exists too.
  if (embed_elems > 0) {
    const int64_t g = host_accum                      ? std::max(carry, embed_elems * gs)
                      : in_backward && !buffer_carried ? embed_elems * gs
                                                       : est.grad_buffer_bytes;
    const int64_t cpu_acc = (!cuda && gs != 4) ? embed_elems * 4 : 0;
    add(MemoryPhaseKind::kEmbeddingBackward, g, boundary + cpu_acc, 0);
  }
  // Buffered updates: the complete gradient buffer while the optimizer runs (its scratch is
  // the optimizer's to count).
  if (!in_backward && est.grad_buffer_bytes > 0) {
    add(MemoryPhaseKind::kOptimizerStep,
        host_accum ? resident_grad_bytes + grads.host_staging_bytes : est.grad_buffer_bytes, 0, 0);
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
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim();
  const int64_t tokens = batch * seq_len;
  const LayerActivations acts = layer_activations(cfg, opt);
  int64_t attn_weights = 0, mlp_weights = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    if (p.layer != layer || !saves_compute_weight(p, opt, L, !include_lm_head)) continue;
    (in_mlp_block(p) ? mlp_weights : attn_weights) += p.numel();
  }
  const int64_t boundary = tokens * H * cs;
  LayerKeepCosts c;
  // Bytes, as estimate_memory holds them from the layer's forward to its backward, beyond what
  // the whole layer's checkpoint holds (its input, on the host when offloaded):
  //   attention kept: tokens x attention graph per token + its weights + hs (the MLP
  //   checkpoint's input) [+ the layer input, which stays on the device];
  //   MLP kept: tokens x MLP graph per token (hs included) + its weights.
  const bool offloaded = opt.device.is_cuda() && opt.offload_layer_inputs;
  c.attention.kept_bytes =
      tokens * acts.attn_per_token + attn_weights * cs + boundary + (offloaded ? boundary : 0);
  c.mlp.kept_bytes = tokens * acts.mlp_per_token + mlp_weights * cs;
  // Multiply-accumulates the recompute of the block runs, per token:
  //   attention: H (q_dim + 2 kv_dim) for q/k/v, q_dim H for o_proj, and causal attention over
  //   seq_len-token rows, (seq_len + 1) / 2 keys a query on average, q_dim each for QK^T and PV:
  //   q_dim (seq_len + 1);
  //   MLP: 2 H I for gate and up (the recompute never runs the down projection's forward).
  // Adapters' rank-r products, norms, RoPE and SwiGLU are left out (a few percent at most), as
  // are the weight taps' fake-quant passes (per layer, not per token). seq_len is taken as every
  // row's length: with packing, shorter examples attend over fewer keys.
  const double attn_macs = static_cast<double>(H) * static_cast<double>(QD + 2 * KVD) +
                           static_cast<double>(QD) * static_cast<double>(H) +
                           static_cast<double>(QD) * static_cast<double>(seq_len + 1);
  c.attention.saved_macs = static_cast<double>(tokens) * attn_macs;
  c.mlp.saved_macs =
      static_cast<double>(tokens) * 2.0 * static_cast<double>(H) * static_cast<double>(I);
  return c;
}

}  // namespace q4::model
