// The model's slots (docs/design.md#architecture): every decoder-layer linear goes through the
// linear backend the model was built with, and the FFN block's sizes come from its slot.
// - a recording backend that wraps the device's default one sees each linear of a forward once
//   (q/k/v and gate/up as groups) and gives the default's loss and gradients bit for bit;
// - the FFN terms of layer_keep_costs are the dense SwiGLU MLP's closed forms;
// - the LoRA target table is the one list the options check against.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <iterator>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/linear_backend.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_params.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

// Counts the calls of each kind and hands every one to `inner`.
class RecordingBackend final : public LinearBackend {
 public:
  explicit RecordingBackend(std::shared_ptr<const LinearBackend> inner)
      : inner_(std::move(inner)) {}
  const char* name() const override { return "recording"; }
  LinearWeights weights(const Qwen3Model::Impl& m, Parameter* p) const override {
    ++weights_calls;
    names.push_back(p->name);
    return inner_->weights(m, p);
  }
  at::Tensor apply(const Qwen3Model::Impl& m, const at::Tensor& x,
                   const LinearWeights& w) const override {
    ++apply_calls;
    return inner_->apply(m, x, w);
  }
  std::vector<at::Tensor> apply_group(const Qwen3Model::Impl& m, const at::Tensor& x,
                                      const std::vector<const LinearWeights*>& ws) const override {
    ++group_calls;
    grouped += static_cast<int64_t>(ws.size());
    return inner_->apply_group(m, x, ws);
  }
  mutable int64_t weights_calls = 0, apply_calls = 0, group_calls = 0, grouped = 0;
  mutable std::vector<std::string> names;

 private:
  std::shared_ptr<const LinearBackend> inner_;
};

ModelOptions full_fp32() {
  ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.trainable = TrainableSpec::everything();
  o.gradient_checkpointing = false;
  return o;
}

ModelInputs inputs(const Qwen3Config& cfg) { return random_inputs(cfg, 2, 7, /*seed=*/11); }

std::map<std::string, at::Tensor> loss_and_grads(Qwen3Model& m, const ModelInputs& in) {
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  std::map<std::string, at::Tensor> out{{"loss", lo.loss.detach().reshape({1})}};
  for (const Parameter& p : m.parameters()) out[p.name] = p.grad;
  return out;
}

TEST(ModelSlots, EveryLinearGoesThroughTheModelsBackend) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kConfig);
  const DatReader w(kWeights);
  const ModelInputs in = inputs(cfg);
  const int64_t L = cfg.num_hidden_layers;

  Qwen3Model plain = Qwen3Model::load(cfg, w, full_fp32());
  const auto expected = loss_and_grads(plain, in);

  ModelOptions o = full_fp32();
  auto rec = std::make_shared<RecordingBackend>(make_linear_backend(o));
  o.linear_backend = rec;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  EXPECT_EQ(rec->weights_calls, 0);  // loading computes nothing
  const auto got = loss_and_grads(m, in);

  // One forward: the 7 linears of every layer resolved once; o_proj and down_proj alone, q/k/v
  // and gate/up as groups. lm_head is the loss's, not a decoder-layer linear.
  EXPECT_EQ(rec->weights_calls, 7 * L);
  EXPECT_EQ(rec->apply_calls, 2 * L);
  EXPECT_EQ(rec->group_calls, 2 * L);
  EXPECT_EQ(rec->grouped, 5 * L);
  ASSERT_EQ(rec->names.size(), static_cast<size_t>(7 * L));
  EXPECT_EQ(rec->names[0], "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(rec->names[6], "model.layers.0.mlp.down_proj.weight");
  for (const auto& [name, t] : expected) {
    ASSERT_TRUE(got.at(name).defined()) << name;
    EXPECT_TRUE(at::equal(got.at(name), t)) << name;
  }

  // Recomputed layers resolve their linears again in the backward, through the same backend.
  ModelOptions ck = o;
  ck.gradient_checkpointing = true;
  auto rec2 = std::make_shared<RecordingBackend>(make_linear_backend(ck));
  ck.linear_backend = rec2;
  Qwen3Model mc = Qwen3Model::load(cfg, w, ck);
  const auto got_ck = loss_and_grads(mc, in);
  EXPECT_EQ(rec2->weights_calls, 2 * 7 * L);
  for (const auto& [name, t] : expected) EXPECT_TRUE(at::equal(got_ck.at(name), t)) << name;
}

TEST(ModelSlots, FfnCostsAreTheDenseMlpsClosedForms) {
  const Qwen3Config cfg = Qwen3Config::from_json_file(kConfig);
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t batch = 2, seq = 64, tokens = batch * seq;
  for (const bool cuda : {false, true}) {
    for (const at::ScalarType cd : {at::kFloat, at::kBFloat16}) {
      ModelOptions o;
      o.device = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
      o.compute_dtype = cd;
      o.trainable = TrainableSpec::nothing();  // no weight taps: activations only
      const int64_t cs = cd == at::kFloat ? 4 : 2;
      const LayerKeepCosts c = layer_keep_costs(cfg, o, batch, seq, true, 0);
      // SwiGLU: hs, the norm output, gate/up/product and the norm's fp32 scale per token; the
      // CPU's ATen RMSNorm keeps its fp32 input and normalized value, SwiGLU silu(gate).
      int64_t per_token = cs * (2 * H + 3 * I) + 4;
      if (!cuda) per_token += 4 * H + (cs == 4 ? 0 : cs * H) + cs * I;
      EXPECT_EQ(c.mlp.kept_bytes, tokens * per_token) << cuda << " " << cs;
      EXPECT_EQ(c.mlp.saved_macs, static_cast<double>(tokens) * 2.0 * H * I);
    }
  }
}

TEST(ModelSlots, LoraTargetsAreOneTable) {
  EXPECT_EQ(lora_target_list(" or "),
            "q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, experts or lm_head");
  const std::vector<std::string> projections = lora_projection_targets();
  ASSERT_EQ(projections.size(), std::size(kLoraTargets) - 2);
  EXPECT_EQ(projections.back(), "down_proj");
  // Every table entry is a name LoraSpec accepts, and nothing else is.
  LoraSpec s;
  s.rank = 4;
  for (const char* t : kLoraTargets) {
    s.targets = {t};
    EXPECT_NO_THROW(s.validate()) << t;
  }
  s.targets = {"embed_tokens"};
  try {
    s.validate();
    FAIL() << "embed_tokens accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(
                  "lora.targets: unknown linear 'embed_tokens' (expected q_proj, k_proj, v_proj, "
                  "o_proj, gate_proj, up_proj, down_proj, experts or lm_head)"),
              std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace q4::model
