// The rewards layer (docs/trainer.md#rewards): each built-in verifier against hand-computed
// values, weights and the logged values, the reward section's config (defaults, round trip,
// one-line errors naming the key), a record lacking a verifier's field (naming line and key), and
// the external command's protocol: a verifier script, pipelining past the pipe buffers, a
// timeout, garbage, NaN, a crash, an exit, extra output, a command that does not start, no
// zombies, and a dead reader's SIGPIPE not killing the caller.
#include "q4/trainer/rewards/rewards.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>
#include <vector>

#include "q4/test/files.h"
#include "q4/test/temp_dir.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/rewards/reward_command.h"

namespace fs = std::filesystem;
using namespace q4::trainer;
using json = nlohmann::json;

namespace q4::test::rewards_test {

const char* kModel = R"(
model:
  config: m/config.json
  tokenizer: m/tokenizer.json
  weights: m/model.dat
data:
  files: [train.jsonl]
)";

Config parse_reward(const std::string& reward_yaml) {
  return parse_config(std::string(kModel) + reward_yaml, "test.yaml", "/base");
}

std::string reward_config_error(const std::string& reward_yaml) {
  try {
    parse_reward(reward_yaml);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

RewardFunctionConfig fn(RewardKind kind, const std::string& name) {
  RewardFunctionConfig f;
  f.kind = kind;
  f.name = name;
  return f;
}

// Scores `completions` against one record with a config holding only `f`.
std::vector<double> score_one(const RewardFunctionConfig& f,
                              const std::vector<std::string>& completions,
                              const json& record = json::object(), int64_t tokens = -1) {
  RewardConfig rc;
  rc.functions = {f};
  Rewards r = make_rewards(rc);
  std::vector<RewardInput> batch;
  for (const auto& c : completions) batch.push_back({"Q", c, &record, tokens, "t.jsonl:1"});
  return r.score(batch).per_function.at(0);
}

using V = std::vector<double>;

// A script file in `dir`, executable.
std::string write_script(const q4::test::ScopedTempDir& dir, const std::string& name,
                         const std::string& text) {
  const std::string p = dir.path(name);
  q4::test::write_text(p, text);
  fs::permissions(p, fs::perms::owner_all);
  return p;
}

template <typename Fn>
std::string reward_error(Fn&& fn) {
  try {
    fn();
  } catch (const RewardError& e) {
    return e.what();
  }
  return "";
}

// The process is gone and reaped (not a zombie of this process).
bool reaped(pid_t pid) {
  int status = 0;
  return waitpid(pid, &status, WNOHANG) < 0 && errno == ECHILD;
}

const char* kPython = "/usr/bin/python3";


TEST(Rewards, ExactMatchNormalisesAndExtracts) {
  auto f = fn(RewardKind::kExactMatch, "exact");
  f.field = "answer";
  const json rec = {{"answer", "New  York"}};
  EXPECT_EQ(score_one(f, {"new york", "  NEW\tYork\n", "New York City", ""}, rec), (V{1, 1, 0, 0}));
  f.normalize = false;
  EXPECT_EQ(score_one(f, {"New  York", "new  york", " New  York"}, rec), (V{1, 0, 0}));
  f.normalize = true;
  f.extract = "<answer>(.*?)</answer>";
  EXPECT_EQ(
      score_one(f, {"think... <answer> new york </answer> bye", "new york", "<answer>x</answer>"},
                rec),
      (V{1, 0, 0}));
  // A number field compares as its JSON text.
  f.extract = "";
  EXPECT_EQ(score_one(f, {"42", "42.0"}, json{{"answer", 42}}), (V{1, 0}));
  EXPECT_EQ(normalize_answer("  A\n\n b\tC  "), "a b c");
}

TEST(Rewards, LastNumberReadsGsm8kAnswers) {
  double v = 0;
  EXPECT_TRUE(last_number("so 3 + 4 = 7, then 1,234.5 apples", &v));
  EXPECT_EQ(v, 1234.5);
  EXPECT_TRUE(last_number("pages 3-5", &v));
  EXPECT_EQ(v, 5);
  EXPECT_TRUE(last_number("x = -2.25.", &v));
  EXPECT_EQ(v, -2.25);
  EXPECT_TRUE(last_number("12,345,678 ants", &v));
  EXPECT_EQ(v, 12345678);
  EXPECT_FALSE(last_number("no digits here", &v));

  auto f = fn(RewardKind::kLastNumber, "gsm8k");
  f.field = "answer";
  const json gsm = {{"answer", "She pays 2 * 617 = 1234.\n#### 1,234"}};
  EXPECT_EQ(
      score_one(f, {"The answer is 1234.", "It is 1,234", "1234 or 5", "none", "1234.0"}, gsm),
      (V{1, 1, 0, 0, 1}));
  EXPECT_EQ(score_one(f, {"-3", "3"}, json{{"answer", -3}}), (V{1, 0}));
  f.extract = "#### (.*)";
  EXPECT_EQ(score_one(f, {"1234 ... #### 1234", "1234 ... #### 12", "1234"}, gsm), (V{1, 0, 0}));
}

TEST(Rewards, RegexJsonAndLength) {
  auto re = fn(RewardKind::kRegex, "format");
  re.pattern = R"((?s)^<think>.*</think>\s*<answer>.+</answer>$)";
  EXPECT_EQ(score_one(re, {"<think>a\nb</think>\n<answer>4</answer>", "<answer>4</answer>",
                           "<think></think><answer></answer>"}),
            (V{1, 0, 0}));
  // A completion cut inside a UTF-8 character still matches byte for byte.
  re.pattern = "caf";
  EXPECT_EQ(score_one(re, {"caf\xc3", "\xff\xfe"}), (V{1, 0}));

  auto js = fn(RewardKind::kJson, "json");
  EXPECT_EQ(score_one(js, {R"({"a": [1, 2]})", "  [1]\n", "{a: 1}", "", "{\"a\": 1} trailing"}),
            (V{1, 1, 0, 0, 0}));
  js.extract = "(?s)```json\\s*(.*?)```";
  EXPECT_EQ(score_one(js, {"Here:\n```json\n{\"ok\": true}\n```", "{\"ok\": true}"}), (V{1, 0}));

  auto len = fn(RewardKind::kLength, "length");
  len.target_tokens = 10;
  len.penalty_per_token = 0.1;
  for (const auto& [tokens, want] : std::vector<std::pair<int64_t, double>>{
           {0, 0.0}, {10, 0.0}, {13, -0.3}, {19, -0.9}, {20, -1.0}, {500, -1.0}}) {
    EXPECT_NEAR(score_one(len, {"x"}, json::object(), tokens).at(0), want, 1e-12) << tokens;
  }
  EXPECT_THROW(score_one(len, {"x"}), c10::Error);  // the token count is the caller's to give
}

// The total is the weighted sum; the logged values against a direct computation.
TEST(Rewards, WeightsTotalAndMetrics) {
  RewardConfig rc;
  auto a = fn(RewardKind::kExactMatch, "acc");
  a.field = "answer";
  a.weight = 2.0;
  auto b = fn(RewardKind::kRegex, "tag");
  b.pattern = "<answer>";
  b.weight = -0.5;
  rc.functions = {a, b};
  Rewards r = make_rewards(rc);
  const json rec = {{"answer", "4"}};
  std::vector<RewardInput> batch;
  for (const char* c : {"4", "<answer>4", "5", "<answer>5"})
    batch.push_back({"Q", c, &rec, -1, ""});
  const RewardScores s = r.score(batch);
  EXPECT_EQ(s.names, (std::vector<std::string>{"acc", "tag"}));
  EXPECT_EQ(s.per_function[0], (V{1, 0, 0, 0}));  // "<answer>4" is not "4" without extract
  EXPECT_EQ(s.per_function[1], (V{0, 1, 0, 1}));
  EXPECT_EQ(s.total, (V{2.0, -0.5, 0.0, -0.5}));
  std::map<std::string, double> m;
  for (const auto& [k, v] : reward_metrics(s, 2)) m[k] = v;
  EXPECT_DOUBLE_EQ(m["reward"], (2.0 - 0.5 + 0.0 - 0.5) / 4);
  // Groups {2, -0.5} and {0, -0.5}: sample std |x - y| / sqrt(2).
  EXPECT_DOUBLE_EQ(m["reward_std"], (2.5 / std::sqrt(2.0) + 0.5 / std::sqrt(2.0)) / 2);
  EXPECT_DOUBLE_EQ(m["rewards/acc/mean"], 0.25);
  EXPECT_DOUBLE_EQ(m["rewards/tag/mean"], 0.5);
  EXPECT_DOUBLE_EQ(m["rewards/tag/std"], std::sqrt(4 * 0.25 / 3));
  EXPECT_EQ(reward_metrics(s, 1)[1].second, 0.0);  // groups of one have no spread
  EXPECT_THROW(reward_metrics(s, 3), c10::Error);
}

TEST(RewardsConfig, ParsesDefaultsAndRoundTrips) {
  const Config c = parse_reward(R"(
reward:
  functions:
    - {kind: last_number, field: answer, weight: 2}
    - {name: fmt, kind: regex, pattern: '^<answer>.*</answer>$'}
    - {kind: length, target_tokens: 256, penalty_per_token: 0.01}
  command: [python3, verify.py]
  command_timeout_s: 5
)");
  ASSERT_EQ(c.reward.functions.size(), 3u);
  EXPECT_EQ(c.reward.functions[0].name, "last_number");  // the name defaults to the kind
  EXPECT_EQ(c.reward.functions[0].weight, 2.0);
  EXPECT_EQ(c.reward.functions[1].pattern, "^<answer>.*</answer>$");
  EXPECT_EQ(c.reward.functions[2].target_tokens, 256);
  EXPECT_EQ(c.reward.command_dir, "/base");  // the config's directory
  const std::string y = config_to_yaml(c);
  EXPECT_FALSE(contains(y, "normalize")) << y;  // only the keys each kind uses
  const Config back = parse_config(y, "back.yaml", "/elsewhere");
  EXPECT_EQ(config_to_yaml(back), y);
  EXPECT_EQ(back.reward.command_dir, "/base");
  // The defaults: no functions, no command.
  EXPECT_TRUE(parse_reward("").reward.functions.empty());
  EXPECT_TRUE(contains(config_reference_markdown(), "| `reward.functions[].pattern` | string |"));
}

TEST(RewardsConfig, ErrorsNameTheKey) {
  // reward.functions entries, and the parts their error must hold.
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"    - {kind: regex, pattern: 'a(b'}\n",
       {"config key reward.functions[0].pattern: invalid regular expression 'a(b'"}},
      {"    - {kind: json}\n    - {kind: exact_match, field: a, extract: 'x+'}\n",
       {"reward.functions[1].extract", "no capture group"}},
      {"    - {kind: exact_match}\n", {"reward.functions[0].field: required by kind exact_match"}},
      {"    - {kind: regex}\n", {"reward.functions[0].pattern: required"}},
      {"    - {field: a}\n", {"reward.functions[0].kind", "required"}},
      {"    - {kind: json, patern: x}\n",
       {"unknown config key reward.functions[0].patern (test.yaml line 10)",
        "did you mean pattern?"}},
      {"    - {kind: json, pattern: x}\n",
       {"reward.functions[0].pattern (test.yaml line 10): does not apply to kind json"}},
      {"    - {kind: jsn}\n", {"reward.functions[0].kind", "exact_match, last_number"}},
      {"    - {kind: json}\n    - {kind: json}\n",
       {"reward.functions[1].name: 'json' names two rewards"}},
      {"    - {kind: json, name: 'a b'}\n", {"reward.functions[0].name"}},
      {"    - {kind: length, penalty_per_token: 0}\n", {"reward.functions[0].penalty_per_token"}},
      {"    - {kind: json, weight: .nan}\n", {"reward.functions[0].weight"}},
      {"    - just_a_string\n", {"reward.functions[0]", "expected a mapping"}},
  };
  for (const auto& [entries, parts] : cases) {
    const std::string m = reward_config_error("reward:\n  functions:\n" + entries);
    for (const std::string& part : parts) EXPECT_TRUE(contains(m, part)) << entries << m;
  }
  std::string m =
      reward_config_error("reward:\n  functions: [{kind: json, name: command}]\n  command: [x]\n");
  EXPECT_TRUE(contains(m, "'command' names two rewards")) << m;
  m = reward_config_error("reward:\n  command_timeout_s: 0\n");
  EXPECT_TRUE(contains(m, "reward.command_timeout_s")) << m;
}

