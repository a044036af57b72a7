// Fused CUDA AdamW step: one kernel per moment mode reads gradient, master and the (packed)
// moments once and writes master and moments once. Block-wise modes give each moment block to a
// group of lanes, each lane owning E consecutive elements (int8: 32 lanes x 8, 4-bit: 32 x 4,
// NVFP4: 4 x 4), so whole groups use 8/16-byte vector loads and stores: decode, update, group
// absmax by shuffles, re-quantize, write. Kernels are persistent (grid-stride over groups; the
// code maps are staged in shared memory once per CTA). Arithmetic is the CPU path's, op for op,
// with explicit round-to-nearest intrinsics (no FMA contraction), so results are bit-identical
// -- when StepParams::exact is set. By default the int8/4-bit kernels fuse multiply-adds and use
// the hardware square root and division in the update (fewer instructions: these kernels are
// issue-bound), everything else (codes, randomness, rounding decisions) unchanged.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "cuda_launch.h"
#include "optim_math.h"

namespace q4::optim::cuda {
namespace {

using detail::CodeMap;
using detail::MapId;

__constant__ float c_map_value[4][256];    // MapId -> decoded value per code
__constant__ float c_map_mid[4][256];      // MapId -> midpoints (size - 1 used)
__constant__ float c_map_sr_value[4][16];  // MapId -> stochastic-rounding entries (4-bit maps)
__constant__ float c_map_inv_gap[4][16];   // MapId -> 1 / gaps of sr_value (size - 1 used)
__constant__ int c_map_size[4];
__constant__ int c_map_flags[4];  // bit 0: stochastic codes, bit 1: sqrt domain
__constant__ uint8_t c_map_start[4][2][detail::kSearchBuckets];  // code search lower bounds

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    throw std::runtime_error(std::string("q4::optim CUDA: ") + what + ": " + cudaGetErrorString(e));
  }
}

// Copies the code tables to the current device once (constant memory is per device).
void ensure_tables() {
  static std::mutex mu;
  static bool ready[256] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 256 || ready[dev]) return;
  float value[4][256] = {};
  float mid[4][256] = {};
  float sr_value[4][16] = {};
  float inv_gap[4][16] = {};
  int size[4];
  int flags[4];
  static uint8_t start[4][2][detail::kSearchBuckets];  // 12.8 KB: not on the stack
  for (int i = 0; i < 4; ++i) {
    const CodeMap m = detail::make_code_map(static_cast<MapId>(i));
    std::memcpy(start[i], m.search_start, sizeof(start[i]));
    size[i] = m.size;
    flags[i] = (m.stochastic ? 1 : 0) | (m.sqrt_domain ? 2 : 0);
    const bool expect_sr = i == static_cast<int>(MapId::k4BitFirst) ||
                           i == static_cast<int>(MapId::k4BitSecond);  // kStochasticMoments
    if (m.stochastic != expect_sr || (m.stochastic && m.size > 16)) {
      throw std::runtime_error("q4::optim CUDA: code map " + std::to_string(i) +
                               ": stochastic codes are compiled in for the 16-entry 4-bit maps");
    }
    const int steps =
        m.stochastic ? detail::max_scan_steps(m.sr_value, m.size, false, m.search_start)
                     : detail::max_scan_steps(m.mid, m.size - 1, true, m.search_start);
    if (i != static_cast<int>(MapId::k4BitSecond) && steps > detail::kMapScanSteps[i]) {
      throw std::runtime_error("q4::optim CUDA: code map " + std::to_string(i) + " needs " +
                               std::to_string(steps) + " search steps, the kernels do " +
                               std::to_string(detail::kMapScanSteps[i]));
    }
    for (int j = 0; j < m.size; ++j) value[i][j] = m.value[j];
    for (int j = 0; j + 1 < m.size; ++j) mid[i][j] = m.mid[j];
    if (m.stochastic) {
      for (int j = 0; j < m.size; ++j) sr_value[i][j] = m.sr_value[j];
      for (int j = 0; j + 1 < m.size; ++j) inv_gap[i][j] = m.inv_gap[j];
    }
  }
  check(cudaMemcpyToSymbol(c_map_value, value, sizeof(value)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_mid, mid, sizeof(mid)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_sr_value, sr_value, sizeof(sr_value)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_inv_gap, inv_gap, sizeof(inv_gap)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_size, size, sizeof(size)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_flags, flags, sizeof(flags)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_start, start, sizeof(start)), "copy code maps");
  ready[dev] = true;
}

