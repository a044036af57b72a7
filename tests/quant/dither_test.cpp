// dither_nvfp4 (q4/quant/dither.h) against a direct fp64 statement of the rounding cells written
// here: the scale from the scalar reference quantizer, the cell bounds as midpoints of the E2M1
// grid. Checked: fake_quant unchanged (values; only a zero's sign may change), every value
// inside its cell and within its block's maximum, the maxima unmoved, most values moved, the same
// seed giving the same bits, and the point of it all: a small update d moves the quantized mean
// by about d from dithered masters and not at all from masters on the grid.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>
#include <tuple>

#include "q4/quant/dither.h"
#include "q4/quant/nvfp4.h"

namespace q4::test::dither_test {
namespace {

using quant::BlockRule;

// Masters as a load makes them: dequantize(quantize(W)) of normal rows whose standard deviations
// span 2^-6 .. 2^9 (E4M3 block scales from subnormal to 2^8), in `dtype`. (64, 512).
at::Tensor loaded_masters(at::ScalarType dtype, uint64_t seed = 3) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor row_scale =
      at::pow(2.0, at::arange(64, at::kFloat).remainder(16) - 6).unsqueeze(1);
  const at::Tensor w = at::randn({64, 512}, gen) * row_scale;
  const quant::Nvfp4Tensor q = quant::quantize_nvfp4(w, "w");
  return quant::dequantize_nvfp4(q.qdata, q.scale, dtype);
}

// The E2M1 grid and its cell bounds (midpoints of adjacent grid values), in units of the scale.
constexpr std::array<double, 8> kGrid = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
double cell_lo(int k) { return k == 0 ? 0.0 : (kGrid[k - 1] + kGrid[k]) / 2; }
double cell_hi(int k) { return k == 7 ? INFINITY : (kGrid[k] + kGrid[k + 1]) / 2; }

// For each element of w (r, c): the fp64 magnitude cell [lo, hi), the sign of a
// nonzero code (0 for zero), the decoded scale, the block max, under the scalar reference.
struct RefCells {
  at::Tensor lo, hi, sign, scale, amax;  // (r, c) fp64
};

RefCells ref_cells(const at::Tensor& w, BlockRule rule) {
  const at::Tensor x = w.to(at::kFloat).contiguous();
  const quant::Nvfp4Tensor q = quant::quantize_nvfp4_ref(x, rule);
  const int64_t r = x.size(0), c = x.size(1);
  RefCells out;
  for (at::Tensor* t : {&out.lo, &out.hi, &out.sign, &out.scale, &out.amax}) {
    *t = at::empty({r, c}, at::kDouble);
  }
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = q.qdata.data_ptr<uint8_t>();
  const uint8_t* sp = q.scale.data_ptr<uint8_t>();
  for (int64_t i = 0; i < r; ++i) {
    for (int64_t b = 0; b < c / 16; ++b) {
      const double s = quant::e4m3_decode_ref(sp[i * (c / 16) + b]);
      double amax = 0;
      for (int64_t j = 0; j < 16; ++j) amax = std::max(amax, std::fabs(static_cast<double>(xp[i * c + 16 * b + j])));
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t e = i * c + 16 * b + j;
        const uint8_t byte = qp[e / 2];
        const int code = (e % 2 == 0) ? (byte & 15) : (byte >> 4);
        const int k = code & 7;
        out.lo.data_ptr<double>()[e] = cell_lo(k) * s;
        out.hi.data_ptr<double>()[e] = cell_hi(k) * s;
        out.sign.data_ptr<double>()[e] = k == 0 ? 0.0 : ((code & 8) ? -1.0 : 1.0);
        out.scale.data_ptr<double>()[e] = s;
        out.amax.data_ptr<double>()[e] = amax;
      }
    }
  }
  return out;
}

// Bits of fp32 values with -0.0 taken as +0.0.
at::Tensor bits_without_zero_sign(const at::Tensor& t) {
  return (t.to(at::kFloat) + 0.0).view(at::kInt);
}

class DitherCells : public testing::TestWithParam<std::tuple<BlockRule, at::ScalarType>> {};

