// Scalar building blocks shared by the CPU ATen path, the scalar references and the CUDA kernels
// (this header includes no torch headers so .cu files can use it): the counter-based hash behind
// stochastic rounding and the code tables of the int8/4-bit maps. The E4M3/E2M1 codecs of the
// NVFP4 moment mode are quant's shared numerics (q4/quant/numerics.h). One definition here is
// what keeps CPU and CUDA bit-identical.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "q4/quant/numerics.h"

namespace q4::optim::detail {

// ---- counter-based hash (stochastic rounding) ----
// lowbias32 (C. Wellons, "Hash function prospector", 2018): a 32-bit mixer with good avalanche.
// The CPU path evaluates it with int64 ATen ops; both multipliers are applied as signed values
// below 2^31 in magnitude (0x846ca68b == 2^32 - 2073254261), so products fit in int64.
inline constexpr uint32_t kHashMul1 = 0x7feb352dU;
inline constexpr uint32_t kHashMul2 = 0x846ca68bU;
inline constexpr int64_t kHashMul2Signed = -2073254261LL;  // kHashMul2 - 2^32

Q4_HD uint32_t hash32(uint32_t x) {
  x ^= x >> 16;
  x *= kHashMul1;
  x ^= x >> 15;
  x *= kHashMul2;
  x ^= x >> 16;
  return x;
}

// Key of one (seed, step, parameter) stream; step is the Adam t (1-based) of the update.
inline uint32_t sr_stream_key(uint64_t seed, int64_t step, int64_t param_index) {
  uint32_t k = hash32(static_cast<uint32_t>(seed));
  k = hash32(k ^ static_cast<uint32_t>(seed >> 32));
  k = hash32(k ^ static_cast<uint32_t>(step));
  k = hash32(k ^ static_cast<uint32_t>(param_index));
  return k;
}

// 32 random bits for element `index` (0-based flat index inside the parameter):
// hash32(lo ^ hash32(key ^ hi)) with lo, hi the low and high 32 bits of the index. The inner
// hash depends on the index only through hi (0 below 2^32 elements), so a kernel computes it once
// per group of elements (sr_range_key) and each element costs one hash32.
Q4_HD uint32_t sr_range_key(uint32_t key, int64_t index) {
  return hash32(key ^ static_cast<uint32_t>(static_cast<uint64_t>(index) >> 32));
}
Q4_HD uint32_t sr_bits_in_range(uint32_t range_key, int64_t index) {
  return hash32(static_cast<uint32_t>(static_cast<uint64_t>(index) & 0xffffffffULL) ^ range_key);
}
Q4_HD uint32_t sr_bits(uint32_t key, int64_t index) {
  return sr_bits_in_range(sr_range_key(key, index), index);
}

// ---- bit casts and the NVFP4 moment codec: the shared definitions (q4/quant/numerics.h) ----
using q4::numerics::bits_f32;
using q4::numerics::e2m1_decode;
using q4::numerics::e2m1_encode;
using q4::numerics::e4m3_decode;
using q4::numerics::e4m3_encode;
using q4::numerics::f32_bits;
using q4::numerics::nvfp4_scale_input;
inline constexpr float kE4m3Max = q4::numerics::kE4m3Max;
inline constexpr float kScaleMin = q4::numerics::kNvfp4ScaleMin;
inline constexpr float kE2m1Max = q4::numerics::kE2m1Max;

// ---- stochastic rounding of fp16/bf16 masters ----
// The element's bits h = sr_bits(key, i) round x to lo or hi, its neighbours in the target format
// toward and away from zero: hi when u < p, p = |x - lo| / |hi - lo|, u = (2^k - 1 - (h mod 2^k))
// / 2^k, with k = 16 for bf16 and k = 13 for fp16 -- the number of fp32 fraction bits the target
// drops. Then p is a multiple of 2^-k and the rule is exact and unbiased: it is the addition of
// h mod 2^k to x's fp32 bit pattern and the truncation of the k low bits (a carry is the round
// away from zero), two integer operations and no division. fp16 below 2^-14 (its subnormals,
// steps of 2^-24): x is first moved by c = copysign(2^-14, x) into [2^-14, 2^-13), whose fp16
// steps are also 2^-24 (x + c rounded to nearest at fp32's 2^-37 there: a p error below 2^-13),
// rounded there, and moved back by -c (exact). Returns an fp32 value that the target represents
// exactly (its RN conversion is exact). x must be finite and inside the target's range (the
// callers saturate first). Bits: fp16 uses h's low 13, bf16 its low 16; moment_uniform() the rest.
Q4_HD float sr_round_bf16(float x, uint32_t h) {
  return bits_f32((f32_bits(x) + (h & 0xffffU)) & 0xffff0000U);
}

Q4_HD float sr_round_fp16(float x, uint32_t h) {
  const uint32_t b = f32_bits(x);
  const float c = (b & 0x7fffffffU) < 0x38800000U ? bits_f32((b & 0x80000000U) | 0x38800000U)
                                                   : 0.0f;
#if defined(__CUDA_ARCH__)
  const float s = __fadd_rn(x, c);
  return __fsub_rn(bits_f32((f32_bits(s) + (h & 0x1fffU)) & 0xffffe000U), c);
#else
  const float s = x + c;
  return bits_f32((f32_bits(s) + (h & 0x1fffU)) & 0xffffe000U) - c;
#endif
}

// ---- block normalization (int8 / 4-bit maps) ----
// The normalized value y = x / amax of every element is computed with one IEEE reciprocal per
// block and two multiplications per element: y = (x * f) * inv, inv = 1 / (div * f), where
// div = amax (1 for an all-zero block) and f = 2^64 when div is below FLT_MIN (1 / div would
// overflow for a subnormal div), else 1 (x * f is exact). The sqrt-domain map (4-bit v) uses
// t = (sqrt(x) * fs) * rs with fs = sqrt(f) and rs = sqrt(inv): sqrt(x) is the sqrt(v) of the
// update, so the fused step takes one square root per element for both. Every operation is one
// fp32 rounding, the same on the CPU (scalar and ATen paths) and in the kernels. |y| can exceed 1
// by an ulp (inv rounded up); every map saturates at its end entry there.
struct BlockNorm {
  float f = 1.0f;    // 1 or 2^64
  float inv = 1.0f;  // 1 / (div * f)
  float fs = 1.0f;   // sqrt(f): 1 or 2^32
  float rs = 1.0f;   // sqrt(inv)
};

Q4_HD BlockNorm block_norm(float amax) {
  const float div = amax == 0.0f ? 1.0f : amax;
  const bool tiny = div < 1.17549435082228751e-38f;  // FLT_MIN
  BlockNorm b;
  b.f = tiny ? 18446744073709551616.0f : 1.0f;
  b.fs = tiny ? 4294967296.0f : 1.0f;
#if defined(__CUDA_ARCH__)
  b.inv = __frcp_rn(__fmul_rn(div, b.f));
  b.rs = __fsqrt_rn(b.inv);
#else
  b.inv = 1.0f / (div * b.f);
  b.rs = std::sqrt(b.inv);
#endif
  return b;
}

// (a * b) * c, each product rounded to nearest (the device form keeps them unfused).
Q4_HD float mul3_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__fmul_rn(a, b), c);
#else
  return (a * b) * c;