// Multiprocessors of the current device (cached): persistent grids are a few CTAs per SM.
int sm_count() {
  static std::mutex mu;
  static int count[256] = {};
  int dev = 0;
  check(cudaGetDevice(&dev), "cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 256) return 132;
  if (count[dev] == 0) {
    check(cudaDeviceGetAttribute(&count[dev], cudaDevAttrMultiProcessorCount, dev),
          "cudaDeviceGetAttribute");
  }
  return count[dev];
}

// ---- dtype helpers ----
__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_bits(unsigned short b);
template <>
__device__ __forceinline__ __half from_bits<__half>(unsigned short b) {
  return __ushort_as_half(b);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short b) {
  return __ushort_as_bfloat16(b);
}
__device__ __forceinline__ unsigned short to_bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ unsigned short to_bits(__nv_bfloat16 x) {
  return __bfloat16_as_ushort(x);
}
__device__ __forceinline__ __half rn(float x, __half*) { return __float2half_rn(x); }
__device__ __forceinline__ __nv_bfloat16 rn(float x, __nv_bfloat16*) {
  return __float2bfloat16_rn(x);
}

// |x - a| / gap for a power-of-two gap (the distance of two adjacent fp16/bf16 values): when the
// gap is a normal fp32, 1/gap is exact (exponent 254 - e, zero mantissa), so the product equals
// the IEEE quotient bit for bit and costs a multiply instead of a division.
__device__ __forceinline__ float div_pow2(float d, float gap) {
  const uint32_t e = __float_as_uint(gap) >> 23;  // gap > 0
  if (e == 0) return __fdiv_rn(d, gap);           // subnormal gap (tiny bf16 values)
  return __fmul_rn(d, __uint_as_float((254U - e) << 23));
}

// Master write-back (docs/optim.md): saturate at the largest finite value, round to nearest, or
// pick the neighbour further from the RN candidate with probability |x - a| / |b - a|, using the
// element's bits h = sr_bits(key, index).
// kMulCompare: decide by a multiply instead of the quotient where that is exact (below); off for
// the int8 kernel, where it costs a register spill at its 64-register bound.
template <typename M, bool kMulCompare = true>
__device__ __forceinline__ M write_master(float x, bool stochastic, uint32_t h) {
  if constexpr (std::is_same<M, float>::value) {
    return x;
  } else {
    const float maxf = std::is_same<M, __half>::value ? 65504.0f : 3.3895313892515355e38f;
    x = fminf(fmaxf(x, -maxf), maxf);
    const M a = rn(x, static_cast<M*>(nullptr));
    if (!stochastic) return a;
    const float af = to_f(a);
    const bool away = fabsf(x) > fabsf(af);
    const unsigned short nb = static_cast<unsigned short>(to_bits(a) + (away ? 1 : -1));
    const M b = from_bits<M>(nb);
    const float bf = to_f(b);
    const float d = fabsf(__fsub_rn(x, af));     // exact (x and af are neighbours)
    const float gap = fabsf(__fsub_rn(bf, af));  // a power of two
    const float u = detail::sr_uniform(h);       // k * 2^-24, k < 2^24
    // u < d / gap (the CPU's test: the quotient is exact) <=> u * gap < d whenever u * gap is
    // exact too, i.e. gap >= 2^-125 (always for fp16, whose gaps are >= 2^-24): a multiply
    // instead of a division. Smaller (bf16) gaps take the quotient.
    if (kMulCompare && (std::is_same<M, __half>::value || (__float_as_uint(gap) >> 23) >= 2u)) {
      return __fmul_rn(u, gap) < d ? b : a;
    }
    return u < div_pow2(d, gap) ? b : a;
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

// sqrt(v): correctly rounded (kExact), else the hardware approximation (MUFU, ~1 ulp; no
// flush of subnormals).
template <bool kExact>
__device__ __forceinline__ float adam_sqrt(float v) {
  if (kExact) return __fsqrt_rn(v);
  float r;
  asm("sqrt.approx.f32 %0, %1;" : "=f"(r) : "f"(v));
  return r;
}

// sv = adam_sqrt(v). The fast variant divides with the hardware reciprocal (__fdividef: ~2 ulp;
// den >= eps > 0 is far below the 2^126 where it would return 0).
template <bool kExact = true>
__device__ __forceinline__ float adam_master_sv(float w, float m, float sv, const StepParams& p) {
  if (kExact) {
    const float den = __fadd_rn(__fmul_rn(sv, p.inv_sqrt_bc2), p.eps);
    const float u = __fmul_rn(__fdiv_rn(m, den), p.step_size);
    return __fsub_rn(__fmul_rn(w, p.decay), u);
  }
  const float den = __fmaf_rn(sv, p.inv_sqrt_bc2, p.eps);
  return __fmaf_rn(-__fdividef(m, den), p.step_size, __fmul_rn(w, p.decay));
}

__device__ __forceinline__ float adam_master(float w, float m, float v, const StepParams& p) {
  const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), p.inv_sqrt_bc2), p.eps);
  const float u = __fmul_rn(__fdiv_rn(m, den), p.step_size);
  return __fsub_rn(__fmul_rn(w, p.decay), u);
}

constexpr int kThreads = 256;  // threads per CTA of every kernel here
// The block kernels are register-bounded so that 4 (int8: 64 registers; unbounded it used 72) or
// 5 (4-bit, NVFP4: 48) CTAs fit an SM; ptxas reports no spills with these bounds (6 spilled).

