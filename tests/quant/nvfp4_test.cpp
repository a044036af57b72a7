// CPU tests of the NVFP4 codec: the scalar references against the spec (E4M3 tie cases, E2M1
// thresholds) and against the independent golden fixture, the vectorized CPU path against both,
// fp16/bf16 inputs, requantization behaviour, the straight-through gradient, and input errors;
// the ops on every backend (Nvfp4Backend: cpu, cuda) and the CUDA kernels against the CPU path.
// Codes and scales are compared bit-exactly; dequantized values exactly (bitwise).
#include "q4/quant/nvfp4.h"

#include <gtest/gtest.h>
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <cmath>
#include <string>

#include "golden_dat.h"
#include "q4/test/backends.h"
#include "q4/test/error_of.h"

namespace q4::quant {
namespace {

using testing::bit_equal;

const std::string kGolden = std::string(Q4_FIXTURES_DIR) + "/nvfp4_golden.dat";
constexpr int kGoldenCases = 8;

const std::map<std::string, at::Tensor>& golden() {
  static const auto kG = testing::read_small_dat(kGolden);
  return kG;
}

at::Tensor g(int c, const std::string& what) {
  const auto it = golden().find("case" + std::to_string(c) + "." + what);
  if (it == golden().end()) throw std::runtime_error("golden entry missing: " + what);
  return it->second;
}

// True if x (fp32) survives a round trip through `dtype` unchanged.
bool representable(const at::Tensor& x, at::ScalarType dtype) {
  return bit_equal(x.to(dtype).to(at::kFloat), x);
}

// Mixed magnitudes: each row scaled by 10^k, k in [-9, 4], and a few exact zeros / -0.0 (fp32).
at::Tensor mixed_random(int64_t rows, int64_t cols, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({rows, cols}, gen, at::kFloat);
  const at::Tensor k = at::arange(rows, at::kFloat).remainder(14) - 9;
  x = x * at::pow(10.0, k).unsqueeze(1);
  x.index_put_({0, at::indexing::Slice(0, 16)}, 0.0);
  x.index_put_({1, at::indexing::Slice(0, 16)}, -0.0);
  return x;
}

// mixed_random in `dtype`, clamped to the fp16 range when the dtype is fp16.
at::Tensor mixed_random(int64_t rows, int64_t cols, uint64_t seed, at::ScalarType dtype) {
  at::Tensor x = mixed_random(rows, cols, seed);
  if (dtype == at::kHalf) x = x.clamp(-6e4, 6e4);
  return x.to(dtype);
}

// ---------------------------------------------------------------------------------------------
TEST(E4m3Ref, DecodeTable) {
  EXPECT_EQ(e4m3_decode_ref(0x00), 0.0f);
  EXPECT_EQ(e4m3_decode_ref(0x01), std::ldexp(1.0f, -9));         // smallest subnormal
  EXPECT_EQ(e4m3_decode_ref(0x07), 7.0f * std::ldexp(1.0f, -9));  // largest subnormal
  EXPECT_EQ(e4m3_decode_ref(0x08), std::ldexp(1.0f, -6));         // smallest normal
  EXPECT_EQ(e4m3_decode_ref(0x38), 1.0f);
  EXPECT_EQ(e4m3_decode_ref(0x78), 256.0f);
  EXPECT_EQ(e4m3_decode_ref(0x7E), 448.0f);
  EXPECT_TRUE(std::isnan(e4m3_decode_ref(0x7F)));
  EXPECT_TRUE(std::isnan(e4m3_decode_ref(0xFF)));
  EXPECT_EQ(e4m3_decode_ref(0xB8), -1.0f);
  int nans = 0;
  for (int b = 0; b < 256; ++b) nans += std::isnan(e4m3_decode_ref(static_cast<uint8_t>(b)));
  EXPECT_EQ(nans, 2);
  // Finite positive codes are strictly increasing.
  for (int b = 1; b <= 0x7E; ++b) {
    EXPECT_LT(e4m3_decode_ref(b - 1), e4m3_decode_ref(b)) << b;
  }
}

TEST(E4m3Ref, EncodeRoundTripsAndTiesToEven) {
  for (int b = 0; b <= 0x7E; ++b) {
    EXPECT_EQ(e4m3_encode_ref(e4m3_decode_ref(b)), b) << b;
  }
  for (int b = 0; b < 0x7E; ++b) {
    const float lo = e4m3_decode_ref(b), hi = e4m3_decode_ref(b + 1);
    const float mid = 0.5f * (lo + hi);  // exact: both have <= 4 significant bits
    const int even = (b % 2 == 0) ? b : b + 1;
    EXPECT_EQ(e4m3_encode_ref(mid), even) << "tie between " << b << " and " << b + 1;
    EXPECT_EQ(e4m3_encode_ref(std::nextafter(mid, 0.0f)), b);
    EXPECT_EQ(e4m3_encode_ref(std::nextafter(mid, 1000.0f)), b + 1);
  }
  // Below half the smallest subnormal (2^-10, itself a tie that goes to even 0) rounds to 0.
  EXPECT_EQ(e4m3_encode_ref(std::ldexp(1.0f, -10)), 0);
  EXPECT_EQ(e4m3_encode_ref(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 1);
  EXPECT_EQ(e4m3_encode_ref(std::ldexp(1.0f, -16)), 0);
  EXPECT_EQ(e4m3_encode_ref(448.0f), 0x7E);
}

TEST(E4m3Fast, MatchesRefOnEveryCodeAndTie) {
  std::vector<float> v;
  for (int b = 0; b <= 0x7E; ++b) v.push_back(e4m3_decode_ref(b));
  for (int b = 0; b < 0x7E; ++b) {
    const float mid = 0.5f * (e4m3_decode_ref(b) + e4m3_decode_ref(b + 1));
    v.push_back(mid);
    v.push_back(std::nextafter(mid, 0.0f));
    v.push_back(std::nextafter(mid, 1000.0f));
  }
  v.push_back(std::ldexp(1.0f, -16));
  const at::Tensor x = at::tensor(v, at::kFloat);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7);
  const at::Tensor rnd = at::exp2(at::rand({20000}, gen) * 24.8 - 16.0).clamp(0, 448);
  for (const at::Tensor& t : {x, rnd}) {
    const at::Tensor bits = e4m3_encode(t);
    const at::Tensor dec = e4m3_decode(bits);
    const float* tp = t.data_ptr<float>();
    const uint8_t* bp = bits.data_ptr<uint8_t>();
    for (int64_t i = 0; i < t.numel(); ++i) {
      ASSERT_EQ(bp[i], e4m3_encode_ref(tp[i])) << "x = " << tp[i];
      ASSERT_EQ(dec.data_ptr<float>()[i], e4m3_decode_ref(bp[i]));
    }
  }
}

TEST(E2m1Ref, ThresholdsTiesAndSign) {
  const float values[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  for (int c = 0; c < 16; ++c) {
    const float v = e2m1_decode_ref(c);
    EXPECT_EQ(std::fabs(v), values[c & 7]);
    EXPECT_EQ(std::signbit(v), (c & 8) != 0);
  }
  const float t[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  for (int i = 0; i < 7; ++i) {
    EXPECT_EQ(e2m1_encode_ref(t[i]), i + 1);  // ties away from zero
    EXPECT_EQ(e2m1_encode_ref(-t[i]), (i + 1) | 8);
    EXPECT_EQ(e2m1_encode_ref(std::nextafter(t[i], 0.0f)), i);
    EXPECT_EQ(e2m1_encode_ref(-std::nextafter(t[i], 0.0f)), i | 8);
  }
  EXPECT_EQ(e2m1_encode_ref(6.0f), 7);
  EXPECT_EQ(e2m1_encode_ref(-6.0f), 15);
  EXPECT_EQ(e2m1_encode_ref(0.0f), 0);
  EXPECT_EQ(e2m1_encode_ref(-0.0f), 0);    // -0.0 < 0 is false
  EXPECT_EQ(e2m1_encode_ref(-1e-30f), 8);  // tiny negative -> code 8 (-0)
}

// ---------------------------------------------------------------------------------------------
// Golden fixture: the independent implementation's codes, scales and dequantized values.
void expect_golden(int c, const at::Tensor& input, bool fast) {
  SCOPED_TRACE("case" + std::to_string(c) + " dtype " +
               std::string(c10::toString(input.scalar_type())) + (fast ? " fast" : " ref"));
  const Nvfp4Tensor q = fast ? quantize_nvfp4(input) : quantize_nvfp4_ref(input);
  EXPECT_TRUE(bit_equal(q.qdata, g(c, "weight.qdata"))) << "codes differ";
  EXPECT_TRUE(bit_equal(q.scale, g(c, "weight.scale"))) << "scales differ";
  const at::Tensor deq = fast ? dequantize_nvfp4(q.qdata, q.scale, at::kFloat)
                              : dequantize_nvfp4_ref(q.qdata, q.scale);
  EXPECT_TRUE(at::equal(deq, g(c, "dequant"))) << "dequantized values differ";
  EXPECT_TRUE(bit_equal(deq, g(c, "dequant"))) << "dequantized values differ in the sign of 0";
  if (fast) {
    // Fused fake-quant in the input's dtype: the dequantized values are exact in fp16/bf16.
    const at::Tensor fq = fake_quant_nvfp4_forward(input);
    EXPECT_EQ(fq.scalar_type(), input.scalar_type());
    EXPECT_TRUE(bit_equal(fq, g(c, "dequant").to(input.scalar_type())));
    EXPECT_TRUE(bit_equal(dequantize_nvfp4(q.qdata, q.scale, input.scalar_type()),
                          g(c, "dequant").to(input.scalar_type())));
  }
}

TEST(Nvfp4Golden, FixtureHasAllCases) {
  for (int c = 0; c < kGoldenCases; ++c) {
    const at::Tensor in = g(c, "input");
    EXPECT_EQ(g(c, "weight.qdata").sizes(), (std::vector<int64_t>{in.size(0), in.size(1) / 2}));
    EXPECT_EQ(g(c, "weight.scale").sizes(), (std::vector<int64_t>{in.size(0), in.size(1) / 16}));
  }
}

TEST(Nvfp4Golden, RefFp32) {
  for (int c = 0; c < kGoldenCases; ++c) expect_golden(c, g(c, "input"), /*fast=*/false);
}

TEST(Nvfp4Golden, FastFp32) {
  for (int c = 0; c < kGoldenCases; ++c) expect_golden(c, g(c, "input"), /*fast=*/true);
}

TEST(Nvfp4Golden, Fp16AndBf16WhereRepresentable) {
  int ran_fp16 = 0;
  for (at::ScalarType dtype : {at::kHalf, at::kBFloat16}) {
    for (int c = 0; c < kGoldenCases; ++c) {
      const at::Tensor in = g(c, "input");
      if (!representable(in, dtype)) continue;
      expect_golden(c, in.to(dtype), /*fast=*/false);
      expect_golden(c, in.to(dtype), /*fast=*/true);
      ran_fp16 += dtype == at::kHalf;
    }
  }
  // Case 6 is fp16-representable by construction (fixtures/README.md), so this cannot be vacuous.
  EXPECT_GE(ran_fp16, 1);
}

// ---------------------------------------------------------------------------------------------
TEST(Nvfp4Fast, RandomMatchesRefAllDtypes) {
  for (at::ScalarType dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    // 130 rows x 1040 cols crosses a CPU chunk boundary (kCpuChunkElems = 2^17) mid-tensor.
    at::Tensor x = mixed_random(130, 1040, 11);
    if (dtype == at::kHalf) x = x.clamp(-6e4, 6e4);  // keep fp16 finite
    x = x.to(dtype);
    const Nvfp4Tensor ref = quantize_nvfp4_ref(x);
    const Nvfp4Tensor fast = quantize_nvfp4(x);
    ASSERT_TRUE(bit_equal(fast.qdata, ref.qdata));
    ASSERT_TRUE(bit_equal(fast.scale, ref.scale));
    const at::Tensor deq_ref = dequantize_nvfp4_ref(ref.qdata, ref.scale);
    ASSERT_TRUE(bit_equal(dequantize_nvfp4(fast.qdata, fast.scale), deq_ref));
    ASSERT_TRUE(bit_equal(fake_quant_nvfp4_forward(x), deq_ref.to(dtype)));
    ASSERT_TRUE(bit_equal(fake_quant_nvfp4_forward_unchecked(x), deq_ref.to(dtype)));
  }
}

TEST(Nvfp4Fast, SingleBlockAndExtremes) {
  // One block (a 1-element broadcast divisor inside ATen), huge values (scale clamps at 448,
  // |d| clamps at 6), values whose scale underflows to 0, and non-contiguous input.
  const at::Tensor one = at::linspace(-3.0, 2.0, 16, at::kFloat).view({1, 16});
  const at::Tensor huge = at::linspace(-3.0, 3.0, 32, at::kFloat).view({1, 32}) * 1e38;
  const at::Tensor tiny = at::linspace(-1e-4, 1e-4, 64, at::kFloat).view({2, 32});
  const at::Tensor strided = mixed_random(32, 64, 3).t();
  for (const at::Tensor& x : {one, huge, tiny, strided}) {
    const Nvfp4Tensor ref = quantize_nvfp4_ref(x);
    const Nvfp4Tensor fast = quantize_nvfp4(x);
    EXPECT_TRUE(bit_equal(fast.qdata, ref.qdata));
    EXPECT_TRUE(bit_equal(fast.scale, ref.scale));
    EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x), dequantize_nvfp4_ref(ref.qdata, ref.scale)));
  }
}

TEST(Nvfp4Fast, NibbleOrder) {
  // Block amax 6 -> scale exactly 1.0 (0x38): the codes are the E2M1 values themselves.
  at::Tensor x = at::zeros({1, 16});
  x[0][0] = 0.5;   // code 1, element 0 -> low nibble of byte 0
  x[0][1] = -6.0;  // code 15, element 1 -> high nibble of byte 0
  x[0][15] = 3.0;  // code 5 -> high nibble of byte 7
  const Nvfp4Tensor q = quantize_nvfp4(x);
  EXPECT_EQ(q.scale[0][0].item<int>(), 0x38);
  EXPECT_EQ(q.qdata[0][0].item<int>(), 0xF1);
  EXPECT_EQ(q.qdata[0][7].item<int>(), 0x50);
  EXPECT_EQ(q.qdata[0][3].item<int>(), 0x00);
}

// ---------------------------------------------------------------------------------------------
// quantize(dequantize(q)): when a block's scale is unchanged, every d = +-code_value * s / s is
// exactly +-code_value, so the codes cannot move, except that -0 (code 8, a tiny negative)
// dequantizes to -0.0 and requantizes to code 0 (-0.0 < 0 is false): same value, other code.
// Blocks of normal-range scales (s >= 2^-6) always keep their scale: amax / s >= 6 / (1 + 2^-4)
// > 5 picks code 7, so the dequantized block's amax is 6 s and 6 s / 6 = s exactly. Values move
// only where the scale is subnormal (1-3 mantissa bits) or clamped.
struct RequantStats {
  int64_t blocks = 0;
  int64_t value_moved = 0;            // blocks whose dequantized values change
  int64_t code_moved = 0;             // blocks whose codes or scale change (-0 -> +0 included)
  int64_t code_moved_same_scale = 0;  // codes changed other than 8 -> 0 while the scale stayed
};

at::Tensor nibbles(const at::Tensor& q) {  // (r, c/2) uint8 -> (r, c) codes
  return at::stack({at::bitwise_and(q, 15), at::bitwise_right_shift(q, 4)}, 2)
      .view({q.size(0), -1});
}

RequantStats requant_stats(const at::Tensor& x) {
  const Nvfp4Tensor q1 = quantize_nvfp4(x);
  const at::Tensor y1 = dequantize_nvfp4(q1.qdata, q1.scale);
  const Nvfp4Tensor q2 = quantize_nvfp4(y1);
  const at::Tensor y2 = dequantize_nvfp4(q2.qdata, q2.scale);
  const int64_t r = x.size(0);
  const at::Tensor c1 = nibbles(q1.qdata), c2 = nibbles(q2.qdata);
  const at::Tensor scale_moved = at::ne(q1.scale, q2.scale);            // (r, c/16)
  const at::Tensor any_code = at::ne(c1, c2).view({r, -1, 16}).any(2);  // (r, c/16)
  const at::Tensor c1_no_neg0 = at::where(c1 == 8, at::zeros_like(c1), c1);
  const at::Tensor real_code = at::ne(c1_no_neg0, c2).view({r, -1, 16}).any(2);  // (r, c/16)
  RequantStats st;
  st.blocks = q1.scale.numel();
  st.value_moved = at::ne(y1, y2).view({r, -1, 16}).any(2).sum().item<int64_t>();
  st.code_moved = at::logical_or(any_code, scale_moved).sum().item<int64_t>();
  st.code_moved_same_scale =
      at::logical_and(real_code, scale_moved.logical_not()).sum().item<int64_t>();
  return st;
}

TEST(Nvfp4Requant, NormalScalesAreFixedPoints) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
  const at::Tensor x = at::randn({256, 512}, gen);  // scales ~0.3: normal E4M3 range
  const RequantStats st = requant_stats(x);
  EXPECT_EQ(st.value_moved, 0);
  EXPECT_EQ(st.code_moved_same_scale, 0);
  EXPECT_GT(st.code_moved, 0);  // the -0 -> +0 recoding is real (tiny negatives exist here)
  const Nvfp4Tensor q1 = quantize_nvfp4(x);
  const at::Tensor y = dequantize_nvfp4(q1.qdata, q1.scale);
  const at::Tensor y2 = fake_quant_nvfp4_forward(y);
  EXPECT_TRUE(at::equal(y2, y));                             // idempotent as values
  EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(y2), y2));  // and bitwise from then on
}

