// Fused CUDA AdamW step: one kernel per moment mode reads gradient, master and the (packed)
// moments once and writes master and moments once. Block-wise modes give each moment block to a
// group of lanes (one warp per 256/128-element block, half a warp per NVFP4 block): decode,
// update, group absmax by shuffles, re-quantize, write. Arithmetic is the CPU path's, op for op,
// with explicit round-to-nearest intrinsics (no FMA contraction), so results are bit-identical.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

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

__constant__ float c_map_value[4][256];  // MapId -> decoded value per code
__constant__ float c_map_mid[4][256];    // MapId -> midpoints (size - 1 used)
__constant__ int c_map_size[4];

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
  int size[4];
  for (int i = 0; i < 4; ++i) {
    const CodeMap m = detail::make_code_map(static_cast<MapId>(i));
    size[i] = m.size;
    for (int j = 0; j < m.size; ++j) value[i][j] = m.value[j];
    for (int j = 0; j + 1 < m.size; ++j) mid[i][j] = m.mid[j];
  }
  check(cudaMemcpyToSymbol(c_map_value, value, sizeof(value)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_mid, mid, sizeof(mid)), "copy code maps");
  check(cudaMemcpyToSymbol(c_map_size, size, sizeof(size)), "copy code maps");
  ready[dev] = true;
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

// Master write-back (docs/optim.md): saturate at the largest finite value, round to nearest, or
// pick the neighbour further from the RN candidate with probability |x - a| / |b - a|.
template <typename M>
__device__ __forceinline__ M write_master(float x, bool stochastic, uint32_t key, int64_t idx) {
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
    const float prob = __fdiv_rn(fabsf(__fsub_rn(x, af)), fabsf(__fsub_rn(bf, af)));
    const float u = detail::sr_uniform(detail::sr_bits(key, idx));
    return u < prob ? b : a;
  }
}

__device__ __forceinline__ void adam_moments(float g, float& m, float& v, const StepParams& p) {
  m = __fadd_rn(__fmul_rn(m, p.beta1), __fmul_rn(g, p.one_minus_beta1));
  v = __fadd_rn(__fmul_rn(v, p.beta2), __fmul_rn(__fmul_rn(g, g), p.one_minus_beta2));
}

__device__ __forceinline__ float adam_master(float w, float m, float v, const StepParams& p) {
  const float den = __fadd_rn(__fmul_rn(__fsqrt_rn(v), p.inv_sqrt_bc2), p.eps);
  const float u = __fmul_rn(__fdiv_rn(m, den), p.step_size);
  return __fsub_rn(__fmul_rn(w, p.decay), u);
}

template <typename G>
__device__ __forceinline__ float load_grad(const void* g, int64_t i, float scale) {
  return g == nullptr ? 0.0f : __fmul_rn(to_f(static_cast<const G*>(g)[i]), scale);
}

// ---- fp32 moments ----
template <typename G, typename M>
__global__ void adamw_fp32_kernel(StepParams p) {
  M* master = static_cast<M*>(p.master);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < p.n;
       i += stride) {
    const float g = load_grad<G>(p.grad, i, p.grad_scale);
    float m = p.m32[i], v = p.v32[i];
    adam_moments(g, m, v, p);
    p.m32[i] = m;
    p.v32[i] = v;
    master[i] =
        write_master<M>(adam_master(to_f(master[i]), m, v, p), p.stochastic != 0, p.sr_key, i);
  }
}

// ---- block codecs (device) ----
template <int MODE>
struct BlockTraits;
template <>
struct BlockTraits<1> {  // int8
  static constexpr int kBlock = 256;
  static constexpr bool kNibbles = false;
};
template <>
struct BlockTraits<2> {  // 4-bit
  static constexpr int kBlock = 128;
  static constexpr bool kNibbles = true;
};
template <>
struct BlockTraits<3> {  // NVFP4
  static constexpr int kBlock = 16;
  static constexpr bool kNibbles = true;
};

template <int MODE>
__device__ __forceinline__ int read_code(const uint8_t* codes, int64_t idx) {
  if (BlockTraits<MODE>::kNibbles) {
    const uint8_t b = codes[idx >> 1];
    return (idx & 1) ? (b >> 4) : (b & 15);
  }
  return codes[idx];
}

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
  int size[2];
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
  }
  if (threadIdx.x < 2) sm.size[threadIdx.x] = c_map_size[base + threadIdx.x];
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