#endif
}

Q4_HD float norm_value(float x, const BlockNorm& b) { return mul3_rn(x, b.f, b.inv); }

Q4_HD float norm_sqrt(float sqrt_x, const BlockNorm& b) { return mul3_rn(sqrt_x, b.fs, b.rs); }

// Stochastic code of t on the 4-bit second-moment map (entries k/16, k = 1..16, gaps 1/16) in
// closed form, bit-identical to sr_pick() on that table: with s = 16 t (exact),
// #{k : k/16 <= t} = floor(s), l = clamp(floor(s) - 1, 0, 14), and
// p = (t - (l + 1)/16) * 16 = s - (l + 1) (scaling by 16 commutes with the rounding: t - (l+1)/16
// is exact or a normal fp32 here). No search, no table.
Q4_HD int sr_pick_4bit_second_s(float s, float u) {  // s = 16 t, given
#if defined(__CUDA_ARCH__)
  int l = __float2int_rd(s) - 1;
#else
  int l = static_cast<int>(std::floor(s)) - 1;
#endif
  l = l < 0 ? 0 : (l > 14 ? 14 : l);
#if defined(__CUDA_ARCH__)
  const float p = __fsub_rn(s, static_cast<float>(l + 1));
#else
  const float p = s - static_cast<float>(l + 1);
#endif
  return u < p ? l + 1 : l;
}

