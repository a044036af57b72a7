// The fused AdamW step with packed moments (int8, 4-bit, NVFP4) and the standalone moment codec.
// They share the code tables in constant memory, which belong to one file (no separable
// compilation): every kernel that reads them is here, and ensure_tables() fills them.
#include <cstring>
#include <limits>
#include <mutex>

#include "adamw_kernels.cuh"

namespace q4::optim::cuda::impl {
namespace {

__constant__ float c_map_value[4][256];    // MapId -> decoded value per code
__constant__ float c_map_mid[4][256];      // MapId -> midpoints (size - 1 used), +inf at 255
__constant__ float c_sr_value4[17];        // 4-bit m: stochastic-rounding entries, +inf at 16
__constant__ float4 c_pick4[17];           // 4-bit m: sr_pick's operands by count (below)
__constant__ float4 c_pick4_fast[17];      // the same with inv_gap * 2^16 (fast kernels)

// Code search lower bounds (optim_math.h "code search") per block mode (0: int8, 1: 4-bit):
// the first moment's rows [sign][bucket], then (int8) the second moment's single row, looked up
// by |v|. Offsets and row lengths follow from kMapSearchBits.
constexpr int kInt8BucketsM = detail::search_buckets(detail::kMapSearchBits[0]);
constexpr int kInt8BucketsV = detail::search_buckets(detail::kMapSearchBits[1]);
constexpr int k4BitBucketsM = detail::search_buckets(detail::kMapSearchBits[2]);
constexpr int kStartBytes = (2 * kInt8BucketsM + kInt8BucketsV + 3) / 4 * 4;
static_assert(2 * k4BitBucketsM <= kStartBytes, "4-bit search table larger than int8's");
static_assert(!detail::kMapSearchSigned[1], "int8 v table is looked up by |v|");
__constant__ uint8_t c_start[2][kStartBytes];

// Offset of a map's rows in its mode's table.
template <int MODE, int SLOT>
constexpr int kStartOffset = (MODE == 1 && SLOT == 1) ? 2 * kInt8BucketsM : 0;

}  // namespace

// Copies the code tables to the current device once (constant memory is per device), after
// checking on the host that every search needs at most the one comparison the kernels do.
void ensure_tables() {
  static std::mutex mu;
  static bool ready[256] = {};
  int dev = 0;
  check_cuda(cudaGetDevice(&dev), "q4::optim CUDA: cudaGetDevice");
  std::lock_guard<std::mutex> lock(mu);
  if (dev < 0 || dev >= 256 || ready[dev]) return;
  const float inf = std::numeric_limits<float>::infinity();
  float value[4][256] = {};
  float mid[4][256] = {};
  float sr_value4[17] = {};
  float4 pick4[17] = {};
  float4 pick4_fast[17] = {};
  static uint8_t start[2][kStartBytes];  // not on the stack
  std::memset(start, 0, sizeof(start));
  for (int i = 0; i < 4; ++i) {
    const CodeMap m = detail::make_code_map(static_cast<MapId>(i));
    const bool expect_sr = i == static_cast<int>(MapId::k4BitFirst) ||
                           i == static_cast<int>(MapId::k4BitSecond);  // kStochasticMoments
    if (m.stochastic != expect_sr || (m.stochastic && m.size != 16)) {
      throw std::runtime_error("q4::optim CUDA: code map " + std::to_string(i) +
                               ": stochastic codes are compiled in for the 16-entry 4-bit maps");
    }
    for (int j = 0; j < m.size; ++j) value[i][j] = m.value[j];
    for (int j = 0; j + 1 < m.size; ++j) mid[i][j] = m.mid[j];
    for (int j = m.size - 1; j < 256; ++j) mid[i][j] = inf;  // sentinel(s)
    if (i == static_cast<int>(MapId::k4BitSecond)) continue;  // closed form, no search
    const float* entries = m.stochastic ? m.sr_value : m.mid;
    const int n = m.stochastic ? m.size : m.size - 1;
    const int steps = detail::max_scan_steps(entries, n, !m.stochastic, m.search_bits,
                                             m.search_start);
    if (steps > 1 || m.search_bits != detail::kMapSearchBits[i]) {
      throw std::runtime_error("q4::optim CUDA: code map " + std::to_string(i) + " needs " +
                               std::to_string(steps) +
                               " search steps at its bucket resolution, the kernels do 1");
    }
    const int nb = detail::search_buckets(m.search_bits);
    uint8_t* dst = start[i < 2 ? 0 : 1] + (i == 1 ? 2 * kInt8BucketsM : 0);
    std::memcpy(dst, m.search_start[0], nb);
    if (detail::kMapSearchSigned[i]) std::memcpy(dst + nb, m.search_start[1], nb);
    if (i == static_cast<int>(MapId::k4BitFirst)) {
      for (int j = 0; j < 16; ++j) sr_value4[j] = m.sr_value[j];
      sr_value4[16] = inf;
      // sr_pick by count c = #{sr_value <= t}: l = clamp(c - 1, 0, 14), p = (t - sr_value[l]) *
      // inv_gap[l], code l + 1 if u < p else l.
      for (int c = 0; c <= 16; ++c) {
        const int l = c - 1 < 0 ? 0 : (c - 1 > 14 ? 14 : c - 1);
        pick4[c] = make_float4(m.sr_value[l], m.inv_gap[l], detail::bits_f32(static_cast<uint32_t>(l)),
                               detail::bits_f32(static_cast<uint32_t>(l + 1)));
        pick4_fast[c] = pick4[c];
        pick4_fast[c].y = m.inv_gap[l] * 65536.0f;  // exact: a power-of-two scale
      }
    }
  }
  check_cuda(cudaMemcpyToSymbol(c_map_value, value, sizeof(value)),
             "q4::optim CUDA: copy code maps");
  check_cuda(cudaMemcpyToSymbol(c_map_mid, mid, sizeof(mid)), "q4::optim CUDA: copy code maps");
  check_cuda(cudaMemcpyToSymbol(c_sr_value4, sr_value4, sizeof(sr_value4)),
             "q4::optim CUDA: copy code maps");
  check_cuda(cudaMemcpyToSymbol(c_pick4, pick4, sizeof(pick4)), "q4::optim CUDA: copy code maps");
  check_cuda(cudaMemcpyToSymbol(c_pick4_fast, pick4_fast, sizeof(pick4_fast)),
             "q4::optim CUDA: copy code maps");
  check_cuda(cudaMemcpyToSymbol(c_start, start, sizeof(start)), "q4::optim CUDA: copy code maps");
  ready[dev] = true;
}

namespace {

// ---- block codecs (device) ----
// kBlock elements per moment block, handled by kLanes lanes of kElems consecutive elements;
// kNibbles: two codes a byte. One row per mode.
template <int Block, int Lanes, int Elems, bool Nibbles>
struct BlockShape {
  static constexpr int kBlock = Block;
  static constexpr int kLanes = Lanes;
  static constexpr int kElems = Elems;
  static constexpr bool kNibbles = Nibbles;
};
template <int MODE>
struct BlockTraits;
template <>
struct BlockTraits<1> : BlockShape<256, 32, 8, false> {};  // int8
template <>
struct BlockTraits<2> : BlockShape<128, 16, 8, true> {};  // 4-bit
template <>
struct BlockTraits<3> : BlockShape<16, 4, 4, true> {};  // NVFP4

template <int MODE>
__device__ __forceinline__ float block_scale(const void* scales, int64_t blk) {
  if (MODE == 3) return detail::e4m3_decode(static_cast<const uint8_t*>(scales)[blk]);
  return static_cast<const float*>(scales)[blk];
}

// The two maps of a mode, staged in shared memory: lanes index them with different codes, which
// __constant__ memory would serialize. Slot 0 = first moment, 1 = second moment.
struct SharedMaps {
  float value[2][256];
  float mid[2][256];      // int8: midpoints, +inf sentinel at 255
  float sr_value4[17];    // 4-bit m: entries, +inf sentinel at 16
  float4 pick4[17];       // 4-bit m: {sr_value[l], inv_gap[l], l, l + 1} by count
  uint8_t start[kStartBytes];  // the mode's search lower bounds (c_start)
};

// kExact: sr_pick's operands as the CPU uses them; else inv_gap * 2^16, compared with the
// uniform's 16-bit integer (fast kernels: one multiply fewer per element, same decisions up to
// the rounding of the product).
template <int MODE, bool kExact = true>
__device__ __forceinline__ void load_shared_maps(SharedMaps& sm) {
  if (MODE == 3) return;
  const int base = MODE == 1 ? 0 : 2;
  const int size = MODE == 1 ? 256 : 16;  // only the entries the mode's maps have
  for (int i = threadIdx.x; i < 2 * size; i += blockDim.x) {
    const int k = i / size, j = i % size;
    sm.value[k][j] = c_map_value[base + k][j];
    if (MODE == 1) sm.mid[k][j] = c_map_mid[base + k][j];
  }
  if (MODE == 2 && threadIdx.x < 17) {
    sm.sr_value4[threadIdx.x] = c_sr_value4[threadIdx.x];
    sm.pick4[threadIdx.x] = kExact ? c_pick4[threadIdx.x] : c_pick4_fast[threadIdx.x];
  }
  // Search tables as 32-bit words (kStartBytes is a multiple of 4).
  constexpr int kWords = kStartBytes / 4;
  const int words = MODE == 1 ? kWords : (2 * k4BitBucketsM + 3) / 4;
  const uint32_t* src = reinterpret_cast<const uint32_t*>(&c_start[MODE - 1][0]);
  uint32_t* dst = reinterpret_cast<uint32_t*>(&sm.start[0]);
  for (int i = threadIdx.x; i < words; i += blockDim.x) dst[i] = src[i];
  __syncthreads();
}

template <int MODE>
__device__ __forceinline__ float decode_value(int code, float scale, const SharedMaps& sm,
                                              int slot) {
  if (MODE == 3) return __fmul_rn(detail::e2m1_decode(static_cast<uint8_t>(code)), scale);
  return __fmul_rn(sm.value[slot][code], scale);
}

// Per-block encoding parameters from the block absmax: int8/4-bit the factors of
// detail::block_norm (one reciprocal per block, no per-element division); NVFP4 the E4M3 scale
// bits and the divisor of docs/design.md#nvfp4-arithmetic (decoded scale + 1e-12, an IEEE
// division per element).
struct BlockEnc {
  detail::BlockNorm bn;
  float stored = 0.0f;  // fp32 absmax (int8/4-bit)
  float rs16 = 16.0f;   // 16 * bn.rs (fast kernels: the 4-bit v code's s = 16 t in one multiply)
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
    // d is normal (f pre-scales a subnormal absmax) and 1/d too below 2^126 (no real moment
    // gets there: IEEE above), so the flushing hardware reciprocal flushes nothing.
    const float d = div * b.bn.f;
    b.bn.inv = d < 8.5070591730234616e37f ? fast_rcp(d) : __frcp_rn(d);
    b.bn.rs = adam_sqrt<false>(b.bn.inv);
    b.rs16 = __fmul_rn(b.bn.rs, 16.0f);
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
// u: the element's uniform (moment_uniform) for stochastic codes. kPlainNorm: the block's
// block_norm has f = 1 (its absmax is a normal number), so y = x * inv -- bit-identical to
// norm_value's (x * f) * inv, one multiply fewer.
// kFast (fast kernels): the 4-bit v code takes s = sx * 16 rs in one multiply, and the 4-bit
// m pick compares u = the uniform's 16-bit integer with the table's inv_gap * 2^16.
template <int MODE, int SLOT, bool kPlainNorm, bool kFast = false>
__device__ __forceinline__ int encode_code(float x, float sx, const BlockEnc& b,
                                           const SharedMaps& sm, float u) {
  if (MODE == 3) return detail::e2m1_encode(__fdiv_rn(x, b.div));  // unclamped: same code
  if (MODE == 2 && SLOT == 1) {
    if (kFast && kPlainNorm) return detail::sr_pick_4bit_second_s(__fmul_rn(sx, b.rs16), u);
    const float t = kPlainNorm ? __fmul_rn(sx, b.bn.rs) : detail::norm_sqrt(sx, b.bn);
    return detail::sr_pick_4bit_second(t, u);
  }
  const float y = kPlainNorm ? __fmul_rn(x, b.bn.inv) : detail::norm_value(x, b.bn);
  constexpr int kId = (MODE == 1 ? 0 : 2) + SLOT;
  constexpr int kBits = detail::kMapSearchBits[kId];
  constexpr int kRow = detail::search_buckets(kBits);
  const int row = detail::kMapSearchSigned[kId] ? static_cast<int>(__float_as_uint(y) >> 31) * kRow
                                                : 0;
  const int start = sm.start[kStartOffset<MODE, SLOT> + row + detail::search_bucket(y, kBits)];
  if (MODE == 2) {
    const int count = detail::count_one_step(sm.sr_value4, false, start, y);
    const float4 q = sm.pick4[count];
    const float p = __fmul_rn(__fsub_rn(y, q.x), q.y);  // sr_pick's probability, same rounding
    return __float_as_int(u < p ? q.w : q.z);
  }
  return detail::count_one_step(sm.mid[SLOT], true, start, y);
}

// The codes of a lane's E elements, packed as in memory (int8: one byte each; 4-bit and NVFP4:
// nibbles, element 2j in the low half of byte j) in 32-bit words kept in registers: codes are
// read and written in place, so a lane holds E/4 (int8) or E/8 words instead of E integers.
template <int MODE, int E>
struct CodeWords {
  static constexpr int kBits = BlockTraits<MODE>::kNibbles ? 4 : 8;
  static constexpr int kBytes = E * kBits / 8;
  static constexpr int kWords = (kBytes + 3) / 4;
  uint32_t w[kWords];
  __device__ __forceinline__ int get(int e) const {
    return static_cast<int>((w[e * kBits / 32] >> ((e * kBits) % 32)) & ((1u << kBits) - 1));
  }
  // Element e's slot must be zero (set() after clear()).
  __device__ __forceinline__ void set(int e, int c) {
    w[e * kBits / 32] |= static_cast<uint32_t>(c) << ((e * kBits) % 32);
  }
  __device__ __forceinline__ void clear() {
#pragma unroll
    for (int k = 0; k < kWords; ++k) w[k] = 0;
  }
  __device__ __forceinline__ uint8_t byte(int j) const {
    return static_cast<uint8_t>(w[j / 4] >> (8 * (j % 4)));
  }
};

// Reads the codes of elements [i0, i0 + E) (i0 a multiple of E, E even for nibbles): one aligned
// vector access when `vec`, else byte by byte (bytes past the tensor read as 0).
template <int MODE, int E>
__device__ __forceinline__ void read_codes(const uint8_t* codes, int64_t i0, int64_t n, bool vec,
                                           CodeWords<MODE, E>& c) {
  using CW = CodeWords<MODE, E>;
  const int64_t b0 = CW::kBits == 4 ? i0 / 2 : i0;
  if (vec) {
    if constexpr (CW::kBytes == 2) {
      c.w[0] = *reinterpret_cast<const uint16_t*>(codes + b0);
    } else if constexpr (CW::kBytes == 4) {
      c.w[0] = *reinterpret_cast<const uint32_t*>(codes + b0);
    } else {
      static_assert(CW::kBytes == 8, "lane code widths: 2, 4 or 8 bytes");
      const uint2 r = *reinterpret_cast<const uint2*>(codes + b0);
      c.w[0] = r.x;
      c.w[1] = r.y;
    }
  } else {
    c.clear();
#pragma unroll
    for (int j = 0; j < CW::kBytes; ++j) {
      const int64_t first = CW::kBits == 4 ? i0 + 2 * j : i0 + j;  // the byte's first element
      if (first < n) c.w[j / 4] |= static_cast<uint32_t>(codes[b0 + j]) << (8 * (j % 4));
    }
  }
}

// Writes the codes of elements [i0, i0 + E). A byte is written when its first element is inside
// the tensor (for nibbles: the high nibble of the last byte of an odd-sized tensor is the code
// of 0, as on the CPU).
template <int MODE, int E>
__device__ __forceinline__ void write_codes(uint8_t* codes, int64_t i0, int64_t n, bool vec,
                                            const CodeWords<MODE, E>& c) {
  using CW = CodeWords<MODE, E>;
  const int64_t b0 = CW::kBits == 4 ? i0 / 2 : i0;
  if (vec) {
    if constexpr (CW::kBytes == 2) {
      *reinterpret_cast<uint16_t*>(codes + b0) = static_cast<uint16_t>(c.w[0]);
    } else if constexpr (CW::kBytes == 4) {
      *reinterpret_cast<uint32_t*>(codes + b0) = c.w[0];
    } else {
      *reinterpret_cast<uint2*>(codes + b0) = make_uint2(c.w[0], c.w[1]);
    }
  } else {
#pragma unroll
    for (int j = 0; j < CW::kBytes; ++j) {
      const int64_t first = CW::kBits == 4 ? i0 + 2 * j : i0 + j;
      if (first < n) codes[b0 + j] = c.byte(j);
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
  // first: the task's first element (a multiple of kBlocksPerWarp * B).
  __device__ GroupPos(int64_t first, int lane, int64_t nblocks) {
    static_assert((B & (B - 1)) == 0, "block sizes are powers of two");
    blk = static_cast<int64_t>(static_cast<uint64_t>(first) / B) + lane / L;
    active = blk < nblocks;
    i0 = first + (lane / L) * B + (lane % L) * E;
  }
};

// ---- fused block-wise step ----
// One warp task = 32 / L moment blocks; lane owns E consecutive elements. FULL: every element of
// the lane's group exists and all pointers are 16-byte aligned (vector accesses, no bounds
// checks) -- the path of every group but a tensor's last; the other path checks each element.
template <int MODE, bool FULL, bool kExact, bool kSR, typename G, typename M>
__device__ __forceinline__ void block_step(const StepParams& p, const SharedMaps& sm,
                                           const GroupPos<MODE>& pos, int64_t n, int lane) {
  constexpr int L = GroupPos<MODE>::L, E = GroupPos<MODE>::E;
  M* master = static_cast<M*>(p.master);
  float g[E], m[E], v[E], w[E];
  CodeWords<MODE, E> mc, vc;
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
  constexpr bool kFast = !kExact && MODE != 3;  // folded constants (StepParams fast_*)
  const float mdec = kFast ? __fmul_rn(ms, p.beta1) : 0.0f;
  const float vdec = kFast ? __fmul_rn(vs, p.beta2) : 0.0f;
  float mmax = 0.0f, vmax = 0.0f;
#pragma unroll
  for (int e = 0; e < E; ++e) {
    if (FULL || pos.i0 + e < n) {
      if constexpr (kFast) {
        // decode * beta and the scaled gradient in one fused multiply-add each
        m[e] = __fmaf_rn(sm.value[0][mc.get(e)], mdec, __fmul_rn(g[e], p.fast_c1));
        v[e] = __fmaf_rn(sm.value[1][vc.get(e)], vdec, __fmul_rn(__fmul_rn(g[e], p.fast_c2), g[e]));
      } else {
        m[e] = decode_value<MODE>(mc.get(e), ms, sm, 0);
        v[e] = decode_value<MODE>(vc.get(e), vs, sm, 1);
        adam_moments<kExact>(__fmul_rn(g[e], p.grad_scale), m[e], v[e], p);
      }
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
  constexpr bool sr = kSR;  // stochastic master rounding (StepParams::stochastic)
  // i0 is a multiple of E (a power of two), so the lane's elements share the index's high half.
  const uint32_t range_key = detail::sr_range_key(p.sr_key, pos.i0);
  auto encode = [&](auto plain) {
    constexpr bool kPlain = decltype(plain)::value;
    mc.clear();  // the codes read above are decoded: the words now collect the new ones
    vc.clear();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t idx = pos.i0 + e;
      // One sr_bits per element serves the master rounding and the moment codes.
      const uint32_t h =
          (sr || kStochasticMoments<MODE>) ? detail::sr_bits_in_range(range_key, idx) : 0U;
      const float sv = adam_sqrt<kExact>(v[e]);  // the update's sqrt(v); also the 4-bit v code's
      // Fast kernels compare the first moment's 16-bit integer with a 2^16-scaled probability.
      const float um = kFast ? static_cast<float>(h >> 16) : detail::moment_uniform(h, 0);
      mc.set(e, encode_code<MODE, 0, kPlain, kFast>(m[e], 0.0f, mb, sm, um));
      vc.set(e, encode_code<MODE, 1, kPlain, kFast>(v[e], sv, vb, sm, detail::moment_uniform(h, 1)));
      out[e] = write_master<M>(adam_master_sv<kExact>(w[e], m[e], sv, p), sr, h);
    }
  };
  // Blocks with a subnormal absmax need block_norm's 2^64 pre-scale (rare): the warp takes the
  // general path when any of its blocks does (a warp-uniform branch).
  if (MODE != 3 && !__any_sync(0xffffffffu, mb.bn.f != 1.0f || vb.bn.f != 1.0f)) {
    encode(std::true_type{});
  } else {
    encode(std::false_type{});
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

// The block kernels are register-bounded so that 4 (int8: 64 registers; unbounded it used 72) or
// 5 (4-bit, NVFP4: 48) CTAs fit an SM; ptxas reports no spills with these bounds (6 spilled).
template <int MODE>
constexpr int kBlockMinCtas = MODE == 3 ? 5 : 4;

// One tensor's update by CTA `cta` of the `ctas` it is given. An element's result depends only
// on its block and its index, never on the grid, so any split over CTAs gives the same bits.
template <int MODE, bool kExact, bool kSR, typename G, typename M>
__device__ __forceinline__ void block_tensor(const StepParams& p, SharedMaps& sm, int cta,
                                             int ctas) {
  if (p.skip != nullptr && *p.skip != 0) return;  // uniform for the whole grid
  using Pos = GroupPos<MODE>;
  constexpr int B = Pos::B;
  load_shared_maps<MODE, kExact>(sm);
  const int lane = threadIdx.x & 31;
  const int64_t nblocks = (p.n + B - 1) / B;
  const int64_t tasks = (nblocks + Pos::kBlocksPerWarp - 1) / Pos::kBlocksPerWarp;
  const int64_t warps = (static_cast<int64_t>(ctas) * blockDim.x) >> 5;
  // Tasks whose every element lies inside the tensor take the vector path when all pointers are
  // 16-byte aligned: with a grid-stride loop these are a prefix, so the loop is split in two
  // (no per-task check). Uniform per warp: shuffles see all 32 lanes.
  constexpr int64_t kTaskElems = Pos::kBlocksPerWarp * B;
  const int64_t full_end = p.vec_ok != 0 ? p.n / kTaskElems * kTaskElems : 0;
  const int64_t end = tasks * kTaskElems;
  const int64_t step = warps * kTaskElems;
  // The loop state is one 64-bit element index per warp task (GroupPos derives the rest).
  int64_t first = ((static_cast<int64_t>(cta) * blockDim.x + threadIdx.x) >> 5) * kTaskElems;
  for (; first < full_end; first += step) {
    block_step<MODE, true, kExact, kSR, G, M>(p, sm, Pos(first, lane, nblocks), p.n, lane);
  }
  for (; first < end; first += step) {
    const Pos pos(first, lane, nblocks);
    block_step<MODE, false, kExact, kSR, G, M>(p, sm, pos, pos.active ? p.n : 0, lane);
  }
}

template <int MODE, bool kExact, bool kSR, typename G, typename M>
__global__ void __launch_bounds__(kThreads, kBlockMinCtas<MODE>) adamw_block_kernel(StepParams p) {
  __shared__ SharedMaps sm;
  block_tensor<MODE, kExact, kSR, G, M>(p, sm, static_cast<int>(blockIdx.x),
                                        static_cast<int>(gridDim.x));
}

// Several small tensors of one kind (mode, arithmetic, rounding, dtypes) in one launch: tensor k
// owns CTAs [cta_start[k], cta_start[k + 1]), as many as its own launch would take. A few
// hundred adapter tensors a step would otherwise each pay a launch and a pipeline ramp.
struct StepBatch {
  StepParams p[kStepBatch];
  int cta_start[kStepBatch + 1];
  int count;
};
static_assert(sizeof(StepBatch) <= 4096, "StepBatch must fit the kernel parameter space");

template <int MODE, bool kExact, bool kSR, typename G, typename M>
__global__ void __launch_bounds__(kThreads, kBlockMinCtas<MODE>)
    adamw_block_multi_kernel(StepBatch b) {
  __shared__ SharedMaps sm;
  int k = 0;
  while (k + 1 < b.count && b.cta_start[k + 1] <= static_cast<int>(blockIdx.x)) ++k;
  block_tensor<MODE, kExact, kSR, G, M>(b.p[k], sm, static_cast<int>(blockIdx.x) - b.cta_start[k],
                                        b.cta_start[k + 1] - b.cta_start[k]);
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
    const Pos pos(task * Pos::kBlocksPerWarp * B, lane, nblocks);
    const int64_t n = pos.active ? n_total : 0;
    float val[E];
    load_f32<float, E>(x, pos.i0, n, false, val);
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) amax = fmaxf(amax, fabsf(val[e]));
    amax = group_max<L>(amax);
    const BlockEnc b = block_params<MODE>(amax);
    CodeWords<MODE, E> c;
    c.clear();
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const float u = kStochasticMoments<MODE>
                          ? detail::moment_uniform(detail::sr_bits(sr_key, pos.i0 + e), moment)
                          : 0.0f;
      c.set(e, moment == 0 ? encode_code<MODE, 0, false>(val[e], 0.0f, b, sm, u)
                           : encode_code<MODE, 1, false>(val[e], __fsqrt_rn(val[e]), b, sm, u));
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

template <int MODE, bool kExact, bool kSR, typename G, typename M>
void launch_block_many(const StepParams* ps, int count, cudaStream_t s) {
  StepBatch b{};
  b.count = count;
  int ctas = 0;
  for (int k = 0; k < count; ++k) {
    b.p[k] = ps[k];
    b.cta_start[k] = ctas;
    ctas += static_cast<int>(block_kernel_grid<MODE>(ps[k].n));
  }
  b.cta_start[count] = ctas;
  adamw_block_multi_kernel<MODE, kExact, kSR, G, M><<<ctas, kThreads, 0, s>>>(b);
}

template <int MODE, bool kExact, typename G, typename M>
void launch_block_many_sr(const StepParams* ps, int count, cudaStream_t s) {
  if (ps[0].stochastic != 0) {
    launch_block_many<MODE, kExact, true, G, M>(ps, count, s);
  } else {
    launch_block_many<MODE, kExact, false, G, M>(ps, count, s);
  }
}

template <int MODE, bool kExact, typename G, typename M>
void launch_block(const StepParams& p, cudaStream_t s) {
  if (p.stochastic != 0) {
    adamw_block_kernel<MODE, kExact, true, G, M><<<block_kernel_grid<MODE>(p.n), kThreads, 0, s>>>(p);
  } else {
    adamw_block_kernel<MODE, kExact, false, G, M><<<block_kernel_grid<MODE>(p.n), kThreads, 0, s>>>(p);
  }
}

// fn(std::integral_constant<int, MODE>{}, std::bool_constant<kExact>{}) with kExact =
// (exact != 0).
template <int MODE, typename Fn>
void dispatch_exact(int exact, Fn&& fn) {
  if (exact != 0) {
    fn(std::integral_constant<int, MODE>{}, std::true_type{});
  } else {
    fn(std::integral_constant<int, MODE>{}, std::false_type{});
  }
}

// dispatch_exact for a packed-moment mode: int8 (1) and 4-bit (2) with the arithmetic
// StepParams::exact selects, NVFP4 (3, a comparison format) always with the exact one; any
// other mode throws.
template <typename Fn>
void dispatch_block_mode(int mode, int exact, Fn&& fn) {
  switch (mode) {
    case 1:
      dispatch_exact<1>(exact, fn);
      break;
    case 2:
      dispatch_exact<2>(exact, fn);
      break;
    case 3:  // only the exact kernels are instantiated
      fn(std::integral_constant<int, 3>{}, std::true_type{});
      break;
    default:
      throw std::runtime_error("q4::optim CUDA: bad state mode " + std::to_string(mode));
  }
}

}  // namespace

void launch_block_step(const StepParams& p, cudaStream_t s) {
  dispatch_step_dtypes(p, [&](auto grad, auto master) {
    using G = decltype(grad);
    using M = decltype(master);
    dispatch_block_mode(p.mode, p.exact, [&](auto mode, auto exact) {
      launch_block<decltype(mode)::value, decltype(exact)::value, G, M>(p, s);
    });
  });
}

void launch_block_steps(const StepParams* ps, int count, cudaStream_t s) {
  dispatch_step_dtypes(ps[0], [&](auto grad, auto master) {
    using G = decltype(grad);
    using M = decltype(master);
    dispatch_block_mode(ps[0].mode, ps[0].exact, [&](auto mode, auto exact) {
      launch_block_many_sr<decltype(mode)::value, decltype(exact)::value, G, M>(ps, count, s);
    });
  });
}

}  // namespace q4::optim::cuda::impl

namespace q4::optim::cuda {

using impl::block_kernel_grid;
using impl::ensure_tables;
using impl::grid_for_elems;
using impl::kThreads;
using impl::pack_kernel;
using impl::unpack_kernel;
using quant::cuda::check_cuda;

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
  check_cuda(cudaGetLastError(), "q4::optim CUDA: pack launch");
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
  check_cuda(cudaGetLastError(), "q4::optim CUDA: unpack launch");
}

}  // namespace q4::optim::cuda
