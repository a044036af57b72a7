// LoRA adapters on the NVFP4 linears (ModelOptions::lora), against direct computations:
// - a fresh adapter (B = 0) leaves the merge-aware model's logits exactly the base model's;
// - merge-aware gradients of A and B are s·Bᵀ·dW and s·dW·Aᵀ (fp64) of the gradient dW of the
//   merged, fake-quantized weight, taken from a full fine-tune of a model holding that weight;
// - plain LoRA gradients are the dense formula's (x·(W + s·B·A)ᵀ in plain precision);
// - the merge-aware export stores quantize(W + s·B·A): the trained forward weights, bit for bit;
// - a PEFT adapter folder (with the norms and heads trained beside the adapters) on its base is
//   the trained model, and a folder q4 would not apply in full is refused by name.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

// fp32 with checkpointing (fp32_all), the base frozen, adapters of rank 4 on every projection.
ModelOptions lora_options(bool merge_aware) {
  ModelOptions o = fp32_all(/*checkpointing=*/true);
  o.trainable = TrainableSpec::nothing();
  o.lora.rank = 4;
  o.lora.alpha = 8.0;
  o.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  o.lora.merge_aware = merge_aware;
  o.lora.seed = 3;
  return o;
}

ModelInputs lora_inputs(const Qwen3Config& cfg) { return random_inputs(cfg, 2, 9, /*seed=*/17); }

// Inference: nothing trains, no checkpointing.
ModelOptions inference_options() {
  ModelOptions inference;
  inference.trainable = TrainableSpec::nothing();
  inference.gradient_checkpointing = false;
  return inference;
}

// The fixture's base model for inference with adapter `ac` in it (ready for load_adapter).
Qwen3Model inference_with_adapter(const Qwen3Config& cfg, const DatReader& w,
                                  const AdapterConfig& ac) {
  return Qwen3Model::load(cfg, w, with_adapter(inference_options(), ac));
}

// B of every adapter drawn away from zero (as after some training), the same in every call.
void perturb_b(Qwen3Model& m) {
  at::Generator gen = at::detail::createCPUGenerator(29);
  for (auto& p : m.adapters()) {
    if (p.name.find("lora_B") == std::string::npos) continue;
    p.master.copy_(at::randn(p.master.sizes(), gen, at::kFloat) * 0.05);
  }
}

// The fixture's model with `o` and adapters on `targets`, their B perturbed so that the adapters
// change the forward.
Qwen3Model perturbed_lora_model(const Qwen3Config& cfg, const DatReader& w, ModelOptions o,
                                std::vector<std::string> targets) {
  o.lora.targets = std::move(targets);
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  perturb_b(m);
  return m;
}

// The reference of an adapted model `m`: the base model with every adapted linear trained in
// full, its master set to m's merged weight W + s·B·A (fp32), in fake-quantized or plain
// precision. Its gradient of each such linear is dW; A's and B's are s·Bᵀ·dW and s·dW·Aᵀ.
Qwen3Model merged_reference(Qwen3Model& m, const Qwen3Config& cfg, const DatReader& w,
                            bool fake_quant) {
  ModelOptions full = lora_options(true);
  full.lora = LoraSpec{};
  full.fake_quant = fake_quant;
  full.trainable = TrainableSpec::nothing();
  full.trainable.projections = true;
  Qwen3Model ref = Qwen3Model::load(cfg, w, full);
  at::NoGradGuard no_grad;
  for (auto& p : m.parameters()) {
    if (p.lora_a != nullptr) ref.parameter(p.name).master.copy_(m.merged_weight(p));
  }
  return ref;
}

std::string lora_temp_path(const std::string& name) {
  return ::testing::TempDir() + "/q4lora_" + std::to_string(::getpid()) + "_" + name;
}

