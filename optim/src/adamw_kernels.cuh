// Internal header of the optimizer's CUDA kernels (the adamw_*.cu files; the host launchers
// they implement are declared in cuda_launch.h). Fused CUDA AdamW step: one kernel per moment
// mode reads gradient, master and the (packed) moments once and writes master and moments once.
// Block-wise modes give each moment block to a group of lanes, each lane owning E consecutive
// elements (int8: 32 lanes x 8, 4-bit: 16 x 8, NVFP4: 4 x 4), so whole groups use 8/16-byte
// vector loads and stores: decode, update, group absmax by shuffles, re-quantize, write. Kernels
// are persistent (grid-stride over groups; the code maps are staged in shared memory once per
// CTA). Arithmetic is the CPU path's, op for op, with explicit round-to-nearest intrinsics (no
// FMA contraction), so results are bit-identical -- when StepParams::exact is set. By default the
// int8/4-bit kernels fuse multiply-adds with host-folded constants and use the hardware square
// root and reciprocal (fewer instructions: these kernels are issue-bound), everything else
// (codes, randomness, rounding rules) unchanged.
//
// Files: adamw_launch.cu (the public step launchers), adamw_fp32_kernel.cu (fp32 moments),
// adamw_block_kernels.cu (packed moments: code tables, block codecs, fused step, standalone
// codec), adamw_norm_kernels.cu (sum of squares, non-finite flag). Everything here is inline or
// a template, so each file compiles alone (no separable compilation).
#pragma once

#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda_launch.h"
#include "optim_math.h"
#include "q4/quant/cuda_common.h"

namespace q4::optim::cuda::impl {

using detail::CodeMap;
using detail::MapId;
using quant::cuda::aligned16;
using quant::cuda::check_cuda;
using quant::cuda::dispatch_dtype;
using quant::cuda::DType;
using quant::cuda::group_max;
using quant::cuda::load_vec;
using quant::cuda::sm_count;
using quant::cuda::store_vec;
using quant::cuda::to_float;
using quant::cuda::Vec;
using quant::cuda::warp_sum;

// Master write-back (docs/optim.md): saturate at the largest finite value, then round to nearest,
// or stochastically with the element's bits h = sr_bits(key, index) (detail::sr_round_fp16/bf16:
// for bf16 and fp16 from 2^-14 up an integer add and mask on the fp32 bits; the result is exact
// in the target, so the conversion below does not round).
template <typename M>
__device__ __forceinline__ M write_master(float x, bool stochastic, uint32_t h) {
  if constexpr (std::is_same<M, float>::value) {
    return x;
  } else if constexpr (std::is_same<M, __half>::value) {
    x = fminf(fmaxf(x, -65504.0f), 65504.0f);
    return __float2half_rn(stochastic ? detail::sr_round_fp16(x, h) : x);
  } else {
    x = fminf(fmaxf(x, -3.3895313892515355e38f), 3.3895313892515355e38f);
    if (!stochastic) return __float2bfloat16_rn(x);
    return __ushort_as_bfloat16(
        static_cast<unsigned short>(__float_as_uint(detail::sr_round_bf16(x, h)) >> 16));
  }
}

// kExact: the CPU path's operations, one rounding each. Otherwise (the block kernels' default,
// AdamWOptions::cuda_exact_arithmetic off) fused multiply-adds, so the same formulas in fewer
// instructions, a few fp32 ulp from the exact results.
template <bool kExact = true>
__device__ __forceinline__ void adam_moments(float g, float& m, float& v, const StepParams& p) {
  if (kExact) {
    m = __fadd_rn(__fmul_rn(m, p.beta1), __fmul_rn(g, p.one_minus_beta1));
    v = __fadd_rn(__fmul_rn(v, p.beta2), __fmul_rn(__fmul_rn(g, g), p.one_minus_beta2));
  } else {
    m = __fmaf_rn(m, p.beta1, __fmul_rn(g, p.one_minus_beta1));
    v = __fmaf_rn(v, p.beta2, __fmul_rn(__fmul_rn(g, g), p.one_minus_beta2));
  }
}

// Hardware approximations (MUFU, ~1 ulp), flushing subnormal inputs and results to zero (the
// non-flushing forms cost three more instructions each for the rescaling).
__device__ __forceinline__ float fast_sqrt(float x) {
  float r;
  asm("sqrt.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}
__device__ __forceinline__ float fast_rcp(float x) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

// sqrt(v): correctly rounded (kExact), else the hardware approximation (a subnormal v, below
// 1.2e-38, gives 0: the update then divides by eps, as for v = 0).
template <bool kExact>
__device__ __forceinline__ float adam_sqrt(float v) {
  if (kExact) return __fsqrt_rn(v);
  return fast_sqrt(v);
}

// sv = adam_sqrt(v). The fast variant multiplies by the hardware reciprocal of
// den / step_size (~1 ulp; eps / step_size is a normal number, so nothing is flushed; with a
// zero step size den is huge and its flushed reciprocal 0: no update).
template <bool kExact = true>
__device__ __forceinline__ float adam_master_sv(float w, float m, float sv, const StepParams& p) {
  if (kExact) {
    const float den = __fadd_rn(__fmul_rn(sv, p.inv_sqrt_bc2), p.eps);
    const float u = __fmul_rn(__fdiv_rn(m, den), p.step_size);
    return __fsub_rn(__fmul_rn(w, p.decay), u);
  }
  // den / step_size (StepParams fast_den_a/b): the step size folded in, one multiply fewer.
  const float den = __fmaf_rn(sv, p.fast_den_a, p.fast_den_b);
  return __fmaf_rn(-m, fast_rcp(den), __fmul_rn(w, p.decay));
}

__device__ __forceinline__ float adam_master(float w, float m, float v, const StepParams& p) {
  const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), p.inv_sqrt_bc2), p.eps);
  const float u = __fmul_rn(__fdiv_rn(m, den), p.step_size);
  return __fsub_rn(__fmul_rn(w, p.decay), u);
}

