// Custom autograd functions of the model. Weight taps hand the forward its compute-dtype weight
// (fake-quantized for NVFP4 linears: straight-through) and, in backward, accumulate the incoming
// gradient into Parameter::grad in the gradient dtype; masters never require grad, a shared
// `trigger` leaf puts the taps into the graph. The checkpoints keep only their input (a layer's,
// or one block's) and recompute it under grad mode in backward (reentrant, as
// torch.utils.checkpoint).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdint>
#include <vector>

#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"

namespace q4::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int64_t ptr_to_int(const void* p) { return static_cast<int64_t>(reinterpret_cast<intptr_t>(p)); }
template <class T>
T* int_to_ptr(int64_t v) {
  return reinterpret_cast<T*>(static_cast<intptr_t>(v));
}

void accumulate(Parameter* p, const at::Tensor& g, at::ScalarType grad_dtype) {
  if (!p->grad.defined()) {
    // The incoming gradient is a fresh tensor that nothing else holds: keep it when it already
    // has the gradient dtype (no copy), else convert.
    p->grad = g.scalar_type() == grad_dtype && g.is_contiguous()
                  ? g
                  : g.to(grad_dtype, /*non_blocking=*/false, /*copy=*/true).contiguous();
  } else {
    p->grad.add_(g.to(grad_dtype));
  }
}

// One use of `p` in the graph has delivered its gradient part: when it was the last, hand the
// complete gradient to the in-backward hook (if any) and free it.
void use_done(const Qwen3Model::Impl* impl, Parameter* p) {
  if (p->pending_uses > 0) --p->pending_uses;
  if (p->pending_uses == 0 && impl->grad_ready && p->grad.defined()) {
    impl->grad_ready(*p);
    p->grad = at::Tensor();
  }
}

// A tap that enters a graph (grad mode on: the forward of a non-checkpointed layer, or a
// checkpointed layer's recompute inside the backward) will deliver one gradient part.
void use_begins(Parameter* p) {
  if (at::GradMode::is_enabled()) ++p->pending_uses;
}

struct WeightTap : public torch::autograd::Function<WeightTap> {
  // master (any float dtype), trigger () -> weight in the compute dtype (fresh tensor).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& master,
                            const at::Tensor& trigger, int64_t impl, int64_t param,
                            int64_t compute_dtype, int64_t grad_dtype) {
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["param"] = param;
    ctx->saved_data["grad_dtype"] = grad_dtype;
    auto* p = int_to_ptr<Parameter>(param);
    const auto cd = static_cast<at::ScalarType>(compute_dtype);
    if (p->kept_weight.defined() && p->kept_weight.scalar_type() == cd) {
      // ForwardWeights::kKept: fake_quant(master) as of the last refresh. A fresh alias per use,
      // so that each use's autograd history is its own; it shares the kept tensor's version
      // counter, so a refresh while a graph still saves it fails that graph's backward loudly.
      return p->kept_weight.detach();
    }
    if (p->qdata.defined()) {
      // Codes (offloaded master, ForwardWeights::kCodes): quantize(master), so this is
      // fake_quant(master) bit for bit (dequantized values are exact in every float dtype).
      return q4::quant::dequantize_nvfp4(p->qdata, p->scale, cd);
    }
    if (p->quantized && int_to_ptr<const Qwen3Model::Impl>(impl)->opt.fake_quant) {
      // Unchecked: no per-weight device->host sync on CUDA (the trainer's non-finite guard
      // catches NaN/Inf through the loss and gradients); on CPU it still raises.
      return q4::quant::fake_quant_nvfp4_forward_unchecked(
          master, cd, p->name, int_to_ptr<const Qwen3Model::Impl>(impl)->opt.block_rule);
    }
    return master.to(cd, /*non_blocking=*/false, /*copy=*/true);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto* p = int_to_ptr<Parameter>(ctx->saved_data["param"].toInt());
    if (grads[0].defined()) {
      accumulate(p, grads[0], static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt()));
    }
    use_done(int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt()), p);
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

