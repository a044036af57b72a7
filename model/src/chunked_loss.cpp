// Token-chunked cross-entropy through the lm_head: forward computes fp32 logits for
// `chunk_tokens` rows at a time (matmul in the weight's dtype, then upcast, as HF does), adds the
// chunk's loss to the running sum and, when a gradient is wanted, turns the same block into
// softmax - onehot in place and accumulates the hidden and weight gradients; backward scales
// them by the upstream gradient. At most one (chunk, V) fp32 block exists at any time; on CUDA
// none (one fused kernel works on the matmul's output, fused_softmax_xent_). A LossTerm (a
// distillation divergence) with a fused form (LossTerm::fused: on CUDA one kernel for the CE, the
// term and their mixed gradient, over the matmul's output) takes it where it applies; otherwise
// the term gets its own fp32 copy of each chunk's logits, returns its gradient in it, and the
// two gradients are mixed by its weight before the same two GEMMs.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>

#include "q4/model/qwen3.h"
#include "qwen3_impl.h"

namespace q4::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnoreIndex = -100;

// Gradient of one chunk's summed CE with respect to its logits, in place on the fp32 block that
// holds exp(x - row max) with row sums `sum`: softmax - onehot(label), rows without a label 0.
void chunk_logit_grad(at::Tensor& e, const at::Tensor& sum, const at::Tensor& y,
                      const at::Tensor& valid) {
  e.div_(sum.unsqueeze(1));
  e.scatter_add_(1, y.clamp_min(0).unsqueeze(1), at::full({e.size(0), 1}, -1.0, e.options()));
  e.mul_(valid.to(at::kFloat).unsqueeze(1));
}

// One chunk's CE sum added to `ce_total`; returns d(CE sum)/d(logits) when `want` (the logits'
// dtype on the fused CUDA kernel, which overwrites `logits`; fp32 otherwise), else undefined.
at::Tensor chunk_ce(at::Tensor& logits, const at::Tensor& y, bool want, bool fused,
                    at::Tensor& ce_total) {
  if (fused && fused_xent_applies(logits, y)) {
    // CUDA: one kernel reads the logits (upcast to fp32 per element), writes the per-row CE and
    // the gradient in place: no fp32 block.
    ce_total.add_(fused_softmax_xent_(logits, y, want).sum());
    return want ? logits : at::Tensor();
  }
  const at::Tensor valid = y.ne(kIgnoreIndex);
  at::Tensor x = logits.to(at::kFloat);
  const at::Tensor picked = x.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);  // (n)
  // Row max, exp in place on the one fp32 block (at::logsumexp would allocate a second).
  const at::Tensor mx = std::get<0>(x.max(1, /*keepdim=*/true));  // (n, 1)
  x.sub_(mx).exp_();
  const at::Tensor row_sum = x.sum(1);
  const at::Tensor lse = row_sum.log().add_(mx.squeeze(1));
  ce_total.add_(((lse - picked) * valid.to(at::kFloat)).sum());
  if (!want) return at::Tensor();
  chunk_logit_grad(x, row_sum, y, valid);
  return x;
}