// ---- vector access ----
// E consecutive elements of T as one aligned aggregate: 8/16-byte loads and stores (32 bytes:
// two 16-byte ones). Used only when the launcher found every pointer 16-byte aligned and the
// group lies inside the tensor; element offsets are multiples of E, so each access is aligned.
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

// Loads elements [i0, i0 + E) as fp32: vector access when `vec`, else element by element with
// the ones at or past n set to 0.
template <typename T, int E>
__device__ __forceinline__ void load_f32(const T* ptr, int64_t i0, int64_t n, bool vec,
                                         float (&out)[E]) {
  if (vec) {
    T raw[E];
    load_vec<T, E>(ptr + i0, raw);
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = to_f(raw[e]);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) out[e] = i0 + e < n ? to_f(ptr[i0 + e]) : 0.0f;
  }
}

// ---- fp32 moments ----
constexpr int kFp32Elems = 4;  // elements per thread

template <typename G, typename M>
__global__ void adamw_fp32_kernel(StepParams p) {
  if (p.skip != nullptr && *p.skip != 0) return;  // non-finite gradient (in-backward step)
  constexpr int E = kFp32Elems;
  M* master = static_cast<M*>(p.master);
  const int64_t groups = (p.n + E - 1) / E;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; gi < groups;
       gi += stride) {
    const int64_t i0 = gi * E;
    const bool vec = p.vec_ok != 0 && i0 + E <= p.n;
    float g[E], m[E], v[E], w[E];
    if (p.grad != nullptr) {
      load_f32<G, E>(static_cast<const G*>(p.grad), i0, p.n, vec, g);
#pragma unroll
      for (int e = 0; e < E; ++e) g[e] = __fmul_rn(g[e], p.grad_scale);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) g[e] = 0.0f;
    }
    load_f32<float, E>(p.m32, i0, p.n, vec, m);
    load_f32<float, E>(p.v32, i0, p.n, vec, v);
    load_f32<M, E>(master, i0, p.n, vec, w);
    M out[E];
    const bool sr = p.stochastic != 0;
    const uint32_t range_key = detail::sr_range_key(p.sr_key, i0);  // i0: a multiple of E
#pragma unroll
    for (int e = 0; e < E; ++e) {
      adam_moments(g[e], m[e], v[e], p);
      out[e] = write_master<M>(adam_master(w[e], m[e], v[e], p), sr,
                               sr ? detail::sr_bits_in_range(range_key, i0 + e) : 0U);
    }
    if (vec) {
      store_vec<float, E>(p.m32 + i0, m);
      store_vec<float, E>(p.v32 + i0, v);
      store_vec<M, E>(master + i0, out);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (i0 + e < p.n) {
          p.m32[i0 + e] = m[e];
          p.v32[i0 + e] = v[e];
          master[i0 + e] = out[e];
        }
      }
    }
  }
}

// ---- block codecs (device) ----
// kBlock elements per moment block, handled by kLanes lanes of kElems consecutive elements.
template <int MODE>
struct BlockTraits;
template <>
struct BlockTraits<1> {  // int8
  static constexpr int kBlock = 256;
  static constexpr int kLanes = 32;
  static constexpr int kElems = 8;
  static constexpr bool kNibbles = false;
};
template <>
struct BlockTraits<2> {  // 4-bit
  static constexpr int kBlock = 128;
  static constexpr int kLanes = 16;
  static constexpr int kElems = 8;
  static constexpr bool kNibbles = true;
};
template <>
struct BlockTraits<3> {  // NVFP4
  static constexpr int kBlock = 16;
  static constexpr int kLanes = 4;
  static constexpr int kElems = 4;
  static constexpr bool kNibbles = true;
};

template <int MODE>
__device__ __forceinline__ float block_scale(const void* scales, int64_t blk) {
  if (MODE == 3) return detail::e4m3_decode(static_cast<const uint8_t*>(scales)[blk]);
  return static_cast<const float*>(scales)[blk];
}

// The two maps of a mode, staged in shared memory: lanes index them with different codes, which
// __constant__ memory would serialize. Slot 0 = first moment, 1 = second moment.
struct SharedMaps {
  float value[2][256];
  float mid[2][256];
  float sr_value[2][16];
  float inv_gap[2][16];
  int size[2];
  int flags[2];
  uint8_t start[2][2][detail::kSearchBuckets];  // [slot][sign][bucket]
};

template <int MODE>
__device__ __forceinline__ void load_shared_maps(SharedMaps& sm) {
  if (MODE == 3) return;
  const int base = MODE == 1 ? 0 : 2;
  const int size = MODE == 1 ? 256 : 16;  // only the entries the mode's maps have
  for (int i = threadIdx.x; i < 2 * size; i += blockDim.x) {
    const int k = i / size, j = i % size;
    sm.value[k][j] = c_map_value[base + k][j];
    sm.mid[k][j] = c_map_mid[base + k][j];
    if (j < 16) {
      sm.sr_value[k][j] = c_map_sr_value[base + k][j];
      sm.inv_gap[k][j] = c_map_inv_gap[base + k][j];
    }
  }
  if (threadIdx.x < 2) {
    sm.size[threadIdx.x] = c_map_size[base + threadIdx.x];
    sm.flags[threadIdx.x] = c_map_flags[base + threadIdx.x];
  }
  // Search tables of both slots as 32-bit words (2 x 2 x kSearchBuckets bytes: a multiple of 4,
  // so every mode's tables start 4-byte aligned in c_map_start).
  constexpr int kWords = 2 * 2 * detail::kSearchBuckets / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&c_map_start[base][0][0]);
  uint32_t* dst = reinterpret_cast<uint32_t*>(&sm.start[0][0][0]);
  for (int i = threadIdx.x; i < kWords; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
}