Q4_HD int sr_pick_4bit_second(float t, float u) {
#if defined(__CUDA_ARCH__)
  return sr_pick_4bit_second_s(__fmul_rn(t, 16.0f), u);
#else
  return sr_pick_4bit_second_s(t * 16.0f, u);
#endif
}

// ---- code search ----
// The code of a normalized value is a count over a sorted table: nearest codes count midpoints
// strictly below y (#{j : mid[j] < y}, ties to the lower entry, == at::bucketize(right=false));
// stochastic codes count entries at or below t (#{j : sr_value[j] <= t}, == bucketize(right=true)).
// The kernels start the count from a per-bucket lower bound looked up by the float bits of the
// value (sign, exponent, top `bits` mantissa bits; |y| < 2^-24 is one bucket) and finish it with
// one comparison: each map's resolution (kMapSearchBits) is the coarsest at which no bucket holds
// more than one table entry, so the lower bound is off by at most one (max_scan_steps() proves it
// on the host; ensure_tables() and the codec test check it). The tables carry a +inf sentinel
// after their last entry, so that comparison needs no bounds check.
inline constexpr int kSearchExpMin = 103;  // 2^-24: smaller magnitudes share bucket 0
inline constexpr int kSearchMaxBits = 7;
Q4_HD constexpr int search_buckets(int bits) { return 1 + (128 - kSearchExpMin) * (1 << bits); }
inline constexpr int kSearchMaxBuckets = search_buckets(kSearchMaxBits);

// Bucket of |y| at `bits` mantissa bits (the sign picks the table); magnitudes >= 2 fall into the
// last bucket (the count stays exact). The bits of |y| shifted right by (23 - bits) are
// (exponent << bits | top mantissa bits), so the bucket is that minus a constant, clamped:
// below 2^-24 -> 0, from 2 up -> the last.
Q4_HD int search_bucket(float y, int bits) {
  const int k = static_cast<int>((f32_bits(y) & 0x7fffffffU) >> (23 - bits)) -
                ((kSearchExpMin << bits) - 1);
  const int last = search_buckets(bits) - 1;
  return k < 0 ? 0 : (k > last ? last : k);
}

// Per MapId (int8 m, int8 v, 4-bit m, 4-bit v): mantissa bits of the search buckets, and whether
// the map has negative entries (else the kernels look up |y|: second moments are >= 0, and -0
// counts as +0 because every entry is positive). The 4-bit v map needs no search (closed form).
inline constexpr int kMapSearchBits[4] = {6, 7, 1, 0};
inline constexpr bool kMapSearchSigned[4] = {true, false, true, false};

// ---- int8 / 4-bit code maps ----
// Tables sorted ascending; the code of a normalized value y is #{j : mid[j] < y} (nearest entry,
// ties to the lower one), identical to at::bucketize(y, mid, right=false).
struct CodeMap {
  int size = 0;      // 256 or 16
  float value[256];  // decoded value of each code (absmax-normalized)
  float mid[255];    // (value[j] + value[j+1]) / 2 in fp32
  // Stochastic codes (sr_pick) instead of nearest: the rounding works on t = y (or sqrt(y) when
  // sqrt_domain) against the sorted entries sr_value (= value, or sqrt(value)), unbiased in t.
  bool stochastic = false;
  bool sqrt_domain = false;
  float sr_value[256];  // entries in the rounding domain
  float inv_gap[255];   // 1 / (sr_value[j+1] - sr_value[j]), computed in double, rounded to fp32
  // Lower bounds of the code search (see "code search" above): over mid (nearest maps) or
  // sr_value (stochastic maps), [sign][search_bucket(y, search_bits)]; the first
  // search_buckets(search_bits) of each row are used.
  int search_bits = 0;
  uint8_t search_start[2][kSearchMaxBuckets];
};

