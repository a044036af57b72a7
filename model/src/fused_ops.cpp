// Autograd wrappers of the fused CUDA layer kernels (qwen3_kernels.cu): RMSNorm and
// rotate-half RoPE, forward and backward in one kernel each instead of ATen's chains of
// elementwise ops (RMSNorm: ~8 kernels forward, more backward, over fp32 copies). Used by
// rms_norm() and apply_rope_bthd() on CUDA when the layout allows; the ATen versions in
// qwen3_ops.cpp stay the reference (tests/model/cuda compares them).
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "qwen3_impl.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "q4/quant/kernel_dtype.h"
#include "qwen3_kernels.h"
#endif

namespace q4::model {

#if Q4_WITH_CUDA
namespace {

using quant::cuda::check_cuda;
using quant::cuda::dtype_of;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w,
                            double eps) {
    const int64_t n = x.size(-1);
    const int64_t rows = x.numel() / n;
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor y = at::empty_like(x);
    at::Tensor rstd = at::empty({rows}, x.options().dtype(at::kFloat));
    check_cuda(cuda::launch_rms_norm_fwd(x.data_ptr(), w.data_ptr(), y.data_ptr(),
                                         rstd.data_ptr<float>(), rows, n, static_cast<float>(eps),
                                         dtype_of(x.scalar_type(), "fused op"),
                                         at::cuda::getCurrentCUDAStream()),
               "rms_norm forward");
    ctx->save_for_backward({x, w, rstd});
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& rstd = saved[2];
    at::Tensor dy = grads[0].contiguous();
    if (!aligned16(dy)) dy = dy.clone();
    const int64_t n = x.size(-1);
    const int64_t rows = x.numel() / n;
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor dx = at::empty_like(x);
    const bool want_dw = ctx->needs_input_grad(1);
    at::Tensor partial;
    if (want_dw) {
      partial = at::empty({cuda::rms_norm_bwd_blocks(rows), n}, x.options().dtype(at::kFloat));
    }
    check_cuda(cuda::launch_rms_norm_bwd(
                   dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr<float>(), dx.data_ptr(),
                   want_dw ? partial.data_ptr<float>() : nullptr, rows, n,
                   dtype_of(x.scalar_type(), "fused op"), at::cuda::getCurrentCUDAStream()),
               "rms_norm backward");
    at::Tensor dw = want_dw ? partial.sum(0).to(w.scalar_type()) : at::Tensor();
    return {dx, dw, at::Tensor()};
  }
};

struct RopeFn : public torch::autograd::Function<RopeFn> {
  // x (tokens, heads, d) contiguous; cos/sin (tokens, d) contiguous, same dtype.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& sin) {
    ctx->save_for_backward({cos, sin});
    return run(x, cos, sin, /*backward=*/false);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    return {run(grads[0].contiguous(), saved[0], saved[1], /*backward=*/true), at::Tensor(),
            at::Tensor()};
  }
  static at::Tensor run(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        bool backward) {
    c10::cuda::CUDAGuard guard(x.device());
    at::Tensor y = at::empty_like(x);
    check_cuda(
        cuda::launch_rope(x.data_ptr(), cos.data_ptr(), sin.data_ptr(), y.data_ptr(), x.size(0),
                          x.size(1), x.size(2), backward, dtype_of(x.scalar_type(), "fused op"),
                          at::cuda::getCurrentCUDAStream()),
        "rope");
    return y;
  }
};

struct SwigluFn : public torch::autograd::Function<SwigluFn> {
  // g, u same shape, contiguous, 16-byte aligned -> silu(g) * u.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    c10::cuda::CUDAGuard guard(g.device());
    at::Tensor h = at::empty_like(g);
    check_cuda(cuda::launch_swiglu_fwd(g.data_ptr(), u.data_ptr(), h.data_ptr(), g.numel(),
                                       dtype_of(g.scalar_type(), "fused op"),
                                       at::cuda::getCurrentCUDAStream()),
               "swiglu forward");
    ctx->save_for_backward({g, u});
    return h;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& g = saved[0];
    const at::Tensor& u = saved[1];
    at::Tensor dh = grads[0].contiguous();
    if (!aligned16(dh)) dh = dh.clone();
    c10::cuda::CUDAGuard guard(g.device());
    at::Tensor dg = at::empty_like(g), du = at::empty_like(u);
    check_cuda(
        cuda::launch_swiglu_bwd(dh.data_ptr(), g.data_ptr(), u.data_ptr(), dg.data_ptr(),
                                du.data_ptr(), g.numel(), dtype_of(g.scalar_type(), "fused op"),
                                at::cuda::getCurrentCUDAStream()),
        "swiglu backward");
    return {dg, du};
  }
};

