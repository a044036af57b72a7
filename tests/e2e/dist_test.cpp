// Data-parallel runs on CPU (Gloo), through `q4train --nproc 2`: the same loss curve as one
// process with the same global batch, exact resume of a two-rank checkpoint, resharding onto one
// rank, master broadcasts overlapped with the next step yet seen by every reader, and failure
// behaviour (a dead or hung rank ends the job with an error; a bad config
// fails before any rank starts). Tiny random Qwen3 with the real tokenizer, a few steps each.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "e2e_util.h"
#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/memorize_set.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/distributed/distributed.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::dist_test {

namespace {

using namespace q4::test;

// The memorized set and two more pairs.
const std::string kData = kMemorizeTsv + "What is 3 + 4?\t7.\nName a fruit.\tApple.\n";

// Per-rank batch 2; `accum` micro-batches per step and rank. Two layers so that several
// parameters of each kind exist to be spread over the ranks.
fs::path write_config(const fs::path& dir, int64_t steps, int64_t accum, int64_t checkpoint_every) {
  TinyRun t;
  t.layers = 2;
  t.data = kData;
  t.model_extra = "  master_dtype: fp16\n";
  t.trainable = "{layers: all, projections: true, norms: true, lm_head: true, embeddings: true}";
  t.steps = steps;
  t.seq_len = 48;
  t.train_extra = "  grad_accum: " + std::to_string(accum) + "\n  max_grad_norm: 0.5\n";
  t.optim =
      "  lr: 1.0e-2\n  state: int8\n  schedule: {kind: cosine, warmup_steps: 2, min_lr_ratio: "
      "0.1}\n";
  t.data_extra = "  packing: false\n";
  t.eval = "  prompts: [你是谁？]\n  max_new_tokens: 8\n";
  t.output_extra = "  checkpoint_every: " + std::to_string(checkpoint_every) +
                   "\n  keep: 5\n  verify_export: false\n";
  t.log = "  every: 1\n  tensorboard: false\n  report: false\n";
  return t.write(dir);
}

// A q4train run (q4::e2e::Result) and its wall time.
struct TimedRun : Result {
  double seconds = 0;
};

TimedRun run(const std::vector<std::string>& args, const fs::path& log_prefix,
             const std::string& env = "") {
  const auto t0 = std::chrono::steady_clock::now();
  TimedRun r;
  static_cast<Result&>(r) =
      run_captured(env + (env.empty() ? "" : " ") + kQ4train + quoted(args),
                   log_prefix.string() + ".out", log_prefix.string() + ".err");
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

constexpr int64_t kSteps = 8;
constexpr const char* kTimeout = "--dist-timeout";

// Two ranks of the base config in a fresh `dir`, the fault `fault` injected (Q4_FAULT), with
// --dist-timeout `timeout` seconds.
TimedRun run_with_fault(const fs::path& dir, const std::string& fault, const std::string& timeout) {
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, kSteps, 1, 0);
  return run({"--config", cfg.string(), "--nproc", "2", kTimeout, timeout}, dir / "log",
             "Q4_FAULT=" + fault);
}

// Relative tolerance of a one-rank vs two-rank loss. The trained weights are the same: one rank
// adds the two micro-batches' gradients, two ranks reduce the same two addends (commutative, so
// bit-identical), and the stochastic-rounding stream of a parameter is its model index on every
// layout. What differs is the loss read-out: one rank keeps one running fp32 sum over its
// micro-batches, two ranks add two fp32 sums in double, about 1e-8 relative apart (measured
// 4e-8 at most). A wrong data split or a missing reduction moves the loss by percent. The
// global norm's double sum runs in another order, so it may differ in its last bits only.
constexpr double kRankTolerance = 1e-6;

void expect_same_curve(const std::vector<nlohmann::json>& got,
                       const std::vector<nlohmann::json>& want, double rel_tol,
                       const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(got[i]["step"], want[i]["step"]) << what;
    EXPECT_EQ(got[i]["tokens"], want[i]["tokens"]) << what << " step " << i + 1;
    const double a = got[i]["loss"].get<double>(), b = want[i]["loss"].get<double>();
    EXPECT_LE(std::fabs(a - b), rel_tol * std::fabs(b))
        << what << " step " << i + 1 << ": " << a << " vs " << b;
    const double ga = got[i]["grad_norm"].get<double>(), gb = want[i]["grad_norm"].get<double>();
    EXPECT_LE(std::fabs(ga - gb), 1e-12 * std::fabs(gb)) << what << " step " << i + 1;
  }
}