TEST(Nvfp4Requant, SmallWeightsMoveRarely) {
  // std 0.02 (LLM-like weights): scales ~0.007 lie in the E4M3 subnormal range.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(9);
  const at::Tensor x = at::randn({512, 1024}, gen) * 0.02;
  const RequantStats st = requant_stats(x);
  EXPECT_EQ(st.code_moved_same_scale, 0);
  const double frac = static_cast<double>(st.value_moved) / st.blocks;
  RecordProperty("value_moved_fraction", std::to_string(frac));
  RecordProperty("code_moved_fraction", std::to_string(double(st.code_moved) / st.blocks));
  // docs/design.md#nvfp4-arithmetic reports ~0.5% of blocks moving on real weights; allow 4x headroom for this
  // synthetic distribution, and require the effect to be real (not silently zero).
  EXPECT_LT(frac, 0.02);
  EXPECT_GT(st.value_moved, 0);
  // A second round trip changes nothing more: dequantized values are then fixed points.
  const at::Tensor y1 = fake_quant_nvfp4_forward(x);
  const at::Tensor y2 = fake_quant_nvfp4_forward(y1);
  const at::Tensor y3 = fake_quant_nvfp4_forward(y2);
  EXPECT_TRUE(bit_equal(y3, y2));
}

// ---------------------------------------------------------------------------------------------
TEST(Nvfp4Autograd, ComposesWithMatmul) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(2);
  const at::Tensor w = at::randn({16, 32}, gen).requires_grad_(true);
  const at::Tensor x = at::randn({4, 32}, gen);
  at::matmul(x, fake_quant_nvfp4(w).t()).sum().backward();
  // d/dW sum(x W^T) = ones(4,16)^T x, straight through the quantizer.
  EXPECT_TRUE(at::allclose(w.grad(), at::matmul(at::ones({16, 4}), x), 1e-6, 1e-6));
}