template <int MODE>
__device__ __forceinline__ float decode_value(int code, float scale, const SharedMaps& sm,
                                              int slot) {
  if (MODE == 3) return __fmul_rn(detail::e2m1_decode(static_cast<uint8_t>(code)), scale);
  return __fmul_rn(sm.value[slot][code], scale);
}

// Max over the GROUP lanes of a group (aligned, power of two).
template <int GROUP>
__device__ __forceinline__ float group_max(float x) {
#pragma unroll
  for (int off = GROUP / 2; off >= 1; off >>= 1) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, off));
  }
  return x;
}

// Per-block encoding parameters from the block absmax: int8/4-bit the factors of
// detail::block_norm (one reciprocal per block, no per-element division); NVFP4 the E4M3 scale
// bits and the divisor of DESIGN.md (decoded scale + 1e-12, an IEEE division per element).
struct BlockEnc {
  detail::BlockNorm bn;
  float stored = 0.0f;  // fp32 absmax (int8/4-bit)
  float div = 1.0f;     // NVFP4 divisor
  uint8_t sbits = 0;    // NVFP4 scale bits
};

template <int MODE, bool kExact = true>
__device__ __forceinline__ BlockEnc block_params(float amax) {
  BlockEnc b;
  if (MODE == 3) {
    b.sbits = detail::e4m3_encode(detail::nvfp4_scale_input(amax));
    b.div = __fadd_rn(detail::e4m3_decode(b.sbits), 1e-12f);
  } else if (kExact) {
    b.stored = amax;
    b.bn = detail::block_norm(amax);
  } else {
    // detail::block_norm with the hardware reciprocal and square root (every lane of a block
    // computes these: a few percent of the kernel's instructions in the exact form).
    b.stored = amax;
    const float div = amax == 0.0f ? 1.0f : amax;
    const bool tiny = div < 1.17549435082228751e-38f;  // FLT_MIN
    b.bn.f = tiny ? 18446744073709551616.0f : 1.0f;
    b.bn.fs = tiny ? 4294967296.0f : 1.0f;
    // __fdividef returns 0 for divisors above 2^126 (no real moment gets there): IEEE there.
    const float d = div * b.bn.f;
    b.bn.inv = d < 8.5070591730234616e37f ? __fdividef(1.0f, d) : __frcp_rn(d);
    b.bn.rs = adam_sqrt<false>(b.bn.inv);
  }
  return b;
}

// Whether a mode's maps use stochastic codes: fixed per mode so that the kernels derive the
// moment bits only where they are used; ensure_tables() checks it against the maps.
template <int MODE>
constexpr bool kStochasticMoments = MODE == 2;

// Code of x (sx = sqrt(x), used by the 4-bit second moment only) in a block: NVFP4 thresholds;
// int8 the nearest map entry (bucketed search over the midpoints); 4-bit first moment sr_pick
// over its table; 4-bit second moment the closed-form pick on its linear sqrt-domain map.
// u: the element's uniform (moment_uniform) for stochastic codes.
template <int MODE, int SLOT>
__device__ __forceinline__ int encode_code(float x, float sx, const BlockEnc& b,
                                           const SharedMaps& sm, float u) {
  if (MODE == 3) return detail::e2m1_encode(__fdiv_rn(x, b.div));  // unclamped: same code
  if (MODE == 2 && SLOT == 1) return detail::sr_pick_4bit_second(detail::norm_sqrt(sx, b.bn), u);
  const float y = detail::norm_value(x, b.bn);
  const int start = (&sm.start[SLOT][0][0])[(__float_as_uint(y) >> 31) * detail::kSearchBuckets +
                                            detail::search_bucket(y)];
  constexpr int kSteps = detail::kMapScanSteps[(MODE == 1 ? 0 : 2) + SLOT];
  if (MODE == 2) {
    const int count = detail::count_steps<kSteps>(sm.sr_value[SLOT], 16, false, start, y);
    return detail::sr_pick(sm.sr_value[SLOT], sm.inv_gap[SLOT], 16, y, count, u);
  }
  return detail::count_steps<kSteps>(sm.mid[SLOT], 255, true, start, y);
}