TEST(Lora, FreshMergeAwareAdapterKeepsTheBaseModel) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions base_opt = lora_options(true);
  base_opt.lora = LoraSpec{};
  Qwen3Model base = Qwen3Model::load(cfg, w, base_opt);
  Qwen3Model adapted = Qwen3Model::load(cfg, w, lora_options(true));
  const int64_t L = cfg.num_hidden_layers;
  ASSERT_EQ(adapted.adapters().size(), static_cast<size_t>(2 * 7 * L));
  EXPECT_EQ(adapted.trainable_parameters().size(), adapted.adapters().size());
  const auto& q = adapted.parameter("model.layers.0.self_attn.q_proj.weight");
  EXPECT_FALSE(q.trainable);
  EXPECT_FALSE(q.master.defined());  // frozen as codes only
  ASSERT_NE(q.lora_a, nullptr);
  EXPECT_EQ(q.lora_a->name, "model.layers.0.self_attn.q_proj.lora_A.weight");
  EXPECT_EQ(q.lora_a->master.sizes(), (at::IntArrayRef{4, cfg.hidden_size}));
  EXPECT_EQ(q.lora_b->master.sizes(), (at::IntArrayRef{cfg.q_dim(), 4}));
  EXPECT_EQ(q.lora_b->master.abs().max().item<double>(), 0.0);
  const double bound = 1.0 / std::sqrt(static_cast<double>(cfg.hidden_size));
  EXPECT_LE(q.lora_a->master.abs().max().item<double>(), bound);
  EXPECT_GT(q.lora_a->master.abs().max().item<double>(), 0.5 * bound);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  EXPECT_TRUE(at::equal(base.forward(in), adapted.forward(in)));
}

TEST(Lora, MergeAwareGradientsAreTheMergedWeightsThroughTheAdapter) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  Qwen3Model m = Qwen3Model::load(cfg, w, lora_options(true));
  perturb_b(m);
  const auto in = lora_inputs(cfg);
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  // Reference: every adapted linear trains in full from its merged weight, so its STE gradient
  // is the gradient of fake_quant(merged).
  Qwen3Model ref = merged_reference(m, cfg, w, /*fake_quant=*/true);
  const double s = 8.0 / 4.0;
  LossOutput lr = ref.loss(in);
  lr.loss.backward();
  EXPECT_EQ(lo.loss.item<double>(), lr.loss.item<double>());
  int64_t checked = 0;
  for (auto& p : m.parameters()) {
    if (p.lora_a == nullptr) continue;
    const at::Tensor dw = ref.parameter(p.name).grad.to(at::kDouble);
    const at::Tensor a = p.lora_a->master.to(at::kDouble), b = p.lora_b->master.to(at::kDouble);
    const at::Tensor ga = s * at::mm(b.t(), dw), gb = s * at::mm(dw, a.t());
    ASSERT_TRUE(p.lora_a->grad.defined() && p.lora_b->grad.defined()) << p.name;
    EXPECT_TRUE(at::allclose(p.lora_a->grad.to(at::kDouble), ga, 1e-4, 1e-7)) << p.name;
    EXPECT_TRUE(at::allclose(p.lora_b->grad.to(at::kDouble), gb, 1e-4, 1e-7)) << p.name;
    EXPECT_GT(gb.abs().max().item<double>(), 0.0) << p.name;
    ++checked;
  }
  EXPECT_EQ(checked, 7 * cfg.num_hidden_layers);
}