// The gradients are computed in the forward, from the same logits block that gives the loss
// (the loss is the last op of the graph and its upstream gradient a scalar): the backward only
// scales them by that scalar. One lm_head GEMM and one exp pass per chunk fewer than
// recomputing the logits in the backward; the same memory (the weight gradient would exist in
// the backward's loss phase anyway, and the forward runs straight into it).
struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden (N, H), weight (V, H), labels (N) int64 -> () fp32 sum of per-row CE, or with `term`
  // (1 - w) * CE + w * term, whose parts go to `parts` (detached) when it is given.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            const LossTerm* term, std::pair<at::Tensor, at::Tensor>* parts,
                            bool fused) {
    const bool want_h = hidden.requires_grad(), want_w = weight.requires_grad();
    const bool want = want_h || want_w;
    const int64_t N = hidden.size(0);
    const double w = term ? term->weight : 0.0;
    const auto f32 = hidden.options().dtype(at::kFloat);
    at::Tensor ce_total = at::zeros({}, f32);
    at::Tensor term_total = term ? at::zeros({}, f32) : at::Tensor();
    at::Tensor grad_h = want_h ? at::empty_like(hidden) : at::Tensor();
    at::Tensor grad_w;
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      at::Tensor h = hidden.narrow(0, s, n);
      at::Tensor y = labels.narrow(0, s, n);
      at::Tensor logits = at::matmul(h, weight.t());  // (n, V) in the weight's dtype
      at::Tensor pc;  // d(chunk's loss)/d(logits), or undefined when no gradient is wanted
      bool done = false;
      if (term && term->fused && fused) {
        // The term's fused form: CE, term and their mixed gradient in one pass over the logits.
        const LossRows r = term->fused(logits, y, s, want);
        if (r.ce.defined()) {
          ce_total.add_(r.ce.sum());
          term_total.add_(r.term.sum());
          if (want) pc = logits;
          done = true;
        }
      }
      if (!done) {
        // The term's own fp32 copy of the logits, taken before the CE works on them in place; it
        // comes back holding the term's gradient.
        at::Tensor zt;
        if (term) {
          zt = logits.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
          term_total.add_(term->chunk(zt, y.ne(kIgnoreIndex), s, want));
        }
        pc = chunk_ce(logits, y, want, fused, ce_total);  // d(chunk's CE sum)/d(logits)
        if (term && want) pc = zt.mul_(w).add_(pc, 1.0 - w);  // the combined gradient, fp32
      }
      if (!want) continue;
      pc = pc.to(hidden.scalar_type());
      if (want_h) grad_h.narrow(0, s, n).copy_(at::matmul(pc, weight));
      if (want_w) {
        if (!grad_w.defined()) {
          grad_w = at::matmul(pc.t(), h);  // (V, H)
        } else {
          grad_w.addmm_(pc.t(), h);
        }
      }
    }
    if (want_h) ctx->saved_data["grad_h"] = grad_h;
    if (want_w) ctx->saved_data["grad_w"] = grad_w;
    if (!term) return ce_total;
    if (parts != nullptr) *parts = {ce_total.clone(), term_total.clone()};
    return ce_total.mul(1.0 - w).add_(term_total, w);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    at::Tensor grad_h, grad_w;
    if (ctx->saved_data.count("grad_h") != 0) grad_h = ctx->saved_data["grad_h"].toTensor();
    if (ctx->saved_data.count("grad_w") != 0) grad_w = ctx->saved_data["grad_w"].toTensor();
    ctx->saved_data.clear();  // the autograd graph may outlive this call: drop the references
    const at::Tensor go = grads[0];  // () upstream gradient of the sum
    if (grad_h.defined()) grad_h.mul_(go);
    if (grad_w.defined()) grad_w.mul_(go);
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// fp32 logits / temperature of rows of hidden: the scaling is the sampler's (TokenSampler with
// SamplingParams::logprobs_at_temperature), op for op, so that the two agree.
at::Tensor logits_at_temperature(const at::Tensor& h, const at::Tensor& weight,
                                 double temperature) {
  at::Tensor logits = at::matmul(h, weight.t()).to(at::kFloat);
  return temperature == 1.0 ? logits : logits / temperature;
}