// Reads the codes of elements [i0, i0 + E) (i0 a multiple of E, E even for nibbles).
template <int MODE, int E>
__device__ __forceinline__ void read_codes(const uint8_t* codes, int64_t i0, int64_t n, bool vec,
                                           int (&c)[E]) {
  if (BlockTraits<MODE>::kNibbles) {
    constexpr int NB = E / 2;
    uint8_t b[NB];
    if (vec) {
      load_vec<uint8_t, NB>(codes + i0 / 2, b);
    } else {
#pragma unroll
      for (int j = 0; j < NB; ++j) b[j] = i0 + 2 * j < n ? codes[i0 / 2 + j] : 0;
    }
#pragma unroll
    for (int j = 0; j < NB; ++j) {
      c[2 * j] = b[j] & 15;
      c[2 * j + 1] = b[j] >> 4;
    }
  } else {
    uint8_t b[E];
    if (vec) {
      load_vec<uint8_t, E>(codes + i0, b);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) b[e] = i0 + e < n ? codes[i0 + e] : 0;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) c[e] = b[e];
  }
}

// Writes the codes of elements [i0, i0 + E). Nibbles: byte j holds elements 2j (low) and 2j + 1
// (high); a byte is written when its low element is inside the tensor (the high nibble of the
// last byte of an odd-sized tensor is the code of 0, as on the CPU).
template <int MODE, int E>
__device__ __forceinline__ void write_codes(uint8_t* codes, int64_t i0, int64_t n, bool vec,
                                            const int (&c)[E]) {
  if (BlockTraits<MODE>::kNibbles) {
    constexpr int NB = E / 2;
    uint8_t b[NB];
#pragma unroll
    for (int j = 0; j < NB; ++j) b[j] = static_cast<uint8_t>(c[2 * j] | (c[2 * j + 1] << 4));
    if (vec) {
      store_vec<uint8_t, NB>(codes + i0 / 2, b);
    } else {
#pragma unroll
      for (int j = 0; j < NB; ++j) {
        if (i0 + 2 * j < n) codes[i0 / 2 + j] = b[j];
      }
    }
  } else {
    uint8_t b[E];
#pragma unroll
    for (int e = 0; e < E; ++e) b[e] = static_cast<uint8_t>(c[e]);
    if (vec) {
      store_vec<uint8_t, E>(codes + i0, b);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (i0 + e < n) codes[i0 + e] = b[e];
      }
    }
  }
}

template <int MODE>
__device__ __forceinline__ void write_scale(void* scales, int64_t blk, float stored,
                                            uint8_t sbits) {
  if (MODE == 3) {
    static_cast<uint8_t*>(scales)[blk] = sbits;
  } else {
    static_cast<float*>(scales)[blk] = stored;
  }
}

// Group geometry shared by the block kernels: warp task -> block, lane -> first element.
template <int MODE>
struct GroupPos {
  static constexpr int B = BlockTraits<MODE>::kBlock;
  static constexpr int L = BlockTraits<MODE>::kLanes;
  static constexpr int E = BlockTraits<MODE>::kElems;
  static constexpr int kBlocksPerWarp = 32 / L;
  int64_t blk;
  int64_t i0;
  bool active;  // the lane's block exists (inactive lanes still join the shuffles)
  __device__ GroupPos(int64_t task, int lane, int64_t nblocks) {
    blk = task * kBlocksPerWarp + lane / L;
    active = blk < nblocks;
    i0 = blk * B + static_cast<int64_t>(lane % L) * E;
  }
};

// ---- fused block-wise step ----
// One warp task = 32 / L moment blocks; lane owns E consecutive elements. FULL: every element of
// the lane's group exists and all pointers are 16-byte aligned (vector accesses, no bounds
// checks) -- the path of every group but a tensor's last; the other path checks each element.
template <int MODE, bool FULL, bool kExact, typename G, typename M>
__device__ __forceinline__ void block_step(const StepParams& p, const SharedMaps& sm,
                                           const GroupPos<MODE>& pos, int64_t n, int lane) {
  constexpr int L = GroupPos<MODE>::L, E = GroupPos<MODE>::E;
  M* master = static_cast<M*>(p.master);
  float g[E], m[E], v[E], w[E];
  int mc[E], vc[E];
  if (p.grad != nullptr) {
    load_f32<G, E>(static_cast<const G*>(p.grad), pos.i0, n, FULL, g);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) g[e] = 0.0f;
  }
  load_f32<M, E>(master, pos.i0, n, FULL, w);
  read_codes<MODE, E>(p.m_codes, pos.i0, n, FULL, mc);
  read_codes<MODE, E>(p.v_codes, pos.i0, n, FULL, vc);
  const float ms = pos.active ? block_scale<MODE>(p.m_scales, pos.blk) : 0.0f;
  const float vs = pos.active ? block_scale<MODE>(p.v_scales, pos.blk) : 0.0f;
  float mmax = 0.0f, vmax = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (FULL || pos.i0 + e < n) {
      m[e] = decode_value<MODE>(mc[e], ms, sm, 0);
      v[e] = decode_value<MODE>(vc[e], vs, sm, 1);
      adam_moments<kExact>(__fmul_rn(g[e], p.grad_scale), m[e], v[e], p);
    } else {
      m[e] = 0.0f;
      v[e] = 0.0f;
    }
    mmax = fmaxf(mmax, fabsf(m[e]));
    vmax = fmaxf(vmax, v[e]);
  }
  mmax = group_max<L>(mmax);
  vmax = group_max<L>(vmax);
  const BlockEnc mb = block_params<MODE, kExact>(mmax);
  const BlockEnc vb = block_params<MODE, kExact>(vmax);
  M out[E];
  const bool sr = p.stochastic != 0;
  // i0 is a multiple of E (a power of two), so the lane's elements share the index's high half.
  const uint32_t range_key = detail::sr_range_key(p.sr_key, pos.i0);
