// The one scalar definition of the NVFP4 element codecs (docs/design.md#nvfp4-arithmetic) used by every
// fast path: quant/ (CPU path and CUDA kernels) and optim/ (NVFP4 moment mode, CPU and CUDA).
// Header-only, no torch headers, host and device (Q4_HD). The brute-force scalar reference
// (quant/src/nvfp4_ref.cpp, `*_ref`) stays the specification: tests/quant/numerics_test.cpp
// compares these functions with it exhaustively over every fp16 and bf16 value and every fp32
// rounding boundary.
//
// Device code here uses explicit round-to-nearest intrinsics: nvcc contracts a*b+c into an FMA by
// default, which would differ from the host in the last bit.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef Q4_HD
#if defined(__CUDACC__)
#define Q4_HD __host__ __device__ __forceinline__
#else
#define Q4_HD inline
#endif
#endif

namespace q4::numerics {

inline constexpr float kE4m3Max = 448.0f;                // largest finite E4M3FN value
inline constexpr float kNvfp4ScaleMin = 1.52587890625e-05f;  // 2^-16: smallest NVFP4 block scale
inline constexpr float kE2m1Max = 6.0f;                  // largest E2M1 magnitude
inline constexpr int kE2m1Thresholds = 7;

// |d| >= e2m1_threshold(i) selects code magnitude i + 1 (ties away from zero), i = 0..6.
Q4_HD constexpr float e2m1_threshold(int i) {
  return i == 0 ? 0.25f
       : i == 1 ? 0.75f
       : i == 2 ? 1.25f
       : i == 3 ? 1.75f
       : i == 4 ? 2.5f
       : i == 5 ? 3.5f
                : 5.0f;
}

// ---- bit casts ----
Q4_HD uint32_t f32_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
#endif
}
Q4_HD float bits_f32(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, 4);
  return x;
#endif
}

// ---- E4M3FN ----
// Encode, round to nearest even, of s in [0, 448] (a clamped block scale; finite, >= 0).
// Subnormal range (s < 2^-6): m = rne(s * 2^9) in 0..8 (8 is 0x08, the smallest normal).
// Normal range: round the 23-bit fp32 mantissa to 3 bits, nearest-even (a carry may bump the
// exponent), then rebias the exponent from 127 to 7: (E32 << 3 | m3) - (120 << 3).
Q4_HD uint8_t e4m3_encode(float s) {
  if (s < 0.015625f) {
#if defined(__CUDA_ARCH__)
    return static_cast<uint8_t>(__float2int_rn(__fmul_rn(s, 512.0f)));
#else
    return static_cast<uint8_t>(static_cast<int>(std::nearbyint(s * 512.0f)));
#endif
  }
  uint32_t b = f32_bits(s);
  b += 0x7FFFFu + ((b >> 20) & 1u);
  return static_cast<uint8_t>((b >> 20) - (120u << 3));
}

// Decode of a code 0x00..0x7E (non-negative, not NaN: what e4m3_encode produces).
Q4_HD float e4m3_decode_unsigned(uint32_t bits) {
  const uint32_t e = bits >> 3, m = bits & 7u;
  if (e == 0) {
#if defined(__CUDA_ARCH__)
    return __fmul_rn(static_cast<float>(m), 0.001953125f);  // m/8 * 2^-6 = m * 2^-9 (exact)
#else
    return static_cast<float>(m) * 0.001953125f;
#endif
  }
  return bits_f32(((e + 120u) << 23) | (m << 20));
}

// Full decode: sign bit, 0x7F/0xFF NaN, exponent 0 subnormal.
Q4_HD float e4m3_decode(uint8_t bits) {
  const uint32_t mag = bits & 0x7Fu;
  const float v = mag == 0x7Fu ? bits_f32(0x7FC00000u) : e4m3_decode_unsigned(mag);
  return (bits & 0x80u) ? -v : v;
}

