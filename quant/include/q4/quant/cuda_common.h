// CUDA building blocks of every kernel library (quant/, model/, optim/): the element dtype code,
// fp32 conversion of fp16/bf16 (round to nearest even), aligned vector accesses, lane-group and
// warp reductions by xor shuffles, the dtype dispatch of host launchers, the multiprocessor count
// that sizes persistent grids, and the one CUDA error check. Host code sees the dtype code, the
// check and the grid helpers; the device part compiles only under nvcc. No torch headers, so
// .cu files can include it; it lives with quant/'s header-only target (q4_numerics), which
// model/ (through q4_quant) and optim/ (directly) already link.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>
#endif

namespace q4::quant::cuda {

// Element type of a kernel's floating-point operands; every launcher takes this code.
enum class DType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

// The CUDA error check: throws std::runtime_error "<what>: CUDA error: <error string>" unless e
// is cudaSuccess. Launchers check their launches with it, or return cudaGetLastError() to a
// caller that does.
inline void check_cuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": CUDA error: " + cudaGetErrorString(e));
  }
}

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Multiprocessors of the current device, read once per device: grids are a few CTAs per SM.
inline int sm_count() {
  static std::mutex mu;
  static int count[256] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 256) return 132;
  if (count[dev] == 0) {
    check_cuda(cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev),
               "cudaDeviceGetAttribute");
  }
  return count[dev];
}

#if defined(__CUDACC__)

// Calls fn(T{}) with T the element type of dt (float, __half or __nv_bfloat16; a tag value, only
// its type is used) and returns its result, or `invalid` when dt is none of the three.
template <typename R, typename Fn>
R dispatch_dtype(DType dt, R invalid, Fn&& fn) {
  switch (dt) {
    case DType::kF32:
      return fn(float{});
    case DType::kF16:
      return fn(__half{});
    case DType::kBF16:
      return fn(__nv_bfloat16{});
  }
  return invalid;
}

// ---- conversion: exact to fp32, round to nearest even from fp32 ----
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same<T, __half>::value) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    return __float2bfloat16_rn(v);
  } else {
    static_assert(std::is_same<T, float>::value, "from_float: float, __half or __nv_bfloat16");
    return v;
  }
}

// ---- vector access ----
// Elements of T in one 16-byte access.
template <typename T>
inline constexpr int kVec16 = 16 / static_cast<int>(sizeof(T));

// E consecutive elements of T as one aligned aggregate: one 4/8/16-byte load or store (32 bytes:
// two 16-byte ones). Only for pointers aligned to the aggregate: callers check 16-byte alignment
// of the base and keep element offsets multiples of E.
template <typename T, int E>
struct alignas(sizeof(T) * E < 16 ? sizeof(T) * E : 16) Vec {
  T v[E];
};

template <typename T, int E>
__device__ __forceinline__ void load_vec(const T* base, T (&out)[E]) {
  const Vec<T, E> r = *reinterpret_cast<const Vec<T, E>*>(base);
#pragma unroll
  for (int e = 0; e < E; ++e) out[e] = r.v[e];
}

template <typename T, int E>
__device__ __forceinline__ void store_vec(T* base, const T (&in)[E]) {
  Vec<T, E> r;
#pragma unroll
  for (int e = 0; e < E; ++e) r.v[e] = in[e];
  *reinterpret_cast<Vec<T, E>*>(base) = r;
}

// One 16-byte word read and written as kVec elements of T, each taken from (or put into) the
// word where it is used: fp16/bf16 pairs stay packed in 32-bit registers until then (the
// aggregate Vec unpacks a whole load at once, which costs the row kernels registers).
template <typename T>
struct Pack {
  static constexpr int kVec = kVec16<T>;
  uint4 raw;
  __device__ __forceinline__ T get(int j) const { return reinterpret_cast<const T*>(&raw)[j]; }
  __device__ __forceinline__ void set(int j, T v) { reinterpret_cast<T*>(&raw)[j] = v; }
};

// ---- reductions ----
// op over the kLanes lanes of an aligned lane group (kLanes a power of two, at most 32), by xor
// shuffles: every lane of the group gets the result. All 32 lanes of the warp take part.
template <int kLanes, typename T, typename Op>
__device__ __forceinline__ T group_reduce(T v, Op op) {
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) v = op(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

template <int kLanes>
__device__ __forceinline__ float group_max(float v) {
  return group_reduce<kLanes>(v, [](float a, float b) { return fmaxf(a, b); });
}

template <int kLanes>
__device__ __forceinline__ uint32_t group_or(uint32_t v) {
  return group_reduce<kLanes>(v, [](uint32_t a, uint32_t b) { return a | b; });
}

__device__ __forceinline__ float warp_sum(float v) {
  return group_reduce<32>(v, [](float a, float b) { return a + b; });
}

#endif  // __CUDACC__

}  // namespace q4::quant::cuda