struct LoraMergedTap : public torch::autograd::Function<LoraMergedTap> {
  // trigger () -> fake_quant(W + s·B·A) (out, in) in the compute dtype, for the adapted linear
  // `param` (W its frozen codes, A and B its adapter's masters).
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& trigger, int64_t impl,
                            int64_t param, int64_t compute_dtype, int64_t grad_dtype) {
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["param"] = param;
    ctx->saved_data["grad_dtype"] = grad_dtype;
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(impl);
    auto* p = int_to_ptr<Parameter>(param);
    return q4::quant::fake_quant_nvfp4_forward_unchecked(im->merged_weight(p),
                                                         static_cast<at::ScalarType>(compute_dtype),
                                                         p->name, im->opt.block_rule);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt());
    auto* p = int_to_ptr<Parameter>(ctx->saved_data["param"].toInt());
    const auto gd = static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt());
    if (grads[0].defined()) {
      // Both gradients from the masters as they were in the forward, before either updates.
      const at::Tensor dw = grads[0].to(at::kFloat);
      const double s = im->opt.lora.scale();
      const at::Tensor a = p->lora_a->master.to(at::kFloat);
      const at::Tensor b = p->lora_b->master.to(at::kFloat);
      const auto g = lora_delta_grads(b, a, dw, s);
      accumulate(p->lora_a, g.first, gd);
      accumulate(p->lora_b, g.second, gd);
    }
    use_done(im, p->lora_a);
    use_done(im, p->lora_b);
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// s·u·v + x·w (u (tokens, r), v (r, n), x (tokens, k), w (k, n)): the rank-r term is written
// first (a GEMM that only writes its output), then the large GEMM adds into it in its epilogue
// (beta 1, in place), where reading the term hides behind the multiply. The other order would
// make the small GEMM read and write the whole output.
at::Tensor adapter_then_base(const at::Tensor& u, const at::Tensor& v, double s,
                             const at::Tensor& x, const at::Tensor& w) {
  // beta 0: the first argument only gives the shape (its values are ignored).
  at::Tensor y = at::addmm(at::empty({u.size(0), v.size(1)}, u.options()), u, v, 0.0, s);
  return y.addmm_(x, w);
}

}  // namespace

PlainLoraGrads plain_lora_grads(const at::Tensor& x2, const at::Tensor& xa, const at::Tensor& w,
                                const at::Tensor& a, const at::Tensor& b, double s,
                                const at::Tensor& g, bool want_dx, bool want_da, bool want_db) {
  const at::Tensor gb = at::mm(g, b);  // (tokens, r)
  PlainLoraGrads d;
  if (want_dx) d.dx = adapter_then_base(gb, a, s, g, w);
  // beta 0: the first argument only gives the shape (its values are ignored).
  if (want_da) d.da = at::addmm(at::empty_like(a), gb.t(), x2, 0.0, s);
  if (want_db) d.db = at::addmm(at::empty_like(b), g.t(), xa, 0.0, s);
  return d;
}