#pragma unroll
  for (int e = 0; e < E; ++e) {
    const int64_t idx = pos.i0 + e;
    // One sr_bits per element serves the master rounding and (one more hash) the moment codes.
    const uint32_t h =
        (sr || kStochasticMoments<MODE>) ? detail::sr_bits_in_range(range_key, idx) : 0U;
    const uint32_t bits = kStochasticMoments<MODE> ? detail::moment_bits(h) : 0U;
    const float sv = adam_sqrt<kExact>(v[e]);  // the update's sqrt(v); also the 4-bit v code's
    mc[e] = encode_code<MODE, 0>(m[e], 0.0f, mb, sm, detail::moment_uniform(bits, 0));
    vc[e] = encode_code<MODE, 1>(v[e], sv, vb, sm, detail::moment_uniform(bits, 1));
    out[e] = write_master<M, MODE != 1 || !kExact>(adam_master_sv<kExact>(w[e], m[e], sv, p), sr, h);
  }
  write_codes<MODE, E>(p.m_codes, pos.i0, n, FULL, mc);
  write_codes<MODE, E>(p.v_codes, pos.i0, n, FULL, vc);
  if (FULL) {
    store_vec<M, E>(master + pos.i0, out);
  } else {
#pragma unroll
    for (int e = 0; e < E; ++e) {
      if (pos.i0 + e < n) master[pos.i0 + e] = out[e];
    }
  }
  if (pos.active && lane % L == 0) {
    write_scale<MODE>(p.m_scales, pos.blk, mb.stored, mb.sbits);
    write_scale<MODE>(p.v_scales, pos.blk, vb.stored, vb.sbits);
  }
}

template <int MODE>
constexpr int kBlockMinCtas = MODE == 3 ? 5 : 4;

template <int MODE, bool kExact, typename G, typename M>
__global__ void __launch_bounds__(kThreads, kBlockMinCtas<MODE>) adamw_block_kernel(StepParams p) {
  if (p.skip != nullptr && *p.skip != 0) return;  // uniform for the whole grid
  using Pos = GroupPos<MODE>;
  constexpr int B = Pos::B;
  __shared__ SharedMaps sm;
  load_shared_maps<MODE>(sm);
  const int lane = threadIdx.x & 31;
  const int64_t nblocks = (p.n + B - 1) / B;
  const int64_t tasks = (nblocks + Pos::kBlocksPerWarp - 1) / Pos::kBlocksPerWarp;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       task < tasks; task += warps) {  // uniform per warp: shuffles see all 32 lanes
    const Pos pos(task, lane, nblocks);
    // Warp-uniform choice: the task's last element lies inside the tensor.
    const int64_t task_end = (task + 1) * Pos::kBlocksPerWarp * B;
    if (p.vec_ok != 0 && task_end <= p.n) {
      block_step<MODE, true, kExact, G, M>(p, sm, pos, p.n, lane);
    } else {
      block_step<MODE, false, kExact, G, M>(p, sm, pos, pos.active ? p.n : 0, lane);
    }
  }
}

// ---- standalone codec ----
template <int MODE>
__global__ void pack_kernel(const float* x, int64_t n_total, int moment, uint32_t sr_key,
                            uint8_t* codes, void* scales) {
  using Pos = GroupPos<MODE>;
  constexpr int B = Pos::B, L = Pos::L, E = Pos::E;
  __shared__ SharedMaps sm;
  load_shared_maps<MODE>(sm);
  const int lane = threadIdx.x & 31;
  const int64_t nblocks = (n_total + B - 1) / B;
  const int64_t tasks = (nblocks + Pos::kBlocksPerWarp - 1) / Pos::kBlocksPerWarp;
  const int64_t warps = (static_cast<int64_t>(gridDim.x) * blockDim.x) >> 5;
  for (int64_t task = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
       task < tasks; task += warps) {
    const Pos pos(task, lane, nblocks);
    const int64_t n = pos.active ? n_total : 0;
    float val[E];
    load_f32<float, E>(x, pos.i0, n, false, val);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(val[e]));
    amax = group_max<L>(amax);
    const BlockEnc b = block_params<MODE>(amax);
    int c[E];
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const uint32_t mb =
          kStochasticMoments<MODE> ? detail::moment_bits(detail::sr_bits(sr_key, pos.i0 + e)) : 0U;
      const float u = detail::moment_uniform(mb, moment);
      c[e] = moment == 0 ? encode_code<MODE, 0>(val[e], 0.0f, b, sm, u)
                         : encode_code<MODE, 1>(val[e], __fsqrt_rn(val[e]), b, sm, u);
    }
    write_codes<MODE, E>(codes, pos.i0, n, false, c);
    if (pos.active && lane % L == 0) write_scale<MODE>(scales, pos.blk, b.stored, b.sbits);
  }
}