// The loss curves of a run on two ranks (grad_accum 1) and of the same run on one rank with
// grad_accum 2 (the same global batch). `args(name, accum)` writes the run's files under
// dir/<name> and returns its arguments; both runs must succeed.
using ArgsOf = std::function<std::vector<std::string>(const std::string& name, int64_t accum)>;
struct RankCurves {
  std::vector<nlohmann::json> two, one;
};
void run_on_two_ranks_and_one(const fs::path& dir, const std::string& two_name,
                              const std::string& one_name, const ArgsOf& args, RankCurves* out) {
  auto two_args = args(two_name, 1);
  two_args.insert(two_args.end(), {"--nproc", "2", kTimeout, "60"});
  const TimedRun r2 = run(two_args, dir / two_name / "log");
  ASSERT_EQ(r2.code, 0) << r2.err << r2.out;
  const TimedRun r1 = run(args(one_name, 2), dir / one_name / "log");
  ASSERT_EQ(r1.code, 0) << r1.err << r1.out;
  out->two = read_jsonl(dir / two_name / "run" / "metrics.jsonl");
  out->one = read_jsonl(dir / one_name / "run" / "metrics.jsonl");
}

// The two-rank base run (8 steps, checkpoint every 4), shared by the tests below. ctest runs each
// test in its own process, several at once: the run is made once per q4train binary under a file
// lock, and a COMPLETE stamp marks it done.
fs::path two_rank_base() {
  const fs::path d = work_root("dist") / "two";
  const int lock = ::open((work_root("dist") / "two.lock").c_str(), O_CREAT | O_RDWR, 0644);
  ::flock(lock, LOCK_EX);
  const std::string stamp =
      std::to_string(fs::last_write_time(kQ4train).time_since_epoch().count());
  if (!fs::exists(d / "COMPLETE") || read_text(d / "COMPLETE") != stamp) {
    q4::io::remove_tree(d);
    const auto cfg = write_config(d, kSteps, 1, 4);
    const TimedRun r = run({"--config", cfg.string(), "--nproc", "2", kTimeout, "60"}, d / "log");
    EXPECT_EQ(r.code, 0) << r.err << r.out;
    if (r.code == 0) write_text(d / "COMPLETE", stamp);
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  return d;
}

// A copy of the base run cut back to its step-4 checkpoint (later checkpoint and export removed)
// in `dir`, resumed from there with `extra` arguments.
TimedRun resume_copy_at_step_4(const fs::path& base, const fs::path& dir,
                               const std::vector<std::string>& extra) {
  copy_run(base, dir);
  q4::io::remove_tree(dir / "run" / "step_000008");
  fs::remove(dir / "run" / "model.dat");
  std::vector<std::string> args = {"--resume", (dir / "run" / "step_000004").string(), "--set",
                                   "output.dir=" + (dir / "run").string()};
  args.insert(args.end(), extra.begin(), extra.end());
  return run(args, dir / "log");
}

}  // namespace

TEST(DataParallel, OwnersAreBalancedAndDeterministic) {
  const std::vector<int64_t> numels = {100, 10, 10, 10, 10, 60, 5};
  const auto a = q4::trainer::assign_owners(numels, 2);
  EXPECT_EQ(a, q4::trainer::assign_owners(numels, 2));
  int64_t load[2] = {0, 0};
  for (size_t i = 0; i < numels.size(); ++i) load[a[i]] += numels[i];
  EXPECT_EQ(load[0] + load[1], 205);
  EXPECT_LE(std::abs(load[0] - load[1]), 10);
  for (int o : q4::trainer::assign_owners(numels, 1)) EXPECT_EQ(o, 0);
  // More ranks than tensors: some ranks own nothing, each tensor has one owner.
  const auto many = q4::trainer::assign_owners({3, 2}, 4);
  EXPECT_NE(many[0], many[1]);
}