namespace {

struct PlainLoraLinear : public torch::autograd::Function<PlainLoraLinear> {
  // x (..., in), w (out, in) the adapted linear's frozen weight, a (r, in), b (out, r) (the
  // adapter's tapped weights), all in the compute dtype -> y = x·wᵀ + s·(x·aᵀ)·bᵀ (..., out).
  // The adapter's term is scaled in its own GEMM and added by the large GEMM's epilogue (beta 1,
  // adapter_then_base) in both directions: no (tokens, in|out) elementwise pass and no separate
  // add of the two input gradients.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            const at::Tensor& a, const at::Tensor& b, double s) {
    const int64_t in = x.size(-1), out = w.size(0);
    const at::Tensor x2 = x.reshape({-1, in});
    const at::Tensor xa = at::mm(x2, a.t());  // (tokens, r)
    const at::Tensor y = adapter_then_base(xa, b.t(), s, x2, w.t());
    ctx->save_for_backward({x2, w, a, b, xa});
    ctx->saved_data["s"] = s;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    std::vector<int64_t> sizes = x.sizes().vec();
    sizes.back() = out;
    return y.view(sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &w = saved[1], &a = saved[2], &b = saved[3], &xa = saved[4];
    const at::Tensor g = grads[0].reshape({-1, w.size(0)});
    PlainLoraGrads d = plain_lora_grads(x2, xa, w, a, b, ctx->saved_data["s"].toDouble(), g,
                                        ctx->needs_input_grad(0), ctx->needs_input_grad(2),
                                        ctx->needs_input_grad(3));
    if (d.dx.defined()) d.dx = d.dx.view(ctx->saved_data["x_sizes"].toIntVector());
    return {d.dx, at::Tensor(), d.da, d.db, at::Tensor()};
  }
};

struct PlainLoraLinears : public torch::autograd::Function<PlainLoraLinears> {
  // Two or three plain adapted linears of one input x (..., in): q/k/v, gate/up. Arguments
  // (w, a, b) per linear as PlainLoraLinear's; for a pair the third triple is empty tensors
  // (LibTorch 1.13 takes no undefined inputs).
  // y_i = x·w_iᵀ + s·(x·a_iᵀ)·b_iᵀ, as PlainLoraLinear computes each, but the adapters' inputs
  // share one GEMM (x·[a_0; a_1; a_2]ᵀ), and in backward the input gradient sums every linear's
  // term in the GEMMs' epilogues (dx = s·[g_i·b_i]·[a_i] + Σ g_i·w_i, one buffer, no separate
  // adds) and the A gradients come from one GEMM over x.
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w0,
                               const at::Tensor& a0, const at::Tensor& b0, const at::Tensor& w1,
                               const at::Tensor& a1, const at::Tensor& b1, const at::Tensor& w2,
                               const at::Tensor& a2, const at::Tensor& b2, double s) {
    const int64_t in = x.size(-1), r = a0.size(0);
    const at::Tensor x2 = x.reshape({-1, in});
    std::vector<at::Tensor> ws = {w0, w1}, as = {a0, a1}, bs = {b0, b1};
    if (w2.numel() > 0) {
      ws.push_back(w2);
      as.push_back(a2);
      bs.push_back(b2);
    }
    const at::Tensor a_all = at::cat(as, 0);          // (k·r, in)
    const at::Tensor xa_all = at::mm(x2, a_all.t());  // (tokens, k·r)
    variable_list ys;
    for (size_t i = 0; i < ws.size(); ++i) {
      const at::Tensor xa = xa_all.narrow(1, static_cast<int64_t>(i) * r, r);
      std::vector<int64_t> sizes = x.sizes().vec();
      sizes.back() = ws[i].size(0);
      ys.push_back(adapter_then_base(xa, bs[i].t(), s, x2, ws[i].t()).view(sizes));
    }
    ctx->save_for_backward({x2, a_all, xa_all, w0, b0, w1, b1, w2, b2});
    ctx->saved_data["s"] = s;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    return ys;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x2 = saved[0], &a_all = saved[1], &xa_all = saved[2];
    const double s = ctx->saved_data["s"].toDouble();
    const int64_t k = saved[7].numel() > 0 ? 3 : 2, r = a_all.size(0) / k, tokens = x2.size(0);
    variable_list out(11);
    std::vector<at::Tensor> gs, gbs;  // per linear: (tokens, out_i), (tokens, r)
    for (int64_t i = 0; i < k; ++i) {
      const at::Tensor &w = saved[3 + 2 * i], &b = saved[4 + 2 * i];
      const at::Tensor g = grads[i].defined() ? grads[i].reshape({tokens, w.size(0)})
                                              : at::zeros({tokens, w.size(0)}, w.options());
      gs.push_back(g);
      gbs.push_back(at::mm(g, b));
    }
    const at::Tensor gb_all = at::cat(gbs, 1);  // (tokens, k·r)
    if (ctx->needs_input_grad(0)) {
      at::Tensor dx = adapter_then_base(gb_all, a_all, s, gs[0], saved[3]);
      for (int64_t i = 1; i < k; ++i) dx.addmm_(gs[i], saved[3 + 2 * i]);
      out[0] = dx.view(ctx->saved_data["x_sizes"].toIntVector());
    }
    bool want_a = false;
    for (int64_t i = 0; i < k; ++i) want_a = want_a || ctx->needs_input_grad(2 + 3 * i);
    // beta 0: the first argument only gives the shape (its values are ignored).
    const at::Tensor da_all =
        want_a ? at::addmm(at::empty_like(a_all), gb_all.t(), x2, 0.0, s) : at::Tensor();
    for (int64_t i = 0; i < k; ++i) {
      if (ctx->needs_input_grad(2 + 3 * i)) out[2 + 3 * i] = da_all.narrow(0, i * r, r);
      if (ctx->needs_input_grad(3 + 3 * i)) {
        const at::Tensor& b = saved[4 + 2 * i];
        out[3 + 3 * i] =
            at::addmm(at::empty_like(b), gs[i].t(), xa_all.narrow(1, i * r, r), 0.0, s);
      }
    }
    return out;
  }
};

