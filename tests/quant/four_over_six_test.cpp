// The 4-over-6 block rule (BlockRule::kFourOverSix, docs/design.md#nvfp4-arithmetic) against a
// direct fp64 statement of it written here (both candidate scales, each block quantized and
// dequantized with the scalar element codecs, errors summed in plain order), on random and
// adversarial blocks; its error never above max6's; fake-quant = dequantize(quantize) under both
// rules and every dtype; the fast CPU path and the CUDA kernels equal to the scalar reference bit
// for bit (the CUDA case skips without a GPU); max6 passed explicitly equals the golden fixture.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "golden_dat.h"
#include "q4/quant/nvfp4.h"

namespace q4::quant {
namespace {

using testing::bit_equal;

// Direct statement of the rule for one block x[0..15] (fp32 values): scale bits chosen.
struct Choice {
  uint8_t bits;
  double err6, err4;  // fp64 squared errors of the two candidates (sequential sums)
};

double candidate_err(const float* x, float target, uint8_t* bits) {
  double amax = 0.0;
  for (int i = 0; i < 16; ++i) amax = std::max(amax, std::fabs(static_cast<double>(x[i])));
  const float sf =
      std::min(std::max(static_cast<float>(amax) / target, 1.52587890625e-05f), 448.0f);
  *bits = e4m3_encode_ref(sf);
  const double s = e4m3_decode_ref(*bits);
  double err = 0.0;
  for (int i = 0; i < 16; ++i) {
    const float d = std::min(std::max(x[i] / (static_cast<float>(s) + 1e-12f), -6.0f), 6.0f);
    const double q = static_cast<double>(e2m1_decode_ref(e2m1_encode_ref(d))) * s;
    err += (x[i] - q) * (x[i] - q);
  }
  return err;
}

Choice direct_rule(const float* x) {
  Choice c{};
  uint8_t b6 = 0, b4 = 0;
  c.err6 = candidate_err(x, 6.0f, &b6);
  c.err4 = candidate_err(x, 4.0f, &b4);
  c.bits = c.err4 < c.err6 ? b4 : b6;
  return c;
}

// Random blocks of several shapes of distribution, and the adversarial ones: zeros, -0.0, one
// large value among zeros or small noise, exact ties (values both scales represent), values at
// the clamps (scale 448, scale 2^-16), E2M1 rounding ties. (r, 16 * k) fp32.
at::Tensor test_blocks() {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(17);
  std::vector<at::Tensor> rows;
  rows.push_back(at::randn({64, 256}, gen));
  rows.push_back(at::rand({64, 256}, gen) * 2 - 1);
  rows.push_back(at::randn({64, 256}, gen).pow(3) * 0.01);  // heavy tails
  at::Tensor mags = at::pow(10.0, at::arange(64, at::kFloat).remainder(16) - 10).unsqueeze(1);
  rows.push_back(at::randn({64, 256}, gen) * mags);
  at::Tensor adv = at::zeros({16, 256});
  adv[1].fill_(-0.0);
  for (int j = 0; j < 16; ++j) adv[2][16 * j + (j % 16)] = 0.5f + 0.37f * j;  // one value
  adv[3] = at::randn({256}, gen) * 1e-3;
  for (int j = 0; j < 16; ++j) adv[3][16 * j] = 6.5f * (j + 1);  // one large among noise
  // Values on both grids (scale 1 for max6, 1.5 for amax -> 4): 0, 1.5, 3, 6 -> both exact.
  const float both[16] = {6, 3, 1.5, 0, -3, -1.5, 6, -6, 0, 3, 1.5, 1.5, -0.0f, 3, 0, 6};
  for (int j = 0; j < 256; ++j) adv[4][j] = both[j % 16] * std::ldexp(1.0f, j / 16 - 8);
  adv[5] = at::linspace(-2688.0, 2688.0, 256);  // amax near 6 * 448
  adv[6] = at::linspace(-1e5, 1e5, 256);        // both scales clamp at 448
  adv[7] = at::linspace(-1e-6, 1e-6, 256);      // both scales at the 2^-16 floor
  // E2M1 thresholds under scale 1: 0.25, 0.75, ... 5, with amax 6.
  const float ties[16] = {6,  0.25, 0.75, 1.25,  1.75,  2.5,   3.5,   5,
                          -5, -3.5, -2.5, -1.75, -1.25, -0.75, -0.25, 4};
  for (int j = 0; j < 256; ++j) adv[8][j] = ties[j % 16];
  adv[9] = at::full({256}, 7.0f);  // constant blocks
  adv[10] = at::arange(256, at::kFloat) - 128;
  rows.push_back(adv);
  return at::cat(rows, 0).contiguous();
}

TEST(FourOverSix, ReferenceMatchesDirectFp64Rule) {
  const at::Tensor x = test_blocks();
  for (const bool fast : {false, true}) {
    SCOPED_TRACE(fast ? "fast CPU path" : "scalar reference");
    const Nvfp4Tensor q = fast ? quantize_nvfp4(x, "x", BlockRule::kFourOverSix)
                               : quantize_nvfp4_ref(x, BlockRule::kFourOverSix);
    const float* xp = x.data_ptr<float>();
    const uint8_t* sp = q.scale.data_ptr<uint8_t>();
    int64_t chose4 = 0, near_ties = 0;
    for (int64_t b = 0; b < q.scale.numel(); ++b) {
      const Choice c = direct_rule(xp + 16 * b);
      // The codec sums in a pairwise order, this in a plain one: they may disagree only where
      // the two errors are within a few fp64 roundings of each other (16 terms: 1e-14 relative).
      const bool near = std::fabs(c.err4 - c.err6) <= 1e-14 * std::max(c.err4, c.err6);
      near_ties += near && c.err4 != c.err6;
      if (!near || c.err4 == c.err6) {
        ASSERT_EQ(sp[b], c.bits) << "block " << b << " err6 " << c.err6 << " err4 " << c.err4;
      }
      uint8_t b6 = 0;
      candidate_err(xp + 16 * b, 6.0f, &b6);
      chose4 += sp[b] != b6;
    }
    EXPECT_LE(near_ties, 2);
    // Random blocks pick amax -> 4 a good part of the time (cannot pass with the rule off).
    EXPECT_GT(chose4, q.scale.numel() / 10) << "of " << q.scale.numel();
  }
}

TEST(FourOverSix, AdversarialBlocks) {
  // Exact tie (both scales represent every value): max6, scale 1.0 = 0x38.
  const std::vector<float> both = {6, 3, 1.5, 0, -3, -1.5, 6, -6, 0, 3, 1.5, 1.5, 0, 3, 0, 6};
  const at::Tensor tie = at::tensor(both).view({1, 16});
  EXPECT_EQ(quantize_nvfp4(tie, "t", BlockRule::kFourOverSix).scale.item<uint8_t>(), 0x38);
  // One value 6.5: max6 scale E4M3(6.5/6) = 1.125 gives 6.75; amax -> 4 gives 1.625 * 4 = 6.5.
  at::Tensor one = at::zeros({1, 16});
  one[0][3] = 6.5f;
  const Nvfp4Tensor q = quantize_nvfp4(one, "o", BlockRule::kFourOverSix);
  EXPECT_EQ(e4m3_decode_ref(q.scale.item<uint8_t>()), 1.625f);
  EXPECT_EQ(dequantize_nvfp4(q.qdata, q.scale)[0][3].item<float>(), 6.5f);
  EXPECT_EQ(e4m3_decode_ref(quantize_nvfp4(one, "o").scale.item<uint8_t>()), 1.125f);
  // Zeros, -0.0 and the 2^-16 floor: both candidates equal, so max6's bits.
  for (const at::Tensor& z : {at::zeros({2, 32}), at::full({2, 32}, -0.0f),
                              at::linspace(-1e-6, 1e-6, 64).view({2, 32})}) {
    EXPECT_TRUE(bit_equal(quantize_nvfp4(z, "z", BlockRule::kFourOverSix).scale,
                          quantize_nvfp4(z, "z").scale));
    EXPECT_TRUE(bit_equal(quantize_nvfp4(z, "z", BlockRule::kFourOverSix).qdata,
                          quantize_nvfp4(z, "z").qdata));
  }
}

// Squared error of each block of x (r, c) against y, fp64, (r * c / 16).
at::Tensor block_err(const at::Tensor& x, const at::Tensor& y) {
  return (x.to(at::kDouble) - y.to(at::kDouble)).pow(2).view({-1, 16}).sum(1);
}

TEST(FourOverSix, ErrorNeverAboveMax6) {
  const at::Tensor x = test_blocks();
  const at::Tensor e6 = block_err(x, fake_quant_nvfp4_forward(x, "x"));
  const at::Tensor e4o6 = block_err(x, fake_quant_nvfp4_forward(x, "x", BlockRule::kFourOverSix));
  // Equal where max6 is kept; strictly lower (beyond summation-order rounding) where not.
  EXPECT_TRUE((e4o6 <= e6 * (1 + 1e-14)).all().item<bool>());
  // Gaussian blocks (the first 64 rows): a clear drop in the mean squared error.
  const int64_t n = 64 * 256 / 16;
  const double mse6 = e6.narrow(0, 0, n).sum().item<double>();
  const double mse4o6 = e4o6.narrow(0, 0, n).sum().item<double>();
  EXPECT_LT(mse4o6, 0.95 * mse6) << "4-over-6 " << mse4o6 << ", max6 " << mse6;
}

TEST(FourOverSix, FakeQuantIsDequantOfQuantizeAndFastEqualsRef) {
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    // 130 x 1040 crosses a CPU chunk boundary; fp16 clamped to stay finite.
    auto gen = at::make_generator<at::CPUGeneratorImpl>(5);
    at::Tensor x = at::randn({130, 1040}, gen) *
                   at::pow(10.0, at::arange(130, at::kFloat).remainder(12) - 8).unsqueeze(1);
    x = (dt == at::kHalf ? x.clamp(-6e4, 6e4) : x).to(dt);
    for (BlockRule rule : {BlockRule::kMax6, BlockRule::kFourOverSix}) {
      const Nvfp4Tensor ref = quantize_nvfp4_ref(x, rule);
      const Nvfp4Tensor fast = quantize_nvfp4(x, "x", rule);
      ASSERT_TRUE(bit_equal(fast.qdata, ref.qdata));
      ASSERT_TRUE(bit_equal(fast.scale, ref.scale));
      const at::Tensor deq = dequantize_nvfp4_ref(ref.qdata, ref.scale).to(dt);
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x, "x", rule), deq));
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward_unchecked(x, std::nullopt, "x", rule), deq));
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4(x, true, rule), deq));
      const Nvfp4Tensor into{at::empty_like(fast.qdata), at::empty_like(fast.scale)};
      quantize_nvfp4_into(x, into, "x", rule);
      EXPECT_TRUE(bit_equal(into.scale, ref.scale));
    }
    EXPECT_FALSE(bit_equal(quantize_nvfp4(x, "x", BlockRule::kFourOverSix).scale,
                           quantize_nvfp4(x, "x").scale));
  }
}

