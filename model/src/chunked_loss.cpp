// Token-chunked cross-entropy through the lm_head: forward computes fp32 logits for
// `chunk_tokens` rows at a time (matmul in the weight's dtype, then upcast, as HF does) and keeps
// only the running sum; backward recomputes each chunk's logits, turns them into
// softmax - onehot in place and accumulates the hidden and weight gradients. At most one
// (chunk, V) fp32 block exists at any time, in forward and in backward.
#include <torch/csrc/autograd/custom_function.h>

#include "q4/model/qwen3.h"

namespace q4::model {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kIgnoreIndex = -100;

// Row-wise over an fp32 (n, V) block without a second block: x <- exp(x - max) and the
// log-sum-exp per row (max + log(sum)). The block is the largest temporary of a step.
at::Tensor in_place_logsumexp(at::Tensor& x) {
  const at::Tensor mx = std::get<0>(x.max(1, /*keepdim=*/true));  // (n, 1)
  x.sub_(mx).exp_();
  return x.sum(1).log_().add_(mx.squeeze(1));
}

// x <- softmax(x) row-wise, in place (as above, then divided by the row sums).
void in_place_softmax(at::Tensor& x) {
  const at::Tensor mx = std::get<0>(x.max(1, /*keepdim=*/true));
  x.sub_(mx).exp_();
  x.div_(x.sum(1, /*keepdim=*/true));
}

struct ChunkedCrossEntropy : public torch::autograd::Function<ChunkedCrossEntropy> {
  // hidden (N, H), weight (V, H), labels (N) int64 -> () fp32 sum of per-row CE.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden,
                            const at::Tensor& weight, const at::Tensor& labels, int64_t chunk) {
    ctx->save_for_backward({hidden, weight, labels});
    ctx->saved_data["chunk"] = chunk;
    ctx->saved_data["hidden_grad"] = hidden.requires_grad();
    ctx->saved_data["weight_grad"] = weight.requires_grad();
    const int64_t N = hidden.size(0);
    at::Tensor total = at::zeros({}, hidden.options().dtype(at::kFloat));
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      at::Tensor y = labels.narrow(0, s, n);
      at::Tensor valid = y.ne(kIgnoreIndex);
      at::Tensor logits = at::matmul(hidden.narrow(0, s, n), weight.t()).to(at::kFloat);  // (n,V)
      at::Tensor picked = logits.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1);       // (n)
      // logsumexp in place on the one fp32 block (at::logsumexp would allocate a second one).
      at::Tensor lse = in_place_logsumexp(logits);  // (n); logits now holds exp(x - max)
      total.add_(((lse - picked) * valid.to(at::kFloat)).sum());
    }
    return total;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const at::Tensor& hidden = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor& labels = saved[2];
    const int64_t chunk = ctx->saved_data["chunk"].toInt();
    const bool want_h = ctx->saved_data["hidden_grad"].toBool();
    const bool want_w = ctx->saved_data["weight_grad"].toBool();
    at::Tensor go = grads[0].to(at::kFloat);  // () upstream gradient of the sum
    const int64_t N = hidden.size(0);
    at::Tensor grad_h = want_h ? at::empty_like(hidden) : at::Tensor();
    at::Tensor grad_w;
    for (int64_t s = 0; s < N; s += chunk) {
      const int64_t n = std::min(chunk, N - s);
      at::Tensor h = hidden.narrow(0, s, n);
      at::Tensor y = labels.narrow(0, s, n);
      at::Tensor valid = y.ne(kIgnoreIndex);
      at::Tensor p = at::matmul(h, weight.t()).to(at::kFloat);  // (n, V) logits
      in_place_softmax(p);
      // d(lse - picked)/dlogits = softmax - onehot(label); rows without a label get 0.
      p.scatter_add_(1, y.clamp_min(0).unsqueeze(1), at::full({n, 1}, -1.0, p.options()));
      p.mul_((valid.to(at::kFloat) * go).unsqueeze(1));
      at::Tensor pc = p.to(hidden.scalar_type());
      if (want_h) grad_h.narrow(0, s, n).copy_(at::matmul(pc, weight));
      if (want_w) {
        if (!grad_w.defined()) {
          grad_w = at::matmul(pc.t(), h);  // (V, H)
        } else {
          grad_w.addmm_(pc.t(), h);
        }
      }
    }
    return {grad_h, grad_w, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

std::pair<at::Tensor, at::Tensor> chunked_cross_entropy_sum(const at::Tensor& hidden,
                                                            const at::Tensor& weight,
                                                            const at::Tensor& labels,
                                                            int64_t chunk_tokens) {
  TORCH_CHECK(hidden.dim() == 2 && weight.dim() == 2 && hidden.size(1) == weight.size(1),
              "chunked_cross_entropy_sum: expected hidden (N, H) and weight (V, H), got ",
              hidden.sizes(), " and ", weight.sizes());
  TORCH_CHECK(
      labels.dim() == 1 && labels.size(0) == hidden.size(0) && labels.scalar_type() == at::kLong,
      "chunked_cross_entropy_sum: expected int64 labels (", hidden.size(0), "), got ",
      labels.sizes(), " ", c10::toString(labels.scalar_type()));
  TORCH_CHECK(hidden.scalar_type() == weight.scalar_type(),
              "chunked_cross_entropy_sum: hidden and weight dtypes differ (",
              c10::toString(hidden.scalar_type()), " vs ", c10::toString(weight.scalar_type()),
              ")");
  TORCH_CHECK(chunk_tokens > 0, "chunked_cross_entropy_sum: chunk_tokens must be > 0, got ",
              chunk_tokens);
  at::Tensor count = labels.ne(kIgnoreIndex).sum();  // () int64
  at::Tensor sum = ChunkedCrossEntropy::apply(hidden, weight, labels, chunk_tokens);
  return {sum, count};
}

}  // namespace q4::model
