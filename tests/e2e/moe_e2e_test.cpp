// The mixture-of-experts demo (configs/demo-moe.yaml: a tiny random Qwen3MoeForCausalLM on CPU,
// 2 layers of 8 experts, top 2) as a user runs it, shortened to 20 steps: the loss falls, every
// logged step's record carries the routers' metrics (moe_* keys, docs/trainer.md#logs) and its
// console line the aux loss and the loads, the export passes the trainer's check and, reloaded by
// the model library, scores lower than the first step's loss. With LoRA on the experts the loss
// falls too, and the PEFT folder is peft's layout and, on the run's base, the trained model.
// --dry-run says the experts; on a machine without a GPU, a Qwen3-235B-A22B config on CUDA is
// estimated against the common cards. About 60 s on 2 CPU cores.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <utility>
#include <vector>

#include "e2e_util.h"
#include "q4/io/remove_tree.h"
#include "q4/model/safetensors.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "shrunk_demo.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::moe_e2e_test {

namespace {

using namespace q4::test;

const std::string kMoeDemo = kSource + "/configs/demo-moe.yaml";

// q4train on the shipped MoE demo with output.dir in `dir`/run, 20 steps, no eval prompts.
Result moe_demo(const fs::path& dir, std::vector<std::string> extra) {
  std::vector<std::string> args = {
      "--config", kMoeDemo,         "--set", "output.dir=" + (dir / "run").string(),
      "--set",    "train.steps=20", "--set", "log.every=5",
      "--set",    "eval.prompts=[]"};
  args.insert(args.end(), extra.begin(), extra.end());
  return run_q4train(args, dir / "q4train");
}

}  // namespace

TEST(MoeDemo, TrainsLogsTheRoutersAndExports) {
  const fs::path dir = fresh_dir(work_root("e2e") / "moe_demo");
  const Result r = moe_demo(dir, {});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "experts    mixture of experts: 2 of 2 layers sparse")) << r.out;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("export check: (\\d+)/(\\d+) tensors")))
      << r.out;
  EXPECT_EQ(m[1], m[2]) << r.out;
  // Log lines: "| aux 2.013 load 1.52/0.61 |".
  EXPECT_TRUE(std::regex_search(
      r.out, std::regex("\\| aux \\d+\\.\\d{3} load \\d+\\.\\d{2}/\\d+\\.\\d{2} \\|")))
      << r.out;

  const auto records = read_jsonl(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(records.size(), 20u);
  const double first = records.front().at("loss").get<double>();
  int logged = 0;
  for (const auto& j : records) {
    if (!j.contains("loss_avg")) {
      EXPECT_FALSE(j.contains("moe_max_load")) << j.dump();
      continue;
    }
    ++logged;
    // Balanced routing of k = 2 routes gives 2; the loads bracket the mean of 1.
    EXPECT_GT(j.at("moe_aux_loss").get<double>(), 1.0) << j.dump();
    EXPECT_LT(j.at("moe_aux_loss").get<double>(), 8.0) << j.dump();
    EXPECT_GE(j.at("moe_max_load").get<double>(), 1.0) << j.dump();
    EXPECT_LE(j.at("moe_min_load").get<double>(), 1.0) << j.dump();
    EXPECT_GE(j.at("moe_min_load").get<double>(), 0.0) << j.dump();
    EXPECT_GT(j.at("moe_router_entropy").get<double>(), 0.0) << j.dump();
    EXPECT_LE(j.at("moe_router_entropy").get<double>(), std::log(8.0) + 1e-9) << j.dump();
    EXPECT_EQ(j.at("moe_dropped_tokens").get<int64_t>(), 0) << j.dump();
  }
  EXPECT_EQ(logged, 5);  // steps 1, 5, 10, 15, 20
  const double last = records.back().at("loss_avg").get<double>();
  EXPECT_LT(last, 0.5 * first) << "loss " << first << " -> " << last;

  // The export, reloaded by the model library, scores the training data below the first loss.
  const auto c = q4::trainer::load_config((dir / "run" / "config.yaml").string());
  const double exported = dataset_loss(c, (dir / "run" / "model.dat").string());
  EXPECT_LT(exported, 0.5 * first) << exported;
  q4::io::remove_tree(dir);
}

