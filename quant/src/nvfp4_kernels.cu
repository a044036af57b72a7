// CUDA kernels of the NVFP4 codec: quantize, dequantize and the fused fake-quant used by every
// trained linear's forward. A group of lanes owns one 16-element block (4 lanes x 4 fp32, or
// 2 lanes x 8 fp16/bf16: one 16-byte load each), reduces amax with shuffles and applies the exact
// fp32 numerics (docs/design.md#nvfp4-arithmetic) with explicitly rounded ops (__fdiv_rn,
// __fadd_rn, __fmul_rn), so the results are bit-identical to the CPU path and the scalar
// reference. 4-over-6 (kFour: a template flag, so the max6 kernels are unchanged) sums each
// candidate scale's fp64 squared errors in the shared pairwise order. No torch headers here.
#include <cuda_runtime.h>

#include <cstdint>

#include "nvfp4_cuda.h"
#include "q4/quant/cuda_common.h"
#include "q4/quant/numerics.h"

namespace q4::quant::cuda {
namespace {

constexpr int kThreadsPerCta = 256;
constexpr int kBlock = 16;  // NVFP4 block size (elements sharing one scale)

// Elements per lane (one 16-byte vector) and lanes per 16-element block.
template <typename T>
struct Layout {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLanes = kBlock / kVec;
};

// One lane's kVec elements as fp32: one 16-byte load when kAligned, else element by element.
template <typename T, bool kAligned>
__device__ __forceinline__ void load_lane(const T* __restrict__ p, float (&v)[Layout<T>::kVec]) {
  if constexpr (kAligned) {
    Pack<T> w;
    w.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < Pack<T>::kVec; ++i) v[i] = to_float(w.get(i));
  } else {
#pragma unroll
    for (int i = 0; i < Layout<T>::kVec; ++i) v[i] = to_float(p[i]);
  }
}

template <typename T, bool kAligned>
__device__ __forceinline__ void store_lane(T* __restrict__ p, const float (&v)[Layout<T>::kVec]) {
  if constexpr (kAligned) {
    Pack<T> w;
#pragma unroll
    for (int i = 0; i < Pack<T>::kVec; ++i) w.set(i, from_float<T>(v[i]));
    *reinterpret_cast<uint4*>(p) = w.raw;
  } else {
#pragma unroll
    for (int i = 0; i < Layout<T>::kVec; ++i) p[i] = from_float<T>(v[i]);
  }
}

// Element codecs: the shared definitions (q4/quant/numerics.h).
__device__ __forceinline__ uint32_t e4m3_encode_dev(float s) { return numerics::e4m3_encode(s); }
__device__ __forceinline__ float e4m3_decode_pos(uint32_t bits) {
  return numerics::e4m3_decode_unsigned(bits);
}
__device__ __forceinline__ float e4m3_decode_any(uint32_t bits) {
  return numerics::e4m3_decode(static_cast<uint8_t>(bits));
}
// E2M1 code of d = x / (s + 1e-12); comparing unclamped d equals comparing clamp(d, -6, 6).
__device__ __forceinline__ uint32_t e2m1_encode_dev(float d) { return numerics::e2m1_encode(d); }
__device__ __forceinline__ float e2m1_decode_dev(uint32_t code) {
  return numerics::e2m1_decode(code);
}

// 4-over-6's block error under the decoded scale s: this lane's elements summed pairwise
// (numerics::pairwise_sum), then the lanes at shuffle distance 1, 2, ...: the adjacent-pairs
// tree over the 16 elements that the CPU path and the reference use, equal in every lane.
template <int kVec, int kLanes>
__device__ __forceinline__ double block_sq_err(const float (&v)[kVec], float s) {
  double e[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = numerics::nvfp4_sq_err(v[i], s);
  double sum = numerics::pairwise_sum(e);
#pragma unroll
  for (int off = 1; off < kLanes; off <<= 1) {
    sum = __dadd_rn(sum, __shfl_xor_sync(0xffffffffu, sum, off));
  }
  return sum;
}

// A lane's kVec values of its 16-element block as fp32 into v (zeros for a lane past the last
// block, valid == false) and the block's scale from the lane group's amax: E4M3 bits and decoded
// value. Every thread of the grid takes part in the shuffles, so a lane group never straddles a
// partially active warp. A block with a NaN/Inf sets *flag (when given) and gets scale NaN, so a
// fake-quant output block is NaN rather than a silently encoded value. kFour: the scale by
// 4-over-6 (amax -> 4 where that block error is smaller; ties keep amax -> 6).
template <typename T, bool kAligned, bool kFour>
__device__ __forceinline__ void read_lane_block(const T* __restrict__ p, bool valid, int32_t* flag,
                                                float (&v)[Layout<T>::kVec], uint32_t* sbits,
                                                float* s) {
  using L = Layout<T>;
  if (valid) {
    load_lane<T, kAligned>(p, v);
  } else {
#pragma unroll
    for (int i = 0; i < L::kVec; ++i) v[i] = 0.0f;
  }
  float amax = 0.0f;
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < L::kVec; ++i) {
    bad |= isfinite(v[i]) ? 0u : 1u;
    amax = fmaxf(amax, fabsf(v[i]));
  }
  amax = group_max<L::kLanes>(amax);
  bad = group_or<L::kLanes>(bad);
  *sbits = e4m3_encode_dev(numerics::nvfp4_scale_input(amax));
  *s = e4m3_decode_pos(*sbits);
  if constexpr (kFour) {
    const uint32_t bits4 = e4m3_encode_dev(numerics::nvfp4_scale_input_over4(amax));
    const float s4 = e4m3_decode_pos(bits4);
    if (block_sq_err<L::kVec, L::kLanes>(v, s4) < block_sq_err<L::kVec, L::kLanes>(v, *s)) {
      *sbits = bits4;
      *s = s4;
    }
  }
  if (bad) *s = __uint_as_float(0x7FC00000u);
  if (bad && flag != nullptr) *flag = 1;
}

// U: output element type, same width as T (one 16-byte vector in, one out), e.g. fp16 masters
// to a bf16 compute weight in one pass (the fake-quantized values are exact in both).
template <typename T, typename U, bool kAligned, bool kFour>
__global__ void fake_quant_kernel(const T* __restrict__ w, U* __restrict__ out, int64_t n_blocks,
                                  int32_t* flag) {
  static_assert(sizeof(T) == sizeof(U), "fake_quant_kernel: in and out of one width");
  using L = Layout<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = tid / L::kLanes;
  const int64_t base = blk * kBlock + (tid % L::kLanes) * L::kVec;
  const bool valid = blk < n_blocks;
  float v[L::kVec];
  uint32_t sbits;
  float s;
  read_lane_block<T, kAligned, kFour>(w + base, valid, flag, v, &sbits, &s);
  const float denom = __fadd_rn(s, 1e-12f);
#pragma unroll
  for (int i = 0; i < L::kVec; ++i) {
    v[i] = __fmul_rn(e2m1_decode_dev(e2m1_encode_dev(__fdiv_rn(v[i], denom))), s);
  }
  if (valid) store_lane<U, kAligned>(out + base, v);
}

template <typename T, bool kAligned, bool kFour>
__global__ void quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ qdata,
                                uint8_t* __restrict__ scale, int64_t n_blocks, int32_t* flag) {
  using L = Layout<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = tid / L::kLanes;
  const int lane = static_cast<int>(tid % L::kLanes);
  const bool valid = blk < n_blocks;
  float v[L::kVec];
  uint32_t sbits;
  float s;
  read_lane_block<T, kAligned, kFour>(x + blk * kBlock + lane * L::kVec, valid, flag, v, &sbits,
                                      &s);
  const float denom = __fadd_rn(s, 1e-12f);
  uint32_t packed = 0;  // element 2j in the low nibble of byte j
#pragma unroll
  for (int i = 0; i < L::kVec; ++i) {
    packed |= e2m1_encode_dev(__fdiv_rn(v[i], denom)) << (4 * i);
  }
  if (!valid) return;
  uint8_t* q = qdata + blk * (kBlock / 2) + lane * (L::kVec / 2);
  if constexpr (L::kVec == 8) {
    *reinterpret_cast<uint32_t*>(q) = packed;  // 4-byte aligned: fresh buffer, offset 4*lane
  } else {
    *reinterpret_cast<uint16_t*>(q) = static_cast<uint16_t>(packed);
  }
  if (lane == 0) scale[blk] = static_cast<uint8_t>(sbits);
}