bool float_kind(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

}  // namespace

bool fused_rms_norm_applies(const at::Tensor& x, const at::Tensor& w) {
  if (!x.is_cuda() || !w.is_cuda() || x.scalar_type() != w.scalar_type() ||
      !float_kind(x.scalar_type()) || !x.is_contiguous() || !w.is_contiguous() || x.dim() < 1) {
    return false;
  }
  const int64_t n = x.size(-1);
  const int64_t vec = 16 / static_cast<int64_t>(x.element_size());
  return n > 0 && n % vec == 0 && w.numel() == n && aligned16(x) && aligned16(w) &&
         n * 4 * 8 <= 200 * 1024;  // the backward's shared weight-gradient slices
}

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  return RmsNormFn::apply(x, w, eps);
}

bool fused_rope_applies(const at::Tensor& x, const at::Tensor& cos) {
  return x.is_cuda() && x.dim() == 3 && cos.dim() == 2 && x.is_contiguous() &&
         cos.is_contiguous() && x.scalar_type() == cos.scalar_type() &&
         float_kind(x.scalar_type()) && cos.size(0) == x.size(0) && cos.size(1) == x.size(2) &&
         x.size(2) % 2 == 0;
}

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return RopeFn::apply(x, cos, sin.contiguous());
}

bool fused_xent_applies(const at::Tensor& logits, const at::Tensor& labels) {
  return logits.is_cuda() && labels.is_cuda() && logits.dim() == 2 && logits.is_contiguous() &&
         float_kind(logits.scalar_type()) && labels.scalar_type() == at::kLong &&
         labels.is_contiguous() && labels.numel() == logits.size(0);
}

at::Tensor fused_softmax_xent_(at::Tensor& logits, const at::Tensor& labels, bool want_grad) {
  c10::cuda::CUDAGuard guard(logits.device());
  at::Tensor loss_rows = at::empty({logits.size(0)}, logits.options().dtype(at::kFloat));
  check_cuda(cuda::launch_softmax_xent(logits.data_ptr(), labels.data_ptr<int64_t>(),
                                       loss_rows.data_ptr<float>(), logits.size(0), logits.size(1),
                                       want_grad, dtype_of(logits.scalar_type(), "fused op"),
                                       at::cuda::getCurrentCUDAStream()),
             "softmax cross-entropy");
  return loss_rows;
}
#else  // no CUDA: no fused op applies, and none is called

bool fused_rms_norm_applies(const at::Tensor&, const at::Tensor&) { return false; }

at::Tensor fused_rms_norm(const at::Tensor& x, const at::Tensor&, double) {
  TORCH_INTERNAL_ASSERT(false, "fused_rms_norm without CUDA");
  return x;
}

bool fused_rope_applies(const at::Tensor&, const at::Tensor&) { return false; }

at::Tensor fused_rope(const at::Tensor& x, const at::Tensor&, const at::Tensor&) {
  TORCH_INTERNAL_ASSERT(false, "fused_rope without CUDA");
  return x;
}

bool fused_xent_applies(const at::Tensor&, const at::Tensor&) { return false; }

at::Tensor fused_softmax_xent_(at::Tensor& logits, const at::Tensor&, bool) {
  TORCH_INTERNAL_ASSERT(false, "fused_softmax_xent_ without CUDA");
  return logits;
}
#endif

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u, bool fused) {
#if Q4_WITH_CUDA
  if (fused && g.is_cuda() && u.is_cuda() && g.scalar_type() == u.scalar_type() &&
      float_kind(g.scalar_type()) && g.sizes() == u.sizes() && g.is_contiguous() &&
      u.is_contiguous() && aligned16(g) && aligned16(u)) {
    return SwigluFn::apply(g, u);
  }
#else
  (void)fused;
#endif
  return at::silu(g) * u;
}

}  // namespace q4::model
