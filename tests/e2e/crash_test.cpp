// Crash test: q4train is killed with SIGKILL at a random moment of a run that
// checkpoints and exports after every step; then the last complete checkpoint must resume (or,
// with none, a fresh start must run) to the same losses and the same exported bytes as an
// uninterrupted run, and no temp file may survive the restart. Trials: Q4_CRASH_TRIALS (default
// 3 in CI; the nightly size is 20 or more), kill times from Q4_CRASH_SEED (default 1).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::crash_test {
using Clock = std::chrono::steady_clock;

namespace {

using namespace q4::test;

constexpr int kSteps = 6;

fs::path root() {
  return fs::temp_directory_path() /
         ("q4_crash_" + std::to_string(::getuid()) + "_" + std::to_string(::getpid()));
}

// Model, data and config in `dir`; the run goes to dir/run. lm_head trains, so checkpoints hold
// a 151936 x 32 master and every checkpoint and export writes megabytes.
void setup(const fs::path& dir) {
  TinyRun t;
  t.trainable = "{layers: all, projections: true, norms: true, lm_head: true}";
  t.steps = kSteps;
  t.output_extra = "  checkpoint_every: 1\n  export_every: 1\n  keep: 2\n  verify_export: false\n";
  t.write(fresh_dir(dir));
}

// Runs q4train to the end; returns its exit code.
int run_to_end(const fs::path& dir, const std::vector<std::string>& args, const std::string& tag) {
  const std::string out = (dir / (tag + ".out")).string();
  return exit_code(std::system((kQ4train + quoted(args) + " >" + out + " 2>&1").c_str()));
}

// step -> loss (as printed in metrics.jsonl, exact).
std::map<int64_t, std::string> losses(const fs::path& metrics) {
  std::map<int64_t, std::string> out;
  for (const auto& j : read_jsonl(metrics)) out[j.at("step").get<int64_t>()] = j.at("loss").dump();
  return out;
}

std::vector<std::string> temp_files(const fs::path& dir) { return files_named(dir, ".tmp."); }

TEST(CrashTest, KillNineThenResumeIsBitIdentical) {
  const int trials = std::getenv("Q4_CRASH_TRIALS") ? std::atoi(std::getenv("Q4_CRASH_TRIALS")) : 3;
  const unsigned seed = std::getenv("Q4_CRASH_SEED") ? std::atoi(std::getenv("Q4_CRASH_SEED")) : 1;
  const fs::path base = root();
  // Reference: the uninterrupted run, timed.
  const fs::path ref = base / "ref";
  setup(ref);
  const auto t0 = Clock::now();
  ASSERT_EQ(run_to_end(ref, {"--config", (ref / "config.yaml").string()}, "ref"), 0)
      << read_text(ref / "ref.out");
  const double total_ms = std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
  const auto ref_losses = losses(ref / "run" / "metrics.jsonl");
  const std::string ref_export = read_text(ref / "run" / "model.dat");
  ASSERT_EQ(ref_losses.size(), static_cast<size_t>(kSteps));

  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> when(0.15, 0.95);
  int resumed = 0;
  for (int t = 0; t < trials; ++t) {
    const fs::path dir = base / ("trial" + std::to_string(t));
    setup(dir);
    const auto kill_ms = static_cast<int64_t>(when(rng) * total_ms);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      const std::string out = (dir / "killed.out").string();
      if (!std::freopen(out.c_str(), "w", stdout) || !std::freopen(out.c_str(), "a", stderr)) {
        ::_exit(126);
      }
      const std::string cfg = (dir / "config.yaml").string();
      ::execl(kQ4train.c_str(), kQ4train.c_str(), "--config", cfg.c_str(),
              static_cast<char*>(nullptr));
      ::_exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(kill_ms));
    ::kill(pid, SIGKILL);
    int status = 0;
    ::waitpid(pid, &status, 0);
    SCOPED_TRACE("trial " + std::to_string(t) + ", killed after " + std::to_string(kill_ms) +
                 " ms of " + std::to_string(static_cast<int64_t>(total_ms)));
    // Restart: resume the newest complete checkpoint, or start afresh when there is none.
    bool has_checkpoint = false;
    if (fs::exists(dir / "run")) {
      for (const auto& e : fs::directory_iterator(dir / "run")) {
        has_checkpoint |= fs::exists(e.path() / "DONE");
      }
    }
    const std::vector<std::string> args =
        has_checkpoint
            ? std::vector<std::string>{"--resume", (dir / "run").string()}
            : std::vector<std::string>{"--config", (dir / "config.yaml").string(), "--overwrite"};
    resumed += has_checkpoint;
    ASSERT_EQ(run_to_end(dir, args, "restart"), 0) << read_text(dir / "restart.out");
    EXPECT_TRUE(temp_files(dir / "run").empty()) << temp_files(dir / "run").front();
    EXPECT_EQ(losses(dir / "run" / "metrics.jsonl"), ref_losses) << read_text(dir / "restart.out");
    EXPECT_TRUE(read_text(dir / "run" / "model.dat") == ref_export) << "export differs";
    if (!::testing::Test::HasFailure()) q4::io::remove_tree(dir);
  }
  std::cout << "crash test: " << trials << " trials, " << resumed << " resumed a checkpoint, "
            << (trials - resumed) << " restarted afresh\n";
  if (!::testing::Test::HasFailure()) q4::io::remove_tree(base);
}

}  // namespace

}  // namespace q4::test::crash_test