template <typename T, bool kAligned>
__global__ void dequantize_kernel(const uint8_t* __restrict__ qdata,
                                  const uint8_t* __restrict__ scale, int64_t n_blocks,
                                  T* __restrict__ out) {
  using L = Layout<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = tid / L::kLanes;
  if (blk >= n_blocks) return;
  const int lane = static_cast<int>(tid % L::kLanes);
  const float s = e4m3_decode_any(scale[blk]);
  const uint8_t* q = qdata + blk * (kBlock / 2) + lane * (L::kVec / 2);
  float v[L::kVec];
#pragma unroll
  for (int j = 0; j < L::kVec / 2; ++j) {
    const uint32_t byte = q[j];
    v[2 * j] = __fmul_rn(e2m1_decode_dev(byte & 0xFu), s);
    v[2 * j + 1] = __fmul_rn(e2m1_decode_dev(byte >> 4), s);
  }
  store_lane<T, kAligned>(out + blk * kBlock + lane * L::kVec, v);
}

template <typename T>
unsigned grid_for(int64_t n_blocks) {
  const int64_t threads = n_blocks * Layout<T>::kLanes;
  return static_cast<unsigned>((threads + kThreadsPerCta - 1) / kThreadsPerCta);
}

template <typename T, typename U, bool kFour>
cudaError_t fake_quant_typed(const void* w, void* out, int64_t n_blocks, int32_t* flag,
                             cudaStream_t stream) {
  const T* wp = static_cast<const T*>(w);
  U* op = static_cast<U*>(out);
  if (aligned16(w) && aligned16(out)) {
    fake_quant_kernel<T, U, true, kFour>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(wp, op, n_blocks, flag);
  } else {
    fake_quant_kernel<T, U, false, kFour>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(wp, op, n_blocks, flag);
  }
  return cudaGetLastError();
}