struct EmbeddingTap : public torch::autograd::Function<EmbeddingTap> {
  // master (V, H), ids (B, T) int64 -> (B, T, H) compute dtype. Backward adds rows into grad.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& master, const at::Tensor& ids,
                            const at::Tensor& trigger, int64_t impl, int64_t param,
                            int64_t compute_dtype, int64_t grad_dtype) {
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["param"] = param;
    ctx->saved_data["grad_dtype"] = grad_dtype;
    ctx->saved_data["ids"] = ids;
    const auto cd = static_cast<at::ScalarType>(compute_dtype);
    return at::embedding(master, ids).to(cd);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    if (grads[0].defined()) {
      auto* p = int_to_ptr<Parameter>(ctx->saved_data["param"].toInt());
      const auto gd = static_cast<at::ScalarType>(ctx->saved_data["grad_dtype"].toInt());
      at::Tensor ids = ctx->saved_data["ids"].toTensor().reshape({-1});
      const int64_t H = grads[0].size(-1);
      at::Tensor g = grads[0].reshape({-1, H});
      if (!p->grad.defined()) p->grad = at::zeros(p->master.sizes(), p->master.options().dtype(gd));
      if (gd == at::kFloat || g.is_cuda()) {
        p->grad.index_add_(0, ids, g.to(gd));
      } else {
        // CPU index_add of half types is not available on every LibTorch: add in fp32.
        at::Tensor acc = at::zeros(p->grad.sizes(), p->grad.options().dtype(at::kFloat));
        acc.index_add_(0, ids, g.to(at::kFloat));
        p->grad.add_(acc.to(gd));
      }
    }
    use_done(int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt()),
             int_to_ptr<Parameter>(ctx->saved_data["param"].toInt()));
    return {at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A checkpoint of a layer's input h with the RoPE tables and the mask: saved in the forward (in
// pinned host memory with ModelOptions::offload_layer_inputs on CUDA: copied out on the compute
// stream, ordered before any later reuse of h's memory, from the caching host allocator), and
// fetched back in the backward as a leaf that requires grad.
void save_layer_input(AutogradContext* ctx, const Qwen3Model::Impl* im, const at::Tensor& h,
                      int64_t layer, const at::Tensor& cos, const at::Tensor& sin,
                      int64_t mask_kind, const at::Tensor& allowed, int64_t max_seqlen) {
  if (im->opt.offload_layer_inputs && h.is_cuda()) {
    at::Tensor host = at::empty(h.sizes(), h.options().device(at::kCPU).pinned_memory(true));
    host.copy_(h, /*non_blocking=*/true);
    ctx->saved_data["host_input"] = host;
  } else {
    ctx->save_for_backward({h});
  }
  ctx->saved_data["max_seqlen"] = max_seqlen;
  ctx->saved_data["impl"] = ptr_to_int(im);
  ctx->saved_data["layer"] = layer;
  ctx->saved_data["cos"] = cos;
  ctx->saved_data["sin"] = sin;
  ctx->saved_data["mask_kind"] = mask_kind;
  ctx->saved_data["allowed"] = allowed;
}

AttnMask mask_of(int64_t kind, const at::Tensor& allowed, int64_t max_seqlen) {
  AttnMask mask;
  mask.kind = static_cast<AttnMask::Kind>(kind);
  mask.allowed = allowed;
  mask.max_seqlen = max_seqlen;
  return mask;
}

struct SavedLayerInput {
  at::Tensor h;  // (B, T, H) leaf that requires grad
  RopeTables rope;
  AttnMask mask;
};

SavedLayerInput restore_layer_input(AutogradContext* ctx) {
  SavedLayerInput in;
  in.rope = RopeTables{ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor()};
  in.mask = mask_of(ctx->saved_data["mask_kind"].toInt(), ctx->saved_data["allowed"].toTensor(),
                    ctx->saved_data["max_seqlen"].toInt());
  if (ctx->saved_data.count("host_input") > 0) {
    const at::Tensor host = ctx->saved_data["host_input"].toTensor();
    in.h = host.to(in.rope.cos.device(), /*non_blocking=*/true).requires_grad_(true);
    ctx->saved_data.erase("host_input");
  } else {
    in.h = ctx->get_saved_variables()[0].detach().requires_grad_(true);
  }
  return in;
}

// The attention block h -> hs recomputed from a restored input, with its graph back to in.h.
at::Tensor recompute_attention(const Qwen3Model::Impl* im, int64_t layer,
                               const SavedLayerInput& in) {
  at::AutoGradMode enable(true);
  return im->attention_block(layer, in.h, in.rope, in.mask, nullptr);
}

// The forward of a checkpoint that starts at the layer input h: saves h (save_layer_input) and
// runs the attention block without a graph.
at::Tensor checkpointed_attention(AutogradContext* ctx, const Qwen3Model::Impl* im,
                                  const at::Tensor& h, int64_t layer, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t mask_kind,
                                  const at::Tensor& allowed, int64_t max_seqlen) {
  save_layer_input(ctx, im, h, layer, cos, sin, mask_kind, allowed, max_seqlen);
  return im->attention_block(layer, h, RopeTables{cos, sin},
                             mask_of(mask_kind, allowed, max_seqlen), nullptr);
}

// The backward's outputs of such a checkpoint: h's gradient; its other 8 inputs take none.
variable_list layer_input_grad(const SavedLayerInput& in) {
  variable_list out(9);
  out[0] = in.h.grad();
  return out;
}

// The whole layer: keeps h; the backward recomputes the attention block, then the MLP's
// (Ffn::backward_roots).
struct LayerCheckpoint : public torch::autograd::Function<LayerCheckpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& trigger,
                            int64_t impl, int64_t layer, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t mask_kind, const at::Tensor& allowed,
                            int64_t max_seqlen) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(impl);
    const at::Tensor hs =
        checkpointed_attention(ctx, im, h, layer, cos, sin, mask_kind, allowed, max_seqlen);
    return im->ffn_of(layer).forward_no_graph(*im, layer, hs, im->opt.mlp_chunk_tokens);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const SavedLayerInput in = restore_layer_input(ctx);
    const at::Tensor hs = recompute_attention(im, layer, in);
    // The autograd graph takes over at hs (and at the MLP weights' taps).
    const at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(in.h);
    std::vector<at::Tensor> roots, seeds;
    im->ffn_of(layer).backward_roots(*im, layer, hs, g, &roots, &seeds);
    torch::autograd::backward(roots, seeds);
    return layer_input_grad(in);
  }
};

