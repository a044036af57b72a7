// Host launchers of the optimizer's CUDA kernels (adamw_*.cu, adamw_kernels.cuh). Raw pointers,
// sizes and a stream only: no torch types, so the .cu files include no torch headers. The .cpp
// callers validate dtypes, devices and sizes; each launcher checks the launch with check_cuda
// (q4/quant/cuda_common.h), which throws std::runtime_error with the CUDA error string.
#pragma once

#include <cstdint>

#if Q4_WITH_CUDA || defined(__CUDACC__)
#include <cuda_runtime_api.h>

#include "q4/quant/cuda_common.h"

namespace q4::optim::cuda {

// Dtype codes of StepParams and the sumsq launchers: the values of quant::cuda::DType.
inline constexpr int kDtF32 = static_cast<int>(quant::cuda::DType::kF32);
inline constexpr int kDtF16 = static_cast<int>(quant::cuda::DType::kF16);
inline constexpr int kDtBF16 = static_cast<int>(quant::cuda::DType::kBF16);
// Mode numbering = StateMode order: 0 fp32, 1 int8, 2 4-bit, 3 NVFP4. Moment: 0 first, 1 second.

struct StepParams {
  const void* grad = nullptr;  // (n) grad_dtype; null: zero gradient
  int grad_dtype = kDtF32;
  void* master = nullptr;  // (n) master_dtype, updated in place
  int master_dtype = kDtF16;
  int64_t n = 0;
  int mode = 0;
  float* m32 = nullptr;  // (n) fp32 moments (mode 0)
  float* v32 = nullptr;
  uint8_t* m_codes = nullptr;  // packed moments (modes 1-3), layout of state_codec.h
  uint8_t* v_codes = nullptr;
  void* m_scales = nullptr;  // fp32 absmax (modes 1, 2) or uint8 E4M3 (mode 3)
  void* v_scales = nullptr;
  float grad_scale = 1.0f;  // fp32 constants, rounded once on the host (same as the CPU path)
  float beta1 = 0.9f;
  float one_minus_beta1 = 0.1f;
  float beta2 = 0.999f;
  float one_minus_beta2 = 0.001f;
  float inv_sqrt_bc2 = 1.0f;  // 1 / sqrt(1 - beta2^t)
  float eps = 1e-8f;
  float step_size = 0.0f;  // lr / (1 - beta1^t)
  float decay = 1.0f;      // 1 - lr * weight_decay (1: none)
  int stochastic = 0;      // 1: stochastic rounding of fp16/bf16 masters
  uint32_t sr_key = 0;     // master rounding stream; stochastic moment codes derive from it
  int vec_ok = 0;  // set by launch_adamw_step: all pointers 16-byte aligned (vector accesses)
  // In-backward steps: device flag set by launch_nonfinite_flag; nonzero = leave master and
  // moments untouched (the kernel returns at once). Null: always update.
  const int32_t* skip = nullptr;
  // 1: int8/4-bit kernels use the CPU path's arithmetic op for op (bit-identical); 0: FMA and
  // the hardware square root / division (AdamWOptions::cuda_exact_arithmetic).
  int exact = 0;
  // Constants of the fast kernels (exact == 0), rounded once on the host: the gradient scale
  // folded into the moment updates, m = m*beta1 + g*fast_c1 and v = v*beta2 + (g*fast_c2)*g
  // (fast_c1 = grad_scale*(1-beta1), fast_c2 = grad_scale^2*(1-beta2)), and the step size into
  // the denominator, w = w*decay - m / (sqrt(v)*fast_den_a + fast_den_b) (fast_den_a =
  // inv_sqrt_bc2/step_size, fast_den_b = eps/step_size; FLT_MAX both when step_size is 0).
  float fast_c1 = 0.1f;
  float fast_c2 = 0.001f;
  float fast_den_a = 0.0f;
  float fast_den_b = 0.0f;
};

void launch_adamw_step(const StepParams& p, cudaStream_t stream);
// The same update for `count` tensors with packed moments (modes 1-3), in as few launches as
// possible: consecutive tensors of one kind (mode, exact, stochastic, dtypes) go kStepBatch to a
// launch, each bit-identical to its own launch_adamw_step.
inline constexpr int kStepBatch = 16;
void launch_adamw_steps(const StepParams* ps, int count, cudaStream_t stream);

// Sum of squares of g (n elements, dtype) in fp32: writes kSumsqPartials fp32 partial sums (each
// a fixed-order reduction), so the result does not depend on scheduling.
inline constexpr int kSumsqPartials = 1024;
void launch_sumsq(const void* g, int dtype, int64_t n, float* partials, cudaStream_t stream);
// The same for `count` tensors of one dtype in as few launches as possible: tensor k's partials
// go to row k (partials + k * kSumsqPartials), bit-identical to launch_sumsq of that tensor.
void launch_sumsq_many(const void* const* ptrs, const int64_t* ns, int count, int dtype,
                       float* partials, cudaStream_t stream);
// *flag = 1 if the sum of the n partials is not finite (NaN/Inf in the gradient), else 0.
void launch_nonfinite_flag(const float* partials, int n, int32_t* flag, cudaStream_t stream);

// Standalone codec (tests, diagnostics): same device code as the fused step.
void launch_pack_moment(const float* x, int64_t n, int mode, int moment, uint32_t sr_key,
                        uint8_t* codes, void* scales, cudaStream_t stream);
void launch_unpack_moment(const uint8_t* codes, const void* scales, int64_t n, int mode, int moment,
                          float* x, cudaStream_t stream);

}  // namespace q4::optim::cuda
#endif