inline constexpr int kThreads = 256;  // threads per CTA of every kernel here

// ---- vector access (Vec, load_vec, store_vec: q4/quant/cuda_common.h) ----
// Loads elements [i0, i0 + E) as fp32: vector access when `vec`, else element by element with
// the ones at or past n set to 0.
template <typename T, int E>
__device__ __forceinline__ void load_f32(const T* ptr, int64_t i0, int64_t n, bool vec,
                                         float (&out)[E]) {
  if (vec) {
    T raw[E];
    load_vec<T, E>(ptr + i0, raw);
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = to_float(raw[e]);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = i0 + e < n ? to_float(ptr[i0 + e]) : 0.0f;
  }
}

// dispatch_dtype for the int dtype codes of StepParams and the sumsq launchers; a code that is
// none of the three throws ("bad <what>").
template <typename Fn>
void dispatch_code(int dtype, const char* what, Fn&& fn) {
  const bool known = dispatch_dtype(static_cast<DType>(dtype), false, [&](auto tag) {
    fn(tag);
    return true;
  });
  if (!known) throw std::runtime_error(std::string("q4::optim CUDA: bad ") + what);
}

// fn(G{}, M{}) with the gradient's and the master's element types (the gradient's dtype is
// checked first).
template <typename Fn>
void dispatch_step_dtypes(const StepParams& p, Fn&& fn) {
  dispatch_code(p.grad_dtype, "grad dtype", [&](auto grad) {
    dispatch_code(p.master_dtype, "master dtype", [&](auto master) { fn(grad, master); });
  });
}

// ---- entry points between the kernel files ----
// Copies the code tables of the block kernels to the current device once
// (adamw_block_kernels.cu: constant memory belongs to the file whose kernels read it).
void ensure_tables();
// One tensor's update with fp32 moments (mode 0; adamw_fp32_kernel.cu).
void launch_fp32_step(const StepParams& p, cudaStream_t s);
// One tensor's update with packed moments (modes 1-3; adamw_block_kernels.cu).
void launch_block_step(const StepParams& p, cudaStream_t s);
// `count` (<= kStepBatch) tensors of one kind (same_block_kind) with packed moments in one launch.
void launch_block_steps(const StepParams* ps, int count, cudaStream_t s);

}  // namespace q4::optim::cuda::impl
