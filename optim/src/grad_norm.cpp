// Gradient norms: the global sum of squares (CPU chunks in the scratch arena; CUDA partial sums
// in a fixed order, docs/optim.md), global_grad_norm, gradient_sumsq_parts and clip_grad_norm_.
#include "grad_norm.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>

#include "cuda_launch.h"
#include "q4/optim/adamw.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "q4/quant/kernel_dtype.h"
#endif

namespace q4::optim {

namespace detail {

// Sum of squares of g in fp32 chunks of at most chunk_elems (CPU).
double sumsq_cpu(const at::Tensor& g, int64_t chunk_elems, Scratch& s) {
  const at::Tensor flat = g.reshape({-1});
  const int64_t n = flat.numel();
  double total = 0.0;
  for (int64_t start = 0; start < n; start += chunk_elems) {
    const int64_t len = std::min(chunk_elems, n - start);
    at::Tensor buf = s.get(kSlotGrad, at::kFloat, len);
    buf.copy_(flat.narrow(0, start, len));
    total += at::dot(buf, buf).item<double>();
  }
  return total;
}

#if Q4_WITH_CUDA
int cuda_dtype(at::ScalarType t) { return static_cast<int>(quant::cuda::dtype_of(t, "q4::optim")); }
#endif

double global_sumsq(const std::vector<at::Tensor>& grads, int64_t chunk_elems, Scratch& s,
                    const std::vector<at::Tensor>& parts) {
  TORCH_CHECK(parts.empty() || parts.size() == grads.size(), "q4::optim: ", parts.size(),
              " sumsq_parts for ", grads.size(), " gradients");
  double total = 0.0;
#if Q4_WITH_CUDA
  std::vector<const at::Tensor*> on_cuda;
  std::vector<const at::Tensor*> on_cuda_part;  // the precomputed row, or nullptr
#endif
  for (size_t k = 0; k < grads.size(); ++k) {
    const at::Tensor& g = grads[k];
    if (!g.defined() || g.numel() == 0) continue;
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf ||
                    g.scalar_type() == at::kBFloat16,
                "q4::optim: gradient dtype must be fp32, fp16 or bf16, got ", g.scalar_type());
    const bool has_part = !parts.empty() && parts[k].defined();
    if (g.is_cuda() || has_part) {
#if Q4_WITH_CUDA
      on_cuda.push_back(&g);
      on_cuda_part.push_back(has_part ? &parts[k] : nullptr);
      continue;
#else
      TORCH_CHECK(false, "q4::optim: CUDA gradient but q4_optim was built without CUDA");
#endif
    }
    TORCH_CHECK(!has_part, "q4::optim: sumsq_parts are for CUDA gradients only");
    total += sumsq_cpu(g, chunk_elems, s);
  }
#if Q4_WITH_CUDA
  if (!on_cuda.empty()) {
    // (P, kSumsqPartials) fp32 partial sums, summed in double in a fixed order.
    const at::Device dev = on_cuda_part.front() != nullptr ? on_cuda_part.front()->device()
                                                           : on_cuda.front()->device();
    at::Tensor partials = at::empty({static_cast<int64_t>(on_cuda.size()), cuda::kSumsqPartials},
                                    at::TensorOptions().device(dev).dtype(at::kFloat));
    // One multi-tensor launch per run of same-dtype gradients (a few hundred per-tensor launches
    // would each pay a launch and a memory-pipeline ramp): raw pointers, one guard and stream.
    // A precomputed row ends a run and is copied into its place.
    float* rows = partials.data_ptr<float>();
    c10::cuda::CUDAGuard guard(dev);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    std::vector<at::Tensor> keep;  // contiguous copies of non-contiguous gradients, if any
    std::vector<const void*> ptrs(on_cuda.size());
    std::vector<int64_t> ns(on_cuda.size());
    std::vector<int> dts(on_cuda.size());
    for (size_t i = 0; i < on_cuda.size(); ++i) {
      const at::Tensor& g = *on_cuda[i];
      const at::Device gdev = on_cuda_part[i] != nullptr ? on_cuda_part[i]->device() : g.device();
      TORCH_CHECK(gdev == dev, "q4::optim: gradients on several devices (", dev, " and ", gdev,
                  ")");
      if (on_cuda_part[i] != nullptr) {
        const at::Tensor& part = *on_cuda_part[i];
        TORCH_CHECK(part.device() == dev && part.scalar_type() == at::kFloat &&
                        part.numel() == cuda::kSumsqPartials,
                    "q4::optim: a sumsq_parts entry must be gradient_sumsq_parts of its gradient");
        partials[static_cast<int64_t>(i)].copy_(part.reshape({-1}), /*non_blocking=*/true);
        continue;
      }
      if (!g.is_contiguous()) keep.push_back(g.contiguous());
      ptrs[i] = g.is_contiguous() ? g.data_ptr() : keep.back().data_ptr();
      ns[i] = g.numel();
      dts[i] = cuda_dtype(g.scalar_type());
    }
    for (size_t i = 0; i < on_cuda.size();) {
      if (on_cuda_part[i] != nullptr) {
        ++i;
        continue;
      }
      size_t j = i + 1;
      while (j < on_cuda.size() && on_cuda_part[j] == nullptr && dts[j] == dts[i]) ++j;
      cuda::launch_sumsq_many(ptrs.data() + i, ns.data() + i, static_cast<int>(j - i), dts[i],
                              rows + static_cast<int64_t>(i) * cuda::kSumsqPartials, stream);
      i = j;
    }
    total += partials.to(at::kDouble).sum().item<double>();
  }
#endif
  return total;
}

}  // namespace detail

double global_grad_norm(const std::vector<at::Tensor>& grads, int64_t chunk_elems) {
  TORCH_CHECK(chunk_elems >= 1, "global_grad_norm: chunk_elems must be >= 1, got ", chunk_elems);
  c10::NoGradGuard no_grad;
  detail::Scratch s;
  return std::sqrt(detail::global_sumsq(grads, chunk_elems, s, {}));
}

at::Tensor gradient_sumsq_parts(const at::Tensor& grad) {
  TORCH_CHECK(grad.defined() && grad.is_cuda() && grad.is_contiguous() &&
                  (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                   grad.scalar_type() == at::kBFloat16),
              "gradient_sumsq_parts: expected a contiguous fp32/fp16/bf16 CUDA tensor");
#if Q4_WITH_CUDA
  const c10::cuda::CUDAGuard guard(grad.device());
  at::Tensor row = at::empty({cuda::kSumsqPartials}, grad.options().dtype(at::kFloat));
  const void* ptr = grad.data_ptr();
  const int64_t n = grad.numel();
  cuda::launch_sumsq_many(&ptr, &n, 1, detail::cuda_dtype(grad.scalar_type()),
                          row.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
  return row;
#else
  TORCH_CHECK(false, "gradient_sumsq_parts: q4_optim was built without CUDA");
  return {};
#endif
}

double clip_grad_norm_(const std::vector<at::Tensor>& grads, double max_norm) {
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0.0,
              "clip_grad_norm_: max_norm must be a finite value > 0, got ", max_norm);
  c10::NoGradGuard no_grad;
  const double norm = global_grad_norm(grads);
  if (!std::isfinite(norm)) return norm;
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (const at::Tensor& g : grads) {
      if (g.defined()) const_cast<at::Tensor&>(g).mul_(coef);
    }
  }
  return norm;
}

}  // namespace q4::optim