// bitsandbytes create_dynamic_map(signed, max_exponent_bits, total_bits) (Dettmers et al.,
// "8-bit Optimizers via Block-wise Quantization", ICLR 2022; also torchao's AdamW4bit uses it
// with (true, 3, 4)): for i < max_exponent_bits, 10^(i - max_exponent_bits + 1) times the
// midpoints of linspace(0.1, 1, n_i + 1), plus 0 and 1. Computed in double, stored as fp32.
inline void fill_dynamic_map(bool is_signed, int max_exponent_bits, int total_bits, CodeMap* map) {
  double data[256];
  int n = 0;
  const int non_sign_bits = total_bits - 1;
  for (int i = 0; i < max_exponent_bits; ++i) {
    const int fraction_items = is_signed ? (1 << (i + non_sign_bits - max_exponent_bits)) + 1
                                         : (1 << (i + non_sign_bits - max_exponent_bits + 1)) + 1;
    const double scale = std::pow(10.0, -(max_exponent_bits - 1) + i);
    for (int k = 0; k + 1 < fraction_items; ++k) {
      const double b0 = 0.1 + 0.9 * k / (fraction_items - 1);
      const double b1 = 0.1 + 0.9 * (k + 1) / (fraction_items - 1);
      const double mean = (b0 + b1) / 2.0;
      data[n++] = scale * mean;
      if (is_signed) data[n++] = -scale * mean;
    }
  }
  data[n++] = 0.0;
  data[n++] = 1.0;
  // additional_items is 0 for the two maps used here (8 bits / 7 exponent bits, 4 / 3).
  for (int a = 1; a < n; ++a) {  // insertion sort, n <= 256
    const double key = data[a];
    int b = a - 1;
    while (b >= 0 && data[b] > key) {
      data[b + 1] = data[b];
      --b;
    }
    data[b + 1] = key;
  }
  map->size = n;
  for (int j = 0; j < n; ++j) map->value[j] = static_cast<float>(data[j]);
}

inline void fill_mids(CodeMap* map) {
  for (int j = 0; j + 1 < map->size; ++j) map->mid[j] = (map->value[j] + map->value[j + 1]) * 0.5f;
}

inline void fill_inv_gaps(CodeMap* map) {
  for (int j = 0; j + 1 < map->size; ++j) {
    map->inv_gap[j] = static_cast<float>(
        1.0 / (static_cast<double>(map->sr_value[j + 1]) - static_cast<double>(map->sr_value[j])));
  }
}

// ---- code search helpers ----
// Count of entries below y (strict: <, else <=), scanning forward from `start` (a lower bound of
// the count).
Q4_HD int count_from(const float* entries, int n, bool strict, int start, float y) {
  int c = start;
  while (c < n && (strict ? entries[c] < y : entries[c] <= y)) ++c;
  return c;
}

// The kernels' count: one comparison after the lower bound, over a table with a +inf sentinel at
// index n (so entries[start] exists for start <= n). Exact when no bucket holds more than one
// entry (max_scan_steps() <= 1).
Q4_HD int count_one_step(const float* padded_entries, bool strict, int start, float y) {
  const float e = padded_entries[start];
  return start + ((strict ? e < y : e <= y) ? 1 : 0);
}

namespace search_detail {
inline float bucket_lo(int k, int bits) {  // smallest |y| of bucket k (0 for bucket 0)
  if (k == 0) return 0.0f;
  const int e = kSearchExpMin + ((k - 1) >> bits);
  const uint32_t m = static_cast<uint32_t>((k - 1) & ((1 << bits) - 1));
  return bits_f32((static_cast<uint32_t>(e) << 23) | (m << (23 - bits)));
}
inline float bucket_hi(int k, int bits) {  // exclusive upper end of bucket k's |y|
  return k + 1 < search_buckets(bits) ? bucket_lo(k + 1, bits) : 2.0f;
}
inline int count(const float* entries, int n, bool strict, float y) {
  int c = 0;
  for (int j = 0; j < n; ++j) c += (strict ? entries[j] < y : entries[j] <= y) ? 1 : 0;
  return c;
}
}  // namespace search_detail