TEST(DataParallel, EnvironmentIsCheckedNamingTheVariable) {
  ::setenv("RANK", "0", 1);
  ::unsetenv("WORLD_SIZE");
  try {
    q4::trainer::world_from_env();
    ADD_FAILURE() << "RANK without WORLD_SIZE accepted";
  } catch (const q4::trainer::ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("WORLD_SIZE"), std::string::npos) << e.what();
  }
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("RANK", "2", 1);
  EXPECT_THROW(q4::trainer::world_from_env(), q4::trainer::ConfigError);
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29511", 1);
  const auto w = q4::trainer::world_from_env();
  EXPECT_EQ(w.rank, 1);
  EXPECT_EQ(w.world_size, 2);
  EXPECT_EQ(w.master_port, 29511);
  for (const char* v : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(v);
  EXPECT_FALSE(q4::trainer::world_from_env().distributed());
}

TEST(DataParallel, TwoRanksTrackOneRankWithTheSameGlobalBatch) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path two = two_rank_base();
  ASSERT_TRUE(fs::exists(two / "run" / "model.dat")) << read_text(two / "log.err");
  // One process with grad_accum 2 takes the same four sequences per step in the same order.
  const fs::path one = work_root("dist") / "one";
  q4::io::remove_tree(one);
  const auto cfg = write_config(one, kSteps, 2, 0);
  const TimedRun r = run({"--config", cfg.string()}, one / "log");
  ASSERT_EQ(r.code, 0) << r.err;
  expect_same_curve(read_jsonl(two / "run" / "metrics.jsonl"),
                    read_jsonl(one / "run" / "metrics.jsonl"), kRankTolerance, "2 ranks vs 1");
  // Both ranks wrote their shard; rank 0 the rest.
  const fs::path ck = two / "run" / "step_000004";
  EXPECT_TRUE(fs::exists(ck / "optim-00000-of-00002.state"));
  EXPECT_TRUE(fs::exists(ck / "optim-00001-of-00002.state"));
  EXPECT_TRUE(fs::exists(ck / "DONE"));
  EXPECT_NE(read_text(two / "log.out").find("data parallel: 2 ranks (gloo)"), std::string::npos)
      << read_text(two / "log.out");
}

// Distillation on two ranks: each rank runs its own teacher copy (online) or reads the same
// top-K file (offline) on its micro-batches, and the curve is the one-rank run's with the same
// global batch. The teacher is the base run's export.
TEST(DataParallel, DistillationOnTwoRanksTracksOneRank) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path two = two_rank_base();
  const std::string teacher = (two / "run" / "model.dat").string();
  ASSERT_TRUE(fs::exists(teacher)) << read_text(two / "log.err");
  const fs::path dir = work_root("dist") / "distill";
  q4::io::remove_tree(dir);
  const std::string topk = (dir / "topk.dat").string();
  const auto config = [&](const std::string& name, int64_t accum) {
    return write_config(dir / name, 4, accum, 0).string();
  };
  const auto distill = [&](const std::string& cfg, bool offline) {
    std::vector<std::string> a = {
        "--config", cfg, "--set", "train.objective=distill", "--set", "distill.alpha=0.5"};
    a.push_back("--set");
    a.push_back(offline ? "distill.topk_file=" + topk : "distill.teacher=" + teacher);
    return a;
  };
  const std::string writer_cfg = config("writer", 2);
  auto w = distill(writer_cfg, true);
  w.insert(w.end(), {"--set", "distill.teacher=" + teacher, "--write-teacher-topk"});
  const TimedRun written = run(w, dir / "writer" / "log");
  ASSERT_EQ(written.code, 0) << written.err << written.out;
  for (const bool offline : {false, true}) {
    const std::string mode = offline ? "offline" : "online";
    const auto args = [&](const std::string& name, int64_t accum) {
      return distill(config(name, accum), offline);
    };
    RankCurves c;
    ASSERT_NO_FATAL_FAILURE(run_on_two_ranks_and_one(dir, mode + "2", mode + "1", args, &c));
    expect_same_curve(c.two, c.one, kRankTolerance, mode + ": 2 ranks vs 1");
    ASSERT_FALSE(c.two.empty());
    EXPECT_TRUE(c.two.front().contains("distill_divergence")) << c.two.front().dump();
  }
}