// Per-block encoding parameters from the block absmax. For int8/4-bit `inv` is the divisor
// (absmax, or 1 for an all-zero block); for NVFP4 it is decoded E4M3 scale + 1e-12.
template <int MODE>
__device__ __forceinline__ void block_params(float amax, float& stored, float& div,
                                             uint8_t& sbits) {
  if (MODE == 3) {
    const float s_in = fminf(fmaxf(__fdiv_rn(amax, 6.0f), detail::kScaleMin), detail::kE4m3Max);
    sbits = detail::e4m3_encode(s_in);
    div = __fadd_rn(detail::e4m3_decode(sbits), 1e-12f);
    stored = 0.0f;
  } else {
    stored = amax;
    div = amax == 0.0f ? 1.0f : amax;
    sbits = 0;
  }
}

template <int MODE>
__device__ __forceinline__ int encode_value(float x, float div, const SharedMaps& sm, int slot) {
  if (MODE == 3) {
    const float d = fminf(fmaxf(__fdiv_rn(x, div), -detail::kE2m1Max), detail::kE2m1Max);
    return detail::e2m1_encode(d);
  }
  const float y = __fdiv_rn(x, div);
  // #{j : mid[j] < y} by binary search over the sorted midpoints (== at::bucketize).
  int lo = 0, hi = sm.size[slot] - 1;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (sm.mid[slot][mid] < y) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Writes the codes of one group's elements; for nibbles, even lanes write the byte with their
// odd neighbour (lane ^ 1 holds element idx ^ 1).
template <int MODE>
__device__ __forceinline__ void write_code(uint8_t* codes, int64_t idx, int code, int64_t n,
                                           bool lane_even) {
  if (BlockTraits<MODE>::kNibbles) {
    const int partner = __shfl_xor_sync(0xffffffffu, code, 1);
    if (lane_even && idx < n) codes[idx >> 1] = static_cast<uint8_t>(code | (partner << 4));
  } else if (idx < n) {
    codes[idx] = static_cast<uint8_t>(code);
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

// ---- fused block-wise step ----
template <int MODE, typename G, typename M>
__global__ void adamw_block_kernel(StepParams p) {
  constexpr int B = BlockTraits<MODE>::kBlock;
  constexpr int GROUP = B >= 32 ? 32 : B;
  constexpr int EPL = B / GROUP;
  constexpr int PER_WARP = 32 / GROUP;
  const int lane = threadIdx.x & 31;
  const int gl = lane % GROUP;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t nblocks = (p.n + B - 1) / B;
  const int64_t blk = warp * PER_WARP + lane / GROUP;
  const bool active = blk < nblocks;  // inactive lanes still join the shuffles
  __shared__ SharedMaps sm;
  load_shared_maps<MODE>(sm);
  M* master = static_cast<M*>(p.master);
  float m[EPL], v[EPL];
  const float ms = active ? block_scale<MODE>(p.m_scales, blk) : 0.0f;
  const float vs = active ? block_scale<MODE>(p.v_scales, blk) : 0.0f;
  float mmax = 0.0f, vmax = 0.0f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t idx = blk * B + e * GROUP + gl;
    const bool valid = active && idx < p.n;
    float g = 0.0f;
    m[e] = 0.0f;
    v[e] = 0.0f;
    if (valid) {
      g = load_grad<G>(p.grad, idx, p.grad_scale);
      m[e] = decode_value<MODE>(read_code<MODE>(p.m_codes, idx), ms, sm, 0);
      v[e] = decode_value<MODE>(read_code<MODE>(p.v_codes, idx), vs, sm, 1);
      adam_moments(g, m[e], v[e], p);
    }
    mmax = fmaxf(mmax, fabsf(m[e]));
    vmax = fmaxf(vmax, v[e]);
  }
  mmax = group_max<GROUP>(mmax);
  vmax = group_max<GROUP>(vmax);
  float m_stored, m_div, v_stored, v_div;
  uint8_t m_bits, v_bits;
  block_params<MODE>(mmax, m_stored, m_div, m_bits);
  block_params<MODE>(vmax, v_stored, v_div, v_bits);
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t idx = blk * B + e * GROUP + gl;
    const int64_t n_eff = active ? p.n : 0;
    write_code<MODE>(p.m_codes, idx, encode_value<MODE>(m[e], m_div, sm, 0), n_eff, (gl & 1) == 0);
    write_code<MODE>(p.v_codes, idx, encode_value<MODE>(v[e], v_div, sm, 1), n_eff, (gl & 1) == 0);
    if (active && idx < p.n) {
      master[idx] = write_master<M>(adam_master(to_f(master[idx]), m[e], v[e], p),
                                    p.stochastic != 0, p.sr_key, idx);
    }
  }
  if (active && gl == 0) {
    write_scale<MODE>(p.m_scales, blk, m_stored, m_bits);
    write_scale<MODE>(p.v_scales, blk, v_stored, v_bits);
  }
}

// ---- standalone codec ----
template <int MODE>
__global__ void pack_kernel(const float* x, int64_t n, int moment, uint8_t* codes, void* scales) {
  constexpr int B = BlockTraits<MODE>::kBlock;
  constexpr int GROUP = B >= 32 ? 32 : B;
  constexpr int EPL = B / GROUP;
  const int lane = threadIdx.x & 31;
  const int gl = lane % GROUP;
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int64_t blk = warp * (32 / GROUP) + lane / GROUP;
  const bool active = blk < (n + B - 1) / B;
  __shared__ SharedMaps sm;
  load_shared_maps<MODE>(sm);
  float val[EPL];
  float amax = 0.0f;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t idx = blk * B + e * GROUP + gl;
    val[e] = (active && idx < n) ? x[idx] : 0.0f;
    amax = fmaxf(amax, fabsf(val[e]));
  }
  amax = group_max<GROUP>(amax);
  float stored, div;
  uint8_t sbits;
  block_params<MODE>(amax, stored, div, sbits);
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int64_t idx = blk * B + e * GROUP + gl;
    write_code<MODE>(codes, idx, encode_value<MODE>(val[e], div, sm, moment), active ? n : 0,
                     (gl & 1) == 0);
  }
  if (active && gl == 0) write_scale<MODE>(scales, blk, stored, sbits);
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
    x[i] =
        decode_value<MODE>(read_code<MODE>(codes, i), block_scale<MODE>(scales, i / B), sm, moment);
  }
}

