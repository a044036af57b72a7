// The mixture-of-experts Qwen3 (Qwen3MoeForCausalLM, docs/model.md#mixture-of-experts):
// - config.json: the MoE keys are read, which layers are sparse follows HF, and routings this
//   FFN does not implement (shared experts, sigmoid scoring, k > E) are refused naming the key;
// - the parameter table: router and stacked experts per sparse layer, the dense MLP elsewhere;
// - HF parity on the tiny fixture (make_moe_fixture.py: 8 experts, top-2, one dense layer, a
//   padded row): logits, CE, the load-balancing loss, the total loss and every gradient, with
//   and without checkpointing;
// - routing ties go to the lower expert, every route is computed, and the router statistics
//   count what was routed;
// - the optional router z-loss: its value (log E squared for a router of zeros) and its gradient
//   at the routers against finite differences of the value.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_params.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {


nlohmann::json tiny_moe_json() {
  return nlohmann::json{{"architectures", {"Qwen3MoeForCausalLM"}},
                        {"model_type", "qwen3_moe"},
                        {"vocab_size", 384},
                        {"hidden_size", 64},
                        {"intermediate_size", 192},
                        {"moe_intermediate_size", 32},
                        {"num_experts", 8},
                        {"num_experts_per_tok", 2},
                        {"norm_topk_prob", true},
                        {"mlp_only_layers", {1}},
                        {"num_hidden_layers", 3},
                        {"num_attention_heads", 4},
                        {"num_key_value_heads", 2},
                        {"head_dim", 16},
                        {"rms_norm_eps", 1e-6},
                        {"max_position_embeddings", 128},
                        {"rope_theta", 1e6}};
}