// LoRA adapters train data parallel: the curve on two ranks is the one-rank run's with the same
// global batch, and rank 0 writes the merged export and the PEFT adapter.
TEST(DataParallel, LoraOnTwoRanksTracksOneRank) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path dir = work_root("dist") / "lora";
  q4::io::remove_tree(dir);
  const auto lora = [&](const std::string& name, int64_t accum) {
    return std::vector<std::string>{"--config", write_config(dir / name, 4, accum, 0).string(),
                                    "--set",    "train.method=lora",
                                    "--set",    "lora.rank=4"};
  };
  RankCurves c;
  ASSERT_NO_FATAL_FAILURE(run_on_two_ranks_and_one(dir, "two", "one", lora, &c));
  expect_same_curve(c.two, c.one, kRankTolerance, "lora: 2 ranks vs 1");
  EXPECT_TRUE(fs::exists(dir / "two" / "run" / "model-adapter" / "adapter_model.safetensors"));
}

// Preference tuning data parallel: each rank trains whole pairs (one a micro-batch here) and the
// loss is the mean over the global step's pairs, so two ranks follow one rank with the same
// global batch; the reference pass runs on every rank and rank 0 writes the run's file.
TEST(DataParallel, PreferenceOnTwoRanksTracksOneRank) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path dir = work_root("dist") / "preference";
  q4::io::remove_tree(dir);
  const auto pref = [&](const std::string& name, int64_t accum) {
    const fs::path cfg = write_config(dir / name, 4, accum, 0);
    write_text(dir / name / "pairs.jsonl", kTinyPairsJsonl);
    return std::vector<std::string>{
        "--config", cfg.string(),
        "--set",    "train.objective=preference",
        "--set",    "data.files=[" + (dir / name / "pairs.jsonl").string() + "]",
        "--set",    "eval.prompts=[]"};
  };
  RankCurves c;
  ASSERT_NO_FATAL_FAILURE(run_on_two_ranks_and_one(dir, "two", "one", pref, &c));
  const auto& two = c.two;
  const auto& one = c.one;
  expect_same_curve(two, one, kRankTolerance, "preference: 2 ranks vs 1");
  ASSERT_FALSE(two.empty());
  ASSERT_TRUE(two.back().contains("rewards/margins"));
  EXPECT_NEAR(two.back()["rewards/margins"].get<double>(),
              one.back()["rewards/margins"].get<double>(), 1e-5);
  EXPECT_TRUE(fs::exists(dir / "two" / "run" / "reference_logprobs.dat"));
}

