// LoRA on the experts of a mixture-of-experts layer (lora.targets "experts",
// docs/model.md#lora-on-experts), on the tiny MoE config (8 experts, top-2, layers 0 and 2
// sparse) with a random NVFP4 base, against direct per-expert computations in fp64:
// - the merged weight of expert e is W_e + s·B_e·A_e, gate and up sharing A_e;
// - plain: the forward and the gradients of A and B are those of x·(W_e + s·B_e·A_e)ᵀ (a model
//   training those merged weights in plain precision), per expert;
// - merge-aware: the loss is the merged model's bit for bit and dA, dB are s·B_eᵀ·dW_e,
// s·dW_e·A_eᵀ;
// - the PEFT export is peft's layout (lora_A (E·r, in) expert-major, lora_B (out, r·E) with
//   expert e's rank j in column j·E + e, gate_up under base_layer.) and loads back.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace moe_lora_test {

constexpr int64_t kRank = 4;
constexpr double kScale = 8.0 / 4.0;  // alpha / rank

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/q4moelora_" + std::to_string(::getpid()) + "_" + name;
}

Qwen3Config moe_config() {
  return Qwen3Config::from_json_file(kFixtures + "/qwen3_moe_tiny.config.json");
}

// An NVFP4 base for the tiny MoE config (the fixture's weights are dense), written once. Its
// quantized weights are a fixed point of the fake quantizer: fake quantization is not idempotent
// on every block (one whose FP8 scale rounds up keeps a largest code below 6 and re-quantizes to
// other values), and the references below train the base's other linears from those codes, so
// their fake-quantized forward must equal the frozen one.
const std::string& moe_base() {
  static const std::string path = [] {
    const std::string p = temp_path("base.dat");
    Qwen3Model m = Qwen3Model::random_init(moe_config(), fp32_all(), 5);
    at::NoGradGuard no_grad;
    bool changed = true;
    for (int round = 0; changed && round < 8; ++round) {
      changed = false;
      for (auto& w : m.parameters()) {
        if (!w.quantized) continue;
        const at::Tensor fq =
            q4::quant::fake_quant_nvfp4_forward_unchecked(w.master, at::kFloat, w.name);
        changed = changed || !at::equal(fq, w.master);
        w.master.copy_(fq);
      }
    }
    EXPECT_FALSE(changed) << "the base did not reach a fixed point of the fake quantizer";
    write_dat(m, p, /*quantize_lm_head=*/false);
    return p;
  }();
  return path;
}

ModelOptions expert_lora(bool merge_aware, std::vector<std::string> targets = {"experts"}) {
  ModelOptions o = fp32_all(/*checkpointing=*/true);
  o.trainable = TrainableSpec::nothing();
  o.lora.rank = kRank;
  o.lora.alpha = 8.0;
  o.lora.targets = std::move(targets);
  o.lora.merge_aware = merge_aware;
  o.lora.seed = 3;
  return o;
}

// B of every adapter away from zero (as after training), the same in every call.
void perturb_b(Qwen3Model& m) {
  at::Generator gen = at::detail::createCPUGenerator(29);
  at::NoGradGuard no_grad;
  for (auto& p : m.adapters()) {
    if (p.name.find("lora_B") == std::string::npos) continue;
    p.master.copy_(at::randn(p.master.sizes(), gen, at::kFloat) * 0.05);
  }
}

// A stacked (E·rows, cols) tensor's block e, fp64.
at::Tensor block(const at::Tensor& t, int64_t E, int64_t e) {
  return t.to(at::kDouble).view({E, -1, t.size(1)})[e];
}

bool is_expert(const Parameter& p) { return p.name.find(".mlp.experts.") != std::string::npos; }

// The base with every adapted linear trained in full from m's merged weight (fp32), in
// fake-quantized or plain precision: its gradient of each is dW.
Qwen3Model merged_reference(Qwen3Model& m, const DatReader& w, bool fake_quant) {
  ModelOptions full = expert_lora(true);
  full.lora = LoraSpec{};
  full.fake_quant = fake_quant;
  full.trainable.projections = true;
  Qwen3Model ref = Qwen3Model::load(moe_config(), w, full);
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    if (p.lora_a != nullptr) ref.parameter(p.name).master.copy_(m.merged_weight(p));
  }
  return ref;
}

