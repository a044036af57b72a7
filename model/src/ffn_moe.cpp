// The mixture-of-experts FFN of Qwen3MoeForCausalLM in the FFN slot (ffn.h), HF
// Qwen3MoeSparseMoeBlock op for op: y = post_attention_layernorm(hs); router logits y·W_rᵀ in
// the compute dtype (the router is never quantized); softmax in fp32; the top k experts of each
// token (ties to the lower index, so routing is deterministic); their probabilities
// renormalised to sum to 1 when norm_topk_prob; cast to the compute dtype; every token goes to
// all of its k experts (no capacity, nothing dropped); out = hs + Σ_k weight_k · expert_k(y),
// each expert a SwiGLU MLP of moe_intermediate_size whose three linears are NVFP4 and
// straight-through fake-quantized like every other. The experts' weights are stacked
// (qwen3_params.h) and computed over the rows routed to each expert: one grouped GEMM for all
// experts on CUDA (ModelOptions::moe_grouped_gemm), one GEMM per expert elsewhere
// (docs/model.md#mixture-of-experts). LoRA on the experts (docs/model.md#lora-on-experts):
// merge-aware, the stacked weights are the merged, fake-quantized ones (Impl::weight); plain,
// each expert's projections add s·(x·A_eᵀ)·B_eᵀ, gate and up from one shared A_e.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <tuple>
#include <vector>

#include "ffn.h"
#include "q4/quant/torch_compat.h"
#include "qwen3_impl.h"

namespace q4::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The N·k routes of N rows, sorted by expert: sorted route i is route order[i] = (row
// order[i] / k, slot order[i] % k), and inverse is order's inverse permutation. Both directions
// of both functions below are gathers and fixed-order sums: no scatter-add, so no atomic float
// adds on CUDA (deterministic, and at gather bandwidth).
//
// y (N, H) -> (N·k, H): sorted route i reads row order[i] / k. Backward: each row's k routes'
// gradients, gathered into route order and summed.
struct GatherRoutes : public torch::autograd::Function<GatherRoutes> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& y, const at::Tensor& order,
                            const at::Tensor& inverse, int64_t k) {
    ctx->save_for_backward({inverse});
    ctx->saved_data["k"] = k;
    return y.index_select(0, at::div(order, k, "trunc"));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor inverse = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt(), H = grads[0].size(1);
    const at::Tensor g = grads[0].index_select(0, inverse).view({-1, k, H}).sum(1);
    return {g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// x (N·k, H) in sorted route order -> (N, H): each row's k routes summed in slot order.
// Backward: sorted route i gets its row's gradient, a gather.
struct CombineRoutes : public torch::autograd::Function<CombineRoutes> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& order,
                            const at::Tensor& inverse, int64_t k) {
    ctx->save_for_backward({order});
    ctx->saved_data["k"] = k;
    return x.index_select(0, inverse).view({-1, k, x.size(1)}).sum(1);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const at::Tensor order = ctx->get_saved_variables()[0];
    const int64_t k = ctx->saved_data["k"].toInt();
    return {grads[0].index_select(0, at::div(order, k, "trunc")), at::Tensor(), at::Tensor(),
            at::Tensor()};
  }
};

// A layer's MoE weights in the compute dtype, each resolved once (taps when they train).
struct MoeWeights {
  at::Tensor norm;    // (H) post_attention_layernorm
  at::Tensor router;  // (E, H) mlp.gate
  at::Tensor gate;    // (E·I, H) every expert's gate_proj
  at::Tensor up;      // (E·I, H)
  at::Tensor down;    // (E·H, I)
  // Plain LoRA on the experts (undefined otherwise), expert e's block of each in rows e·(rows/E):
  at::Tensor gate_up_a;     // (E·r, H) shared by gate and up
  at::Tensor gate_b, up_b;  // (E·I, r)
  at::Tensor down_a;        // (E·r, I)
  at::Tensor down_b;        // (E·H, r)
  double scale = 0;         // alpha / rank
  bool plain_lora() const { return gate_up_a.defined(); }
};

// The routing of N rows: each row's k experts and their weights.
struct Routing {
  at::Tensor chosen;   // (N, k) int64, by descending probability
  at::Tensor weights;  // (N, k) compute dtype
};