// GRPO on two ranks (docs/multi-gpu.md#grpo): every rank takes the same generation batch, samples
// and scores its half of the prompts (each completion's sampler seeded by its row in the batch),
// and the rewards are gathered for the advantages and the logs. Against one process with
// grad_accum 2 (the same prompts): the same completions and rewards (exactly: each row draws
// from its own generator, and a row's logits do not depend on the rows beside it here, where
// the prompts have the same length), the same trained micro-batches, so the loss within
// kRankTolerance and the gradient norm within 1e-5 relative, for each loss_type's
// normalisation. (Measured by hand: gradient norms 1e-7 relative apart and the exports a few
// bytes apart; why they are not bit-identical as the supervised runs' is not known yet.)
TEST(DataParallel, GrpoOnTwoRanksTracksOneRank) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  for (const std::string loss_type : {"dapo", "grpo", "dr_grpo"}) {
    const fs::path dir = work_root("dist") / ("grpo_" + loss_type);
    q4::io::remove_tree(dir);
    RankCurves c;
    run_on_two_ranks_and_one(dir, "two", "one", [&](const std::string& name, int64_t accum) {
      TinyRun t;
      t.layers = 2;
      t.data_file = "prompts.jsonl";
      t.data =
          "{\"prompt\": \"Pick a color.\"}\n{\"prompt\": \"Pick a fruit.\"}\n"
          "{\"prompt\": \"Pick a tree.\"}\n{\"prompt\": \"Pick a bird.\"}\n"
          "{\"prompt\": \"Pick a fish.\"}\n{\"prompt\": \"Pick a city.\"}\n";
      t.trainable = "{layers: all, projections: true, norms: true, lm_head: true}";
      t.steps = 3;
      t.batch_size = 4;
      t.seq_len = 32;
      t.train_extra = "  objective: grpo\n  grad_accum: " + std::to_string(accum) + "\n";
      t.optim = "  lr: 2.0e-2\n  state: fp32\n  weight_decay: 0.0\n";
      t.data_extra = "  packing: false\n";
      t.output_extra = "  checkpoint_every: 0\n  verify_export: false\n";
      t.log = "  every: 1\n  tensorboard: false\n  report: false\n"
              "grpo:\n  num_generations: 4\n  max_completion_length: 6\n  loss_type: " +
              loss_type +
              "\nreward:\n  functions:\n    - {name: e, kind: regex, pattern: 'e'}\n"
              "    - {name: digit, kind: regex, pattern: '[0-9]', weight: 0.5}\n";
      return config_args(t.write(dir / name));
    }, &c);
    ASSERT_EQ(c.two.size(), 3u) << loss_type;
    ASSERT_EQ(c.one.size(), 3u) << loss_type;
    double advantage_steps = 0;
    for (size_t i = 0; i < c.one.size(); ++i) {
      const auto& a = c.two[i];
      const auto& b = c.one[i];
      for (const char* k : {"reward", "reward_std", "rewards/e/mean", "rewards/digit/mean",
                            "frac_reward_zero_std", "completions/mean_length", "tokens"}) {
        EXPECT_EQ(a.at(k), b.at(k)) << loss_type << " step " << i + 1 << " " << k;
      }
      const double la = a.at("loss").get<double>(), lb = b.at("loss").get<double>();
      EXPECT_LE(std::fabs(la - lb), kRankTolerance * std::fabs(lb) + 1e-12)
          << loss_type << " step " << i + 1 << ": " << la << " vs " << lb;
      EXPECT_NEAR(a.at("clip_ratio").get<double>(), b.at("clip_ratio").get<double>(), 1e-12);
      const double ga = a.at("grad_norm").get<double>(), gb = b.at("grad_norm").get<double>();
      EXPECT_LE(std::fabs(ga - gb), 1e-5 * std::fabs(gb) + 1e-12) << loss_type << " step " << i + 1;
      if (b.at("frac_reward_zero_std").get<double>() < 1) ++advantage_steps;
    }
    EXPECT_GT(advantage_steps, 0) << loss_type << ": no step had a non-zero advantage";
  }
}

TEST(DataParallel, TwoRankResumeEqualsTheUninterruptedRun) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path base = two_rank_base();
  ASSERT_TRUE(fs::exists(base / "run" / "model.dat")) << read_text(base / "log.err");
  const fs::path dir = work_root("dist") / "resume2";
  const TimedRun r = resume_copy_at_step_4(base, dir, {"--nproc", "2", kTimeout, "60"});
  ASSERT_EQ(r.code, 0) << r.err;
  // Same world size on CPU: bit-identical.
  ASSERT_NO_FATAL_FAILURE(expect_same_steps(base / "run" / "metrics.jsonl",
                                            dir / "run" / "metrics.jsonl", {"loss", "grad_norm"}));
  EXPECT_EQ(read_text(dir / "run" / "model.dat"), read_text(base / "run" / "model.dat"));
}

TEST(DataParallel, TwoRankCheckpointResumesOnOneRank) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path base = two_rank_base();
  ASSERT_TRUE(fs::exists(base / "run" / "model.dat")) << read_text(base / "log.err");
  const fs::path dir = work_root("dist") / "reshard";
  const TimedRun r = resume_copy_at_step_4(base, dir, {});
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("continues on 1 rank(s) with grad_accum 2"), std::string::npos) << r.out;
  expect_same_curve(read_jsonl(dir / "run" / "metrics.jsonl"),
                    read_jsonl(base / "run" / "metrics.jsonl"), kRankTolerance,
                    "resumed on 1 rank vs 2 ranks");
}