TEST(MoeLora, MergedWeightIsEachExpertsUpdate) {
  const auto cfg = moe_config();
  DatReader w(moe_base());
  Qwen3Model m = Qwen3Model::load(cfg, w, expert_lora(true));
  const int64_t E = cfg.moe.num_experts, I = cfg.moe.moe_intermediate_size, H = cfg.hidden_size;
  // Layers 0 and 2: a shared gate/up A, gate, up B, down A and B.
  ASSERT_EQ(m.adapters().size(), 2u * 5);
  const auto& gate = m.parameter("model.layers.0.mlp.experts.gate_proj.weight");
  const auto& up = m.parameter("model.layers.0.mlp.experts.up_proj.weight");
  const auto& down = m.parameter("model.layers.0.mlp.experts.down_proj.weight");
  ASSERT_NE(gate.lora_a, nullptr);
  EXPECT_EQ(gate.lora_a, up.lora_a);
  EXPECT_EQ(gate.lora_a->master.sizes(), (at::IntArrayRef{E * kRank, H}));
  EXPECT_EQ(up.lora_b->master.sizes(), (at::IntArrayRef{E * I, kRank}));
  EXPECT_EQ(down.lora_a->master.sizes(), (at::IntArrayRef{E * kRank, I}));
  EXPECT_EQ(down.lora_b->master.sizes(), (at::IntArrayRef{E * H, kRank}));
  EXPECT_EQ(m.parameter("model.layers.1.mlp.gate_proj.weight").lora_a, nullptr);
  perturb_b(m);
  for (const Parameter* p : {&gate, &up, &down}) {
    const at::Tensor merged = m.merged_weight(*p);
    const at::Tensor base = q4::quant::dequantize_nvfp4(p->qdata, p->scale, at::kFloat);
    for (int64_t e = 0; e < E; ++e) {
      const at::Tensor want = block(base, E, e) + kScale * at::mm(block(p->lora_b->master, E, e),
                                                                  block(p->lora_a->master, E, e));
      EXPECT_TRUE(at::allclose(block(merged, E, e), want, 1e-6, 1e-7)) << p->name << " " << e;
    }
  }
}

// dA and dB of every expert adapter from the reference's dW, fp64, expert by expert; gate's and
// up's A is one tensor, so its gradient is the sum of both.
void expect_expert_grads(Qwen3Model& m, Qwen3Model& ref, double rtol) {
  const int64_t E = moe_config().moe.num_experts;
  std::map<const Parameter*, at::Tensor> want;
  for (auto& p : m.parameters()) {
    if (p.lora_a == nullptr || !is_expert(p)) continue;
    const at::Tensor dw = ref.parameter(p.name).grad;
    ASSERT_TRUE(dw.defined()) << p.name;
    at::Tensor ga = at::zeros(p.lora_a->master.sizes(), at::kDouble);
    at::Tensor gb = at::zeros(p.lora_b->master.sizes(), at::kDouble);
    for (int64_t e = 0; e < E; ++e) {
      const at::Tensor a = block(p.lora_a->master, E, e), b = block(p.lora_b->master, E, e);
      const at::Tensor d = block(dw, E, e);
      ga.view({E, kRank, -1})[e].copy_(kScale * at::mm(b.t(), d));
      gb.view({E, -1, kRank})[e].copy_(kScale * at::mm(d, a.t()));
    }
    want[p.lora_a] = want.count(p.lora_a) ? want[p.lora_a] + ga : ga;
    want[p.lora_b] = gb;
  }
  ASSERT_EQ(want.size(), 2u * 5);
  for (const auto& kv : want) {
    ASSERT_TRUE(kv.first->grad.defined()) << kv.first->name;
    const double scale = kv.second.abs().max().item<double>();
    EXPECT_GT(scale, 0.0) << kv.first->name;
    EXPECT_LE((kv.first->grad.to(at::kDouble) - kv.second).abs().max().item<double>(), rtol * scale)
        << kv.first->name;
  }
}

// `m` against its merged reference on one batch, after perturb_b: the losses within
// `loss_rtol` (relative; 0: equal) and every expert adapter's gradient within `grad_rtol`.
void expect_merged_reference(Qwen3Model& m, const DatReader& w, bool fake_quant, double loss_rtol,
                             double grad_rtol) {
  perturb_b(m);
  const auto in = random_inputs(moe_config(), 2, 9, /*seed=*/17);
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  Qwen3Model ref = merged_reference(m, w, fake_quant);
  LossOutput lr = ref.loss(in);
  lr.loss.backward();
  const double want = lr.loss.item<double>();
  EXPECT_NEAR(lo.loss.item<double>(), want, loss_rtol * std::abs(want));
  expect_expert_grads(m, ref, grad_rtol);
}

TEST(MoeLora, PlainForwardAndGradientsArePerExpertFormulas) {
  const auto cfg = moe_config();
  DatReader w(moe_base());
  for (const bool checkpointing : {true, false}) {
    ModelOptions o = expert_lora(false);
    o.gradient_checkpointing = checkpointing;
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    // Plain precision from the merged weights: x·(W_e + s·B_e·A_e)ᵀ is the plain formula; fp32
    // sums in another order (the adapter's rank-r term beside W's GEMM): 1e-5 relative.
    expect_merged_reference(m, w, /*fake_quant=*/false, /*loss_rtol=*/1e-5, /*grad_rtol=*/2e-3);
  }
}