TEST(Lora, PlainGradientsAreTheDenseFormulas) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  for (const bool checkpointing : {true, false}) {
    ModelOptions o = lora_options(false);
    o.gradient_checkpointing = checkpointing;
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    perturb_b(m);
    const auto in = lora_inputs(cfg);
    LossOutput lo = m.loss(in);
    lo.loss.backward();
    // Reference: plain precision (the weights as they are) from the merged weights: y =
    // x·(W + s·B·A)ᵀ is the plain adapter's formula.
    Qwen3Model ref = merged_reference(m, cfg, w, /*fake_quant=*/false);
    const double s = 2.0;
    LossOutput lr = ref.loss(in);
    lr.loss.backward();
    // Only lm_head differs (fake-quantized here, not in the reference): a few of its blocks.
    EXPECT_NEAR(lo.loss.item<double>(), lr.loss.item<double>(), 2e-3);
    for (auto& p : m.parameters()) {
      if (p.lora_a == nullptr) continue;
      const at::Tensor dw = ref.parameter(p.name).grad.to(at::kDouble);
      const at::Tensor a = p.lora_a->master.to(at::kDouble), b = p.lora_b->master.to(at::kDouble);
      const at::Tensor ga = s * at::mm(b.t(), dw), gb = s * at::mm(dw, a.t());
      const double scale_a = ga.abs().max().item<double>(), scale_b = gb.abs().max().item<double>();
      EXPECT_LE((p.lora_a->grad.to(at::kDouble) - ga).abs().max().item<double>(), 2e-2 * scale_a)
          << p.name << " checkpointing " << checkpointing;
      EXPECT_LE((p.lora_b->grad.to(at::kDouble) - gb).abs().max().item<double>(), 2e-2 * scale_b)
          << p.name << " checkpointing " << checkpointing;
    }
  }
}

// Plain and merge-aware adapters: the gradients do not depend on what recomputes (the whole
// layers, or one block of each with the other keeping its graph): bitwise equal on the CPU.
TEST(Lora, GradientsDoNotDependOnCheckpointing) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  for (const bool merge_aware : {false, true}) {
    auto grads = [&](bool checkpointing, int64_t keep_attention, int64_t keep_mlp) {
      ModelOptions o = lora_options(merge_aware);
      o.gradient_checkpointing = checkpointing;
      o.recompute_keep_attention = keep_attention;
      o.recompute_keep_mlp = keep_mlp;
      Qwen3Model m = Qwen3Model::load(cfg, w, o);
      perturb_b(m);
      m.loss(lora_inputs(cfg)).loss.backward();
      std::map<std::string, at::Tensor> g;
      for (auto& p : m.adapters()) g[p.name] = p.grad.clone();
      return g;
    };
    const auto want = grads(false, 0, 0);
    for (const auto& [ka, km] :
         std::vector<std::pair<int64_t, int64_t>>{{0, 0}, {2, 0}, {0, 2}, {1, 1}}) {
      const auto got = grads(true, ka, km);
      for (const auto& [name, g] : want) {
        EXPECT_TRUE(at::equal(g, got.at(name)))
            << name << (merge_aware ? " merge-aware" : " plain") << ", keep " << ka << "/" << km;
      }
    }
  }
}

// Plain adapters with the frozen weights kept dequantized (ModelOptions::cache_adapted_weights):
// losses and adapter gradients of two steps (the adapters updated between them) equal those of
// dequantizing in every forward, with and without checkpointing; the kept weights are made once
// and dropped by set_cache_adapted_weights(false).
TEST(Lora, CachedFrozenWeightsGiveIdenticalSteps) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  for (const bool checkpointing : {false, true}) {
    auto run = [&](bool cache) {
      ModelOptions o = lora_options(false);
      o.gradient_checkpointing = checkpointing;
      o.cache_adapted_weights = cache;
      Qwen3Model m = Qwen3Model::load(cfg, w, o);
      perturb_b(m);
      std::map<std::string, at::Tensor> out;
      for (int step = 0; step < 2; ++step) {
        out["loss" + std::to_string(step)] = m.loss(lora_inputs(cfg)).loss;
        out["loss" + std::to_string(step)].backward();
        at::NoGradGuard no_grad;
        for (auto& p : m.adapters()) {
          out[p.name + std::to_string(step)] = p.grad.clone();
          p.master.sub_(p.grad, 0.1);
          p.grad = at::Tensor();
        }
      }
      int64_t kept = 0;
      for (const auto& p : m.parameters()) kept += p.dequantized.defined() ? 1 : 0;
      EXPECT_EQ(kept, cache ? static_cast<int64_t>(m.adapters().size() / 2) : 0);
      m.set_cache_adapted_weights(false);
      for (const auto& p : m.parameters()) EXPECT_FALSE(p.dequantized.defined()) << p.name;
      return out;
    };
    const auto want = run(false);
    const auto got = run(true);
    for (const auto& [name, t] : want) {
      EXPECT_TRUE(at::equal(t.detach(), got.at(name).detach()))
          << name << (checkpointing ? " checkpointed" : "");
    }
  }
}

