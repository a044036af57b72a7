// End-to-end tests of what q4train says and refuses, on the shrunk demo (shrunk_demo.h): the
// start-up and end summaries, validation and held-out losses, clipped warm-up, a non-empty output
// directory, a CUDA device without CUDA, export-only from a checkpoint and a changed schedule on
// resume.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "shrunk_demo.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::e2e_ux_test {
using namespace q4::test;

namespace {

bool has(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

int64_t lines_of(const std::string& s) { return std::count(s.begin(), s.end(), '\n'); }

}  // namespace

// The base run's own words: a short start-up summary instead of the config dump, the resolved
// config saved with clean floats, and an end that lists time, losses, files and next commands.
TEST(E2EUx, StartAndEndSummaries) {
  const fs::path dir = base_dir();
  ASSERT_TRUE(fs::exists(dir / "COMPLETE")) << read_text(dir / "base.err");
  const std::string out = read_text(dir / "base.out");
  EXPECT_TRUE(has(out, "run summary:")) << out;
  for (const char* k : {"  model ", "  trainable ", "  data ", "  steps ", "  output ", "  memory ",
                        "time: about "}) {
    EXPECT_TRUE(has(out, k)) << k << "\n" << out;
  }
  EXPECT_FALSE(has(out, "beta1")) << "the config is dumped again";
  EXPECT_LT(lines_of(out.substr(0, out.find("run summary:"))), 8) << out;
  const std::string yaml = read_text(dir / "run" / "config.yaml");
  EXPECT_TRUE(has(yaml, "beta1: 0.9 ")) << yaml;
  EXPECT_TRUE(has(yaml, "lr: 0.01 ")) << yaml;
  EXPECT_FALSE(has(yaml, "0000000")) << yaml;
  const std::string end = out.substr(out.find("done: "));
  EXPECT_TRUE(has(end, "done: 40 steps in ")) << end;
  EXPECT_TRUE(has(end, "final loss ")) << end;
  EXPECT_TRUE(has(end, (dir / "run" / "model.dat").string())) << end;
  EXPECT_TRUE(has(end, (dir / "run" / "step_000040").string())) << end;
  EXPECT_TRUE(has(end, "q4chat --model " + (dir / "run").string())) << end;
  // The export hint writes a new file named by the step, never over model.dat.
  EXPECT_TRUE(has(end, "--resume " + (dir / "run" / "step_000040").string() +
                           " --export-only --set output.export_path=model-step40.dat"))
      << end;
  EXPECT_TRUE(has(end, "vllm serve")) << end;
  // The log line carries the window average.
  EXPECT_TRUE(has(out, " (avg ")) << out;
}

// Validation loss from data.eval_files: at step 0, every eval.every steps and at the end, in the
// log line and metrics.jsonl; checked against the loss recomputed from init.dat and model.dat.
// The logged average is the token-weighted mean of the window (equal batches here: the mean).
TEST(E2EUx, ValidationLossAndWindowAverage) {
  const fs::path dir = work_root("e2e") / "validation";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 4, 0);
  write_text(dir / "eval.tsv", "What is 3 + 3?\t6.\nSay goodbye.\tBye!\n你好吗？\t很好。\n");
  const auto r = run_q4train(
      {"--config", cfg.string(), "--set", "data.eval_files=[" + (dir / "eval.tsv").string() + "]",
       "--set", "eval.every=2", "--set", "log.every=2", "--set", "eval.prompts=[]"},
      dir / "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto c = load_cfg(dir);
  ASSERT_EQ(c.data.eval_files.size(), 1u);
  const auto m = read_jsonl(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(m.size(), 5u);  // step 0 (validation only), steps 1-4
  EXPECT_EQ(m[0]["step"], 0);
  EXPECT_FALSE(m[0].contains("loss"));
  for (size_t i : {0, 2, 4}) ASSERT_TRUE(m[i].contains("val_loss")) << m[i].dump();
  for (size_t i : {1, 3}) EXPECT_FALSE(m[i].contains("val_loss")) << m[i].dump();
  const std::string eval = (dir / "eval.tsv").string();
  const double at0 = dataset_loss(c, (dir / "run" / "init.dat").string(), eval);
  const double at4 = dataset_loss(c, (dir / "run" / "model.dat").string(), eval);
  EXPECT_NEAR(m[0]["val_loss"].get<double>(), at0, 1e-3 * at0);
  // The export requantizes the trained masters (a few blocks move by one code): 2%.
  EXPECT_NEAR(m[4]["val_loss"].get<double>(), at4, 0.02 * at4);
  EXPECT_NE(m[4]["val_loss"].get<double>(), m[0]["val_loss"].get<double>());
  EXPECT_GT(m[4]["val_tokens"].get<int64_t>(), 0);
  // Steps 3 and 4 form one window; every step sees all 8 examples (one packed batch).
  const double mean = (m[3]["loss"].get<double>() + m[4]["loss"].get<double>()) / 2;
  EXPECT_NEAR(m[4]["loss_avg"].get<double>(), mean, 1e-9 * mean);
  EXPECT_FALSE(m[3].contains("loss_avg"));
  EXPECT_TRUE(has(r.out, "| val ")) << r.out;
  EXPECT_TRUE(has(r.out, "validation loss ")) << r.out;
  EXPECT_TRUE(has(read_text(dir / "run" / "report.html"), "validation loss"));
  // TensorBoard: val/loss beside train/loss_avg (tag strings inside the event records).
  std::string events;
  for (const auto& e : fs::directory_iterator(dir / "run")) {
    if (e.path().filename().string().rfind("events.out.tfevents.", 0) == 0) {
      events += read_text(e.path());
    }
  }
  EXPECT_TRUE(has(events, "val/loss"));
  EXPECT_TRUE(has(events, "train/loss_avg"));
  EXPECT_FALSE(has(events, "train/val_loss"));
}

// data.eval_fraction holds out ceil(fraction x N) training examples, never trained on, the same
// ones for the same seed; a fraction out of range is a config error naming the key.
TEST(E2EUx, EvalFractionHoldsOutExamples) {
  const fs::path dir = work_root("e2e") / "fraction";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 1, 0);
  auto run_once = [&](const std::string& tag) {
    return run_q4train(
        {"--config", cfg.string(), "--set", "data.eval_fraction=0.25", "--set", "eval.prompts=[]",
         "--set", "output.export_path=none", "--set", "output.dir=" + (dir / tag).string()},
        dir / tag);
  };
  const auto a = run_once("a");
  ASSERT_EQ(a.code, 0) << a.err;
  EXPECT_TRUE(has(a.out, "validation: 2 examples (2 held out")) << a.out;
  EXPECT_TRUE(has(a.out, "  data       6 examples")) << a.out;
  // One held-out example is one example.
  const auto one =
      run_q4train({"--config", cfg.string(), "--set", "data.eval_fraction=0.1", "--set",
                   "eval.prompts=[]", "--set", "output.export_path=none", "--set",
                   "output.dir=" + (dir / "one").string(), "--set", "train.steps=1"},
                  dir / "one");
  ASSERT_EQ(one.code, 0) << one.err;
  EXPECT_TRUE(has(one.out, "validation: 1 example (1 held out")) << one.out;
  EXPECT_TRUE(has(one.out, "; validation 1 example\n")) << one.out;
  const auto b = run_once("b");
  ASSERT_EQ(b.code, 0) << b.err;
  const auto ma = read_jsonl(dir / "a" / "metrics.jsonl");
  const auto mb = read_jsonl(dir / "b" / "metrics.jsonl");
  ASSERT_EQ(ma.size(), 2u);
  EXPECT_EQ(ma[0]["val_loss"], mb[0]["val_loss"]);
  EXPECT_EQ(ma[1]["val_loss"], mb[1]["val_loss"]);
  const auto bad =
      run_q4train({"--config", cfg.string(), "--set", "data.eval_fraction=0.5"}, dir / "bad");
  EXPECT_EQ(bad.code, 2);
  EXPECT_TRUE(has(bad.err, "data.eval_fraction")) << bad.err;
}

// A short smoke run just works: warmup (3) longer than the run (2) is clipped with a note. The
// config path may be given positionally (not together with --config).
TEST(E2EUx, WarmupIsClippedAndConfigMayBePositional) {
  const fs::path dir = work_root("e2e") / "smoke";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 2, 0);
  const auto r = run_q4train(
      {cfg.string(), "--set", "eval.prompts=[]", "--set", "output.export_path=none"}, dir / "a");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(has(r.out, "warmup_steps 3 is longer than the run (train.steps 2); clipped to 2"))
      << r.out;
  const auto both = run_q4train({cfg.string(), "--config", cfg.string()}, dir / "b");
  EXPECT_EQ(both.code, 2);
  EXPECT_EQ(lines_of(both.err), 1) << both.err;
}

