// ModelOptions::master_init = kDither on a tiny random Qwen3 written as NVFP4 (write_dat): every
// trainable NVFP4 linear's fake-quantized forward weight equals the undithered load's (values;
// with -0 taken as +0, bit for bit) under both block rules and master dtypes, the masters moved
// off their grid points, the same seed gives the same masters, another seed others, and the
// model's loss and logits are the undithered model's exactly. Frozen linears, norms and raw
// entries keep their file values; plain precision refuses the option.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::test::master_dither_test {
namespace {

using model::DatReader;
using model::MasterInit;
using model::ModelOptions;
using model::Parameter;
using model::Qwen3Model;

// The tiny config's random model (std 0.5) written as an NVFP4 .dat, once.
const std::string& nvfp4_file() {
  static const std::string path = [] {
    const std::string p = model::temp_path("master_dither.dat");
    model::write_dat(model::tiny_random_model(41), p, /*quantize_lm_head=*/true);
    return p;
  }();
  return path;
}

Qwen3Model load(MasterInit init, uint64_t seed, quant::BlockRule rule, at::ScalarType dtype) {
  ModelOptions o = model::fp32_all(/*checkpointing=*/false);
  o.master_dtype = dtype;
  o.block_rule = rule;
  o.master_init = init;
  o.master_init_seed = seed;
  return Qwen3Model::load(model::Qwen3Config::from_json_file(model::kConfig),
                          DatReader(nvfp4_file()), o);
}

at::Tensor without_zero_sign_bits(const at::Tensor& t) {
  return (t.to(at::kFloat) + 0.0).view(at::kInt);
}

class MasterDither
    : public testing::TestWithParam<std::tuple<quant::BlockRule, at::ScalarType>> {};

TEST_P(MasterDither, ForwardWeightsUnchangedMastersMoved) {
  const auto [rule, dtype] = GetParam();
  Qwen3Model codes = load(MasterInit::kCodes, 0, rule, dtype);
  Qwen3Model dith = load(MasterInit::kDither, 5, rule, dtype);
  int64_t linears = 0, elements = 0, moved = 0;
  for (Parameter* p : codes.trainable_parameters()) {
    const Parameter& q = dith.parameter(p->name);
    if (!p->quantized) {  // norms (raw entries) load as they are
      EXPECT_TRUE(at::equal(p->master, q.master)) << p->name;
      continue;
    }
    ++linears;
    const at::Tensor f0 = quant::fake_quant_nvfp4_forward(p->master, p->name, rule);
    const at::Tensor f1 = quant::fake_quant_nvfp4_forward(q.master, p->name, rule);
    ASSERT_TRUE(at::equal(without_zero_sign_bits(f0), without_zero_sign_bits(f1))) << p->name;
    elements += p->master.numel();
    moved += at::ne(p->master, q.master).sum().item<int64_t>();
  }
  EXPECT_EQ(linears, 7 * codes.config().num_hidden_layers + 1);  // the projections, lm_head
  EXPECT_GT(static_cast<double>(moved) / elements, 0.85) << moved << " of " << elements;
  // The whole model computes the same loss and logits.
  const model::ModelInputs in = model::random_inputs(codes.config(), 2, 24, 9);
  at::NoGradGuard ng;
  EXPECT_EQ(codes.loss(in).loss.item<float>(), dith.loss(in).loss.item<float>());
  EXPECT_TRUE(at::equal(codes.forward(in), dith.forward(in)));
}

INSTANTIATE_TEST_SUITE_P(RulesAndDtypes, MasterDither,
                         testing::Combine(testing::Values(quant::BlockRule::kMax6,
                                                          quant::BlockRule::kFourOverSix),
                                          testing::Values(at::kFloat, at::kHalf)));

TEST(MasterDitherSeed, SameSeedSameMastersOtherSeedOthers) {
  Qwen3Model a = load(MasterInit::kDither, 5, quant::BlockRule::kMax6, at::kHalf);
  Qwen3Model b = load(MasterInit::kDither, 5, quant::BlockRule::kMax6, at::kHalf);
  Qwen3Model c = load(MasterInit::kDither, 6, quant::BlockRule::kMax6, at::kHalf);
  for (Parameter* p : a.trainable_parameters()) {
    if (!p->quantized) continue;
    EXPECT_TRUE(at::equal(p->master.view(at::kShort), b.parameter(p->name).master.view(at::kShort)))
        << p->name;
    EXPECT_FALSE(at::equal(p->master, c.parameter(p->name).master)) << p->name;
  }
}

TEST(MasterDitherScope, FrozenLinearsKeepTheFileAndPlainPrecisionRefuses) {
  ModelOptions o = model::fp32_all(false);
  o.trainable = model::TrainableSpec::nothing();
  o.master_init = MasterInit::kDither;
  const auto cfg = model::Qwen3Config::from_json_file(model::kConfig);
  Qwen3Model frozen = Qwen3Model::load(cfg, DatReader(nvfp4_file()), o);
  o.master_init = MasterInit::kCodes;
  Qwen3Model plain = Qwen3Model::load(cfg, DatReader(nvfp4_file()), o);
  for (const Parameter& p : plain.parameters()) {
    EXPECT_TRUE(at::equal(p.master, frozen.parameter(p.name).master)) << p.name;
  }
  ModelOptions pp = model::fp32_all(false);
  pp.fake_quant = false;
  pp.master_init = MasterInit::kDither;
  try {
    pp.validate();
    FAIL() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("master_init"), std::string::npos);
  }
}

}  // namespace
}  // namespace q4::test::master_dither_test