// The recompute's MLP in row chunks (ModelOptions::mlp_chunk_tokens) with adapters on every
// linear: gate/up/down's plain A and B (the down projection's through its own term) or
// merge-aware merged weights are taps resolved once; each chunk computes with their detached
// copies and the taps get the fp32 sums. Against the unchunked recompute, for chunks of 4 (a
// last chunk of 2 of the 18 tokens) and 7, with the norms training beside the adapters; and with
// the in-backward hook, which must see every trainable parameter once per step with the
// gradient the buffered chunked run leaves. Tolerance as in
// Qwen3Model.MlpChunkedRecomputeMatchesUnchunked (fp32 summation order only).
TEST(Lora, ChunkedMlpRecomputeMatchesUnchunked) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  const auto in = lora_inputs(cfg);
  // Loss and every trainable parameter's gradient, from Parameter::grad or the hook.
  auto run = [&](const ModelOptions& o, bool hook) {
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    perturb_b(m);
    std::map<std::string, at::Tensor> got;
    std::map<std::string, int> calls;
    if (hook) {
      m.set_grad_ready_hook([&](Parameter& p) {
        ++calls[p.name];
        got[p.name] = p.grad.clone();
      });
    }
    m.begin_grad_step();
    LossOutput lo = m.loss(in);
    lo.loss.backward();
    got["loss"] = lo.loss.detach().reshape({1});
    for (Parameter* p : m.trainable_parameters()) {
      if (hook) {
        EXPECT_EQ(calls[p->name], 1) << p->name;
        EXPECT_FALSE(p->grad.defined()) << p->name << ": freed after the hook";
      } else {
        got[p->name] = p->grad.clone();
      }
    }
    return got;
  };
  for (const bool merge_aware : {false, true}) {
    ModelOptions base = lora_options(merge_aware);
    base.trainable.norms = true;
    const auto want = run(base, false);
    ASSERT_EQ(want.size(), 1 + 2 * 7 * 2 + 4 * 2 + 1u);  // loss, A and B, 4 norms a layer, final
    for (const int64_t chunk : {4, 7}) {
      SCOPED_TRACE(std::string(merge_aware ? "merge-aware" : "plain") + ", chunk " +
                   std::to_string(chunk));
      ModelOptions o = base;
      o.mlp_chunk_tokens = chunk;
      const auto got = run(o, false);
      const auto hooked = run(o, true);
      ASSERT_EQ(got.size(), want.size());
      for (const auto& [name, g] : want) {
        ASSERT_TRUE(got.count(name) && hooked.count(name)) << name;
        const double scale = g.abs().max().item<double>();
        const at::Tensor excess = (got.at(name) - g).abs() - (g.abs() * 1e-5 + 4e-6 * scale);
        EXPECT_LE(excess.max().item<double>(), 0.0)
            << name << ": max |diff| " << (got.at(name) - g).abs().max().item<double>();
        EXPECT_GT(scale, 0.0) << name;
        if (name != "loss") EXPECT_TRUE(at::equal(hooked.at(name), got.at(name))) << name;
      }
    }
  }
}

