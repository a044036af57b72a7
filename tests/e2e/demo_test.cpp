// The README's first command, as shipped: `q4train --config configs/demo.yaml` (only output.dir
// moved to a temp folder) must end with every eval answer equal to the trained answer. The demo
// claims memorization, so the test first checks that its eval prompts are exactly the prompts of
// its data files; answers are then compared with the data read independently of the trainer (a
// plain TSV split, no tokenizer), from eval.jsonl. Before training no answer may be right (the
// random model cannot know them). Then q4chat answers from the run directory, as the README shows.
// About a minute on 2 CPU cores: the full demo, not a shortened one, so CI checks what users run.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "q4/trainer/config/config.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::demo_test {

namespace {

using namespace q4::test;

const std::string kDemo = kSource + "/configs/demo.yaml";

// prompt -> answer of a demo TSV: `prompt<TAB>answer` lines; blank, `#` and the header skipped.
std::map<std::string, std::string> read_pairs(const std::string& path) {
  std::map<std::string, std::string> pairs;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    if (line.empty() || line[0] == '#' || line == "prompt\tanswer") continue;
    const auto tab = line.find('\t');
    if (tab == std::string::npos) {
      ADD_FAILURE() << path << ": line without a tab: " << line;
      continue;
    }
    EXPECT_TRUE(pairs.emplace(line.substr(0, tab), line.substr(tab + 1)).second)
        << path << ": duplicate prompt " << line.substr(0, tab);
  }
  return pairs;
}

// `cmd` with stdout and stderr together in `log` (Result's out; err stays empty).
Result run(const std::string& cmd, const fs::path& log) {
  Result r;
  r.code = exit_code(std::system((cmd + " >" + log.string() + " 2>&1").c_str()));
  r.out = read_text(log);
  return r;
}

// An emptied folder of this user and process under the system's temp directory.
fs::path scratch_dir(const std::string& prefix) {
  return fresh_dir(fs::temp_directory_path() /
                   (prefix + std::to_string(::getuid()) + "_" + std::to_string(::getpid())));
}

// q4train on a shipped config with only output.dir moved to `rundir`; its log in `dir`.
Result train(const std::string& config, const fs::path& rundir, const fs::path& dir) {
  return run(kBin + "/q4train --config " + config + " --set output.dir=" + rundir.string(),
             dir / "q4train.log");
}

}  // namespace

TEST(Demo, EvalPromptsAreTheTrainingPrompts) {
  const auto c = q4::trainer::load_config(kDemo);
  ASSERT_EQ(c.data.files.size(), 1u);
  const auto pairs = read_pairs(c.data.files[0]);
  ASSERT_GE(pairs.size(), 10u);
  std::map<std::string, int> asked;
  for (const auto& p : c.eval.prompts) {
    EXPECT_TRUE(pairs.count(p)) << "eval prompt not in " << c.data.files[0] << ": " << p;
    EXPECT_EQ(++asked[p], 1) << "eval prompt repeated: " << p;
  }
  for (const auto& [prompt, answer] : pairs) {
    EXPECT_TRUE(asked.count(prompt)) << "training prompt the demo does not ask: " << prompt;
  }
}

