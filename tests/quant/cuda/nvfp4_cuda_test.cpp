// CUDA tests of the NVFP4 kernels: bit-exact against the golden fixture and against the CPU path
// (itself tested against the scalar reference) on large random tensors of every dtype, including
// extreme magnitudes and unaligned inputs; the NaN/Inf check and the straight-through gradient.
// Every test skips without a GPU.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <string>

#include "../golden_dat.h"
#include "q4/quant/nvfp4.h"

namespace q4::quant {
namespace {

using testing::bit_equal;

#define Q4_REQUIRE_CUDA()                                            \
  do {                                                               \
    if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU"; \
  } while (0)

const at::Device kCuda(at::kCUDA, 0);

// Mixed magnitudes per row (10^k, k in [-9, 4]) plus zero and -0.0 blocks; clamped to fp16 range
// when the dtype is fp16.
at::Tensor mixed_random(int64_t rows, int64_t cols, uint64_t seed, at::ScalarType dtype) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  at::Tensor x = at::randn({rows, cols}, gen, at::kFloat);
  const at::Tensor k = at::arange(rows, at::kFloat).remainder(14) - 9;
  x = x * at::pow(10.0, k).unsqueeze(1);
  x.index_put_({0, torch::indexing::Slice(0, 16)}, 0.0);
  x.index_put_({1, torch::indexing::Slice(0, 16)}, -0.0);
  if (dtype == at::kHalf) x = x.clamp(-6e4, 6e4);
  return x.to(dtype);
}

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

TEST(Nvfp4Cuda, GoldenCases) {
  Q4_REQUIRE_CUDA();
  const auto golden = testing::read_small_dat(std::string(Q4_FIXTURES_DIR) + "/nvfp4_golden.dat");
  for (int c = 0; c < 8; ++c) {
    const std::string p = "case" + std::to_string(c) + ".";
    const at::Tensor in = golden.at(p + "input");
    for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
      if (!bit_equal(in.to(dt).to(at::kFloat), in)) continue;  // only exactly representable
      SCOPED_TRACE(p + c10::toString(dt));
      const at::Tensor x = in.to(dt).to(kCuda);
      const Nvfp4Tensor q = quantize_nvfp4(x);
      EXPECT_TRUE(bit_equal(q.qdata, golden.at(p + "weight.qdata")));
      EXPECT_TRUE(bit_equal(q.scale, golden.at(p + "weight.scale")));
      EXPECT_TRUE(
          bit_equal(dequantize_nvfp4(q.qdata, q.scale, at::kFloat), golden.at(p + "dequant")));
      EXPECT_TRUE(bit_equal(fake_quant_nvfp4_forward(x), golden.at(p + "dequant").to(dt)));
    }
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

TEST(Nvfp4Cuda, NonFiniteIsAnError) {
  Q4_REQUIRE_CUDA();
  for (float bad : {NAN, INFINITY}) {
    at::Tensor x = at::ones({64, 64}, at::TensorOptions().device(kCuda));
    x[5][33] = bad;
    try {
      fake_quant_nvfp4_forward(x, "blk.w");
      ADD_FAILURE() << "no error for " << bad;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find("blk.w"), std::string::npos) << msg;
      EXPECT_NE(msg.find("[5, 33]"), std::string::npos) << msg;
    }
    EXPECT_THROW(quantize_nvfp4(x.to(at::kBFloat16), "w"), c10::Error);
    // Unchecked: no error, the offending block (row 5, cols 32..47) is NaN, the rest exact.
    const at::Tensor y = fake_quant_nvfp4_forward_unchecked(x.to(at::kHalf));
    EXPECT_TRUE(at::isnan(y[5].slice(0, 32, 48)).all().item<bool>());
    EXPECT_EQ(at::isnan(y).sum().item<int64_t>(), 16);
    at::Tensor clean = x.clone();
    clean[5].slice(0, 32, 48).fill_(1.0);
    const at::Tensor expect = fake_quant_nvfp4_forward(clean.to(at::kHalf));
    EXPECT_TRUE(at::equal(y.slice(0, 0, 5), expect.slice(0, 0, 5)));
  }
}

TEST(Nvfp4Cuda, StraightThroughGradient) {
  Q4_REQUIRE_CUDA();
  for (at::ScalarType dt : {at::kFloat, at::kHalf, at::kBFloat16}) {
    const at::Tensor w = mixed_random(32, 64, 2, dt).to(kCuda).requires_grad_(true);
    const at::Tensor gout = at::randn({32, 64}, at::TensorOptions().device(kCuda).dtype(dt));
    const at::Tensor y = fake_quant_nvfp4(w);
    EXPECT_TRUE(bit_equal(y.detach(), fake_quant_nvfp4_forward(w.detach())));
    y.backward(gout);
    EXPECT_TRUE(bit_equal(w.grad(), gout));
  }
}

// fake-quant straight into the other 16-bit dtype (the model's fp16 master -> bf16 compute
// weight) equals fake-quant then a cast, bit for bit: the values are exact in both dtypes.
TEST(Nvfp4Cuda, CastOutputEqualsFakeQuantThenCast) {
  Q4_REQUIRE_CUDA();
  at::Generator gen = at::detail::createCPUGenerator(5);
  const at::Tensor w32 = at::randn({1024, 320}, gen) * 0.05;
  for (auto [in, out] : {std::pair{at::kHalf, at::kBFloat16}, std::pair{at::kBFloat16, at::kHalf},
                         std::pair{at::kHalf, at::kHalf}, std::pair{at::kFloat, at::kBFloat16}}) {
    const at::Tensor w = w32.to(in).cuda();
    const at::Tensor direct = fake_quant_nvfp4_forward_unchecked(w, out);
    const at::Tensor ref = fake_quant_nvfp4_forward(w).to(out);
    EXPECT_EQ(direct.scalar_type(), out);
    EXPECT_TRUE(at::equal(direct.cpu(), ref.cpu())) << in << " -> " << out;
  }
}

}  // namespace
}  // namespace q4::quant