TEST(Lora, MergeAwareExportHoldsTheTrainedWeights) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = lora_options(true);
  o.lora.targets.push_back("lm_head");
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  perturb_b(m);
  const std::string path = lora_temp_path("merged.dat");
  m.export_to(w, path);
  DatReader exported(path);
  // Each adapted linear is stored as quantize(W + s·B·A), whose dequantization is the weight the
  // merge-aware forward computed with (fake_quant of the merge), bit for bit.
  const double s = 2.0;
  int64_t adapted = 0;
  for (auto& p : m.parameters()) {
    if (p.lora_a == nullptr) continue;
    at::Tensor merged = quant::dequantize_nvfp4(p.qdata, p.scale, at::kFloat);
    merged.add_(at::mm(p.lora_b->master, p.lora_a->master), s);
    const quant::Nvfp4Tensor q = quant::quantize_nvfp4(merged, p.name);
    const at::Tensor qd = exported.load(p.name + ".qdata"), sc = exported.load(p.name + ".scale");
    EXPECT_TRUE(at::equal(qd, q.qdata) && at::equal(sc, q.scale)) << p.name;
    EXPECT_TRUE(at::equal(quant::dequantize_nvfp4(qd, sc, at::kFloat),
                          quant::fake_quant_nvfp4_forward(merged)))
        << p.name;
    ++adapted;
  }
  EXPECT_GE(adapted, 7 * cfg.num_hidden_layers);
  // write_dat (a model without a source file) stores the same merge.
  const std::string written = lora_temp_path("written.dat");
  write_dat(m, written, /*quantize_lm_head=*/true);
  DatReader wd(written);
  for (auto& p : m.parameters()) {
    if (p.lora_a == nullptr) continue;
    EXPECT_TRUE(at::equal(wd.load(p.name + ".qdata"), exported.load(p.name + ".qdata"))) << p.name;
    EXPECT_TRUE(at::equal(m.merged_weight(p),
                          [&] {
                            at::Tensor x = quant::dequantize_nvfp4(p.qdata, p.scale, at::kFloat);
                            return x.add_(at::mm(p.lora_b->master, p.lora_a->master), s);
                          }()))
        << p.name;
  }
  std::remove(written.c_str());
  // Anything the export check reports is an adapted linear (re-quantized blocks on reload).
  for (const auto& d : m.compare_forward_weights(exported)) {
    const std::string name = d.substr(0, d.find(' '));
    ASSERT_NE(m.parameter(name).lora_a, nullptr) << d;
  }
  // The base file gives other logits than the exported merge.
  ModelOptions plain = o;
  plain.lora = LoraSpec{};
  Qwen3Model reloaded = Qwen3Model::load(cfg, exported, plain);
  Qwen3Model base = Qwen3Model::load(cfg, w, plain);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  EXPECT_FALSE(at::equal(reloaded.forward(in), base.forward(in)));
  std::remove(path.c_str());
}

// A plain adapter written as a PEFT folder and loaded onto the base model (as q4chat --adapter
// does) computes the trained model's logits bit for bit; a broken folder is refused by name.
TEST(Lora, PeftAdapterFolderRoundTrips) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = lora_options(false);
  o.trainable.layers = {1};  // adapters on the second layer only: layers_to_transform
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  ASSERT_EQ(m.adapters().size(), 14u);
  perturb_b(m);
  const std::string dir = lora_temp_path("adapter");
  m.export_adapter(dir, "base");
  const AdapterConfig ac = read_adapter_config(dir);
  EXPECT_EQ(ac.lora.rank, 4);
  EXPECT_EQ(ac.lora.alpha, 8.0);
  EXPECT_FALSE(ac.lora.merge_aware);
  EXPECT_EQ(ac.layers, std::vector<int64_t>{1});
  EXPECT_EQ(ac.lora.targets.size(), 7u);
  Qwen3Model loaded = inference_with_adapter(cfg, w, ac);
  ASSERT_EQ(loaded.adapters().size(), 14u);
  loaded.load_adapter(dir);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  EXPECT_TRUE(at::equal(m.forward(in), loaded.forward(in)));
  // Without the adapter the logits differ (B is not zero).
  EXPECT_FALSE(at::equal(m.forward(in), Qwen3Model::load(cfg, w, inference_options()).forward(in)));
  // A wrong rank: the shape mismatch names the tensor.
  ModelOptions wrong = with_adapter(inference_options(), ac);
  wrong.lora.rank = 2;
  Qwen3Model other = Qwen3Model::load(cfg, w, wrong);
  try {
    other.load_adapter(dir);
    ADD_FAILURE() << "a rank-4 adapter loaded into rank-2 adapters";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("lora_A"), std::string::npos) << e.what();
  }
}

