// The dense SwiGLU MLP in the FFN slot (ffn.h): out = hs + down(silu(gate(y)) * up(y)) with
// y = post_attention_layernorm(hs), HF Qwen3MLP op for op. Its linears go through the model's
// linear slot; its recompute skips the down projection's forward GEMM and forms that
// projection's gradients by hand (docs/model.md#gradient-checkpointing).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/autograd/autograd.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "ffn.h"
#include "qwen3_impl.h"

namespace q4::model {
namespace {

// The weights of a layer's MLP block, each resolved once (taps when they train).
struct SwiGluWeights {
  at::Tensor norm;     // (H) post_attention_layernorm
  LinearWeights gate;  // (I, H)
  LinearWeights up;    // (I, H)
  LinearWeights down;  // (H, I)
};

// The tensors of `w` that are tap outputs in the graph (trainable weights, merge-aware
// adapters' merged weights, plain adapters' A and B, the trainable norm), in a fixed order.
std::vector<at::Tensor*> tapped_weights(SwiGluWeights* w) {
  std::vector<at::Tensor*> out;
  for (at::Tensor* t :
       {&w->norm, &w->gate.w, &w->gate.lora_a, &w->gate.lora_b, &w->up.w, &w->up.lora_a,
        &w->up.lora_b, &w->down.w, &w->down.lora_a, &w->down.lora_b}) {
    if (t->defined() && t->requires_grad()) out.push_back(t);
  }
  return out;
}

// Adds `g` (any float dtype) into the fp32 sum `acc` (undefined: starts it).
void add_fp32(at::Tensor* acc, const at::Tensor& g) {
  if (!acc->defined()) {
    *acc = g.scalar_type() == at::kFloat ? g : g.to(at::kFloat);
  } else {
    acc->add_(g);
  }
}

class DenseSwiGluFfn final : public Ffn {
 public:
  const char* name() const override { return "dense SwiGLU"; }

  std::vector<FfnParamSpec> param_specs(const Qwen3Config& c) const override {
    const int64_t H = c.hidden_size, I = c.intermediate_size;
    const auto lin = [](const char* n, int64_t rows, int64_t cols) {
      return FfnParamSpec{n, {rows, cols}, ParamKind::kQuantizedLinear, ParamGroup::kProjection};
    };
    return {lin("mlp.gate_proj.weight", I, H),   // (I, H)
            lin("mlp.up_proj.weight", I, H),     // (I, H)
            lin("mlp.down_proj.weight", H, I)};  // (H, I)
  }
  bool owns(const ParamSpec& p) const override { return ffn_block_owns(p); }
  bool hand_formed_grad(const ParamSpec& p) const override {
    return name_has_tail(p.name, ".mlp.down_proj.weight");
  }
  std::vector<Parameter*> parameters(const Qwen3Model::Impl& m, int64_t layer) const override {
    return ffn_block_parameters(m, layer);
  }

  at::Tensor forward(const Qwen3Model::Impl& m, int64_t layer,
                     const at::Tensor& hs) const override {
    const SwiGluWeights w = weights(m, layer);
    return output(m, hs, hidden(m, hs, w), w);
  }

  at::Tensor forward_no_graph(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                              int64_t chunk_tokens) const override {
    const SwiGluWeights w = weights(m, layer);
    const int64_t H = hs.size(-1), N = hs.numel() / H;
    if (chunk_tokens <= 0 || N <= chunk_tokens) return output(m, hs, hidden(m, hs, w), w);
    // The MLP is token-wise: row chunks of the flattened tokens give the same rows, and only one
    // chunk's (chunk, I) gate/up/SwiGLU tensors exist at a time.
    const at::Tensor hs2 = hs.reshape({N, H});
    at::Tensor out = at::empty_like(hs2);  // (N, H)
    for (int64_t b = 0; b < N; b += chunk_tokens) {
      const int64_t n = std::min(chunk_tokens, N - b);
      const at::Tensor hs_c = hs2.narrow(0, b, n);
      out.narrow(0, b, n).copy_(output(m, hs_c, hidden(m, hs_c, w), w));
    }
    return out.view(hs.sizes());
  }

  // out = hs + s·W_downᵀ (+ the down projection's plain adapter term), recomputed from hs. The
  // weights are resolved once. The down projection's output is not needed for any gradient, so
  // its forward GEMM is not recomputed: its backward is done here (ds = g·W_down,
  // dW_down = gᵀ·s). With ModelOptions::mlp_chunk_tokens below the token count, over row chunks
  // (backward_chunked).
  void backward_roots(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                      const at::Tensor& g, std::vector<at::Tensor>* roots,
                      std::vector<at::Tensor>* seeds) const override {
    SwiGluWeights w;
    {
      at::AutoGradMode enable(true);
      w = weights(m, layer);
    }
    const int64_t H = hs.size(-1), N = hs.numel() / H;
    const int64_t chunk = m.opt.mlp_chunk_tokens;
    if (chunk <= 0 || N <= chunk) {
      backward_whole(m, w, hs, g, roots, seeds);
    } else {
      backward_chunked(m, w, hs, g, chunk, roots, seeds);
    }
  }