// ---- sum of squares ----
template <typename G>
__global__ void sumsq_kernel(const G* g, int64_t n, float* partials) {
  __shared__ float red[256];
  float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};  // 4 independent loads in flight per thread
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float x = to_f(g[i + k * stride]);
      acc[k] = __fadd_rn(acc[k], __fmul_rn(x, x));
    }
  }
  for (; i < n; i += stride) {
    const float x = to_f(g[i]);
    acc[0] = __fadd_rn(acc[0], __fmul_rn(x, x));
  }
  red[threadIdx.x] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) partials[blockIdx.x] = red[0];
}

constexpr int kThreads = 256;

int64_t grid_for_blocks(int64_t n, int block) {
  const int group = block >= 32 ? 32 : block;
  const int64_t nblocks = (n + block - 1) / block;
  const int64_t warps = (nblocks + (32 / group) - 1) / (32 / group);
  return (warps * 32 + kThreads - 1) / kThreads;
}

int64_t grid_for_elems(int64_t n) {
  const int64_t g = (n + kThreads - 1) / kThreads;
  return g < 65535 * 8 ? g : 65535 * 8;
}

template <typename G, typename M>
void launch_typed(const StepParams& p, cudaStream_t s) {
  switch (p.mode) {
    case 0:
      adamw_fp32_kernel<G, M><<<grid_for_elems(p.n), kThreads, 0, s>>>(p);
      break;
    case 1:
      adamw_block_kernel<1, G, M><<<grid_for_blocks(p.n, 256), kThreads, 0, s>>>(p);
      break;
    case 2:
      adamw_block_kernel<2, G, M><<<grid_for_blocks(p.n, 128), kThreads, 0, s>>>(p);
      break;
    case 3:
      adamw_block_kernel<3, G, M><<<grid_for_blocks(p.n, 16), kThreads, 0, s>>>(p);
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

void launch_adamw_step(const StepParams& p, cudaStream_t stream) {
  if (p.n == 0) return;
  ensure_tables();
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

void launch_pack_moment(const float* x, int64_t n, int mode, int moment, uint8_t* codes,
                        void* scales, cudaStream_t stream) {
  if (n == 0) return;
  ensure_tables();
  switch (mode) {
    case 1:
      pack_kernel<1><<<grid_for_blocks(n, 256), kThreads, 0, stream>>>(x, n, moment, codes, scales);
      break;
    case 2:
      pack_kernel<2><<<grid_for_blocks(n, 128), kThreads, 0, stream>>>(x, n, moment, codes, scales);
      break;
    case 3:
      pack_kernel<3><<<grid_for_blocks(n, 16), kThreads, 0, stream>>>(x, n, moment, codes, scales);
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