// The fake-quant kernel for rule (block_rule.h): one instantiation per rule.
template <typename T, typename U>
cudaError_t fake_quant_rule(const void* w, void* out, int64_t n_blocks, int32_t* flag,
                            BlockRule rule, cudaStream_t stream) {
  return rule == BlockRule::kFourOverSix
             ? fake_quant_typed<T, U, true>(w, out, n_blocks, flag, stream)
             : fake_quant_typed<T, U, false>(w, out, n_blocks, flag, stream);
}

template <typename T, bool kFour>
cudaError_t quantize_typed(const void* x, int64_t n_blocks, uint8_t* qdata, uint8_t* scale,
                           int32_t* flag, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x);
  if (aligned16(x)) {
    quantize_kernel<T, true, kFour>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(xp, qdata, scale, n_blocks, flag);
  } else {
    quantize_kernel<T, false, kFour>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(xp, qdata, scale, n_blocks, flag);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t dequantize_typed(const uint8_t* qdata, const uint8_t* scale, int64_t n_blocks,
                             void* out, cudaStream_t stream) {
  T* op = static_cast<T*>(out);
  if (aligned16(out)) {
    dequantize_kernel<T, true>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(qdata, scale, n_blocks, op);
  } else {
    dequantize_kernel<T, false>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(qdata, scale, n_blocks, op);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_quantize_nvfp4(const void* x, DType kind, int64_t n_blocks, uint8_t* qdata,
                                  uint8_t* scale, int32_t* nonfinite_flag, BlockRule rule,
                                  cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_dtype(kind, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    return rule == BlockRule::kFourOverSix
               ? quantize_typed<T, true>(x, n_blocks, qdata, scale, nonfinite_flag, stream)
               : quantize_typed<T, false>(x, n_blocks, qdata, scale, nonfinite_flag, stream);
  });
}

cudaError_t launch_dequantize_nvfp4(const uint8_t* qdata, const uint8_t* scale, int64_t n_blocks,
                                    void* out, DType kind, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_dtype(kind, cudaErrorInvalidValue, [&](auto tag) {
    return dequantize_typed<decltype(tag)>(qdata, scale, n_blocks, out, stream);
  });
}

cudaError_t launch_fake_quant_nvfp4(const void* w, void* out, DType kind, int64_t n_blocks,
                                    int32_t* nonfinite_flag, BlockRule rule, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_dtype(kind, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    return fake_quant_rule<T, T>(w, out, n_blocks, nonfinite_flag, rule, stream);
  });
}

cudaError_t launch_fake_quant_nvfp4_cast(const void* w, DType kind, void* out, DType out_kind,
                                         int64_t n_blocks, int32_t* nonfinite_flag, BlockRule rule,
                                         cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  if (kind == out_kind) {
    return launch_fake_quant_nvfp4(w, out, kind, n_blocks, nonfinite_flag, rule, stream);
  }
  if (kind == DType::kF16 && out_kind == DType::kBF16) {
    return fake_quant_rule<__half, __nv_bfloat16>(w, out, n_blocks, nonfinite_flag, rule, stream);
  }
  if (kind == DType::kBF16 && out_kind == DType::kF16) {
    return fake_quant_rule<__nv_bfloat16, __half>(w, out, n_blocks, nonfinite_flag, rule, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace q4::quant::cuda