  // Bytes per token of the block's graph, as this implementation allocates them: its input hs
  // (the post-attention norm's input), that norm's output and the gate/up/product (2H + 3I), the
  // norm's fp32 scale; with the CPU's ATen RMSNorm also its fp32 input and normalized value (in
  // fp32 compute, the input itself and the fp32 product), and SwiGLU's silu(gate).
  FfnCosts costs(const Qwen3Config& cfg, const ModelOptions& opt) const override {
    const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
    const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
    FfnCosts c;
    c.graph_per_token = cs * (2 * H + 3 * I) + 4;
    if (!opt.device.is_cuda()) c.graph_per_token += 4 * H + (cs == 4 ? 0 : cs * H) + cs * I;
    // A no-graph forward: the (rows, I) gate/up/product beside its input and the norm output.
    c.forward_per_row = cs * (2 * H + 3 * I);
    // A recomputed chunk: its graph less the hs rows (views), and the SwiGLU's three (rows, I)
    // gradients.
    c.chunk_per_row = c.graph_per_token - cs * H + 3 * I * cs;
    c.inner_per_token = I * cs;
    // gate and up, 2 H I (the recompute never runs the down projection's forward).
    c.recompute_macs_per_token = 2.0 * static_cast<double>(H) * static_cast<double>(I);
    return c;
  }

 private:
  SwiGluWeights weights(const Qwen3Model::Impl& m, int64_t layer) const {
    const LayerParams& lp = m.layers[layer];
    SwiGluWeights w;
    w.norm = m.weight(lp.post_attention_layernorm);
    w.gate = m.linear_weights(lp.ffn[0]);
    w.up = m.linear_weights(lp.ffn[1]);
    w.down = m.linear_weights(lp.ffn[2]);
    return w;
  }
  // s = swiglu(gate(y), up(y)), y = post_attention_layernorm(hs): (..., H) -> (..., I).
  static at::Tensor hidden(const Qwen3Model::Impl& m, const at::Tensor& hs,
                           const SwiGluWeights& w) {
    at::Tensor y = rms_norm(hs, w.norm, m.cfg.rms_norm_eps, m.opt.fused_cuda_kernels);
    const std::vector<at::Tensor> gate_up = m.linears(y, {&w.gate, &w.up});
    return swiglu(gate_up[0], gate_up[1], m.opt.fused_cuda_kernels);
  }
  // out = hs + down(s) (+ the down projection's plain adapter term).
  static at::Tensor output(const Qwen3Model::Impl& m, const at::Tensor& hs, const at::Tensor& s,
                           const SwiGluWeights& w) {
    return hs + m.linear(s, w.down);
  }

  // Unchunked: s recomputed with its graph; hs and s are roots, the down projection's gradients
  // formed here (PlainLoraLinear's for a plain adapter).
  static void backward_whole(const Qwen3Model::Impl& m, const SwiGluWeights& w,
                             const at::Tensor& hs, const at::Tensor& g,
                             std::vector<at::Tensor>* roots, std::vector<at::Tensor>* seeds) {
    const int64_t H = hs.size(-1), I = w.down.w.size(1);
    at::Tensor s;
    {
      at::AutoGradMode enable(true);
      s = hidden(m, hs, w);  // (B, T, I)
    }
    roots->push_back(hs);
    seeds->push_back(g);
    roots->push_back(s);
    at::NoGradGuard no_grad;
    const at::Tensor g2 = g.reshape({-1, H});
    const at::Tensor s2 = s.detach().reshape({-1, I});
    if (w.down.lora_a.defined()) {
      // A plain adapter: PlainLoraLinear's gradients (output()'s down projection is one).
      const at::Tensor &a = w.down.lora_a, &b = w.down.lora_b;
      const at::Tensor xa = at::mm(s2, a.detach().t());
      const PlainLoraGrads d =
          plain_lora_grads(s2, xa, w.down.w, a.detach(), b.detach(), m.opt.lora.scale(), g2, true,
                           a.requires_grad(), b.requires_grad());
      seeds->push_back(d.dx.view(s.sizes()));
      for (const auto& [tap, grad] : {std::make_pair(a, d.da), std::make_pair(b, d.db)}) {
        if (!grad.defined()) continue;
        roots->push_back(tap);
        seeds->push_back(grad);
      }
    } else {
      seeds->push_back(at::mm(g2, w.down.w).view(s.sizes()));
    }
    if (w.down.w.requires_grad()) {
      roots->push_back(w.down.w);
      seeds->push_back(at::mm(g2.t(), s2));
    }
  }

