// The README's GRPO demo as shipped: configs/demo-grpo-sft.yaml (the tiny demo model learns four
// answers per prompt, about equally likely), then configs/demo-grpo.yaml (GRPO rewards one of
// them per prompt, exact_match against the record's "answer"), only output.dir moved and the
// stage-2 weights pointed at stage 1's export. The mean reward of the first step (sampled before
// any update; 0.25 expected) must be low and the last steps' must be >= 0.9, both stages within
// 3 minutes of 2 CPU cores; the rollout samples must reach eval.jsonl (report.html's table).
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <torch/cuda.h>
#include <utility>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::grpo_demo_test {

namespace {

using namespace q4::test;

// q4train with `args`, its output in `log`; `env`: assignments before it ("Q4_FAULT=...").
int grpo_demo_run(const std::string& args, const fs::path& log, const std::string& env = "") {
  return exit_code(std::system(
      (env + " " + kBin + "/q4train " + args + " >" + log.string() + " 2>&1").c_str()));
}

std::vector<nlohmann::json> grpo_demo_records(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

// A fresh folder (temp/q4_<tag>_<uid>_<pid>) with the demo's first stage trained into its sft/
// (`extra`: more arguments), whose model.dat the second stage starts from.
fs::path grpo_sft_stage(const std::string& tag, const std::string& extra) {
  const fs::path dir = fresh_dir(fs::temp_directory_path() / ("q4_" + tag + "_" +
                                                              std::to_string(::getuid()) + "_" +
                                                              std::to_string(::getpid())));
  EXPECT_EQ(grpo_demo_run("--config " + kSource + "/configs/demo-grpo-sft.yaml --set output.dir=" +
                              (dir / "sft").string() + " " + extra,
                          dir / "sft.log"),
            0)
      << read_text(dir / "sft.log");
  return dir;
}

}  // namespace

TEST(Demo, GrpoDemoRaisesTheReward) {
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path dir = grpo_sft_stage("grpo_demo", "");
  ASSERT_FALSE(HasFailure());
  const fs::path sft = dir / "sft", grpo = dir / "grpo";
  ASSERT_EQ(grpo_demo_run("--config " + kSource + "/configs/demo-grpo.yaml --set output.dir=" +
                              grpo.string() + " --set model.weights=" +
                              (sft / "model.dat").string(),
                          dir / "grpo.log"),
            0)
      << read_text(dir / "grpo.log");
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto metrics = grpo_demo_records(grpo / "metrics.jsonl");
  ASSERT_GE(metrics.size(), 10u);
  std::string curve;
  for (const auto& m : metrics) {
    ASSERT_TRUE(m.contains("reward") && m.contains("rewards/correct/mean") &&
                m.contains("completions/mean_length") && m.contains("clip_ratio"))
        << m.dump();
    curve += " " + std::to_string(m.at("reward").get<double>()).substr(0, 5);
  }
  std::cout << "reward by step:" << curve << "\n";
  std::cout << "both stages in " << secs << " s\n";
  EXPECT_LE(metrics.front().at("reward").get<double>(), 0.3) << curve;
  double last = 0;
  for (size_t i = metrics.size() - 5; i < metrics.size(); ++i) {
    last += metrics[i].at("reward").get<double>() / 5;
  }
  EXPECT_GE(last, 0.9) << curve;
  EXPECT_LE(secs, 180.0);
  int samples = 0;
  for (const auto& e : grpo_demo_records(grpo / "eval.jsonl")) {
    if (e.at("when").get<std::string>().rfind("rollout", 0) == 0) ++samples;
  }
  EXPECT_GT(samples, 0);
  q4::io::remove_tree(dir);
}

// A resume continues the same prompts and samples: 8 steps in one run against a run killed at
// the start of step 6 (Q4_FAULT) and resumed from its step-4 checkpoint; every step's reward and
// loss are identical on the CPU.
TEST(Demo, GrpoResumeContinuesTheSameRollouts) {
  const fs::path dir = grpo_sft_stage("grpo_resume", "--set train.steps=20");
  ASSERT_FALSE(HasFailure());
  const fs::path sft = dir / "sft";
  const std::string common = "--config " + kSource + "/configs/demo-grpo.yaml --set model.weights=" +
                             (sft / "model.dat").string() +
                             " --set train.steps=8 --set output.checkpoint_every=4";
  ASSERT_EQ(grpo_demo_run(common + " --set output.dir=" + (dir / "a").string(), dir / "a.log"), 0)
      << read_text(dir / "a.log");
  EXPECT_EQ(grpo_demo_run(common + " --set output.dir=" + (dir / "b").string(), dir / "b.log",
                          "Q4_FAULT=exit:0:6"),
            9)
      << read_text(dir / "b.log");
  ASSERT_EQ(grpo_demo_run("--resume " + (dir / "b").string(), dir / "b2.log"), 0)
      << read_text(dir / "b2.log");
  const auto a = grpo_demo_records(dir / "a" / "metrics.jsonl");
  const auto b = grpo_demo_records(dir / "b" / "metrics.jsonl");
  ASSERT_EQ(a.size(), 8u);
  ASSERT_EQ(b.size(), 8u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].at("step"), b[i].at("step"));
    EXPECT_EQ(a[i].at("reward"), b[i].at("reward")) << "step " << i + 1;
    EXPECT_EQ(a[i].at("loss"), b[i].at("loss")) << "step " << i + 1;
    EXPECT_EQ(a[i].at("completions/mean_length"), b[i].at("completions/mean_length"));
  }
  q4::io::remove_tree(dir);
}