TEST_P(DitherCells, ForwardUnchangedValuesInsideTheirCells) {
  const auto [rule, dtype] = GetParam();
  const at::Tensor w = loaded_masters(dtype);
  quant::DitherStats st;
  const at::Tensor d = quant::dither_nvfp4(w, 7, "w", rule, &st);
  ASSERT_EQ(d.scalar_type(), dtype);
  ASSERT_EQ(d.sizes(), w.sizes());
  // (i) the forward weights: equal as values, and bit for bit once a zero's sign is ignored.
  const at::Tensor fq0 = quant::fake_quant_nvfp4_forward(w, "w", rule);
  const at::Tensor fq1 = quant::fake_quant_nvfp4_forward(d, "w", rule);
  EXPECT_TRUE(at::eq(fq0, fq1).all().item<bool>());
  EXPECT_TRUE(at::equal(bits_without_zero_sign(fq0), bits_without_zero_sign(fq1)));
  // (ii) inside the cells of the undithered masters, computed here in fp64.
  const RefCells c = ref_cells(w, rule);
  const at::Tensor x = d.to(at::kDouble), x0 = w.to(at::kDouble);
  const at::Tensor ax = x.abs();
  // Each block keeps its maximum, and no value exceeds it.
  EXPECT_TRUE(at::equal(std::get<0>(ax.view({-1, 16}).max(1)),
                        std::get<0>(x0.abs().view({-1, 16}).max(1))));
  EXPECT_TRUE(at::le(ax, c.amax).all().item<bool>());
  const at::Tensor moved = at::ne(x, x0);
  const at::Tensor inside = at::ge(ax, c.lo).logical_and_(at::lt(ax, c.hi));
  EXPECT_TRUE(inside.logical_or_(moved.logical_not()).all().item<bool>());
  const at::Tensor sign_ok = at::eq(c.sign, 0).logical_or_(at::eq(at::sign(x), c.sign));
  EXPECT_TRUE(sign_ok.all().item<bool>());
  // Most values moved: every element but a block's maximum may; the rounds leave few blocks.
  const double frac_moved = moved.to(at::kDouble).mean().item<double>();
  const double frac_blocks = static_cast<double>(st.blocks_dithered) / st.blocks;
  EXPECT_EQ(st.blocks, w.numel() / 16);
  EXPECT_EQ(st.elements_moved, moved.sum().item<int64_t>());
  std::printf("rule %s dtype %s: %.4f of blocks dithered, %.4f of elements moved\n",
              rule == BlockRule::kMax6 ? "max6" : "4over6", c10::toString(dtype),
              frac_blocks, frac_moved);
  EXPECT_GT(frac_moved, 0.8);
  EXPECT_GT(frac_blocks, 0.95);
}

INSTANTIATE_TEST_SUITE_P(
    RulesAndDtypes, DitherCells,
    testing::Combine(testing::Values(BlockRule::kMax6, BlockRule::kFourOverSix),
                     testing::Values(at::kFloat, at::kHalf, at::kBFloat16)));

TEST(Dither, SameSeedSameBits) {
  const at::Tensor w = loaded_masters(at::kHalf);
  const at::Tensor a = quant::dither_nvfp4(w, 11, "w");
  const at::Tensor b = quant::dither_nvfp4(w, 11, "w");
  const at::Tensor c = quant::dither_nvfp4(w, 12, "w");
  EXPECT_TRUE(at::equal(a.view(at::kShort), b.view(at::kShort)));
  EXPECT_FALSE(at::equal(a, c));
}

TEST(Dither, NonFiniteIsAnErrorNamingTheTensor) {
  at::Tensor w = loaded_masters(at::kFloat);
  w[3][17] = NAN;
  try {
    quant::dither_nvfp4(w, 1, "layers.0.q_proj");
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("layers.0.q_proj"), std::string::npos);
  }
}

