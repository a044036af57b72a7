// build/bin/q4chat end to end on CPU: a tiny random model (real vocabulary, q4dat init) with the
// real Qwen3 tokenizer; one-shot greedy and seeded sampling, interactive turns on stdin, and
// usage errors (exit 2).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "q4/io/remove_tree.h"
#include "q4/test/process.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

namespace {

const std::string kBin = Q4_BIN_DIR;
const std::string kTokenizer = Q4_SOURCE_DIR "/assets/qwen3/tokenizer.json";

using q4::test::Result;

Result run(const std::string& cmd) { return q4::test::run_piped(cmd); }

class Q4chatTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fs::path(::testing::TempDir()) / ("q4chat_e2e_" + std::to_string(::getpid()));
    q4::io::remove_tree(dir_);
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << q4::test::tiny_model_config(1);
    init_rc_ = run(kBin + "/q4dat init --config " + (dir_ / "config.json").string() + " --out " +
                   (dir_ / "model.dat").string() + " --seed 3 --std 0.3 2>&1")
                   .code;
  }
  static void TearDownTestSuite() { q4::io::remove_tree(dir_); }
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kTokenizer))
        << "missing " << kTokenizer << ": run tools/fetch_tokenizer.sh";
    ASSERT_EQ(init_rc_, 0) << "q4dat init failed";
  }
  static std::string chat(const std::string& args) {
    return kBin + "/q4chat --model " + (dir_ / "model.dat").string() + " --tokenizer " +
           kTokenizer + " --quiet " + args;
  }
  static fs::path dir_;
  static int init_rc_;
};
fs::path Q4chatTest::dir_;
int Q4chatTest::init_rc_ = -1;

TEST_F(Q4chatTest, OneShotGreedyPrintsTextAndIsDeterministic) {
  const auto a = run(chat("--prompt 'Who are you?' --temperature 0 --max-new-tokens 8"));
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_GT(a.out.size(), 1u) << "no text printed";
  const auto b = run(chat("--prompt 'Who are you?' --temperature 0 --max-new-tokens 8"));
  EXPECT_EQ(a.out, b.out);
}

TEST_F(Q4chatTest, SeededSamplingIsReproducible) {
  const std::string args =
      "--prompt hi --system 'Be nice.' --temperature 1 --top-k 40 --top-p 0.9 "
      "--repetition-penalty 1.1 --max-new-tokens 8 --seed ";
  const auto a = run(chat(args + "7"));
  const auto b = run(chat(args + "7"));
  ASSERT_EQ(a.code, 0) << a.out;
  EXPECT_EQ(a.out, b.out);
  EXPECT_GT(a.out.size(), 1u);
}

TEST_F(Q4chatTest, InteractiveTurnsFromStdin) {
  const auto r =
      run("printf 'hello\\nsecond turn\\n' | " + chat("--temperature 0 --max-new-tokens 4"));
  ASSERT_EQ(r.code, 0) << r.out;
  // One reply line per turn.
  EXPECT_GE(std::count(r.out.begin(), r.out.end(), '\n'), 2) << r.out;
}

TEST_F(Q4chatTest, UsageErrorsExitTwo) {
  EXPECT_EQ(run(chat("--prompt x --top-p 0 2>&1")).code, 2);
  EXPECT_EQ(run(kBin + "/q4chat --model " + (dir_ / "missing.dat").string() + " 2>&1").code, 2);
  const auto r = run(kBin + "/q4chat --model " + (dir_ / "model.dat").string() +
                     " --prompt x 2>&1");  // no tokenizer.json beside the .dat
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.out.find("--tokenizer"), std::string::npos) << r.out;
}

}  // namespace