class MoeFfn final : public Ffn {
 public:
  const char* name() const override { return "mixture of experts"; }

  std::vector<FfnParamSpec> param_specs(const Qwen3Config& c) const override {
    const int64_t H = c.hidden_size, I = c.moe.moe_intermediate_size, E = c.moe.num_experts;
    const auto experts = [](const char* n, int64_t rows, int64_t cols) {
      return FfnParamSpec{n, {rows, cols}, ParamKind::kQuantizedLinear, ParamGroup::kProjection};
    };
    return {{"mlp.gate.weight", {E, H}, ParamKind::kRaw, ParamGroup::kRouter},
            experts("mlp.experts.gate_proj.weight", E * I, H),   // (E·I, H)
            experts("mlp.experts.up_proj.weight", E * I, H),     // (E·I, H)
            experts("mlp.experts.down_proj.weight", E * H, I)};  // (E·H, I)
  }
  bool owns(const ParamSpec& p) const override { return ffn_block_owns(p); }
  bool hand_formed_grad(const ParamSpec&) const override { return false; }
  std::vector<Parameter*> parameters(const Qwen3Model::Impl& m, int64_t layer) const override {
    return ffn_block_parameters(m, layer);
  }

  at::Tensor forward(const Qwen3Model::Impl& m, int64_t layer,
                     const at::Tensor& hs) const override {
    return block(m, layer, hs, weights(m, layer));
  }

  // One pass: the rows of an expert are gathered from the whole layer, so row chunks would not
  // bound the experts' transients.
  at::Tensor forward_no_graph(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                              int64_t) const override {
    return block(m, layer, hs, weights(m, layer));
  }

  // The block recomputed with its graph from hs; autograd forms every gradient (hs's, the
  // residual included, and the taps').
  void backward_roots(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                      const at::Tensor& g, std::vector<at::Tensor>* roots,
                      std::vector<at::Tensor>* seeds) const override {
    at::Tensor out;
    {
      at::AutoGradMode enable(true);
      out = block(m, layer, hs, weights(m, layer));
    }
    roots->push_back(out);
    seeds->push_back(g);
  }

  // Bytes per token of the block's graph as it allocates them, with k routed experts of width I:
  // its input hs, the norm's output y and fp32 scale, the router's logits and fp32
  // probabilities, y gathered once per route (k·H) and each route's gate/up/product (3·k·I),
  // expert output and weighted output (2·k·H), and the k routes' sum.
  FfnCosts costs(const Qwen3Config& cfg, const ModelOptions& opt) const override {
    const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
    const int64_t H = cfg.hidden_size, I = cfg.moe.moe_intermediate_size;
    const int64_t E = cfg.moe.num_experts, k = cfg.moe.num_experts_per_tok;
    FfnCosts c;
    const int64_t routes = k * (3 * H + 3 * I);
    c.graph_per_token = cs * (2 * H + E + routes) + 4 + 8 * E + 16 * k;
    if (!opt.device.is_cuda()) c.graph_per_token += 4 * H + (cs == 4 ? 0 : cs * H) + cs * k * I;
    c.forward_per_row = cs * (2 * H + E + routes) + 8 * E + 16 * k;
    c.chunk_per_row = c.graph_per_token + 3 * k * I * cs;
    c.inner_per_token = k * I * cs;
    // The recompute runs the whole block: the router (H·E) and k experts' three linears.
    c.recompute_macs_per_token =
        static_cast<double>(H) * static_cast<double>(E) +
        3.0 * static_cast<double>(k) * static_cast<double>(H) * static_cast<double>(I);
    return c;
  }

 private:
  static MoeWeights weights(const Qwen3Model::Impl& m, int64_t layer) {
    const LayerParams& lp = m.layers[layer];
    MoeWeights w{m.weight(lp.post_attention_layernorm), m.weight(lp.ffn[0]), m.weight(lp.ffn[1]),
                 m.weight(lp.ffn[2]), m.weight(lp.ffn[3])};
    if (lp.ffn[1]->lora_a != nullptr && !m.opt.lora.merge_aware) {
      w.gate_up_a = m.weight(lp.ffn[1]->lora_a);
      w.gate_b = m.weight(lp.ffn[1]->lora_b);
      w.up_b = m.weight(lp.ffn[2]->lora_b);
      w.down_a = m.weight(lp.ffn[3]->lora_a);
      w.down_b = m.weight(lp.ffn[3]->lora_b);
      w.scale = m.opt.lora.scale();
    }
    return w;
  }