// A copy of adapter folder `src` as `dst` after `edit` changed its tensors (by key, in order) and
// its adapter_config.json.
using AdapterTensors = std::vector<std::pair<std::string, at::Tensor>>;
void edit_adapter(const std::string& src, const std::string& dst,
                  const std::function<void(AdapterTensors&, nlohmann::json&)>& edit) {
  namespace fs = std::filesystem;
  fs::remove_all(dst);
  fs::create_directories(dst);
  AdapterTensors tensors;
  {
    const SafetensorsFile f(src + "/adapter_model.safetensors");
    for (const auto& t : f.tensors()) tensors.emplace_back(t.name, f.load(t));
  }
  std::ifstream in(src + "/adapter_config.json");
  nlohmann::json cfg = nlohmann::json::parse(in);
  edit(tensors, cfg);
  std::vector<SafetensorsWriter::Decl> decls;
  for (const auto& [name, t] : tensors) {
    decls.push_back({name, t.scalar_type() == at::kHalf ? io::StDtype::kF16 : io::StDtype::kF32,
                     t.sizes().vec()});
  }
  SafetensorsWriter w(dst + "/adapter_model.safetensors", decls);
  for (const auto& kv : tensors) w.append(kv.second.contiguous());
  w.commit();
  std::ofstream(dst + "/adapter_config.json") << cfg.dump(2);
}