// On a GPU, the GRPO demo's second stage with each path that GRPO shares with the other
// objectives: the full fine-tune as shipped, masters offloaded to the host (optim.offload: all),
// plain and merge-aware LoRA (the sampler runs the adapted forward) and a KL to the reference
// (grpo.beta > 0, the reference model loaded). Each must raise the mean reward from the first step
// (sampled before any update, ~0.25) to >= 0.8 over the last 5 steps.
TEST(DemoCuda, GrpoVariantsRaiseTheReward) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const fs::path dir = grpo_sft_stage("grpo_cuda", "--set model.device=cuda");
  ASSERT_FALSE(HasFailure());
  const fs::path sft = dir / "sft";
  const std::vector<std::pair<std::string, std::string>> variants = {
      {"full", ""},
      {"offload", "--set optim.offload=all"},
      {"lora", "--set train.method=lora --set lora.merge_aware=false"},
      {"lora_merge_aware", "--set train.method=lora"},
      {"beta", "--set grpo.beta=0.04"},
  };
  for (const auto& [name, args] : variants) {
    const fs::path run = dir / name;
    ASSERT_EQ(grpo_demo_run("--config " + kSource + "/configs/demo-grpo.yaml --set output.dir=" +
                                run.string() + " --set model.weights=" +
                                (sft / "model.dat").string() + " --set model.device=cuda " + args,
                            dir / (name + ".log")),
              0)
        << name << ":\n" << read_text(dir / (name + ".log"));
    const auto metrics = grpo_demo_records(run / "metrics.jsonl");
    ASSERT_GE(metrics.size(), 10u) << name;
    std::string curve;
    double last = 0;
    for (size_t i = 0; i < metrics.size(); ++i) {
      curve += " " + std::to_string(metrics[i].at("reward").get<double>()).substr(0, 4);
      if (i + 5 >= metrics.size()) last += metrics[i].at("reward").get<double>() / 5;
    }
    if (name == "beta") EXPECT_TRUE(metrics.back().contains("kl")) << metrics.back().dump();
    std::cout << name << ": reward by step" << curve << "\n";
    EXPECT_LE(metrics.front().at("reward").get<double>(), 0.3) << name << ":" << curve;
    EXPECT_GE(last, 0.8) << name << ":" << curve;
  }
  q4::io::remove_tree(dir);
}

}  // namespace q4::test::grpo_demo_test