// ---------------------------------------------------------------------------------------------
using q4::test::error_of;

TEST(Nvfp4Errors, ShapeAndDtype) {
  const std::string cols = error_of([] { quantize_nvfp4(at::ones({4, 24}), "w"); });
  EXPECT_NE(cols.find("cols % 16 == 0"), std::string::npos) << cols;
  EXPECT_NE(cols.find("[4, 24]"), std::string::npos) << cols;
  const std::string dim = error_of([] { quantize_nvfp4(at::ones({32}), "w"); });
  EXPECT_NE(dim.find("2-D"), std::string::npos) << dim;
  EXPECT_NE(dim.find("1-D"), std::string::npos) << dim;
  const std::string dt = error_of([] { fake_quant_nvfp4_forward(at::ones({4, 32}, at::kDouble)); });
  EXPECT_NE(dt.find("Double"), std::string::npos) << dt;
  EXPECT_NE(error_of([] { quantize_nvfp4(at::ones({4, 32}, at::kInt)); }), "");
  EXPECT_NE(error_of([] { quantize_nvfp4_ref(at::ones({4, 20})); }), "");
  EXPECT_NE(error_of([] { fake_quant_nvfp4(at::ones({2, 3, 16})); }), "");
  const at::Tensor q = at::zeros({4, 16}, at::kByte);
  EXPECT_NE(error_of([] {
              dequantize_nvfp4(at::zeros({4, 16}, at::kByte), at::zeros({4, 3}, at::kByte));
            }).find("expected scale shape [4, 2]"),
            std::string::npos);
  EXPECT_NE(error_of([&] { dequantize_nvfp4(q, at::zeros({4, 2}, at::kByte), at::kInt); }), "");
  EXPECT_NE(error_of([&] { dequantize_nvfp4(q.to(at::kInt), at::zeros({4, 2}, at::kByte)); }), "");
}