// Loads adapter `dir` onto the fixture's base model: the error's text, or "" when it loads.
std::string adapter_error(const std::string& dir) {
  try {
    DatReader w(kWeights);
    const auto cfg = Qwen3Config::from_json_file(kConfig);
    Qwen3Model m = inference_with_adapter(cfg, w, read_adapter_config(dir));
    m.load_adapter(dir);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// A plain LoRA run that also trains the norms and lm_head (the trainer's default trains the
// norms): the PEFT folder carries them as modules_to_save under their full module paths, and
// the adapter on the base computes the trained model's logits.
TEST(Lora, PeftAdapterCarriesTheTensorsTrainedBesideIt) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = lora_options(false);
  o.trainable.layers = {1};
  o.trainable.norms = true;
  o.trainable.lm_head = true;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  perturb_b(m);
  at::Generator gen = at::detail::createCPUGenerator(31);
  int64_t trained = 0;
  {
    at::NoGradGuard no_grad;
    for (auto& p : m.parameters()) {
      if (!p.trainable) continue;
      p.master.add_(at::randn(p.master.sizes(), gen, at::kFloat) * 0.1);
      ++trained;
    }
  }
  ASSERT_EQ(trained, 6);  // layer 1's four norms, model.norm, lm_head
  const std::string dir = lora_temp_path("modules_to_save");
  m.export_adapter(dir, "base");
  const AdapterConfig ac = read_adapter_config(dir);
  const std::vector<std::string> want = {"model.layers.1.input_layernorm",
                                         "model.layers.1.self_attn.q_norm",
                                         "model.layers.1.self_attn.k_norm",
                                         "model.layers.1.post_attention_layernorm",
                                         "model.norm",
                                         "lm_head"};
  auto got = ac.modules_to_save;
  EXPECT_EQ(std::set<std::string>(got.begin(), got.end()),
            std::set<std::string>(want.begin(), want.end()));
  {
    const SafetensorsFile f(dir + "/adapter_model.safetensors");
    EXPECT_NE(f.find("base_model.model.model.norm.weight"), nullptr);
    // lm_head as the forward computes with it: fake_quant(master).
    const StTensor* head = f.find("base_model.model.lm_head.weight");
    ASSERT_NE(head, nullptr);
    const at::Tensor master = m.parameter("lm_head.weight").master;
    EXPECT_TRUE(at::equal(f.load(*head), q4::quant::fake_quant_nvfp4_forward(master)));
  }
  Qwen3Model loaded = inference_with_adapter(cfg, w, ac);
  const AdapterLoad applied = loaded.load_adapter(dir);
  EXPECT_EQ(applied.lora_pairs, 7);
  EXPECT_EQ(applied.full_tensors, 6);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  const at::Tensor trained_logits = m.forward(in);
  EXPECT_LT(rel_err(loaded.forward(in), trained_logits), 1e-6);
  // The LoRA pairs alone are another model (what the folder held before).
  const std::string bare = lora_temp_path("bare");
  edit_adapter(dir, bare, [](AdapterTensors& t, nlohmann::json& c) {
    t.erase(
        std::remove_if(t.begin(), t.end(),
                       [](const auto& kv) { return kv.first.find("lora_") == std::string::npos; }),
        t.end());
    c["modules_to_save"] = nullptr;
  });
  Qwen3Model pairs = inference_with_adapter(cfg, w, read_adapter_config(bare));
  EXPECT_EQ(pairs.load_adapter(bare).full_tensors, 0);
  EXPECT_GT(rel_err(pairs.forward(in), trained_logits), 1e-3);
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(bare);
}

// A mixture-of-experts model (the tiny MoE fixture: layers 0 and 2 sparse, layer 1 dense): the
// targets gate/up/down_proj name the dense MLPs only (the stacked experts take the target
// `experts`, moe_lora_test.cpp), so they adapt only the dense layer's MLP;
// the routers stay frozen and are no modules_to_save; the PEFT folder loads back onto the base
// as the trained model (docs/model.md#mixture-of-experts).
TEST(Lora, MixtureOfExpertsAdaptsOnlyTheDenseMlps) {
  const auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_moe_tiny.config.json");
  // An NVFP4 base (the fixture's weights are dense): a random init written as a .dat.
  const std::string base = lora_temp_path("moe_base.dat");
  write_dat(Qwen3Model::random_init(cfg, fp32_all(), 5), base, /*quantize_lm_head=*/false);
  DatReader w(base);
  ModelOptions o = lora_options(false);
  o.trainable.norms = true;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  // q/k/v/o of 3 layers and gate/up/down of layer 1: an A and a B each.
  ASSERT_EQ(m.adapters().size(), 2u * (3 * 4 + 3));
  for (const Parameter& p : m.adapters()) {
    EXPECT_EQ(p.name.find(".experts."), std::string::npos) << p.name;
  }
  for (const Parameter& p : m.parameters()) {
    if (p.name.find(".mlp.") != std::string::npos) EXPECT_FALSE(p.trainable) << p.name;
  }
  perturb_b(m);
  const std::string dir = lora_temp_path("moe");
  m.export_adapter(dir, "base");
  const AdapterConfig ac = read_adapter_config(dir);
  EXPECT_FALSE(ac.modules_to_save.empty());  // the norms
  for (const auto& e : ac.modules_to_save) {
    EXPECT_EQ(e.find("mlp"), std::string::npos) << e;
  }
  Qwen3Model loaded = inference_with_adapter(cfg, w, ac);
  const AdapterLoad applied = loaded.load_adapter(dir);
  EXPECT_EQ(applied.lora_pairs, 15);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  EXPECT_LT(rel_err(loaded.forward(in), m.forward(in)), 1e-6);
  std::filesystem::remove_all(dir);
  std::filesystem::remove(base);
}

// The lm_head adapter of a merge-aware run loads (as peft applies it: W + s·B·A unrounded, which
// a model holding that merged weight in plain precision computes).
TEST(Lora, LmHeadAdapterLoadsAsPeftAppliesIt) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = lora_options(true);
  Qwen3Model m = perturbed_lora_model(cfg, w, o, {"q_proj", "lm_head"});
  const std::string dir = lora_temp_path("lm_head");
  m.export_adapter(dir, "base");
  Qwen3Model loaded = inference_with_adapter(cfg, w, read_adapter_config(dir));
  EXPECT_EQ(loaded.load_adapter(dir).lora_pairs, 3);  // lm_head and two q_proj
  Qwen3Model ref = merged_reference(m, cfg, w, /*fake_quant=*/false);
  at::NoGradGuard no_grad;
  const auto in = lora_inputs(cfg);
  EXPECT_LT(rel_err(loaded.forward(in), ref.forward(in)), 1e-5);
  std::filesystem::remove_all(dir);
}

