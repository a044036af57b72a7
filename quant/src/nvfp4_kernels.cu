// CUDA kernels of the NVFP4 codec: quantize, dequantize and the fused fake-quant used by every
// trained linear's forward. A group of lanes owns one 16-element block (4 lanes x 4 fp32, or
// 2 lanes x 8 fp16/bf16: one 16-byte load each), reduces amax with shuffles and applies the exact
// fp32 numerics of DESIGN.md with explicitly rounded ops (__fdiv_rn, __fadd_rn, __fmul_rn), so
// the results are bit-identical to the CPU path and the scalar reference. No torch headers here.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "nvfp4_cuda.h"
#include "q4/quant/numerics.h"

namespace q4::quant::cuda {
namespace {

constexpr int kThreadsPerCta = 256;
constexpr int kBlock = 16;  // NVFP4 block size (elements sharing one scale)

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

// Elements per lane (one 16-byte vector) and lanes per 16-element block.
template <typename T>
struct Layout {
  static constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  static constexpr int kLanes = kBlock / kVec;
};

template <typename T, bool kAligned>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&v)[Layout<T>::kVec]) {
  constexpr int kVec = Layout<T>::kVec;
  if constexpr (kAligned) {
    union {
      uint4 raw;
      T elem[kVec];
    } u;
    u.raw = *reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = to_float(u.elem[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) v[i] = to_float(p[i]);
  }
}

template <typename T, bool kAligned>
__device__ __forceinline__ void store_vec(T* __restrict__ p, const float (&v)[Layout<T>::kVec]) {
  constexpr int kVec = Layout<T>::kVec;
  if constexpr (kAligned) {
    union {
      uint4 raw;
      T elem[kVec];
    } u;
#pragma unroll
    for (int i = 0; i < kVec; ++i) u.elem[i] = from_float<T>(v[i]);
    *reinterpret_cast<uint4*>(p) = u.raw;
  } else {
#pragma unroll
    for (int i = 0; i < kVec; ++i) p[i] = from_float<T>(v[i]);
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

// Block amax over the lane group and the scale; returns (scale bits, decoded scale). A block
// with a NaN/Inf sets *flag (when given) and gets scale NaN, so a fake-quant output block is NaN
// rather than a silently encoded value.
template <typename T>
__device__ __forceinline__ void block_scale(const float (&v)[Layout<T>::kVec], int32_t* flag,
                                            uint32_t* sbits, float* s) {
  float amax = 0.0f;
  uint32_t bad = 0;
#pragma unroll
  for (int i = 0; i < Layout<T>::kVec; ++i) {
    bad |= isfinite(v[i]) ? 0u : 1u;
    amax = fmaxf(amax, fabsf(v[i]));
  }
#pragma unroll
  for (int off = Layout<T>::kLanes / 2; off > 0; off >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, off));
    bad |= __shfl_xor_sync(0xFFFFFFFFu, bad, off);
  }
  *sbits = e4m3_encode_dev(numerics::nvfp4_scale_input(amax));
  *s = bad ? __uint_as_float(0x7FC00000u) : e4m3_decode_pos(*sbits);
  if (bad && flag != nullptr) *flag = 1;
}

// Every thread of the grid takes part in the shuffles (threads past the end use zeros), so a
// lane group never straddles a partially active warp.
// U: output element type, same width as T (one 16-byte vector in, one out), e.g. fp16 masters
// to a bf16 compute weight in one pass (the fake-quantized values are exact in both).
template <typename T, typename U, bool kAligned>
__global__ void fake_quant_kernel(const T* __restrict__ w, U* __restrict__ out, int64_t n_blocks,
                                  int32_t* flag) {
  static_assert(sizeof(T) == sizeof(U), "fake_quant_kernel: in and out of one width");
  using L = Layout<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = tid / L::kLanes;
  const int64_t base = blk * kBlock + (tid % L::kLanes) * L::kVec;
  const bool valid = blk < n_blocks;
  float v[L::kVec];
  if (valid) {
    load_vec<T, kAligned>(w + base, v);
  } else {
#pragma unroll
    for (int i = 0; i < L::kVec; ++i) v[i] = 0.0f;
  }
  uint32_t sbits;
  float s;
  block_scale<T>(v, flag, &sbits, &s);
  const float denom = __fadd_rn(s, 1e-12f);
#pragma unroll
  for (int i = 0; i < L::kVec; ++i) {
    v[i] = __fmul_rn(e2m1_decode_dev(e2m1_encode_dev(__fdiv_rn(v[i], denom))), s);
  }
  if (valid) store_vec<U, kAligned>(out + base, v);
}

template <typename T, bool kAligned>
__global__ void quantize_kernel(const T* __restrict__ x, uint8_t* __restrict__ qdata,
                                uint8_t* __restrict__ scale, int64_t n_blocks, int32_t* flag) {
  using L = Layout<T>;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t blk = tid / L::kLanes;
  const int lane = static_cast<int>(tid % L::kLanes);
  const bool valid = blk < n_blocks;
  float v[L::kVec];
  if (valid) {
    load_vec<T, kAligned>(x + blk * kBlock + lane * L::kVec, v);
  } else {
#pragma unroll
    for (int i = 0; i < L::kVec; ++i) v[i] = 0.0f;
  }
  uint32_t sbits;
  float s;
  block_scale<T>(v, flag, &sbits, &s);
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
  store_vec<T, kAligned>(out + blk * kBlock + lane * L::kVec, v);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
unsigned grid_for(int64_t n_blocks) {
  const int64_t threads = n_blocks * Layout<T>::kLanes;
  return static_cast<unsigned>((threads + kThreadsPerCta - 1) / kThreadsPerCta);
}

template <typename T, typename U>
cudaError_t fake_quant_typed(const void* w, void* out, int64_t n_blocks, int32_t* flag,
                             cudaStream_t stream) {
  const T* wp = static_cast<const T*>(w);
  U* op = static_cast<U*>(out);
  if (aligned16(w) && aligned16(out)) {
    fake_quant_kernel<T, U, true>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(wp, op, n_blocks, flag);
  } else {
    fake_quant_kernel<T, U, false>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(wp, op, n_blocks, flag);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t quantize_typed(const void* x, int64_t n_blocks, uint8_t* qdata, uint8_t* scale,
                           int32_t* flag, cudaStream_t stream) {
  const T* xp = static_cast<const T*>(x);
  if (aligned16(x)) {
    quantize_kernel<T, true>
        <<<grid_for<T>(n_blocks), kThreadsPerCta, 0, stream>>>(xp, qdata, scale, n_blocks, flag);
  } else {
    quantize_kernel<T, false>
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

// Calls fn(T{}) with T the element type of `kind` (a tag value: only its type is used).
template <typename Fn>
cudaError_t dispatch_kind(FloatKind kind, Fn&& fn) {
  switch (kind) {
    case FloatKind::kFloat32:
      return fn(float{});
    case FloatKind::kFloat16:
      return fn(__half{});
    case FloatKind::kBFloat16:
      return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_quantize_nvfp4(const void* x, FloatKind kind, int64_t n_blocks, uint8_t* qdata,
                                  uint8_t* scale, int32_t* nonfinite_flag, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_kind(kind, [&](auto tag) {
    return quantize_typed<decltype(tag)>(x, n_blocks, qdata, scale, nonfinite_flag, stream);
  });
}

cudaError_t launch_dequantize_nvfp4(const uint8_t* qdata, const uint8_t* scale, int64_t n_blocks,
                                    void* out, FloatKind kind, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_kind(kind, [&](auto tag) {
    return dequantize_typed<decltype(tag)>(qdata, scale, n_blocks, out, stream);
  });
}

cudaError_t launch_fake_quant_nvfp4(const void* w, void* out, FloatKind kind, int64_t n_blocks,
                                    int32_t* nonfinite_flag, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  return dispatch_kind(kind, [&](auto tag) {
    using T = decltype(tag);
    return fake_quant_typed<T, T>(w, out, n_blocks, nonfinite_flag, stream);
  });
}

cudaError_t launch_fake_quant_nvfp4_cast(const void* w, FloatKind kind, void* out,
                                         FloatKind out_kind, int64_t n_blocks,
                                         int32_t* nonfinite_flag, cudaStream_t stream) {
  if (n_blocks == 0) return cudaSuccess;
  if (kind == out_kind) {
    return launch_fake_quant_nvfp4(w, out, kind, n_blocks, nonfinite_flag, stream);
  }
  if (kind == FloatKind::kFloat16 && out_kind == FloatKind::kBFloat16) {
    return fake_quant_typed<__half, __nv_bfloat16>(w, out, n_blocks, nonfinite_flag, stream);
  }
  if (kind == FloatKind::kBFloat16 && out_kind == FloatKind::kFloat16) {
    return fake_quant_typed<__nv_bfloat16, __half>(w, out, n_blocks, nonfinite_flag, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace q4::quant::cuda