TEST(Nvfp4Errors, EmptyTensorIsFine) {
  const Nvfp4Tensor q = quantize_nvfp4(at::zeros({0, 32}));
  EXPECT_EQ(q.qdata.sizes(), (std::vector<int64_t>{0, 16}));
  EXPECT_EQ(fake_quant_nvfp4_forward(at::zeros({0, 32})).numel(), 0);
}

// ---------------------------------------------------------------------------------------------
// The NVFP4 ops on every backend (cpu, cuda), one body each. Tolerance of every op against its
// reference, on every backend: none. Codes, scales, dequantized and fake-quantized values are
// bit-equal by construction (each backend computes the same E4M3 scale and E2M1 codes with the
// same rounding, and the dequantized values are exact in fp32, fp16 and bf16), so every check
// is bit_equal.
class Nvfp4Backend : public q4::test::BackendTest {};

TEST_P(Nvfp4Backend, GoldenCases) {
  for (int c = 0; c < kGoldenCases; ++c) {
    const at::Tensor in = g(c, "input");
    for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
      if (!representable(in, dt)) continue;  // only exactly representable
      SCOPED_TRACE("case" + std::to_string(c) + " " + c10::toString(dt));
      const at::Tensor x = in.to(dt).to(device());
      const Nvfp4Tensor q = quantize_nvfp4(x);
      EXPECT_TRUE(bit_equal(q.qdata, g(c, "weight.qdata")));
      EXPECT_TRUE(bit_equal(q.scale, g(c, "weight.scale")));
      EXPECT_TRUE(bit_equal(dequantize_nvfp4(q.qdata, q.scale, at::kFloat), g(c, "dequant")));
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x), g(c, "dequant").to(dt)));
    }
  }
}