// Every block with the same maximum (so the same scale, 0.171875 = E4M3(1.03125 / 6)) whatever
// a small update does: elements uniform in [-1, 1], element 0 of each block +1. (128, 1024).
at::Tensor fixed_scale_masters() {
  at::Generator gen = at::detail::createCPUGenerator(5);
  at::Tensor w = at::rand({128, 1024}, gen) * 2 - 1;
  w.view({-1, 16}).select(1, 0).fill_(1.0);
  const quant::Nvfp4Tensor q = quant::quantize_nvfp4(w, "w");
  return quant::dequantize_nvfp4(q.qdata, q.scale, at::kFloat);
}

TEST(Dither, SmallUpdateMovesTheQuantizedMeanByItsSize) {
  const at::Tensor codes = fixed_scale_masters();
  const double s = 0.171875;
  const RefCells c = ref_cells(codes, BlockRule::kMax6);
  ASSERT_TRUE(at::eq(c.scale, s).all().item<bool>());
  const at::Tensor dith = quant::dither_nvfp4(codes, 21, "w");
  const double delta = 0.02 * s;  // a twelfth of the smallest half spacing (0.25 s)
  auto mean_change = [&](const at::Tensor& m) {
    const at::Tensor before = quant::fake_quant_nvfp4_forward(m, "w").to(at::kDouble);
    const at::Tensor after = quant::fake_quant_nvfp4_forward(m + delta, "w").to(at::kDouble);
    // The scales stay (the block maxima move by delta, far from an E4M3 rounding boundary).
    EXPECT_TRUE(at::equal(quant::quantize_nvfp4(m, "w").scale,
                          quant::quantize_nvfp4(m + delta, "w").scale));
    return (after - before).mean().item<double>();
  };
  // Masters on the grid: nothing crosses a threshold.
  EXPECT_EQ(mean_change(codes), 0.0);
  // Dithered: each element uniform in its cell [a, b) crosses b with probability delta / (b - a)
  // and then moves by the gap g to the next grid value (the top cell [5 s, 6 s) only downward);
  // the expected mean and its standard error from those, in fp64.
  const at::Tensor x = dith.to(at::kDouble);
  const at::Tensor movable = at::ne(dith, codes);
  const at::Tensor k = at::round((codes.to(at::kDouble) / s).abs() * 2);  // 2 * |grid value|
  at::Tensor p = at::zeros_like(x), g = at::zeros_like(x);
  auto* pp = p.data_ptr<double>();
  auto* gp = g.data_ptr<double>();
  const double* xp = x.data_ptr<double>();
  const double* kp = k.data_ptr<double>();
  const bool* mp = movable.data_ptr<bool>();
  const double amax = 6 * s;  // every block's maximum (its element 0, code 7)
  for (int64_t i = 0; i < x.numel(); ++i) {
    if (!mp[i]) continue;
    int gi = 0;
    while (kGrid[gi] * 2 != kp[i]) ++gi;
    const double width = std::min(cell_hi(gi) * s, amax) - cell_lo(gi) * s;
    if (gi == 0) {  // zero's cell (-0.25 s, 0.25 s): upward into 0.5 s
      pp[i] = delta / width;
      gp[i] = 0.5 * s;
    } else if (xp[i] > 0 && gi < 7) {  // up to the next grid value
      pp[i] = delta / width;
      gp[i] = (kGrid[gi + 1] - kGrid[gi]) * s;
    } else if (xp[i] < 0) {  // towards zero: the magnitude crosses its cell's lower bound
      pp[i] = delta / width;
      gp[i] = (kGrid[gi] - kGrid[gi - 1]) * s;
    }
  }
  const double n = static_cast<double>(x.numel());
  const double expected = (p * g).sum().item<double>() / n;
  const double se = std::sqrt((p * (1 - p) * g * g).sum().item<double>()) / n;
  const double got = mean_change(dith);
  std::printf("delta %.6g: mean change %.6g, expected %.6g +- %.3g\n", delta, got, expected, se);
  EXPECT_NEAR(got, expected, 5 * se);
  EXPECT_GT(got, 0.7 * delta);
  EXPECT_LT(got, 1.3 * delta);
}

}  // namespace
}  // namespace q4::test::dither_test