TEST(FourOverSix, Max6ExplicitEqualsGolden) {
  const auto golden = testing::read_small_dat(std::string(Q4_FIXTURES_DIR) + "/nvfp4_golden.dat");
  for (int c = 0; c < 8; ++c) {
    const std::string k = "case" + std::to_string(c) + ".";
    const at::Tensor in = golden.at(k + "input");
    const Nvfp4Tensor q = quantize_nvfp4(in, "x", BlockRule::kMax6);
    EXPECT_TRUE(bit_equal(q.qdata, golden.at(k + "weight.qdata"))) << c;
    EXPECT_TRUE(bit_equal(q.scale, golden.at(k + "weight.scale"))) << c;
    EXPECT_TRUE(
        bit_equal(quantize_nvfp4_ref(in, BlockRule::kMax6).scale, golden.at(k + "weight.scale")))
        << c;
  }
}

// CUDA kernels under 4-over-6 against the CPU path (itself equal to the reference above), every
// dtype, aligned and unaligned: codes, scales and fake-quant (also into the other 16-bit dtype)
// bit for bit. Skips without a GPU.
TEST(FourOverSixCuda, MatchesCpu) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const at::Device cuda(at::kCUDA, 0);
  const BlockRule r = BlockRule::kFourOverSix;
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dt));
    at::Tensor x_cpu = test_blocks();
    x_cpu = (dt == at::kHalf ? x_cpu.clamp(-6e4, 6e4) : x_cpu).to(dt);
    for (const bool aligned : {true, false}) {
      const at::Tensor base = x_cpu.view({-1}).to(cuda);
      const at::Tensor flat =
          aligned ? base : at::cat({base.narrow(0, 0, 1), base}).narrow(0, 1, base.numel());
      const at::Tensor x = flat.view(x_cpu.sizes());
      const Nvfp4Tensor cpu = quantize_nvfp4(x_cpu, "x", r);
      const Nvfp4Tensor gpu = quantize_nvfp4(x, "x", r);
      EXPECT_TRUE(bit_equal(gpu.qdata, cpu.qdata)) << "codes differ, aligned " << aligned;
      EXPECT_TRUE(bit_equal(gpu.scale, cpu.scale)) << "scales differ, aligned " << aligned;
      const at::Tensor fq_cpu = fake_quant_nvfp4_forward(x_cpu, "x", r);
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x, "x", r), fq_cpu));
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward_unchecked(x, std::nullopt, "x", r), fq_cpu));
      const Nvfp4Tensor into{at::empty_like(gpu.qdata), at::empty_like(gpu.scale)};
      quantize_nvfp4_into(x, into, "x", r);
      EXPECT_TRUE(bit_equal(into.scale, cpu.scale));
      if (dt != at::kFloat) {
        const at::ScalarType other = dt == at::kHalf ? at::kBFloat16 : at::kHalf;
        EXPECT_TRUE(
            bit_equal(fake_quant_nvfp4_forward_unchecked(x, other, "x", r), fq_cpu.to(other)));
      }
    }
  }
}

}  // namespace
}  // namespace q4::quant