std::string error_of(const nlohmann::json& j) {
  try {
    Qwen3Config::from_json(j, "moe.json");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(Moe, ConfigReadsTheMoeKeysAndSparseLayers) {
  const Qwen3Config c = Qwen3Config::from_json(tiny_moe_json(), "moe.json");
  EXPECT_TRUE(c.is_moe());
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.num_experts_per_tok, 2);
  EXPECT_EQ(c.moe.moe_intermediate_size, 32);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_DOUBLE_EQ(c.moe.router_aux_loss_coef, 0.001);  // HF's default
  EXPECT_TRUE(c.is_moe_layer(0));
  EXPECT_FALSE(c.is_moe_layer(1));  // mlp_only_layers
  EXPECT_TRUE(c.is_moe_layer(2));
  nlohmann::json step2 = tiny_moe_json();
  step2["decoder_sparse_step"] = 2;
  step2["mlp_only_layers"] = nlohmann::json::array();
  const Qwen3Config s = Qwen3Config::from_json(step2, "moe.json");
  EXPECT_FALSE(s.is_moe_layer(0));  // HF: (layer + 1) % step == 0
  EXPECT_TRUE(s.is_moe_layer(1));
  EXPECT_FALSE(s.is_moe_layer(2));
  // to_json round trip keeps the MoE keys; a dense config stays dense.
  const Qwen3Config back = Qwen3Config::from_json(c.to_json(), "back");
  EXPECT_EQ(back.moe.num_experts, 8);
  EXPECT_EQ(back.moe.mlp_only_layers, std::vector<int64_t>{1});
  EXPECT_EQ(c.to_json()["architectures"][0], "Qwen3MoeForCausalLM");
  EXPECT_FALSE(Qwen3Config::from_json_file(kConfig).is_moe());
}

TEST(Moe, ConfigRefusesRoutingsItDoesNotImplement) {
  nlohmann::json j = tiny_moe_json();
  j["num_experts_per_tok"] = 9;
  EXPECT_NE(error_of(j).find("'num_experts_per_tok'"), std::string::npos) << error_of(j);
  j = tiny_moe_json();
  j["shared_expert_intermediate_size"] = 64;
  EXPECT_NE(error_of(j).find("'shared_expert_intermediate_size'"), std::string::npos);
  j = tiny_moe_json();
  j["scoring_func"] = "sigmoid";
  EXPECT_NE(error_of(j).find("'scoring_func'"), std::string::npos);
  j = tiny_moe_json();
  j["mlp_only_layers"] = {7};
  EXPECT_NE(error_of(j).find("'mlp_only_layers'"), std::string::npos);
  j = tiny_moe_json();
  j["model_type"] = "qwen3_next";
  EXPECT_NE(error_of(j).find("'model_type'"), std::string::npos);
  j = tiny_moe_json();
  j["shared_expert_intermediate_size"] = 0;  // Qwen2-MoE-style key, switched off: fine
  EXPECT_EQ(error_of(j), "");
}

TEST(Moe, ParameterTableStacksExpertsPerSparseLayer) {
  const Qwen3Config c = Qwen3Config::from_json(tiny_moe_json(), "moe.json");
  std::vector<std::string> layer0, layer1;
  for (const ParamSpec& p : qwen3_parameters(c, true)) {
    if (p.layer == 0) layer0.push_back(p.name);
    if (p.layer == 1) layer1.push_back(p.name);
    if (p.name == "model.layers.0.mlp.gate.weight") {
      EXPECT_EQ(p.shape, (std::vector<int64_t>{8, 64}));
      EXPECT_EQ(p.kind, ParamKind::kRaw);
      EXPECT_EQ(p.group, ParamGroup::kRouter);
    }
    if (p.name == "model.layers.2.mlp.experts.down_proj.weight") {
      EXPECT_EQ(p.shape, (std::vector<int64_t>{8 * 64, 32}));
      EXPECT_EQ(p.kind, ParamKind::kQuantizedLinear);
    }
  }
  EXPECT_EQ(layer0.size(), 12u);  // 4 attention + 2 head norms + router + 3 experts + 2 norms
  EXPECT_EQ(layer1.size(), 11u);  // 4 + 2 + 3 dense MLP + 2
  EXPECT_EQ(layer0[6], "model.layers.0.mlp.gate.weight");
  EXPECT_EQ(layer1[6], "model.layers.1.mlp.gate_proj.weight");
  // Counts: a sparse layer holds E experts' three linears and the router.
  EXPECT_EQ(c.layer_num_parameters(0) - c.layer_num_parameters(1),
            8 * 3 * 32 * 64 + 8 * 64 - 3 * 192 * 64);
}

// The fixture's inputs, with its padding mask.
ModelInputs moe_inputs(const DatReader& e) {
  ModelInputs in = fixture_inputs(e);
  in.attention_mask = e.load("attention_mask");
  return in;
}

TEST(Moe, MatchesHfTransformersOnTheTinyFixture) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kMoeConfig);
  const DatReader w(kMoeWeights), e(kMoeExpected);
  const ModelInputs in = moe_inputs(e);
  const at::Tensor valid = in.attention_mask.ne(0).unsqueeze(-1);  // (B, T, 1)
  const FixtureTolerances& tol = kFixtureFp32.at(q4::test::Backend::kCpu);
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing on" : "checkpointing off");
    Qwen3Model m = Qwen3Model::load(cfg, w, fp32_all(checkpointing));
    {
      at::NoGradGuard ng;
      // Padded rows' logits are not compared (HF and q4train mask keys, not queries).
      EXPECT_CLOSE(m.forward(in).masked_fill(valid.logical_not(), 0),
                   e.load("logits").masked_fill(valid.logical_not(), 0), tol.logits.rtol,
                   tol.logits.atol, "logits");
    }
    m.zero_grad();
    const LossOutput lo = m.loss(in);
    lo.loss.backward();
    ASSERT_TRUE(lo.aux_loss.defined());
    EXPECT_CLOSE(lo.aux_loss.reshape({1}), e.load("aux_loss"), tol.loss.rtol, tol.loss.atol,
                 "aux_loss");
    EXPECT_CLOSE((lo.ce_sum / lo.num_tokens.to(at::kFloat)).reshape({1}), e.load("ce_loss"),
                 tol.loss.rtol, tol.loss.atol, "ce_loss");
    EXPECT_CLOSE(lo.loss.detach().reshape({1}), e.load("loss"), tol.loss.rtol, tol.loss.atol,
                 "loss");
    int n = 0;
    for (const auto& p : m.parameters()) {
      const std::string key = "grad." + p.name;
      ASSERT_NE(e.find(key), nullptr) << key;
      ASSERT_TRUE(p.grad.defined()) << key;
      EXPECT_CLOSE(p.grad, e.load(key), tol.grad.rtol, tol.grad.atol, key);
      ++n;
    }
    EXPECT_EQ(n, 3 + 12 + 11 + 12);  // embed, norm, lm_head; layers 0 and 2 sparse, 1 dense
  }
}

// Without the aux term (coefficient 0) the loss is the CE alone and the router's gradient
// differs from the fixture's (which includes the aux term): the term reaches the router.
TEST(Moe, AuxLossReachesTheRouterGradient) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kMoeConfig);
  const DatReader w(kMoeWeights), e(kMoeExpected);
  ModelOptions o = fp32_all(false);
  o.router_aux_loss_coef = 0.0;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  m.zero_grad();
  const LossOutput lo = m.loss(moe_inputs(e));
  lo.loss.backward();
  EXPECT_CLOSE(lo.loss.detach().reshape({1}), e.load("ce_loss"), 1e-4, 1e-5, "loss without aux");
  const at::Tensor g = m.parameter("model.layers.0.mlp.gate.weight").grad;
  const at::Tensor want = e.load("grad.model.layers.0.mlp.gate.weight");
  EXPECT_GT((g - want).abs().max().item<double>(), 1e-4 * want.abs().max().item<double>());
}