// What the loader would not apply in full is refused, naming the file and the key: tensors for
// a layer the model lacks, a module outside target_modules, a weight outside modules_to_save;
// non-finite values; rank_pattern / alpha_pattern; a lora_alpha whose scale overflows fp32.
TEST(Lora, AdapterFolderThatWouldNotApplyIsRefusedByName) {
  DatReader w(kWeights);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = lora_options(false);
  o.trainable.norms = true;
  Qwen3Model m = perturbed_lora_model(cfg, w, o, {"q_proj", "v_proj"});
  const std::string dir = lora_temp_path("good");
  m.export_adapter(dir, "base");
  ASSERT_EQ(adapter_error(dir), "");
  const std::string bad = lora_temp_path("bad");
  const auto refused = [&](const std::function<void(AdapterTensors&, nlohmann::json&)>& edit,
                           const std::string& key, const std::string& what) {
    edit_adapter(dir, bad, edit);
    const std::string e = adapter_error(bad);
    EXPECT_NE(e.find(key), std::string::npos) << e;
    EXPECT_NE(e.find(what), std::string::npos) << e;
    EXPECT_NE(e.find(bad + "/adapter_"), std::string::npos) << e;  // the file
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  };
  const auto a0 = [](AdapterTensors& t) -> at::Tensor& { return t.front().second; };
  // The edit that adds the first tensor again under `name`.
  const auto adding = [a0](const std::string& name) {
    return [a0, name](AdapterTensors& t, nlohmann::json&) { t.emplace_back(name, a0(t)); };
  };
  // A layer the model does not have.
  refused(adding("base_model.model.model.layers.5.self_attn.q_proj.lora_A.weight"),
          "model.layers.5.self_attn.q_proj.lora_A.weight", "2 decoder layers");
  // A module outside target_modules.
  refused(adding("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"), "k_proj.lora_A",
          "target_modules");
  // A weight of a module outside modules_to_save.
  refused(adding("base_model.model.model.layers.0.mlp.up_proj.weight"), "mlp.up_proj.weight",
          "modules_to_save");
  // Non-LoRA tensors PEFT writes for other methods.
  refused(adding("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"),
          "lora_magnitude_vector", "not a LoRA A or B");
  // Non-finite values, in an A and in a norm.
  const std::string first = SafetensorsFile(dir + "/adapter_model.safetensors").tensors()[0].name;
  refused([&](AdapterTensors& t, nlohmann::json&) { a0(t).view(-1).select(0, 0).fill_(NAN); },
          first, "non-finite");
  refused(
      [&](AdapterTensors& t, nlohmann::json&) {
        for (auto& [name, v] : t) {
          if (name == "base_model.model.model.norm.weight") v.select(0, 0).fill_(INFINITY);
        }
      },
      "base_model.model.model.norm.weight", "non-finite");
  // Per-module rank and alpha: not applied, so refused.
  refused(
      [&](AdapterTensors&, nlohmann::json& c) {
        c["alpha_pattern"] = {{"q_proj", 4}};
      },
      "alpha_pattern", "not apply");
  refused(
      [&](AdapterTensors&, nlohmann::json& c) {
        c["rank_pattern"] = {{"v_proj", 2}};
      },
      "rank_pattern", "not apply");
  refused([&](AdapterTensors&, nlohmann::json& c) { c["lora_alpha"] = 1e300; }, "lora_alpha",
          "fp32");
  // PEFT writes empty patterns: accepted.
  edit_adapter(dir, bad, [](AdapterTensors&, nlohmann::json& c) {
    c["alpha_pattern"] = nlohmann::json::object();
    c["rank_pattern"] = nlohmann::json::object();
  });
  EXPECT_EQ(adapter_error(bad), "");
  std::filesystem::remove_all(dir);
  std::filesystem::remove_all(bad);
}

}  // namespace
}  // namespace q4::model