template <int MODE>
__global__ void unpack_kernel(const uint8_t* codes, const void* scales, int64_t n, int moment,
                              float* x) {
  constexpr int B = BlockTraits<MODE>::kBlock;
  __shared__ SharedMaps sm;
  load_shared_maps<MODE>(sm);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += stride) {
    const uint8_t byte = BlockTraits<MODE>::kNibbles ? codes[i >> 1] : codes[i];
    const int code = BlockTraits<MODE>::kNibbles ? ((i & 1) ? (byte >> 4) : (byte & 15)) : byte;
    x[i] = decode_value<MODE>(code, block_scale<MODE>(scales, i / B), sm, moment);
  }
}

// ---- sum of squares ----
// Each thread sums the squares of its 16-byte vectors (grid-stride, two vectors in flight) and
// then, one element at a time, the unaligned head and the tail, into fixed accumulators; the CTA
// reduces in a fixed tree. Deterministic for a given n and pointer alignment.
template <typename G>
__global__ void sumsq_kernel(const G* g, int64_t n, float* partials) {
  constexpr int V = 16 / sizeof(G);  // elements per vector
  __shared__ float red[256];
  float acc[2] = {0.0f, 0.0f};
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  // Elements before the first 16-byte boundary, then whole vectors, then the tail.
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(g) & 15) / sizeof(G));
  const int64_t head = mis == 0 ? 0 : (V - mis < n ? V - mis : n);
  const int64_t nvec = (n - head) / V;
  const Vec<G, V>* vp = reinterpret_cast<const Vec<G, V>*>(g + head);
  int64_t i = tid;
  for (; i + stride < nvec; i += 2 * stride) {
    const Vec<G, V> r0 = vp[i], r1 = vp[i + stride];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x0 = to_f(r0.v[e]), x1 = to_f(r1.v[e]);
      acc[0] = __fadd_rn(acc[0], __fmul_rn(x0, x0));
      acc[1] = __fadd_rn(acc[1], __fmul_rn(x1, x1));
    }
  }
  for (; i < nvec; i += stride) {
    const Vec<G, V> r0 = vp[i];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x0 = to_f(r0.v[e]);
      acc[0] = __fadd_rn(acc[0], __fmul_rn(x0, x0));
    }
  }
  const int64_t rest = n - head - nvec * V;  // < V
  if (tid < head) {
    const float x = to_f(g[tid]);
    acc[1] = __fadd_rn(acc[1], __fmul_rn(x, x));
  } else if (tid < head + rest) {
    const float x = to_f(g[head + nvec * V + (tid - head)]);
    acc[1] = __fadd_rn(acc[1], __fmul_rn(x, x));
  }
  red[threadIdx.x] = acc[0] + acc[1];
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = red[0];
}

constexpr int kCtasPerSm = 8;  // 8 x 256 threads = the 2048-thread limit of an SM (sm_80/90)