TEST_P(Nvfp4Backend, StraightThroughGradient) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1);
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (const at::Tensor& w0 : {at::randn({8, 64}, gen).to(dt), mixed_random(32, 64, 2, dt)}) {
      const at::Tensor w = w0.to(device()).requires_grad_(true);
      const at::Tensor gout = at::randn(w0.sizes(), gen).to(dt).to(device());
      const at::Tensor y = fake_quant_nvfp4(w);
      EXPECT_EQ(y.scalar_type(), dt);
      EXPECT_TRUE(bit_equal(y.detach(), fake_quant_nvfp4_forward(w.detach())));
      y.backward(gout);
      ASSERT_TRUE(w.grad().defined());
      EXPECT_TRUE(bit_equal(w.grad(), gout));
    }
  }
}

// A NaN or Inf is an error naming the tensor and the element; on CUDA the unchecked variant
// leaves the offending block NaN and the rest exact.
TEST_P(Nvfp4Backend, NonFiniteIsAnErrorNamingTheTensor) {
  const auto opts = at::TensorOptions().device(device());
  for (float bad : {NAN, INFINITY, -INFINITY}) {
    at::Tensor x = at::ones({4, 32}, opts);
    x[2][17] = bad;
    const std::string msg = error_of([&] { quantize_nvfp4(x, "layers.3.mlp.up_proj.weight"); });
    EXPECT_NE(msg.find("layers.3.mlp.up_proj.weight"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[2, 17]"), std::string::npos) << msg;
    EXPECT_NE(error_of([&] { fake_quant_nvfp4_forward(x.to(at::kHalf), "w_h"); }).find("w_h"),
              std::string::npos);
    EXPECT_NE(error_of([&] { quantize_nvfp4_ref(x.cpu()); }), "");
  }
  at::Tensor x = at::ones({4, 32}, opts);
  x[0][0] = NAN;
  EXPECT_NE(error_of([&] { fake_quant_nvfp4(x); }), "");

  for (float bad : {NAN, INFINITY}) {
    at::Tensor x = at::ones({64, 64}, opts);
    x[5][33] = bad;
    const std::string msg = error_of([&] { fake_quant_nvfp4_forward(x, "blk.w"); });
    EXPECT_NE(msg.find("blk.w"), std::string::npos) << msg;
    EXPECT_NE(msg.find("[5, 33]"), std::string::npos) << msg;
    EXPECT_THROW(quantize_nvfp4(x.to(at::kBFloat16), "w"), c10::Error);
    // The CUDA kernel alone has an unchecked variant (the CPU path always checks): no error, the
    // offending block (row 5, cols 32..47) is NaN, the rest exact.
    if (!on_cuda()) continue;
    const at::Tensor y = fake_quant_nvfp4_forward_unchecked(x.to(at::kHalf));
    EXPECT_TRUE(at::isnan(y[5].slice(0, 32, 48)).all().item<bool>());
    EXPECT_EQ(at::isnan(y).sum().item<int64_t>(), 16);
    at::Tensor clean = x.clone();
    clean[5].slice(0, 32, 48).fill_(1.0);
    const at::Tensor expect = fake_quant_nvfp4_forward(clean.to(at::kHalf));
    EXPECT_TRUE(at::equal(y.slice(0, 0, 5), expect.slice(0, 0, 5)));
  }
}

// fake-quant straight into the other 16-bit dtype (the model's fp16 master -> bf16 compute
// weight) equals fake-quant then a cast, bit for bit: the values are exact in both dtypes.
TEST_P(Nvfp4Backend, CastOutputEqualsFakeQuantThenCast) {
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor w32 = at::randn({1024, 320}, gen) * 0.05;
  for (auto [in, out] : {std::pair{at::kHalf, at::kBFloat16}, std::pair{at::kBFloat16, at::kHalf},
                         std::pair{at::kHalf, at::kHalf}, std::pair{at::kFloat, at::kBFloat16}}) {
    const at::Tensor w = w32.to(in).to(device());
    const at::Tensor direct = fake_quant_nvfp4_forward_unchecked(w, out);
    const at::Tensor ref = fake_quant_nvfp4_forward(w).to(out);
    EXPECT_EQ(direct.scalar_type(), out);
    EXPECT_TRUE(at::equal(direct.cpu(), ref.cpu())) << in << " -> " << out;
  }
}

Q4_INSTANTIATE_BACKENDS(Nvfp4Backend);

// ---------------------------------------------------------------------------------------------
// The CUDA kernels against the CPU path (itself tested against the scalar reference above) on
// large random tensors of every dtype, extreme magnitudes, odd shapes and unaligned inputs:
// codes, scales, fake-quant and dequantize bit-equal. Every test skips without a GPU.
#define Q4_REQUIRE_CUDA()                                            \
  do {                                                               \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

const at::Device kCuda(at::kCUDA, 0);

void expect_cuda_matches_cpu(const at::Tensor& x_cpu) {
  const at::Tensor x = x_cpu.to(kCuda);
  const Nvfp4Tensor cpu = quantize_nvfp4(x_cpu);
  const Nvfp4Tensor gpu = quantize_nvfp4(x);
  ASSERT_TRUE(gpu.qdata.is_cuda());
  EXPECT_TRUE(bit_equal(gpu.qdata, cpu.qdata)) << "codes differ";
  EXPECT_TRUE(bit_equal(gpu.scale, cpu.scale)) << "scales differ";
  const at::Tensor fq = fake_quant_nvfp4_forward(x);
  EXPECT_EQ(fq.scalar_type(), x.scalar_type());
  EXPECT_TRUE(bit_equal(fq, fake_quant_nvfp4_forward(x_cpu))) << "fake-quant differs";
  EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward_unchecked(x), fq)) << "unchecked differs";
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    EXPECT_TRUE(bit_equal(dequantize_nvfp4(gpu.qdata, gpu.scale, dt),
                          dequantize_nvfp4(cpu.qdata, cpu.scale, dt)))
        << "dequantize differs for " << dt;
  }
}