  static at::Tensor block(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                          const MoeWeights& w) {
    const int64_t H = hs.size(-1), N = hs.numel() / H;
    const at::Tensor y =
        rms_norm(hs, w.norm, m.cfg.rms_norm_eps, m.opt.fused_cuda_kernels).reshape({N, H});
    const Routing r = route(m, layer, y, w.router);
    return hs + experts(m, y, r, w).view(hs.sizes());
  }

  // HF Qwen3MoeSparseMoeBlock's routing; records the layer's choices (RouterRecord).
  static Routing route(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& y,
                       const at::Tensor& router) {
    const int64_t k = m.cfg.moe.num_experts_per_tok;
    const at::Tensor logits = router_tap(&m, at::linear(y, router));  // (N, E)
    const at::Tensor probs = at::softmax(logits, 1, at::kFloat);      // (N, E) fp32
    // A stable descending sort: equal probabilities keep the lower expert first.
    Routing r;
    r.chosen = std::get<1>(at::sort(probs.detach(), /*stable=*/true, 1, /*descending=*/true))
                   .narrow(1, 0, k)
                   .contiguous();  // (N, k)
    m.router.record(layer, logits.detach(), probs.detach(), r.chosen);
    at::Tensor p = probs.gather(1, r.chosen);  // (N, k) fp32
    if (m.cfg.moe.norm_topk_prob) p = p / p.sum(1, /*keepdim=*/true);
    r.weights = p.to(y.scalar_type());
    return r;
  }

  // Σ_k weight_k · expert_k(y) for each row: the N·k routes sorted by expert (stable, so each
  // expert's rows stay in token order), one SwiGLU MLP per expert over its rows, weighted, put
  // back in route order and summed over each row's k routes (GatherRoutes, CombineRoutes: no
  // atomic float adds either way, so the results are deterministic on every device). (N, H) in
  // the compute dtype.
  static at::Tensor experts(const Qwen3Model::Impl& m, const at::Tensor& y, const Routing& r,
                            const MoeWeights& w) {
    const int64_t E = m.cfg.moe.num_experts, I = m.cfg.moe.moe_intermediate_size;
    const int64_t N = y.size(0), H = y.size(1), k = r.chosen.size(1);
    const at::Tensor route_expert = r.chosen.reshape({-1});  // (N·k)
    const at::Tensor order =
        std::get<1>(at::sort(route_expert, /*stable=*/true, 0, /*descending=*/false));
    const at::Tensor per_expert = at::zeros({E}, route_expert.options())
                                      .index_add_(0, route_expert, at::ones_like(route_expert));
    const at::Tensor inverse =
        at::empty_like(order).scatter_(0, order, at::arange(N * k, order.options()));
    const at::Tensor xs = GatherRoutes::apply(y, order, inverse, k);  // (N·k, H)
    const at::Tensor gate = w.gate.view({E, I, H}), up = w.up.view({E, I, H});
    const at::Tensor down = w.down.view({E, H, I});
    const ExpertLora lora = expert_lora(w, E);
    const at::Tensor out = grouped_applies(m, y, w)
                               ? grouped(m, xs, per_expert, gate, up, down, lora)
                               : per_expert_gemms(m, xs, per_expert, gate, up, down, lora);
    const at::Tensor weighted = out * r.weights.reshape({-1}).index_select(0, order).unsqueeze(1);
    return CombineRoutes::apply(weighted, order, inverse, k);
  }

  // Plain expert adapters as (E, rows, cols) stacks (undefined without them).
  struct ExpertLora {
    at::Tensor a_gu, b_g, b_u;  // (E, r, H), (E, I, r), (E, I, r)
    at::Tensor a_d, b_d;        // (E, r, I), (E, H, r)
    double s = 0;
  };
  static ExpertLora expert_lora(const MoeWeights& w, int64_t E) {
    ExpertLora l;
    if (!w.plain_lora()) return l;
    const int64_t r = w.gate_b.size(1);
    l.a_gu = w.gate_up_a.view({E, r, -1});
    l.b_g = w.gate_b.view({E, -1, r});
    l.b_u = w.up_b.view({E, -1, r});
    l.a_d = w.down_a.view({E, r, -1});
    l.b_d = w.down_b.view({E, -1, r});
    l.s = w.scale;
    return l;
  }

