// The fused distillation loss (q4/model/fused_divergence.h): checks and the launches of
// divergence_kernels.cu. Without CUDA nothing applies.
#include "q4/model/fused_divergence.h"

#include <ATen/ATen.h>

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "divergence_kernels.h"
#include "q4/quant/kernel_dtype.h"
#endif

namespace q4::model {

#if Q4_WITH_CUDA
namespace {

using quant::cuda::check_cuda;
using quant::cuda::dtype_of;

void check_rows(const char* what, const at::Tensor& logits, const at::Tensor& labels,
                const at::Tensor& other, int64_t other_cols, double temperature, double weight) {
  TORCH_CHECK(fused_distill_applies(logits, labels), what,
              ": expected contiguous CUDA logits (n, V) and int64 labels (n), got ", logits.sizes(),
              " and ", labels.sizes());
  TORCH_CHECK(other.dim() == 2 && other.size(0) == logits.size(0) && other.size(1) == other_cols &&
                  other.device() == logits.device(),
              what, ": expected (", logits.size(0), ", ", other_cols, ") on ", logits.device(),
              ", got ", other.sizes(), " on ", other.device());
  TORCH_CHECK(temperature > 0 && weight >= 0 && weight <= 1, what,
              ": expected temperature > 0 and weight in [0, 1], got ", temperature, " and ",
              weight);
}

LossRows empty_rows(const at::Tensor& logits) {
  const auto f32 = logits.options().dtype(at::kFloat);
  return {at::empty({logits.size(0)}, f32), at::empty({logits.size(0)}, f32)};
}

}  // namespace
#endif

bool fused_distill_applies(const at::Tensor& logits, const at::Tensor& labels) {
#if Q4_WITH_CUDA
  const auto t = logits.scalar_type();
  return logits.is_cuda() && logits.dim() == 2 && logits.is_contiguous() &&
         (t == at::kFloat || t == at::kHalf || t == at::kBFloat16) && labels.dim() == 1 &&
         labels.device() == logits.device() && labels.scalar_type() == at::kLong &&
         labels.is_contiguous() && labels.size(0) == logits.size(0);
#else
  (void)logits;
  (void)labels;
  return false;
#endif
}

LossRows fused_distill_xent_(at::Tensor& logits, const at::Tensor& labels,
                             const at::Tensor& teacher_logits, bool reverse, double temperature,
                             double weight, bool want_grad) {
#if Q4_WITH_CUDA
  check_rows("fused_distill_xent_", logits, labels, teacher_logits, logits.size(1), temperature,
             weight);
  const at::Tensor teacher = teacher_logits.to(logits.scalar_type()).contiguous();
  c10::cuda::CUDAGuard guard(logits.device());
  LossRows out = empty_rows(logits);
  check_cuda(cuda::launch_distill_xent(logits.data_ptr(), teacher.data_ptr(),
                                       labels.data_ptr<int64_t>(), out.ce.data_ptr<float>(),
                                       out.term.data_ptr<float>(), logits.size(0), logits.size(1),
                                       reverse, temperature, weight, want_grad,
                                       dtype_of(logits.scalar_type(), "fused distillation loss"),
                                       at::cuda::getCurrentCUDAStream()),
             "fused distillation loss");
  return out;
#else
  (void)logits, (void)labels, (void)teacher_logits, (void)reverse, (void)temperature;
  (void)weight, (void)want_grad;
  TORCH_INTERNAL_ASSERT(false, "fused_distill_xent_ without CUDA");
  return {};
#endif
}

bool fused_topk_distill_applies(const at::Tensor& logits, const at::Tensor& labels,
                                const at::Tensor& ids) {
#if Q4_WITH_CUDA
  return fused_distill_applies(logits, labels) && ids.dim() == 2 && ids.size(0) == logits.size(0) &&
         ids.size(1) >= 1 && ids.size(1) <= logits.size(1) &&
         cuda::topk_distill_smem_bytes(logits.size(1), ids.size(1)) <= cuda::kTopkSmemLimit;
#else
  (void)logits, (void)labels, (void)ids;
  return false;
#endif
}

LossRows fused_topk_distill_xent_(at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& ids, const at::Tensor& logprobs,
                                  double temperature, double weight, bool want_grad) {
#if Q4_WITH_CUDA
  const char* what = "fused_topk_distill_xent_";
  TORCH_CHECK(fused_topk_distill_applies(logits, labels, ids), what,
              ": expected contiguous CUDA logits (n, V), int64 labels (n) and ids (n, K) with K "
              "<= V within the kernel's shared memory, got ",
              logits.sizes(), ", ", labels.sizes(), " and ", ids.sizes());
  check_rows(what, logits, labels, logprobs, ids.size(1), temperature, weight);
  const at::Tensor id = ids.to(at::kLong).contiguous();
  const at::Tensor lq = logprobs.to(at::kFloat).contiguous();
  TORCH_CHECK(id.device() == logits.device(), what, ": ids on ", id.device(), ", logits on ",
              logits.device());
  c10::cuda::CUDAGuard guard(logits.device());
  LossRows out = empty_rows(logits);
  check_cuda(cuda::launch_topk_distill_xent(
                 logits.data_ptr(), id.data_ptr<int64_t>(), lq.data_ptr<float>(),
                 labels.data_ptr<int64_t>(), out.ce.data_ptr<float>(), out.term.data_ptr<float>(),
                 logits.size(0), logits.size(1), id.size(1), temperature, weight, want_grad,
                 dtype_of(logits.scalar_type(), "fused top-K distillation loss"),
                 at::cuda::getCurrentCUDAStream()),
             "fused top-K distillation loss");
  return out;
#else
  (void)logits, (void)labels, (void)ids, (void)logprobs, (void)temperature, (void)weight;
  (void)want_grad;
  TORCH_INTERNAL_ASSERT(false, "fused_topk_distill_xent_ without CUDA");
  return {};
#endif
}

}  // namespace q4::model