  // Chunked: each chunk recomputes y, gate/up and s from its rows of hs with the weights'
  // detached copies (and the frozen weights themselves, so no chunk enters the taps' graph) and
  // is back-propagated alone (torch::autograd::grad), its rows of hs's gradient written into one
  // (tokens, H) tensor and its weight gradients added into fp32 sums; then the taps get those
  // sums, cast to the compute dtype, in the same backward call as hs.
  static void backward_chunked(const Qwen3Model::Impl& m, const SwiGluWeights& w,
                               const at::Tensor& hs, const at::Tensor& g, int64_t chunk,
                               std::vector<at::Tensor>* roots, std::vector<at::Tensor>* seeds) {
    const int64_t H = hs.size(-1), N = hs.numel() / H;
    SwiGluWeights taps_of = w, leaf = w;
    const std::vector<at::Tensor*> taps = tapped_weights(&taps_of);
    const std::vector<at::Tensor*> leaves = tapped_weights(&leaf);
    for (at::Tensor* t : leaves) *t = t->detach().requires_grad_(true);
    // Gradients of every leaf but the down projection's weight come from autograd::grad; that one
    // is formed by hand from the chunk's s.
    std::vector<at::Tensor> grad_inputs(1);  // [0]: the chunk's rows of hs
    std::vector<size_t> grad_slot;           // index into taps of grad_inputs[1 + i]
    size_t down_slot = taps.size();
    for (size_t i = 0; i < leaves.size(); ++i) {
      if (leaves[i] == &leaf.down.w) {
        down_slot = i;
      } else {
        grad_inputs.push_back(*leaves[i]);
        grad_slot.push_back(i);
      }
    }
    const at::Tensor w_down = leaf.down.w.detach();  // (H, I)
    const at::Tensor hs2 = hs.detach().reshape({N, H});
    const at::Tensor g2 = g.reshape({N, H});
    at::Tensor g_hs = at::empty_like(g2);       // (N, H) hs's gradient, chunk by chunk
    std::vector<at::Tensor> sums(taps.size());  // fp32, each tap's shape
    for (int64_t b = 0; b < N; b += chunk) {
      const int64_t n = std::min(chunk, N - b);
      const at::Tensor g_c = g2.narrow(0, b, n);  // (n, H)
      grad_inputs[0] = hs2.narrow(0, b, n).detach().requires_grad_(true);
      std::vector<at::Tensor> outs, out_grads;
      {
        at::AutoGradMode enable(true);
        outs.push_back(hidden(m, grad_inputs[0], leaf));  // s_c (n, I)
        if (leaf.down.lora_a.defined()) outs.push_back(m.plain_lora(outs[0], leaf.down));
      }
      at::NoGradGuard no_grad;
      out_grads.push_back(at::mm(g_c, w_down));  // (n, I)
      if (outs.size() > 1) out_grads.push_back(g_c);
      if (down_slot < taps.size()) add_fp32(&sums[down_slot], at::mm(g_c.t(), outs[0].detach()));
      const std::vector<at::Tensor> grads =
          torch::autograd::grad(outs, grad_inputs, out_grads, /*retain_graph=*/false,
                                /*create_graph=*/false, /*allow_unused=*/true);
      // out = hs + ...: the residual's gradient plus the block's.
      at::Tensor rows = g_hs.narrow(0, b, n);
      if (grads[0].defined()) {
        at::add_out(rows, g_c, grads[0]);
      } else {
        rows.copy_(g_c);
      }
      for (size_t i = 0; i < grad_slot.size(); ++i) {
        if (grads[1 + i].defined()) add_fp32(&sums[grad_slot[i]], grads[1 + i]);
      }
    }
    roots->push_back(hs);
    seeds->push_back(g_hs.view(hs.sizes()));
    for (size_t i = 0; i < taps.size(); ++i) {
      // Every tap that began a use delivers it, zero when no chunk reached it.
      roots->push_back(*taps[i]);
      seeds->push_back(sums[i].defined() ? sums[i].to(taps[i]->scalar_type())
                                         : at::zeros_like(*taps[i]));
      sums[i] = at::Tensor();
    }
  }
};

}  // namespace

bool ffn_block_owns(const ParamSpec& p) {
  return p.name.find(".mlp.") != std::string::npos ||
         name_has_tail(p.name, ".post_attention_layernorm.weight");
}

std::vector<Parameter*> ffn_block_parameters(const Qwen3Model::Impl& m, int64_t layer) {
  const LayerParams& lp = m.layers[layer];
  std::vector<Parameter*> out{lp.post_attention_layernorm};
  out.insert(out.end(), lp.ffn.begin(), lp.ffn.end());
  return out;
}

const Ffn& dense_swiglu_ffn() {
  static const DenseSwiGluFfn dense;
  return dense;
}

const Ffn& ffn_for(const Qwen3Config& cfg, int64_t layer) {
  return cfg.is_moe_layer(layer) ? moe_ffn() : dense_swiglu_ffn();
}

}  // namespace q4::model