  // The grouped GEMMs need 16-byte aligned rows: a plain adapter's rank-r operands in bf16
  // take r % 8 == 0 (else the per-expert GEMMs run).
  static bool grouped_applies(const Qwen3Model::Impl& m, const at::Tensor& y,
                              const MoeWeights& w) {
#if Q4_HAS_GROUPED_MM
    return m.opt.moe_grouped_gemm && y.is_cuda() && y.scalar_type() == at::kBFloat16 &&
           (!w.plain_lora() || w.gate_b.size(1) % 8 == 0);
#else
    (void)m;
    (void)y;
    (void)w;
    return false;
#endif
  }

  // One GEMM per expert over its rows of xs (N·k, H) sorted by expert; `per_expert` (E) its
  // row counts (read on the host: a device sync on CUDA).
  static at::Tensor per_expert_gemms(const Qwen3Model::Impl& m, const at::Tensor& xs,
                                     const at::Tensor& per_expert, const at::Tensor& gate,
                                     const at::Tensor& up, const at::Tensor& down,
                                     const ExpertLora& l) {
    const at::Tensor counts = per_expert.cpu();
    const int64_t* n = counts.data_ptr<int64_t>();
    const std::vector<at::Tensor> gs = gate.unbind(0), us = up.unbind(0), ds = down.unbind(0);
    std::vector<at::Tensor> outs;
    for (int64_t e = 0, begin = 0; e < gate.size(0); begin += n[e], ++e) {
      if (n[e] == 0) continue;
      const at::Tensor x = xs.narrow(0, begin, n[e]);
      at::Tensor g = at::mm(x, gs[e].t()), u = at::mm(x, us[e].t());
      if (l.a_gu.defined()) {
        const at::Tensor xa = at::mm(x, l.a_gu[e].t());  // (n_e, r)
        g = g + at::mm(xa, l.b_g[e].t()) * l.s;
        u = u + at::mm(xa, l.b_u[e].t()) * l.s;
      }
      const at::Tensor s = swiglu(g, u, m.opt.fused_cuda_kernels);
      at::Tensor o = at::mm(s, ds[e].t());  // (n_e, H)
      if (l.a_d.defined()) o = o + at::mm(at::mm(s, l.a_d[e].t()), l.b_d[e].t()) * l.s;
      outs.push_back(o);
    }
    return at::cat(outs);
  }

  // The same three projections as grouped GEMMs over every expert at once, offsets on the
  // device (no sync). The weights' (E, out, in) stacks are read transposed, as column-major
  // (E, in, out) operands.
  static at::Tensor grouped(const Qwen3Model::Impl& m, const at::Tensor& xs,
                            const at::Tensor& per_expert, const at::Tensor& gate,
                            const at::Tensor& up, const at::Tensor& down,
                            const ExpertLora& l) {
#if Q4_HAS_GROUPED_MM
    const at::Tensor offs = at::cumsum(per_expert, 0).to(at::kInt);
    const auto gmm = [&](const at::Tensor& x, const at::Tensor& w) {
      return at::_grouped_mm(x, w.transpose(1, 2), offs);
    };
    at::Tensor g = gmm(xs, gate), u = gmm(xs, up);
    if (l.a_gu.defined()) {
      const at::Tensor xa = gmm(xs, l.a_gu);  // (N·k, r)
      g = g + gmm(xa, l.b_g) * l.s;
      u = u + gmm(xa, l.b_u) * l.s;
    }
    const at::Tensor s = swiglu(g, u, m.opt.fused_cuda_kernels);
    at::Tensor o = gmm(s, down);
    if (l.a_d.defined()) o = o + gmm(gmm(s, l.a_d), l.b_d) * l.s;
    return o;
#else
    (void)m;
    (void)xs;
    (void)per_expert;
    (void)gate;
    (void)up;
    (void)down;
    (void)l;
    TORCH_CHECK(false, "grouped GEMM: needs LibTorch 2.9 or newer");
#endif
  }
};

}  // namespace

const Ffn& moe_ffn() {
  static const MoeFfn moe;
  return moe;
}

}  // namespace q4::model