// A fresh run refuses a non-empty output.dir (one line naming it and --overwrite); --overwrite
// removes the previous run's files and keeps the user's. A run that fails in set-up leaves no
// directory behind, so the corrected command needs no --overwrite.
TEST(E2EUx, FreshRunRefusesANonEmptyDirectoryUnlessOverwrite) {
  const fs::path dir = work_root("e2e") / "overwrite";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 1, 1);
  const std::vector<std::string> args = {"--config", cfg.string(), "--set", "eval.prompts=[]"};
  auto r = run_q4train(args, dir / "a");
  ASSERT_EQ(r.code, 0) << r.err;
  write_text(dir / "run" / "notes.txt", "mine");
  r = run_q4train(args, dir / "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(lines_of(r.err), 1) << r.err;
  EXPECT_TRUE(has(r.err, (dir / "run").string() + " is not empty")) << r.err;
  EXPECT_TRUE(has(r.err, "--overwrite")) << r.err;
  EXPECT_TRUE(has(r.err, "--resume")) << r.err;  // it holds a checkpoint
  auto with = args;
  with.push_back("--overwrite");
  with.insert(with.end(),
              {"--set", "output.checkpoint_every=0", "--set", "output.checkpoint_minutes=0"});
  r = run_q4train(with, dir / "c");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_text(dir / "run" / "notes.txt"), "mine");
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000001"));
  EXPECT_EQ(read_jsonl(dir / "run" / "metrics.jsonl").size(), 1u);
  // Set-up fails (no examples): nothing is left, and the fixed command runs as a fresh run.
  write_text(dir / "empty.tsv", "# nothing\n");
  const std::string failed = "output.dir=" + (dir / "failed").string();
  r = run_q4train({"--config", cfg.string(), "--set", failed, "--set",
                   "data.files=[" + (dir / "empty.tsv").string() + "]"},
                  dir / "d");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_FALSE(fs::exists(dir / "failed")) << "a failed set-up left files";
}