// The attention block h -> hs: keeps h; the MLP block after it keeps its graph.
struct AttentionCheckpoint : public torch::autograd::Function<AttentionCheckpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& trigger,
                            int64_t impl, int64_t layer, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t mask_kind, const at::Tensor& allowed,
                            int64_t max_seqlen) {
    return checkpointed_attention(ctx, int_to_ptr<const Qwen3Model::Impl>(impl), h, layer, cos, sin,
                                  mask_kind, allowed, max_seqlen);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const SavedLayerInput in = restore_layer_input(ctx);
    const at::Tensor hs = recompute_attention(im, layer, in);
    torch::autograd::backward({hs}, {grads[0].defined() ? grads[0] : at::zeros_like(hs)});
    return layer_input_grad(in);
  }
};

// The MLP block hs -> out: keeps hs (the attention block before it keeps its graph); the
// backward recomputes it (Ffn::backward_roots, chunked as the whole layer's).
struct MlpCheckpoint : public torch::autograd::Function<MlpCheckpoint> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hs, const at::Tensor& trigger,
                            int64_t impl, int64_t layer) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(impl);
    ctx->save_for_backward({hs});
    ctx->saved_data["impl"] = impl;
    ctx->saved_data["layer"] = layer;
    return im->ffn_of(layer).forward_no_graph(*im, layer, hs, im->opt.mlp_chunk_tokens);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = int_to_ptr<const Qwen3Model::Impl>(ctx->saved_data["impl"].toInt());
    const int64_t layer = ctx->saved_data["layer"].toInt();
    const at::Tensor hs = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(hs);
    std::vector<at::Tensor> roots, seeds;
    im->ffn_of(layer).backward_roots(*im, layer, hs, g, &roots, &seeds);
    torch::autograd::backward(roots, seeds);
    return {hs.grad(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor tap_weight(const Qwen3Model::Impl* impl, Parameter* p, at::ScalarType compute_dtype,
                      at::ScalarType grad_dtype) {
  use_begins(p);
  return WeightTap::apply(p->master, impl->trigger, ptr_to_int(impl), ptr_to_int(p),
                          static_cast<int64_t>(compute_dtype), static_cast<int64_t>(grad_dtype));
}

at::Tensor lora_delta(const at::Tensor& b, const at::Tensor& a) {
  const int64_t r = b.size(1), experts = a.size(0) / r;
  if (experts == 1) return at::mm(b, a);
  return at::bmm(b.view({experts, -1, r}), a.view({experts, r, a.size(1)})).view({-1, a.size(1)});
}

std::pair<at::Tensor, at::Tensor> lora_delta_grads(const at::Tensor& b, const at::Tensor& a,
                                                   const at::Tensor& dw, double s) {
  const int64_t r = b.size(1), experts = a.size(0) / r;
  if (experts == 1) return {at::mm(b.t(), dw).mul_(s), at::mm(dw, a.t()).mul_(s)};
  const at::Tensor be = b.view({experts, -1, r}), ae = a.view({experts, r, a.size(1)});
  const at::Tensor de = dw.view({experts, -1, dw.size(1)});
  return {at::bmm(be.transpose(1, 2), de).mul_(s).view(a.sizes()),
          at::bmm(de, ae.transpose(1, 2)).mul_(s).view(b.sizes())};
}

at::Tensor tap_lora_merged(const Qwen3Model::Impl* impl, Parameter* p, at::ScalarType compute_dtype,
                           at::ScalarType grad_dtype) {
  use_begins(p->lora_a);
  use_begins(p->lora_b);
  return LoraMergedTap::apply(impl->trigger, ptr_to_int(impl), ptr_to_int(p),
                              static_cast<int64_t>(compute_dtype),
                              static_cast<int64_t>(grad_dtype));
}

at::Tensor plain_lora_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& a,
                             const at::Tensor& b, double scale) {
  return PlainLoraLinear::apply(x, w, a, b, scale);
}

std::vector<at::Tensor> plain_lora_linears(const at::Tensor& x,
                                           const std::vector<const LinearWeights*>& ws,
                                           double scale) {
  TORCH_CHECK(ws.size() == 2 || ws.size() == 3, "plain_lora_linears: 2 or 3 linears, got ",
              ws.size());
  const at::Tensor empty = at::empty({0}, x.options());
  const LinearWeights none{empty, empty, empty};
  const LinearWeights& third = ws.size() == 3 ? *ws[2] : none;
  return PlainLoraLinears::apply(x, ws[0]->w, ws[0]->lora_a, ws[0]->lora_b, ws[1]->w, ws[1]->lora_a,
                                 ws[1]->lora_b, third.w, third.lora_a, third.lora_b, scale);
}

at::Tensor tap_embedding(const Qwen3Model::Impl* impl, Parameter* p, const at::Tensor& ids,
                         at::ScalarType compute_dtype, at::ScalarType grad_dtype) {
  use_begins(p);
  return EmbeddingTap::apply(p->master, ids, impl->trigger, ptr_to_int(impl), ptr_to_int(p),
                             static_cast<int64_t>(compute_dtype), static_cast<int64_t>(grad_dtype));
}

namespace {

// A checkpoint of the layer input h: Function `Checkpoint` applied to h, the RoPE tables and the
// mask. Function::apply rejects undefined tensor arguments: an empty bool stands in for "no
// mask".
template <class Checkpoint>
at::Tensor apply_layer_checkpoint(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& h,
                                  const RopeTables& rope, const AttnMask& mask) {
  at::Tensor allowed =
      mask.allowed.defined() ? mask.allowed : at::empty({0}, h.options().dtype(at::kBool));
  return Checkpoint::apply(h, impl->trigger, ptr_to_int(impl), layer, rope.cos, rope.sin,
                           static_cast<int64_t>(mask.kind), allowed, mask.max_seqlen);
}

}  // namespace

at::Tensor checkpoint_layer(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& h,
                            const RopeTables& rope, const AttnMask& mask) {
  return apply_layer_checkpoint<LayerCheckpoint>(impl, layer, h, rope, mask);
}

at::Tensor checkpoint_attention(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& h,
                                const RopeTables& rope, const AttnMask& mask) {
  return apply_layer_checkpoint<AttentionCheckpoint>(impl, layer, h, rope, mask);
}

at::Tensor checkpoint_mlp(const Qwen3Model::Impl* impl, int64_t layer, const at::Tensor& hs) {
  return MlpCheckpoint::apply(hs, impl->trigger, ptr_to_int(impl), layer);
}

}  // namespace q4::model
