// The shared element codecs (q4/quant/numerics.h, used by quant/ and optim/ on CPU and CUDA)
// against the brute-force scalar reference (nvfp4_ref.cpp, the specification): every fp16 and
// every bf16 value, every fp32 E4M3 rounding boundary and E2M1 threshold with its neighbours, and
// a dense random fp32 sweep. Comparisons are exact (codes equal, decoded values bit-equal).
#include "q4/quant/numerics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "q4/quant/nvfp4.h"

namespace q4::quant {
namespace {

float from_bits(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}
uint32_t to_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

// Every finite fp16 value (as fp32: exact) and every finite bf16 value.
std::vector<float> all_half_and_bf16() {
  std::vector<float> v;
  v.reserve(2 * 65536);
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
    if (exp == 0x1f) continue;  // Inf/NaN
    const float mag = exp == 0 ? std::ldexp(static_cast<float>(man), -24)
                               : std::ldexp(1.0f + static_cast<float>(man) / 1024.0f,
                                            static_cast<int>(exp) - 15);
    v.push_back(sign ? -mag : mag);
  }
  for (uint32_t b = 0; b < 65536; ++b) {
    const float x = from_bits(b << 16);
    if (std::isfinite(x)) v.push_back(x);
  }
  return v;
}

// The ref's domain for E4M3: [0, 448].
float clamp_scale(float x) { return std::min(std::max(std::fabs(x), 0.0f), 448.0f); }

TEST(SharedNumerics, E4m3DecodeEqualsRefForEveryByte) {
  for (int b = 0; b < 256; ++b) {
    const float ref = e4m3_decode_ref(static_cast<uint8_t>(b));
    const float got = numerics::e4m3_decode(static_cast<uint8_t>(b));
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << b;
    } else {
      EXPECT_EQ(to_bits(got), to_bits(ref)) << b;
    }
    if ((b & 0x7f) != 0x7f && b < 0x80) {
      EXPECT_EQ(to_bits(numerics::e4m3_decode_unsigned(static_cast<uint32_t>(b))), to_bits(ref));
    }
  }
}

TEST(SharedNumerics, E4m3EncodeEqualsRefOnEveryHalfBf16AndBoundary) {
  std::vector<float> xs;
  for (float x : all_half_and_bf16()) xs.push_back(clamp_scale(x));
  for (int c = 0; c <= 0x7e; ++c) {  // every code, every midpoint and their fp32 neighbours
    const float v = e4m3_decode_ref(static_cast<uint8_t>(c));
    xs.push_back(v);
    if (c < 0x7e) {
      const float mid = 0.5f * (v + e4m3_decode_ref(static_cast<uint8_t>(c + 1)));  // exact
      float lo = mid, hi = mid;
      xs.push_back(mid);
      for (int k = 0; k < 3; ++k) {
        lo = std::nextafter(lo, 0.0f);
        hi = std::nextafter(hi, 1000.0f);
        xs.push_back(lo);
        xs.push_back(hi);
      }
    }
  }
  std::mt19937 rng(11);  // dense sweep: 300k fp32 values spread over [2^-20, 448] in log scale
  std::uniform_real_distribution<float> e(-20.0f, 8.81f);
  for (int i = 0; i < 300000; ++i) xs.push_back(clamp_scale(std::exp2(e(rng))));
  xs.push_back(0.0f);
  xs.push_back(448.0f);
  xs.push_back(numerics::kNvfp4ScaleMin);
  for (float x : xs) {
    ASSERT_EQ(numerics::e4m3_encode(x), e4m3_encode_ref(x)) << "x = " << x;
  }
}

TEST(SharedNumerics, Nvfp4ScaleInputIsTheClampedQuotient) {
  for (float a : all_half_and_bf16()) {
    a = std::fabs(a);
    const float want = std::min(std::max(a / 6.0f, 1.52587890625e-05f), 448.0f);
    ASSERT_EQ(to_bits(numerics::nvfp4_scale_input(a)), to_bits(want)) << a;
  }
}

TEST(SharedNumerics, E2m1EqualsRefOnEveryHalfBf16AndThreshold) {
  std::vector<float> xs = all_half_and_bf16();
  for (int i = 0; i < numerics::kE2m1Thresholds; ++i) {
    const float t = numerics::e2m1_threshold(i);
    float lo = t, hi = t;
    xs.push_back(t);
    xs.push_back(-t);
    for (int k = 0; k < 3; ++k) {
      lo = std::nextafter(lo, 0.0f);
      hi = std::nextafter(hi, 100.0f);
      for (float s : {1.0f, -1.0f}) {
        xs.push_back(s * lo);
        xs.push_back(s * hi);
      }
    }
  }
  xs.push_back(-0.0f);
  xs.push_back(-1e-30f);
  xs.push_back(from_bits(0x80000001u));  // smallest negative subnormal
  for (float x : xs) {
    const float d = std::min(std::max(x, -6.0f), 6.0f);  // the ref's domain
    const uint8_t ref = e2m1_encode_ref(d);
    ASSERT_EQ(numerics::e2m1_encode(d), ref) << "d = " << d;
    ASSERT_EQ(numerics::e2m1_encode(x), ref) << "unclamped d = " << x;  // the kernels' use
  }
  for (uint32_t c = 0; c < 16; ++c) {
    EXPECT_EQ(to_bits(numerics::e2m1_decode(c)), to_bits(e2m1_decode_ref(static_cast<uint8_t>(c))))
        << c;
  }
}

}  // namespace
}  // namespace q4::quant