// Persistent grid: enough CTAs for `threads` threads, at most kCtasPerSm per SM.
int64_t persistent_grid(int64_t threads) {
  const int64_t need = (threads + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * kCtasPerSm;
  return need < 1 ? 1 : (need < cap ? need : cap);
}

// Block kernels: one wave of the CTAs that fit an SM at their register bound (kBlockMinCtas), so
// no CTA waits for a second wave.
template <int MODE>
int64_t block_kernel_grid(int64_t n) {
  using Pos = GroupPos<MODE>;
  const int64_t nblocks = (n + Pos::B - 1) / Pos::B;
  const int64_t tasks = (nblocks + Pos::kBlocksPerWarp - 1) / Pos::kBlocksPerWarp;
  const int64_t need = (tasks * 32 + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * kBlockMinCtas<MODE>;
  return need < 1 ? 1 : (need < cap ? need : cap);
}

int64_t grid_for_elems(int64_t n) {
  const int64_t g = (n + kThreads - 1) / kThreads;
  return g < 65535 * 8 ? g : 65535 * 8;
}

bool aligned16(const void* ptr) { return (reinterpret_cast<uintptr_t>(ptr) & 15) == 0; }

template <typename G, typename M>
void launch_typed(const StepParams& p, cudaStream_t s) {
  switch (p.mode) {
    case 0:
      adamw_fp32_kernel<G, M>
          <<<persistent_grid((p.n + kFp32Elems - 1) / kFp32Elems), kThreads, 0, s>>>(p);
      break;
    case 1:
      if (p.exact != 0) {
        adamw_block_kernel<1, true, G, M><<<block_kernel_grid<1>(p.n), kThreads, 0, s>>>(p);
      } else {
        adamw_block_kernel<1, false, G, M><<<block_kernel_grid<1>(p.n), kThreads, 0, s>>>(p);
      }
      break;
    case 2:
      if (p.exact != 0) {
        adamw_block_kernel<2, true, G, M><<<block_kernel_grid<2>(p.n), kThreads, 0, s>>>(p);
      } else {
        adamw_block_kernel<2, false, G, M><<<block_kernel_grid<2>(p.n), kThreads, 0, s>>>(p);
      }
      break;
    case 3:  // NVFP4 (a comparison format): always the exact arithmetic
      adamw_block_kernel<3, true, G, M><<<block_kernel_grid<3>(p.n), kThreads, 0, s>>>(p);
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: bad state mode " + std::to_string(p.mode));
  }
}

template <typename G>
void launch_grad(const StepParams& p, cudaStream_t s) {
  switch (p.master_dtype) {
    case kDtF32:
      return launch_typed<G, float>(p, s);
    case kDtF16:
      return launch_typed<G, __half>(p, s);
    case kDtBF16:
      return launch_typed<G, __nv_bfloat16>(p, s);
    default:
      throw std::runtime_error("q4::optim CUDA: bad master dtype");
  }
}

}  // namespace

void launch_adamw_step(const StepParams& params, cudaStream_t stream) {
  if (params.n == 0) return;
  ensure_tables();
  StepParams p = params;
  p.vec_ok = aligned16(p.grad) && aligned16(p.master) &&
             (p.mode == 0 ? aligned16(p.m32) && aligned16(p.v32)
                          : aligned16(p.m_codes) && aligned16(p.v_codes));
  switch (p.grad_dtype) {
    case kDtF32:
      launch_grad<float>(p, stream);
      break;
    case kDtF16:
      launch_grad<__half>(p, stream);
      break;
    case kDtBF16:
      launch_grad<__nv_bfloat16>(p, stream);
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: bad grad dtype");
  }
  check(cudaGetLastError(), "adamw step launch");
}

void launch_sumsq(const void* g, int dtype, int64_t n, float* partials, cudaStream_t stream) {
  switch (dtype) {
    case kDtF32:
      sumsq_kernel<float>
          <<<kSumsqPartials, kThreads, 0, stream>>>(static_cast<const float*>(g), n, partials);
      break;
    case kDtF16:
      sumsq_kernel<__half>
          <<<kSumsqPartials, kThreads, 0, stream>>>(static_cast<const __half*>(g), n, partials);
      break;
    case kDtBF16:
      sumsq_kernel<__nv_bfloat16><<<kSumsqPartials, kThreads, 0, stream>>>(
          static_cast<const __nv_bfloat16*>(g), n, partials);
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: bad grad dtype");
  }
  check(cudaGetLastError(), "sumsq launch");
}

namespace {
__global__ void nonfinite_flag_kernel(const float* partials, int n, int32_t* flag) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += 32) s += partials[i];
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  if (threadIdx.x == 0) *flag = isfinite(s) ? 0 : 1;
}
}  // namespace

void launch_nonfinite_flag(const float* partials, int n, int32_t* flag, cudaStream_t stream) {
  nonfinite_flag_kernel<<<1, 32, 0, stream>>>(partials, n, flag);
  check(cudaGetLastError(), "nonfinite flag launch");
}

void launch_pack_moment(const float* x, int64_t n, int mode, int moment, uint32_t sr_key,
                        uint8_t* codes, void* scales, cudaStream_t stream) {
  if (n == 0) return;
  ensure_tables();
  switch (mode) {
    case 1:
      pack_kernel<1>
          <<<block_kernel_grid<1>(n), kThreads, 0, stream>>>(x, n, moment, sr_key, codes, scales);
      break;
    case 2:
      pack_kernel<2>
          <<<block_kernel_grid<2>(n), kThreads, 0, stream>>>(x, n, moment, sr_key, codes, scales);
      break;
    case 3:
      pack_kernel<3>
          <<<block_kernel_grid<3>(n), kThreads, 0, stream>>>(x, n, moment, sr_key, codes, scales);
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: pack: bad mode");
  }
  check(cudaGetLastError(), "pack launch");
}

void launch_unpack_moment(const uint8_t* codes, const void* scales, int64_t n, int mode, int moment,
                          float* x, cudaStream_t stream) {
  if (n == 0) return;
  ensure_tables();
  const int64_t grid = grid_for_elems(n);
  switch (mode) {
    case 1:
      unpack_kernel<1><<<grid, kThreads, 0, stream>>>(codes, scales, n, moment, x);
      break;
    case 2:
      unpack_kernel<2><<<grid, kThreads, 0, stream>>>(codes, scales, n, moment, x);
      break;
    case 3:
      unpack_kernel<3><<<grid, kThreads, 0, stream>>>(codes, scales, n, moment, x);
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: unpack: bad mode");
  }
  check(cudaGetLastError(), "unpack launch");
}

}  // namespace q4::optim::cuda
