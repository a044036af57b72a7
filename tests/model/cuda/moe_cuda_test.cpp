// CUDA only: the tiny mixture-of-experts fixture (make_moe_fixture.py) on the GPU, in fp32
// against HF's outputs with the fixture's tolerances, and in the training configuration (fp16
// masters, bf16 compute and gradients) against the fp32 fixture within bf16's. Skips without a
// GPU.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>

#include "../qwen3_check.h"
#include "../tiny_fixture.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace q4::model {
namespace {

const std::string kMoeConfig = kFixtures + "/qwen3_moe_tiny.config.json";
const std::string kMoeWeights = kFixtures + "/qwen3_moe_tiny.weights.dat";
const std::string kMoeExpected = kFixtures + "/qwen3_moe_tiny.expected.dat";

// rel_grad > 0: each gradient within that relative error of the fixture's in norm (bf16);
// otherwise elementwise within the fixture's tolerances.
void check_moe_fixture(ModelOptions o, double rtol, double grad_rtol, double atol,
                       double rel_grad = 0) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kMoeConfig);
  const DatReader w(kMoeWeights), e(kMoeExpected);
  ModelInputs in = fixture_inputs(e);
  in.attention_mask = e.load("attention_mask");
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  m.zero_grad();
  const LossOutput lo = m.loss(in);
  lo.loss.backward();
  EXPECT_CLOSE(lo.loss.detach().reshape({1}), e.load("loss"), rtol, atol, "loss");
  EXPECT_CLOSE(lo.aux_loss.reshape({1}), e.load("aux_loss"), rtol, atol, "aux_loss");
  for (const auto& p : m.parameters()) {
    const std::string key = "grad." + p.name;
    ASSERT_TRUE(p.grad.defined()) << key;
    if (rel_grad > 0) {
      EXPECT_LE(rel_err(p.grad, e.load(key)), rel_grad) << key;
    } else {
      EXPECT_CLOSE(p.grad, e.load(key), grad_rtol, atol, key);
    }
  }
  const RouterStats s = m.router_stats();
  EXPECT_EQ(s.layers.size(), 2u);
  EXPECT_GT(s.max_load(), 1.0);
}

TEST(MoeCuda, FixtureFp32) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  for (bool ckpt : {false, true}) {
    SCOPED_TRACE(ckpt ? "checkpointing" : "no checkpointing");
    ModelOptions o = fp32_all(ckpt);
    o.device = at::Device(at::kCUDA, 0);
    const FixtureTolerances& t = kFixtureFp32.at(q4::test::Backend::kCuda);
    check_moe_fixture(o, t.loss.rtol, t.grad.rtol, t.grad.atol);
  }
}

TEST(MoeCuda, FixtureBf16Compute) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device";
  ModelOptions o = fp32_all(true);
  o.device = at::Device(at::kCUDA, 0);
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.grad_dtype = at::kBFloat16;
  // bf16 activations: a routing near a tie may flip, so gradients are held loosely (the fp32
  // test above holds the numerics).
  check_moe_fixture(o, 2e-2, 0, 1e-3, 0.1);
}

}  // namespace
}  // namespace q4::model