// start[sign][bucket]: for every y in the bucket a lower bound of the count (the count is
// non-decreasing in y): the count at lo for y >= 0 (|y| in [lo, hi)); for y < 0 (y in (-hi, -lo])
// the number of entries <= -hi, all of which are below any such y.
inline void fill_search_start(const float* entries, int n, bool strict, int bits,
                              uint8_t (*start)[kSearchMaxBuckets]) {
  using namespace search_detail;
  for (int k = 0; k < search_buckets(bits); ++k) {
    start[0][k] = static_cast<uint8_t>(count(entries, n, strict, bucket_lo(k, bits)));
    // entries <= -hi are < y too, whatever `strict`
    start[1][k] = static_cast<uint8_t>(count(entries, n, false, -bucket_hi(k, bits)));
  }
}

// The largest count - start over every value a bucket holds (the count is non-decreasing, so
// the top of each bucket for y >= 0 and its bottom, -lo, for y < 0): the steps a scan from the
// bucket's lower bound needs at most. Entries: mid (nearest maps) or sr_value (stochastic).
inline int max_scan_steps(const float* entries, int n, bool strict, int bits,
                          const uint8_t (*start)[kSearchMaxBuckets]) {
  using namespace search_detail;
  int most = 0;
  for (int k = 0; k < search_buckets(bits); ++k) {
    const int up = count(entries, n, strict, std::nextafter(bucket_hi(k, bits), 0.0f)) - start[0][k];
    const int down = count(entries, n, strict, -bucket_lo(k, bits)) - start[1][k];
    most = up > most ? up : most;
    most = down > most ? down : most;
  }
  return most;
}

// Uniforms of the stochastic moment codes of element i, from its master-rounding bits
// h = sr_bits(key, i) with the same (seed, step, parameter) key: the first moment takes the high
// 16 bits of h (the master rounding uses at most the low 16), the second the high 16 bits of
// h * kMomentMul mod 2^32 (one multiply; they depend on every bit of h). 16-bit probability
// resolution: a bias of at most 2^-16 of a code gap. One hash32 per element in all.
inline constexpr uint32_t kMomentMul = 0x9e3779b1U;  // odd (2^32 / golden ratio, prime)
inline constexpr int64_t kMomentMulSigned = -1640531535LL;  // kMomentMul - 2^32 (CPU int64 ops)
Q4_HD float moment_uniform(uint32_t h, int moment) {
  const uint32_t bits = moment == 0 ? h : h * kMomentMul;
  return static_cast<float>(bits >> 16) * 1.52587890625e-05f;
}

// Stochastic code of t (the normalized value y, or sqrt(y) for a sqrt-domain map; sqrt correctly
// rounded on both CPU and CUDA), given count = #{j : sr_value[j] <= t}: with l = count - 1 clamped
// to [0, size - 2] (the entries bracketing t), take l + 1 with probability
// p = (t - sr_value[l]) * inv_gap[l] (fp32, one rounding per operation), i.e. when the uniform
// u < p, and l otherwise. Unbiased in t for t inside the map's range; outside it the code
// saturates at the end entry. The CPU path computes the same with ATen ops (bucketize
// right=true, index_select, sub, mul, lt).
Q4_HD int sr_pick(const float* sr_value, const float* inv_gap, int size, float t, int count,
                  float u) {
  int l = count - 1;
  l = l < 0 ? 0 : (l > size - 2 ? size - 2 : l);
#if defined(__CUDA_ARCH__)
  const float p = __fmul_rn(__fsub_rn(t, sr_value[l]), inv_gap[l]);
#else
  const float p = (t - sr_value[l]) * inv_gap[l];
#endif
  return u < p ? l + 1 : l;
}