// Per-row log-probability of the label at a temperature T. Forward: chunk logits / T, log p =
// picked - logsumexp; nothing saved but the inputs. Backward: each chunk's logits again,
// d(log p_r)/d(logits_r) = (onehot(label_r) - softmax_r) / T scaled by the row's upstream
// gradient, then the two GEMMs.
struct ChunkedTokenLogprobs : public torch::autograd::Function<ChunkedTokenLogprobs> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk,
                            double temperature) {
    ctx->save_for_backward({hidden, weight, labels});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["temperature"] = temperature;
    const int64_t N = hidden.size(0);
    at::Tensor out = at::empty({N}, hidden.options().dtype(at::kFloat));
    at::NoGradGuard no_grad;
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      const at::Tensor logits = logits_at_temperature(hidden.narrow(0, s, n), weight, temperature);
      const at::Tensor y = labels.narrow(0, s, n).unsqueeze(1);
      out.narrow(0, s, n).copy_(logits.gather(1, y).squeeze(1) - at::logsumexp(logits, 1));
    }
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& labels = saved[2];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const double temperature = ctx->saved_data["temperature"].toDouble();
    const at::Tensor go = grads[0].to(at::kFloat);  // (N)
    const bool want_h = ctx->needs_input_grad(0), want_w = ctx->needs_input_grad(1);
    const int64_t N = hidden.size(0);
    at::Tensor grad_h = want_h ? at::empty_like(hidden) : at::Tensor();
    at::Tensor grad_w;
    at::NoGradGuard no_grad;
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      const at::Tensor h = hidden.narrow(0, s, n);
      at::Tensor p = logits_at_temperature(h, weight, temperature).softmax(1);  // (n, V)
      const at::Tensor g = go.narrow(0, s, n).unsqueeze(1);
      // g (onehot - p) = -(g p) + g at the label; d(logits / T) / d logits = 1 / T.
      p.mul_(g).neg_();
      p.scatter_add_(1, labels.narrow(0, s, n).unsqueeze(1), g);
      if (temperature != 1.0) p.div_(temperature);
      const at::Tensor pc = p.to(hidden.scalar_type());
      if (want_h) grad_h.narrow(0, s, n).copy_(at::matmul(pc, weight));
      if (want_w) {
        if (!grad_w.defined()) {
          grad_w = at::matmul(pc.t(), h);
        } else {
          grad_w.addmm_(pc.t(), h);
        }
      }
    }
    return {grad_h, grad_w, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

void check_loss_args(const char* what, const at::Tensor& hidden, const at::Tensor& weight,
                     const at::Tensor& labels, int64_t chunk_tokens) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1), what,
              ": expected hidden (N, H) and weight (V, H), got ", hidden.sizes(), " and ",
              weight.sizes());
  TORCH_CHECK(
      labels.dim() == 1 && labels.size(0) == hidden.size(0) && labels.scalar_type() == at::kLong,
      what, ": expected int64 labels (", hidden.size(0), "), got ", labels.sizes(), " ",
      c10::toString(labels.scalar_type()));
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(), what,
              ": hidden and weight dtypes differ (", c10::toString(hidden.scalar_type()), " vs ",
              c10::toString(weight.scalar_type()), ")");
  TORCH_CHECK(chunk_tokens > 0, what, ": chunk_tokens must be > 0, got ", chunk_tokens);
}

}  // namespace

std::pair<at::Tensor, at::Tensor> chunked_cross_entropy_sum(const at::Tensor& hidden,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& labels,
                                                            int64_t chunk_tokens,
                                                            bool fused_kernels) {
  check_loss_args("chunked_cross_entropy_sum", hidden, weight, labels, chunk_tokens);
  at::Tensor count = labels.ne(kIgnoreIndex).sum();  // () int64
  at::Tensor sum = ChunkedCrossEntropy::apply(
      hidden, weight, labels, chunk_tokens, static_cast<const LossTerm*>(nullptr),
      static_cast<std::pair<at::Tensor, at::Tensor>*>(nullptr), fused_kernels);
  return {sum, count};
}

at::Tensor chunked_loss_with_term(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& labels, int64_t chunk_tokens,
                                  const LossTerm& term, at::Tensor* ce_sum, at::Tensor* term_sum,
                                  bool fused_kernels) {
  check_loss_args("chunked_loss_with_term", hidden, weight, labels, chunk_tokens);
  TORCH_CHECK(term.chunk, "chunked_loss_with_term: the term has no chunk function");
  TORCH_CHECK(term.weight >= 0.0 && term.weight <= 1.0,
              "chunked_loss_with_term: the term's weight must be in [0, 1], got ", term.weight);
  std::pair<at::Tensor, at::Tensor> parts;
  at::Tensor total = ChunkedCrossEntropy::apply(hidden, weight, labels, chunk_tokens, &term, &parts,
                                                fused_kernels);
  if (ce_sum != nullptr) *ce_sum = parts.first;
  if (term_sum != nullptr) *term_sum = parts.second;
  return total;
}

at::Tensor chunked_token_logprobs(const at::Tensor& hidden, const at::Tensor& weight,
                                  const at::Tensor& labels, int64_t chunk_tokens,
                                  double temperature) {
  check_loss_args("chunked_token_logprobs", hidden, weight, labels, chunk_tokens);
  TORCH_CHECK(std::isfinite(temperature) && temperature > 0,
              "chunked_token_logprobs: temperature must be finite and > 0, got ", temperature);
  if (labels.numel() > 0 && labels.is_cpu()) {  // no device sync for a check
    const auto lo = labels.min().item<int64_t>(), hi = labels.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < weight.size(0), "chunked_token_logprobs: labels must be in [0, ",
                weight.size(0), "), got [", lo, ", ", hi, "]");
  }
  return ChunkedTokenLogprobs::apply(hidden, weight, labels, chunk_tokens, temperature);
}

}  // namespace q4::model