// A router of zeros gives every expert the same probability: the ties go to experts 0 and 1
// for every token, both are computed for every token (no capacity), and the statistics say so.
TEST(Moe, TiesGoToTheLowerExpertAndEveryRouteIsComputed) {
  const Qwen3Config cfg = Qwen3Config::from_json(tiny_moe_json(), "moe.json");
  ModelOptions o = fp32_all(false);
  o.trainable = TrainableSpec::nothing();
  o.fake_quant = false;
  Qwen3Model m = Qwen3Model::random_init(cfg, o, 3);
  {
    at::NoGradGuard ng;
    for (const char* r : {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"}) {
      m.parameter(r).master.zero_();
    }
  }
  ModelInputs in;
  in.input_ids = at::randint(0, 384, {2, 10}, at::kLong);
  at::NoGradGuard ng;
  m.forward(in);
  const RouterStats s = m.router_stats();
  ASSERT_EQ(s.layers.size(), 2u);
  for (const RouterStats::Layer& l : s.layers) {
    EXPECT_DOUBLE_EQ(l.max_load, 4.0);  // 20 tokens each on 2 of 8 experts: 4 x the mean of 5
    EXPECT_DOUBLE_EQ(l.min_load, 0.0);
    EXPECT_NEAR(l.entropy, std::log(8.0), 1e-6);
  }
  EXPECT_EQ(s.dropped_tokens, 0);
}

// A router of zeros: every router logit is 0, so lse = log E on every row and the z-loss is
// (log 8)² exactly; the loss adds it times its coefficient, and coefficient 0 leaves it out.
TEST(Moe, RouterZLossOfAZeroRouterIsLogESquared) {
  const Qwen3Config cfg = Qwen3Config::from_json(tiny_moe_json(), "moe.json");
  ModelInputs in;
  in.input_ids = at::randint(0, 384, {2, 10}, at::kLong);
  in.labels = in.input_ids.clone();
  std::vector<double> losses;
  for (double coef : {0.0, 0.5}) {
    ModelOptions o = fp32_all(false);
    o.fake_quant = false;
    o.router_z_loss_coef = coef;
    Qwen3Model m = Qwen3Model::random_init(cfg, o, 3);
    at::NoGradGuard ng;
    for (const char* r : {"model.layers.0.mlp.gate.weight", "model.layers.2.mlp.gate.weight"}) {
      m.parameter(r).master.zero_();
    }
    const LossOutput lo = m.loss(in);
    EXPECT_EQ(lo.z_loss.defined(), coef > 0);
    if (coef > 0) EXPECT_NEAR(lo.z_loss.item<double>(), std::pow(std::log(8.0), 2), 1e-5);
    losses.push_back(lo.loss.item<double>());
  }
  EXPECT_NEAR(losses[1] - losses[0], 0.5 * std::pow(std::log(8.0), 2), 1e-4);
}

// d z / d router weights, as the backward injects it (the difference of the router gradients
// with and without the z term, over its coefficient), against central differences of z itself,
// with and without checkpointing (a recompute must not count a layer twice).
TEST(Moe, RouterZLossGradientMatchesFiniteDifferences) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kMoeConfig);
  const DatReader w(kMoeWeights), e(kMoeExpected);
  const ModelInputs in = moe_inputs(e);
  const char* router = "model.layers.2.mlp.gate.weight";
  constexpr double kCoef = 2.0;
  for (bool checkpointing : {false, true}) {
    SCOPED_TRACE(checkpointing ? "checkpointing on" : "checkpointing off");
    std::vector<at::Tensor> grads;
    for (double coef : {0.0, kCoef}) {
      ModelOptions o = fp32_all(checkpointing);
      o.router_z_loss_coef = coef;
      Qwen3Model m = Qwen3Model::load(cfg, w, o);
      m.zero_grad();
      m.loss(in).loss.backward();
      grads.push_back(m.parameter(router).grad.clone());
    }
    const at::Tensor dz = (grads[1] - grads[0]) / kCoef;  // (E, H)
    ModelOptions o = fp32_all(checkpointing);
    o.router_z_loss_coef = 1.0;
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    at::NoGradGuard ng;
    at::Tensor wr = m.parameter(router).master;
    const at::Tensor w0 = wr.clone();
    // Directional derivatives (a fp32 z resolves differences of ~1e-7 of ~4: single entries are
    // too small a signal): along the gradient itself and along a fixed random direction.
    at::manual_seed(7);
    const at::Tensor rnd = at::randn(wr.sizes(), at::kFloat);
    for (const at::Tensor& d0 : {dz, rnd}) {
      const at::Tensor d = d0 / d0.norm();
      const double h = 1e-2;
      wr.copy_(w0 + h * d);
      const double up = m.loss(in).z_loss.item<double>();
      wr.copy_(w0 - h * d);
      const double down = m.loss(in).z_loss.item<double>();
      wr.copy_(w0);
      const double fd = (up - down) / (2 * h);
      const double want = (dz * d).sum().item<double>();
      EXPECT_NEAR(want, fd, 2e-2 * std::abs(want) + 2e-5);
    }
  }
}

}  // namespace
}  // namespace q4::model