// model.device: cuda without CUDA: one line naming the fix, before anything is written.
TEST(E2EUx, CudaDeviceWithoutCudaIsOneLineAndWritesNothing) {
  if (at::hasCUDA()) GTEST_SKIP() << "CUDA is available here";
  const fs::path dir = work_root("e2e") / "nocuda";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 1, 0);
  const auto r = run_q4train({"--config", cfg.string(), "--set", "model.device=cuda"}, dir / "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_EQ(lines_of(r.err), 1) << r.err;
  EXPECT_TRUE(has(r.err, "model.device")) << r.err;
  EXPECT_TRUE(has(r.err, "set model.device: cpu")) << r.err;
  EXPECT_LT(r.err.size(), 400u) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run"));
}

// --resume DIR --export-only: the checkpoint's model exported (byte-identical to the run's own
// export of the same step), nothing else changed; without --resume it is a usage error.
TEST(E2EUx, ExportOnlyFromACheckpoint) {
  const fs::path base = base_dir();
  ASSERT_TRUE(fs::exists(base / "COMPLETE")) << read_text(base / "base.err");
  const fs::path dir = work_root("e2e") / "exportonly";
  copy_run(base, dir);
  fs::remove(dir / "run" / "model.dat");
  const std::string metrics = read_text(dir / "run" / "metrics.jsonl");
  auto r = run_q4train({"--resume", (dir / "run").string(), "--export-only", "--set",
                        "output.dir=" + (dir / "run").string()},
                       dir / "a");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(read_text(dir / "run" / "model.dat") == read_text(base / "run" / "model.dat"))
      << "export differs";
  EXPECT_EQ(read_text(dir / "run" / "metrics.jsonl"), metrics);
  r = run_q4train({"--config", (dir / "run" / "config.yaml").string(), "--export-only"}, dir / "b");
  EXPECT_EQ(r.code, 2);
  EXPECT_TRUE(has(r.err, "--export-only needs --resume")) << r.err;
}

// Resuming with a changed LR schedule is refused naming the keys, unless asked for.
TEST(E2EUx, ResumeRefusesAChangedSchedule) {
  const fs::path base = base_dir();
  ASSERT_TRUE(fs::exists(base / "COMPLETE")) << read_text(base / "base.err");
  const fs::path dir = work_root("e2e") / "schedule";
  copy_run(base, dir);
  const std::string out_dir = "output.dir=" + (dir / "run").string();
  const std::string ck = (dir / "run" / "step_000040").string();
  const std::string config_before = read_text(dir / "run" / "config.yaml");
  auto r = run_q4train(
      {"--resume", ck, "--set", out_dir, "--set", "train.steps=41", "--set", "optim.lr=0.02"},
      dir / "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(has(r.err, "train.steps 40 -> 41")) << r.err;
  EXPECT_TRUE(has(r.err, "optim.lr 0.01 -> 0.02")) << r.err;
  EXPECT_TRUE(has(r.err, "--allow-schedule-change")) << r.err;
  EXPECT_EQ(read_text(dir / "run" / "config.yaml"), config_before);  // nothing written
  r = run_q4train({"--resume", ck, "--set", out_dir, "--set", "train.steps=41", "--set",
                   "eval.prompts=[]", "--allow-schedule-change"},
                  dir / "b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_jsonl(dir / "run" / "metrics.jsonl").size(), 41u);
}

}  // namespace q4::test::e2e_ux_test