TEST(MoeLora, MergeAwareGradientsAreTheMergedWeightsThroughTheAdapter) {
  const auto cfg = moe_config();
  DatReader w(moe_base());
  Qwen3Model m = Qwen3Model::load(cfg, w, expert_lora(true));
  // Equal losses; the STE gradient is dW of fake_quant(merged) in both, only bmm vs mm rounding
  // differs.
  expect_merged_reference(m, w, /*fake_quant=*/true, /*loss_rtol=*/0.0, /*grad_rtol=*/1e-5);
}

TEST(MoeLora, PeftExportIsPeftsLayoutAndRoundTrips) {
  const auto cfg = moe_config();
  DatReader w(moe_base());
  Qwen3Model m = Qwen3Model::load(cfg, w, expert_lora(false, {"q_proj", "experts"}));
  perturb_b(m);
  const std::string dir = temp_path("peft");
  m.export_adapter(dir, "base");
  std::ifstream cf(dir + "/adapter_config.json");
  const auto j = nlohmann::json::parse(cf);
  EXPECT_EQ(j.at("target_modules"), nlohmann::json({"q_proj"}));
  EXPECT_EQ(j.at("target_parameters"), nlohmann::json({"model.layers.0.mlp.experts.gate_up_proj",
                                                       "model.layers.0.mlp.experts.down_proj",
                                                       "model.layers.2.mlp.experts.gate_up_proj",
                                                       "model.layers.2.mlp.experts.down_proj"}));
  const int64_t E = cfg.moe.num_experts, I = cfg.moe.moe_intermediate_size, H = cfg.hidden_size;
  const SafetensorsFile f(dir + "/adapter_model.safetensors");
  const std::string pre = "base_model.model.model.layers.2.mlp.experts.";
  const at::Tensor a = f.load(*f.find(pre + "base_layer.lora_A.weight"));
  const at::Tensor b = f.load(*f.find(pre + "base_layer.lora_B.weight"));
  const at::Tensor bd = f.load(*f.find(pre + "lora_B.weight"));
  ASSERT_EQ(a.sizes(), (at::IntArrayRef{kRank * E, H}));
  ASSERT_EQ(b.sizes(), (at::IntArrayRef{2 * I, kRank * E}));
  ASSERT_EQ(bd.sizes(), (at::IntArrayRef{H, kRank * E}));
  ASSERT_EQ(f.load(*f.find(pre + "lora_A.weight")).sizes(), (at::IntArrayRef{kRank * E, I}));
  // peft's get_delta_weight: A.reshape(E, r, in), B.reshape(out, r, E), delta[e] = B[:, :, e]·A[e].
  const auto& gate = m.parameter("model.layers.2.mlp.experts.gate_proj.weight");
  const auto& up = m.parameter("model.layers.2.mlp.experts.up_proj.weight");
  const auto& down = m.parameter("model.layers.2.mlp.experts.down_proj.weight");
  for (int64_t e = 0; e < E; ++e) {
    const at::Tensor delta = at::mm(b.to(at::kDouble).view({2 * I, kRank, E}).select(2, e),
                                    a.to(at::kDouble).view({E, kRank, H})[e]);
    const at::Tensor ag = block(gate.lora_a->master, E, e);
    EXPECT_TRUE(at::allclose(delta.narrow(0, 0, I), at::mm(block(gate.lora_b->master, E, e), ag)));
    EXPECT_TRUE(at::allclose(delta.narrow(0, I, I), at::mm(block(up.lora_b->master, E, e), ag)));
    EXPECT_TRUE(at::equal(bd.view({H, kRank, E}).select(2, e),
                          block(down.lora_b->master, E, e).to(at::kFloat)));
  }
  // Back in q4: the same adapters and the same forward.
  ModelOptions inference;
  inference.trainable = TrainableSpec::nothing();
  inference.gradient_checkpointing = false;
  const AdapterConfig ac = read_adapter_config(dir);
  Qwen3Model loaded = Qwen3Model::load(cfg, w, with_adapter(inference, ac));
  const AdapterLoad r = loaded.load_adapter(dir);
  EXPECT_EQ(r.lora_pairs, 3 + 2 * 3);
  for (size_t i = 0; i < m.adapters().size(); ++i) {
    EXPECT_TRUE(at::equal(loaded.adapters()[i].master, m.adapters()[i].master))
        << m.adapters()[i].name;
  }
  at::NoGradGuard no_grad;
  const auto in = random_inputs(cfg, 2, 9, /*seed=*/17);
  EXPECT_TRUE(at::allclose(loaded.forward(in), m.forward(in), 1e-5, 1e-6));
  // A folder whose target_parameters q4 would not apply in full is refused by name.
  {
    auto bad = j;
    bad["target_parameters"] = {"model.layers.0.mlp.experts.down_proj"};
    std::ofstream(dir + "/adapter_config.json") << bad.dump();
    try {
      read_adapter_config(dir);
      FAIL() << "down_proj alone accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("must name both mlp.experts.gate_up_proj"),
                std::string::npos)
          << e.what();
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace moe_lora_test
}  // namespace q4::model