// LoRA on the experts and q_proj (lora.targets [q_proj, experts], plain, the norms trained
// beside them; embedding and lm_head frozen), 12 steps (about 13 s on 2 CPU cores): the loss
// falls, and the PEFT folder is peft's target_parameters layout (docs/model.md#lora-on-experts)
// whose adapter, applied to the run's base (init.dat) by the model library, scores the data
// below the base, which is the model of the first step. The merged export is written and loads
// (plain: requantized, so not checked against the base).
TEST(MoeDemo, LoraOnTheExpertsTrainsAndExportsItsPeftFolder) {
  const fs::path dir = fresh_dir(work_root("e2e") / "moe_lora");
  const Result r = moe_demo(
      dir, {"--set", "train.method=lora", "--set", "lora.targets=[q_proj, experts]", "--set",
            "lora.rank=4", "--set", "lora.alpha=8", "--set", "lora.merge_aware=false", "--set",
            "train.trainable.lm_head=false", "--set", "train.trainable.embeddings=false", "--set",
            "train.steps=12", "--set", "optim.schedule.warmup_steps=2"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  // q_proj in 2 layers, 2 sparse layers x (gate, up, down); 4 norms a layer and the final one.
  EXPECT_TRUE(contains(r.out, "(8 LoRA pairs, 9 full tensors as modules_to_save)")) << r.out;
  const auto records = read_jsonl(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(records.size(), 12u);
  const double first = records.front().at("loss").get<double>();
  const double last = records.back().at("loss_avg").get<double>();
  // The frozen random embedding and lm_head keep the loss near ln(vocab); the adapters and norms
  // take about 0.8 off it in 12 steps.
  EXPECT_LT(last, first - 0.5) << "loss " << first << " -> " << last;

  const fs::path adapter = dir / "run" / "model-adapter";
  const auto ac = nlohmann::json::parse(read_text(adapter / "adapter_config.json"));
  EXPECT_EQ(ac.at("target_modules"), nlohmann::json({"q_proj"})) << ac.dump();
  EXPECT_EQ(ac.at("target_parameters"), nlohmann::json({"model.layers.0.mlp.experts.gate_up_proj",
                                                        "model.layers.0.mlp.experts.down_proj",
                                                        "model.layers.1.mlp.experts.gate_up_proj",
                                                        "model.layers.1.mlp.experts.down_proj"}))
      << ac.dump();
  const q4::model::SafetensorsFile st((adapter / "adapter_model.safetensors").string());
  const std::string pre = "base_model.model.model.layers.1.mlp.experts.";
  const std::vector<std::pair<std::string, std::vector<int64_t>>> shapes = {
      {"base_layer.lora_A.weight", {8 * 4, 64}},      // (E·r, H)
      {"base_layer.lora_B.weight", {2 * 64, 4 * 8}},  // (2I, r·E)
      {"lora_A.weight", {8 * 4, 64}},                 // (E·r, I)
      {"lora_B.weight", {64, 4 * 8}}};                // (H, r·E)
  for (const auto& [name, shape] : shapes) {
    const q4::model::StTensor* t = st.find(pre + name);
    ASSERT_NE(t, nullptr) << pre + name;
    EXPECT_EQ(t->shape, shape) << pre + name;
  }

  // Loaded back: the adapter on the run's base is the trained model.
  const auto c = q4::trainer::load_config((dir / "run" / "config.yaml").string());
  const std::string init = (dir / "run" / "init.dat").string();
  const double base = dataset_loss(c, init);
  const double adapted = dataset_loss(c, init, "", adapter.string());
  std::printf("first step %.4f, last %.4f; base %.4f, base + adapter %.4f\n", first, last, base,
              adapted);
  EXPECT_NEAR(base, first, 1e-3 * first);  // the base is the model of step 1
  EXPECT_LT(adapted, base - 0.5);
  EXPECT_TRUE(std::isfinite(dataset_loss(c, (dir / "run" / "model.dat").string())));
  q4::io::remove_tree(dir);
}

TEST(MoeDemo, DryRunSaysTheExperts) {
  const fs::path dir = fresh_dir(work_root("e2e") / "moe_dry");
  const Result r = moe_demo(dir, {"--dry-run"});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  for (const char* line :
       {"mixture of experts: 2 of 2 layers sparse, 8 experts of width 64, top 2 (renormalised);",
        "routers train (train.trainable.router)", "load-balancing loss coefficient 0.001"}) {
    EXPECT_TRUE(contains(r.out, line)) << line << "\n" << r.out;
  }
  // LoRA on the MLP projections: the experts are said not to be adapted.
  const Result lora = moe_demo(dir, {"--dry-run", "--set", "train.method=lora", "--set",
                                     "lora.targets=[q_proj, gate_proj]"});
  ASSERT_EQ(lora.code, 0) << lora.out << lora.err;
  EXPECT_TRUE(contains(lora.out,
                       "note: lora.targets gate_proj: the experts of the 2 mixture-of-experts "
                       "layers are not adapted"))
      << lora.out;
  if (!at::hasCUDA()) {  // a CUDA config on a machine without a GPU: the common cards
    const Result big =
        moe_demo(dir, {"--dry-run", "--set",
                       "model.config=" + kSource + "/tests/fixtures/qwen3_235b_a22b.config.json",
                       "--set", "model.device=cuda", "--set", "model.master_dtype=fp16", "--set",
                       "model.compute_dtype=bf16", "--set", "train.batch_size=1"});
    EXPECT_EQ(big.code, 2) << big.out << big.err;  // no device here
    EXPECT_TRUE(contains(big.out,
                         "mixture of experts: 94 of 94 layers sparse, 128 experts of "
                         "width 1536, top 8 (renormalised); 235.09B parameters, 22.19B "
                         "active per token"))
        << big.out;
    EXPECT_TRUE(contains(big.out, "on common cards:\n  80 GB: estimate")) << big.out;
    EXPECT_TRUE(contains(big.out, "\n  141 GB: estimate")) << big.out;
  }
  q4::io::remove_tree(dir);
}

}  // namespace q4::test::moe_e2e_test