// The four maps. Second-moment maps never decode to 0 for a positive block:
//  int8 m: signed dynamic map (256 entries, block 256).
//  int8 v: unsigned dynamic map (256 entries) with its 0 entry replaced by the smallest positive
//          entry (3.25e-7), so codes 0 and 1 both decode to it: zero-free.
//  4bit m: signed dynamic-exponent map, 3 exponent bits (torchao QMAP_SIGNED), block 128.
//  4bit v: linear zero-free map applied to sqrt(v): (k/16)^2, k = 1..16, block 128. The update
//          divides by sqrt(v), so sqrt(v) is the quantity whose relative error matters. torchao's
//          QMAP_UNSIGNED (k/16 on v itself; Li et al. 2023 "linear map without zero") decodes
//          everything below absmax/32 to absmax/16, i.e. sqrt(v) overestimated up to 4x for
//          elements 16x below the block max in sqrt(v); on sqrt(v) the same 16 levels reach
//          absmax/256 (floor: sqrt(v) >= sqrt(absmax)/16). Same zero-free property, same storage.
//  4-bit codes of both moments are stochastically rounded (sr_pick; v in the sqrt domain). An
//  EMA moves by (1 - beta) per step (0.1% for v at beta2 = 0.999), far below the 4-bit code
//  spacing, so nearest codes are sticky and biased: small m flush to 0 (|m| < 0.00275 absmax)
//  and v stays on its code instead of decaying/growing. Tiny-Qwen3 memorization (300 steps,
//  final loss; ablations with fp32 m or v): nearest m and v 1.87x the fp32 loss, nearest v alone
//  0.78x (too fast: v stuck low), nearest m alone 2.0x; stochastic m and v track fp32 within 10%
//  (tests/convergence). Smaller m blocks (32) did not help: a bias, not a range, problem.
//  int8 codes stay nearest (bitsandbytes): its spacing is fine enough that int8 tracks fp32.
enum class MapId { kInt8First = 0, kInt8Second = 1, k4BitFirst = 2, k4BitSecond = 3 };

inline CodeMap make_code_map(MapId id) {
  CodeMap map{};
  switch (id) {
    case MapId::kInt8First:
      fill_dynamic_map(true, 7, 8, &map);
      break;
    case MapId::kInt8Second:
      fill_dynamic_map(false, 7, 8, &map);
      map.value[0] = map.value[1];  // drop the zero: the map's smallest entry (sorted: 0 first)
      break;
    case MapId::k4BitFirst:
      fill_dynamic_map(true, 3, 4, &map);
      // The dynamic map has +1 but not -1 (its most negative entry is -0.8875): a block whose
      // absmax element is negative would store it shrunk by 11% every step, a bias the
      // stochastic codes cannot remove. Replacing that entry by -1 makes the map cover [-1, 1].
      map.value[0] = -1.0f;
      map.stochastic = true;
      for (int j = 0; j < map.size; ++j) map.sr_value[j] = map.value[j];
      fill_inv_gaps(&map);
      break;
    case MapId::k4BitSecond:
      // Linear zero-free map on sqrt(v): entry k decodes to (k/16)^2, k = 1..16, and a value is
      // coded to the entry nearest in sqrt domain, so the midpoints are ((k + 1/2)/16)^2. All
      // entries and midpoints are exact in fp32 (k^2/256, (2k+1)^2/1024).
      map.size = 16;
      for (int k = 1; k <= 16; ++k) map.value[k - 1] = static_cast<float>(k * k) / 256.0f;
      for (int k = 1; k < 16; ++k) {
        map.mid[k - 1] = static_cast<float>((2 * k + 1) * (2 * k + 1)) / 1024.0f;
      }
      // Stochastic codes in the sqrt domain: entries k/16, gaps 1/16 (all exact).
      map.stochastic = true;
      map.sqrt_domain = true;
      for (int k = 1; k <= 16; ++k) map.sr_value[k - 1] = static_cast<float>(k) / 16.0f;
      fill_inv_gaps(&map);
      return map;  // closed-form codes (sr_pick_4bit_second): no search table
  }
  fill_mids(&map);
  map.search_bits = kMapSearchBits[static_cast<int>(id)];
  if (map.stochastic) {
    fill_search_start(map.sr_value, map.size, false, map.search_bits, map.search_start);
  } else {
    fill_search_start(map.mid, map.size - 1, true, map.search_bits, map.search_start);
  }
  return map;
}

inline constexpr int64_t kInt8Block = 256;
inline constexpr int64_t k4BitBlock = 128;
inline constexpr int64_t kNvfp4Block = 16;

}  // namespace q4::optim::detail