// The owners' master broadcasts are left in flight at the end of a step and waited for by each
// master's next reader. With bf16 masters Gloo carries a broadcast widened to fp32 and writes the
// master back only when the broadcast is waited for, so a reader without its wait (the next
// forward, the eval, the checkpoint, the export, the first forward after a resume's broadcast)
// would see the old value, deterministically. Two ranks give one rank's curve and, byte for
// byte, its export; the two-rank checkpoint of step 2 resumed on two ranks gives the
// uninterrupted run's losses and export bit for bit.
TEST(DataParallel, OverlappedMasterBroadcastsReachEveryReader) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path dir = work_root("dist") / "bf16";
  q4::io::remove_tree(dir);
  const auto with = [](const fs::path& cfg, std::vector<std::string> extra) {
    std::vector<std::string> a = {"--config", cfg.string(), "--set", "model.master_dtype=bf16"};
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  const TimedRun two =
      run(with(write_config(dir / "two", 4, 1, 2), {"--nproc", "2", kTimeout, "60"}),
          dir / "two" / "log");
  ASSERT_EQ(two.code, 0) << two.err << two.out;
  const TimedRun one = run(with(write_config(dir / "one", 4, 2, 0), {}), dir / "one" / "log");
  ASSERT_EQ(one.code, 0) << one.err << one.out;
  const auto curve = read_jsonl(dir / "two" / "run" / "metrics.jsonl");
  expect_same_curve(curve, read_jsonl(dir / "one" / "run" / "metrics.jsonl"), kRankTolerance,
                    "bf16 masters: 2 ranks vs 1");
  const std::string exported = read_text(dir / "two" / "run" / "model.dat");
  ASSERT_FALSE(exported.empty());
  EXPECT_TRUE(exported == read_text(dir / "one" / "run" / "model.dat"))
      << "the two-rank export differs from the one-rank export";

  const fs::path resumed = dir / "resumed";
  fs::create_directories(resumed);
  fs::copy(dir / "two" / "run", resumed / "run", fs::copy_options::recursive);
  q4::io::remove_tree(resumed / "run" / "step_000004");
  fs::remove(resumed / "run" / "model.dat");
  const TimedRun r =
      run({"--resume", (resumed / "run" / "step_000002").string(), "--set",
           "output.dir=" + (resumed / "run").string(), "--nproc", "2", kTimeout, "60"},
          resumed / "log");
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  ASSERT_NO_FATAL_FAILURE(expect_same_steps(dir / "two" / "run" / "metrics.jsonl",
                                            resumed / "run" / "metrics.jsonl", {"loss"}));
  EXPECT_TRUE(read_text(resumed / "run" / "model.dat") == exported)
      << "the resumed export differs from the uninterrupted run's";
}

TEST(DataParallel, ADeadRankEndsTheJobWithAnError) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path dir = work_root("dist") / "dead";
  const TimedRun r = run_with_fault(dir, "exit:1:3", "20");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.err.find("rank 1 exited with code 9"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 60.0);
  EXPECT_FALSE(fs::exists(dir / "run" / "model.dat"));
}

TEST(DataParallel, AHungRankTimesOutTheOthers) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const TimedRun r = run_with_fault(work_root("dist") / "hung", "hang:1:3", "5");
  EXPECT_NE(r.code, 0);
  // Rank 0 fails in a collective after the timeout, naming itself; the launcher then stops the
  // hung rank.
  EXPECT_NE(r.err.find("rank 0"), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 90.0);
}

TEST(DataParallel, ABadConfigFailsBeforeAnyRankStarts) {
  const fs::path dir = work_root("dist") / "badcfg";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, kSteps, 1, 0);
  TimedRun r =
      run({"--config", cfg.string(), "--nproc", "2", "--set", "train.setps=3"}, dir / "log");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("train.setps"), std::string::npos) << r.err;
  // Under torchrun every rank reads the config before the rendezvous: it fails at once instead
  // of waiting for the others.
  r = run({"--config", cfg.string(), "--set", "train.setps=3", kTimeout, "60"}, dir / "log2",
          "RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=1");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("rank 1: "), std::string::npos) << r.err;
  EXPECT_LT(r.seconds, 30.0);
  EXPECT_FALSE(fs::exists(dir / "run"));
}

}  // namespace q4::test::dist_test