TEST(Nvfp4Cuda, LargeRandomAllDtypes) {
  Q4_REQUIRE_CUDA();
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    expect_cuda_matches_cpu(mixed_random(4096, 4096, 21, dt));
  }
}

TEST(Nvfp4Cuda, ExtremesAndOddShapes) {
  Q4_REQUIRE_CUDA();
  // Huge (scale clamps at 448), tiny (scale underflows to 0), a single block, a block count that
  // is not a multiple of the warp's lane groups.
  expect_cuda_matches_cpu(at::linspace(-3.0, 3.0, 64, at::kFloat).view({2, 32}) * 1e38);
  expect_cuda_matches_cpu(at::linspace(-1e-4, 1e-4, 64, at::kFloat).view({2, 32}));
  expect_cuda_matches_cpu(at::linspace(-3.0, 2.0, 16, at::kFloat).view({1, 16}));
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    expect_cuda_matches_cpu(mixed_random(37, 48, 4, dt));
  }
}

TEST(Nvfp4Cuda, UnalignedAndStridedInput) {
  Q4_REQUIRE_CUDA();
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    // Offset by one element: contiguous but not 16-byte aligned (scalar-load kernel variant).
    const at::Tensor base = mixed_random(2, 4112, 8, dt).to(kCuda);  // >= 64 * 128 + 1 elements
    const at::Tensor x = base.view({-1}).narrow(0, 1, 64 * 128).view({64, 128});
    ASSERT_NE(reinterpret_cast<uintptr_t>(x.data_ptr()) % 16, 0u);
    const at::Tensor x_cpu = x.cpu();
    const Nvfp4Tensor gpu = quantize_nvfp4(x);
    const Nvfp4Tensor cpu = quantize_nvfp4(x_cpu);
    EXPECT_TRUE(bit_equal(gpu.qdata, cpu.qdata));
    EXPECT_TRUE(bit_equal(gpu.scale, cpu.scale));
    EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x), fake_quant_nvfp4_forward(x_cpu)));
    // Transposed (non-contiguous) input goes through .contiguous().
    const at::Tensor t = mixed_random(64, 32, 9, dt).to(kCuda).t();
    EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(t), fake_quant_nvfp4_forward(t.cpu())));
  }
}

}  // namespace
}  // namespace q4::quant