TEST(Demo, EveryEvalAnswerIsTheTrainedAnswer) {
  const auto c = q4::trainer::load_config(kDemo);
  const auto pairs = read_pairs(c.data.files.at(0));
  const fs::path dir = scratch_dir("q4_demo_");
  const fs::path rundir = dir / "demo";
  const Result r = train(kDemo, rundir, dir);
  ASSERT_EQ(r.code, 0) << r.out;

  // The trainer's own check of the export: every tensor gives the trained forward weights.
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("export check: (\\d+)/(\\d+) tensors")))
      << r.out;
  EXPECT_EQ(m[1], m[2]) << r.out;

  std::ifstream in(rundir / "eval.jsonl");
  std::string line;
  std::vector<nlohmann::json> start, end;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    auto j = nlohmann::json::parse(line);
    const std::string when = j.at("when");
    if (when == "end") end.push_back(std::move(j));
    if (when == "start") start.push_back(std::move(j));
  }
  ASSERT_EQ(end.size(), c.eval.prompts.size()) << r.out;
  ASSERT_EQ(start.size(), c.eval.prompts.size()) << r.out;
  for (const auto& e : end) {
    const std::string prompt = e.at("prompt");
    ASSERT_TRUE(pairs.count(prompt)) << prompt;
    EXPECT_EQ(e.at("step").get<int64_t>(), c.train.steps);
    EXPECT_EQ(e.at("answer").get<std::string>(), pairs.at(prompt)) << "prompt: " << prompt;
    EXPECT_TRUE(e.at("stopped").get<bool>()) << "no <|im_end|> after: " << prompt;
  }
  for (const auto& s : start) {
    EXPECT_NE(s.at("answer").get<std::string>(), pairs.at(s.at("prompt")))
        << "the untrained model already answers " << s.at("prompt");
  }

  // The README's next step: chat with the result (greedy, one shot).
  const Result chat = run(kBin + "/q4chat --model " + rundir.string() +
                              " --prompt 'What is the capital of Japan?' --temperature 0 --quiet",
                          dir / "q4chat.log");
  ASSERT_EQ(chat.code, 0) << chat.out;
  EXPECT_EQ(chat.out, pairs.at("What is the capital of Japan?") + "\n");
  q4::io::remove_tree(dir);
}

// The README's preference demo as shipped (`configs/demo-preference.yaml`, only output.dir moved):
// the held-out pairs' reward accuracy starts at 0.5 (the policy is its own reference) and ends at
// 0.95 or more, the validation DPO loss falls, no eval answer is a brush-off of the rejected
// style, and q4chat answers in the chosen style ("Sure! ..."). About 80 s on 2 CPU cores.
TEST(Demo, PreferenceDemoFlipsTheHeldOutPairs) {
  const std::string config = kSource + "/configs/demo-preference.yaml";
  const fs::path dir = scratch_dir("q4_demo_pref_");
  const fs::path rundir = dir / "run";
  const Result r = train(config, rundir, dir);
  ASSERT_EQ(r.code, 0) << r.out;
  double first = -1, last = -1, first_loss = 0, last_loss = 0;
  for (const auto& m : read_jsonl(rundir / "metrics.jsonl")) {
    if (!m.contains("eval_rewards/accuracies")) continue;
    if (first < 0) {
      first = m["eval_rewards/accuracies"].get<double>();
      first_loss = m["val_loss"].get<double>();
    }
    last = m["eval_rewards/accuracies"].get<double>();
    last_loss = m["val_loss"].get<double>();
  }
  EXPECT_EQ(first, 0.5) << r.out;
  EXPECT_GE(last, 0.95) << r.out;
  EXPECT_LT(last_loss, first_loss) << r.out;
  std::ifstream in(rundir / "eval.jsonl");
  std::string line;
  int answers = 0;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto j = nlohmann::json::parse(line);
    if (j.at("when") != "end") continue;
    ++answers;
    const std::string a = j.at("answer");
    EXPECT_EQ(a.rfind("Sure!", 0), 0u) << j.at("prompt") << " => " << a;
    for (const char* rude : {"yourself", "problem", "someone else", "care"}) {
      EXPECT_EQ(a.find(rude), std::string::npos) << j.at("prompt") << " => " << a;
    }
  }
  EXPECT_GT(answers, 0);
  const Result chat = run(kBin + "/q4chat --model " + rundir.string() +
                              " --prompt 'What is the capital of Japan?' --temperature 0 --quiet",
                          dir / "q4chat.log");
  ASSERT_EQ(chat.code, 0) << chat.out;
  EXPECT_EQ(chat.out.rfind("Sure!", 0), 0u) << chat.out;
  q4::io::remove_tree(dir);
}

}  // namespace q4::test::demo_test