// Block scale input (docs/design.md#nvfp4-arithmetic): clamp(amax / 6, 2^-16, 448), IEEE division (a NaN amax
// gives 2^-16, as fmaxf does; callers flag non-finite blocks themselves).
Q4_HD float nvfp4_scale_input(float amax) {
#if defined(__CUDA_ARCH__)
  return fminf(fmaxf(__fdiv_rn(amax, 6.0f), kNvfp4ScaleMin), kE4m3Max);
#else
  return std::fmin(std::fmax(amax / 6.0f, kNvfp4ScaleMin), kE4m3Max);
#endif
}

// 4-over-6's second candidate (docs/design.md#nvfp4-arithmetic): clamp(amax / 4, 2^-16, 448).
Q4_HD float nvfp4_scale_input_over4(float amax) {
#if defined(__CUDA_ARCH__)
  return fminf(fmaxf(__fdiv_rn(amax, 4.0f), kNvfp4ScaleMin), kE4m3Max);
#else
  return std::fmin(std::fmax(amax / 4.0f, kNvfp4ScaleMin), kE4m3Max);
#endif
}

// ---- E2M1 ----
// Code of d: magnitude = number of thresholds <= |d| (so |d| >= 5, also unclamped, is code 7),
// bit 3 set when d < 0 (tiny negatives become code 8, -0; -0.0 itself is code 0).
Q4_HD uint8_t e2m1_encode(float d) {
  const float a = d < 0.0f ? -d : d;
  uint32_t c = (a >= e2m1_threshold(0)) + (a >= e2m1_threshold(1)) + (a >= e2m1_threshold(2)) +
               (a >= e2m1_threshold(3)) + (a >= e2m1_threshold(4)) + (a >= e2m1_threshold(5)) +
               (a >= e2m1_threshold(6));
  if (d < 0.0f) c |= 8u;
  return static_cast<uint8_t>(c);
}

// Value of code 0..15 (bit 3 = sign): 0, 0.5, 1, 1.5, 2, 3, 4, 6.
Q4_HD float e2m1_decode(uint32_t code) {
  const uint32_t c = code & 7u;
  const float mag = c <= 4u ? 0.5f * static_cast<float>(c) : (c == 7u ? 6.0f : float(c) - 2.0f);
  return (code & 8u) ? -mag : mag;
}

// ---- 4-over-6 block error ----
// (x - q)^2 in fp64, q = e2m1_decode(e2m1_encode(x / (s + 1e-12))) * s the element's dequantized
// value under the decoded block scale s. x - q is exact in fp64 (both fp32, within 2^30 of each
// other unless the scale is clamped); the square rounds once.
Q4_HD double nvfp4_sq_err(float x, float s) {
#if defined(__CUDA_ARCH__)
  const float q = __fmul_rn(e2m1_decode(e2m1_encode(__fdiv_rn(x, __fadd_rn(s, 1e-12f)))), s);
  const double e = __dsub_rn(static_cast<double>(x), static_cast<double>(q));
  return __dmul_rn(e, e);
#else
  const float q = e2m1_decode(e2m1_encode(x / (s + 1e-12f))) * s;
  const double e = static_cast<double>(x) - static_cast<double>(q);
  return e * e;
#endif
}

Q4_HD double add_rn(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}

// Sum of e[0..N-1] (N a power of 2) as a pairwise tree of adjacent elements: (e0 + e1),
// (e2 + e3), ..., then adjacent pairs of those. The block error's one summation order: a CUDA
// lane sums its consecutive elements this way and the lanes of a block combine with shuffles
// at distance 1, 2, ..., which continues the same tree. Overwrites e.
template <int N>
Q4_HD double pairwise_sum(double (&e)[N]) {
  static_assert(N > 0 && (N & (N - 1)) == 0, "pairwise_sum: N must be a power of 2");
  for (int w = N; w > 1; w /= 2) {
    for (int i = 0; i < w / 2; ++i) e[i] = add_rn(e[2 * i], e[2 * i + 1]);
  }
  return e[0];
}

}  // namespace q4::numerics
