// The mixture-of-experts demo (configs/demo-moe.yaml: a tiny random Qwen3MoeForCausalLM on CPU,
// 2 layers of 8 experts, top 2) as a user runs it, shortened to 20 steps: the loss falls, every
// logged step's record carries the routers' metrics (moe_* keys, docs/trainer.md#logs) and its
// console line the aux loss and the loads, the export passes the trainer's check and, reloaded by
// the model library, scores lower than the first step's loss. --dry-run says the experts; on a
// machine without a GPU, a Qwen3-235B-A22B config on CUDA is estimated against the common cards.
// About 30 s on 2 CPU cores.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include "e2e_util.h"
#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "shrunk_demo.h"

namespace fs = std::filesystem;

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