// A record without the field a verifier reads: one line naming the line and the key, before any
// generation (--dry-run and the loader call check_reward_example).
TEST(RewardsConfig, MissingFieldNamesLineAndKey) {
  RewardConfig rc;
  auto f = fn(RewardKind::kLastNumber, "gsm8k");
  f.field = "answer";
  rc.functions = {fn(RewardKind::kJson, "json"), f};
  auto msg = [&](const json& rec) {
    try {
      check_reward_example(rc, rec, "data/train.jsonl:7");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  std::string m = msg({{"prompt", "2+2?"}, {"solution", "4"}});
  EXPECT_EQ(m,
            "data/train.jsonl:7: reward.functions[1] ('gsm8k', last_number) needs the field "
            "'answer', which this record lacks (its keys: prompt, solution)");
  m = msg({{"answer", json::array({4})}});
  EXPECT_TRUE(contains(m, "data/train.jsonl:7") && contains(m,
                                                            "expected a string or a number, "
                                                            "found array"))
      << m;
  m = msg({{"answer", "four"}});
  EXPECT_TRUE(contains(m, "data/train.jsonl:7") && contains(m, "holds no number")) << m;
  EXPECT_TRUE(contains(msg(json::array()), "expected a JSON object record")) << msg(json::array());
  EXPECT_EQ(msg({{"answer", "#### 4"}}), "");
  // score() checks each record too.
  Rewards r = make_rewards(rc);
  const json bad = {{"prompt", "x"}};
  EXPECT_THROW(r.score({{"x", "4", &bad, -1, "data/train.jsonl:9"}}), ConfigError);
}

TEST(RewardCommand, VerifierScriptAnswersALongLivedBatchStream) {
  if (access(kPython, X_OK) != 0) GTEST_SKIP() << kPython << " is missing";
  q4::test::ScopedTempDir dir("reward_cmd_");
  ASSERT_TRUE(dir.ok());
  // Right when the completion equals the record's answer; the request counter shows it is one
  // process over batches; the prompt and the record's fields arrive.
  write_script(dir, "verify.py", R"(import json, sys
n = 0
for line in sys.stdin:
    r = json.loads(line)
    n += 1
    ok = r["completion"].strip() == str(r["answer"]) and r["prompt"] == "What is 2+2?"
    print((1.0 if ok else 0.0) + (100 * n if r.get("count") else 0), flush=True)
)");
  RewardConfig rc;
  rc.command = {kPython, "verify.py"};
  rc.command_dir = dir.dir();
  rc.command_weight = 0.5;
  auto ex = fn(RewardKind::kExactMatch, "exact");
  ex.field = "answer";
  rc.functions = {ex};
  Rewards r = make_rewards(rc);
  EXPECT_EQ(r.names(), (std::vector<std::string>{"exact", "command"}));
  const json rec = {{"answer", 4}};
  std::vector<RewardInput> batch;
  for (const char* c : {"4", " 4\n", "5", "four"})
    batch.push_back({"What is 2+2?", c, &rec, -1, ""});
  RewardScores s = r.score(batch);
  EXPECT_EQ(s.per_function[1], (V{1, 1, 0, 0}));
  EXPECT_EQ(s.total, (V{1.5, 1.5, 0, 0}));
  // The same process answers the next batch: its counter went on from 4.
  const json counted = {{"answer", 4}, {"count", true}};
  s = r.score({{"What is 2+2?", "4", &counted, -1, ""}, {"What is 2+2?", "3", &counted, -1, ""}});
  EXPECT_EQ(s.per_function[1], (V{501, 600}));
}

// Requests and answers past the pipes' 64 KiB buffers: written while answers are read.
TEST(RewardCommand, PipelinesABatchLargerThanThePipes) {
  if (access(kPython, X_OK) != 0) GTEST_SKIP() << kPython << " is missing";
  RewardCommand cmd(
      {kPython, "-c", "import sys\nfor l in sys.stdin: print('%.30f' % len(l), flush=True)\n"}, "",
      20);
  std::vector<std::string> requests;
  for (int i = 0; i < 4000; ++i) requests.push_back(std::string(100 + i % 7, 'x'));
  const auto got = cmd.score(requests, {});
  ASSERT_EQ(got.size(), requests.size());
  for (size_t i = 0; i < got.size(); ++i) ASSERT_EQ(got[i], requests[i].size() + 1) << i;
}

TEST(RewardCommand, TimeoutStopsTheCommandNamingTheRequest) {
  const auto t0 = std::chrono::steady_clock::now();
  RewardCommand cmd({"sh", "-c", "read l; echo 1; exec sleep 30"}, "", 0.3);
  const pid_t pid = cmd.pid();
  const std::string m = reward_error([&] {
    cmd.score({"{}", "{}", "{}"}, {"a.jsonl:1", "a.jsonl:2", "a.jsonl:3"});
  });
  EXPECT_TRUE(contains(m,
                       "reward.command 'sh -c read l; echo 1; exec sleep 30' gave no answer "
                       "to request 2 of 3 (a.jsonl:2) within 0.3 s"))
      << m;
  EXPECT_TRUE(reaped(pid));  // killed and reaped, not a zombie
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
  // Every later call repeats the error instead of scoring zero.
  EXPECT_EQ(reward_error([&] { cmd.score({"{}"}, {}); }), m);
}

TEST(RewardCommand, GarbageAndNanAreErrorsNamingTheRequest) {
  RewardCommand garbage({"sh", "-c", "while read l; do echo 0.5; echo yes; done"}, "", 5);
  std::string m = reward_error([&] { garbage.score({"{}", "{}"}, {"t.jsonl:4", "t.jsonl:5"}); });
  EXPECT_TRUE(contains(m,
                       "answered 'yes', not a number to request 2 of 2 (t.jsonl:5); expected "
                       "one finite number a line"))
      << m;
  RewardCommand nan({"sh", "-c", "while read l; do echo nan; done"}, "", 5);
  m = reward_error([&] { nan.score({"{}"}, {"t.jsonl:3"}); });
  EXPECT_TRUE(contains(m, "answered nan, not a finite number to request 1 of 1 (t.jsonl:3)")) << m;
  RewardCommand inf({"sh", "-c", "while read l; do echo 1e999; done"}, "", 5);
  EXPECT_TRUE(contains(reward_error([&] { inf.score({"{}"}, {}); }), "not a finite number"));
  RewardCommand empty({"sh", "-c", "while read l; do echo; done"}, "", 5);
  EXPECT_TRUE(contains(reward_error([&] { empty.score({"{}"}, {}); }), "an empty line"));
  // Two lines for one request: found in this batch or before the next one's requests.
  RewardCommand extra({"sh", "-c", "while read l; do echo 1; echo 2; done"}, "", 5);
  m = reward_error([&] {
    extra.score({"{}"}, {});
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    extra.score({"{}"}, {});
  });
  EXPECT_TRUE(contains(m, "more lines than") || contains(m, "no request asked for")) << m;
}

TEST(RewardCommand, CrashAndExitAreErrorsWithTheStatus) {
  RewardCommand crash({"sh", "-c", "ulimit -c 0; read l; echo 1; read l; kill -SEGV $$"}, "", 5);
  const pid_t pid = crash.pid();
  std::string m = reward_error([&] { crash.score({"{}", "{}", "{}"}, {}); });
  EXPECT_TRUE(contains(m, "was killed by signal 11") && contains(m, "after answering 1 of 3")) << m;
  EXPECT_TRUE(reaped(pid));
  // It closes its input and exits a little later: the write meets a closed pipe, whose SIGPIPE
  // must not end this process, and the error waits for the exit status.
  RewardCommand quits({"sh", "-c", "exec 0<&-; sleep 0.2; exit 3"}, "", 5);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const std::vector<std::string> big(2000, std::string(200, 'x'));
  m = reward_error([&] { quits.score(big, {}); });
  EXPECT_TRUE(contains(m, "exited with status 3 after answering 0 of 2000")) << m;
}

TEST(RewardCommand, StartsInItsDirectoryOrSaysWhyNot) {
  q4::test::ScopedTempDir dir("reward_dir_");
  ASSERT_TRUE(dir.ok());
  write_script(dir, "v.sh", "#!/bin/sh\nwhile read l; do echo 7; done\n");
  pid_t pid = 0;
  {
    RewardCommand cmd({"./v.sh"}, dir.dir(), 5);  // relative to reward.command_dir
    pid = cmd.pid();
    EXPECT_EQ(cmd.score({"{}"}, {}), (V{7}));
  }
  EXPECT_TRUE(reaped(pid));  // stopped at end of input and reaped by the destructor
  try {
    RewardCommand missing({"no-such-verifier-q4"}, "", 5);
    ADD_FAILURE() << "a missing program started";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "config key reward.command: cannot start 'no-such-verifier-q4'"))
        << e.what();
  }
}

}  // namespace q4::test::rewards_test
