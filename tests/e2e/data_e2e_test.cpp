// End-to-end tests of build/bin/q4train on data as people have it and on the run length (tiny
// random Qwen3, real tokenizer, CPU, 1-6 steps each): long chat examples are truncated and
// counted (not dropped), JSON-array files train, train.epochs and warmup_ratio resolve to steps
// once the data is loaded (log line, metrics, summary, resume), --dry-run reads the data and the
// device, and config mistakes are one line naming the key or the file and line (exit 2).
#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::data_e2e_test {

namespace {

using namespace q4::test;

// A fresh directory with model.json, the data file `data_name` holding `data`, and config.yaml
// (random init, no eval prompts, run in dir/run; `extra` is appended to the train section).
fs::path setup_dir(const std::string& name, const std::string& data_name, const std::string& data,
                   const std::string& train_extra = "  steps: 1\n") {
  TinyRun t;
  t.data_file = data_name;
  t.data = data;
  t.trainable = "";
  t.steps = -1;
  t.seq_len = 64;
  t.train_extra = train_extra;
  t.output_extra = "  export_path: none\n";
  t.log = "  tensorboard: false\n  report: false\n";
  return t.write_fresh("data_e2e", name);
}

// q4train --config dir/config.yaml plus `args` (each --set given as "key=value" after "-s").
Result run(const fs::path& dir, const std::vector<std::string>& args, const std::string& env = "") {
  static int n = 0;
  const std::string cmd = env + (env.empty() ? "" : " ") + kQ4train + " --config '" +
                          (dir / "config.yaml").string() + "'" + quoted(args);
  const std::string tag = std::to_string(::getpid()) + "_" + std::to_string(n++);
  return run_in(dir, tag, cmd);
}

// `n` prompt/answer lines of a TSV: answers of about `answer_words` words.
std::string tsv(int n, int answer_words = 2) {
  std::string s;
  for (int i = 0; i < n; ++i) {
    s += "Question number " + std::to_string(i) + "?\t";
    for (int w = 0; w < answer_words; ++w) s += (w ? " word" : "word") + std::to_string(w);
    s += "\n";
  }
  return s;
}

// Chat examples longer than train.seq_len were dropped ("raise max_seq_len"); they are truncated
// per data.truncation and counted, the run trains, and a loss of more than 1% of the supervised
// tokens is a warning naming the settings.
TEST(DataE2E, LongChatExamplesAreTruncatedAndCounted) {
  std::string data;
  for (int i = 0; i < 3; ++i) {
    std::string answer;
    for (int w = 0; w < 80; ++w) answer += "alpha" + std::to_string(w) + " ";
    data += R"({"messages": [{"role": "user", "content": "Tell me a long story )" +
            std::to_string(i) + R"("}, {"role": "assistant", "content": ")" + answer + R"("}]})" +
            "\n";
  }
  const fs::path dir = setup_dir("long", "data.jsonl", data);
  for (const char* policy : {"cut_left", "cut_right"}) {
    const Result r = run(dir, {"--overwrite", "--set", std::string("data.truncation=") + policy});
    ASSERT_EQ(r.code, 0) << policy << ": " << r.err << r.out;
    EXPECT_TRUE(contains(r.out, std::string("truncation to train.seq_len 64 (") + policy +
                                    "): 3 examples, 3 kept (3 truncated), 0 dropped"))
        << r.out;
    EXPECT_TRUE(contains(r.out, "supervised tokens lost (")) << r.out;
    EXPECT_TRUE(contains(r.out, "cut from truncated examples, 0 in dropped ones")) << r.out;
    EXPECT_TRUE(
        contains(r.err, "warning: truncation to 64 tokens (" + std::string(policy) + ") loses "))
        << r.err;
    EXPECT_TRUE(contains(r.err, "raise train.seq_len, or for plain text set data.truncation auto"))
        << r.err;
  }
  // Only the drop policy drops, and then the message names real keys.
  const Result d = run(dir, {"--overwrite", "--set", "data.truncation=drop"});
  EXPECT_EQ(d.code, 2) << d.err;
  EXPECT_TRUE(contains(d.err, "train.seq_len")) << d.err;
  EXPECT_FALSE(contains(d.err, "max_seq_len")) << d.err;
}

// A .txt file is one document, split into train.seq_len windows by default: every token trained,
// the split counted in the start lines and by --dry-run, nothing lost, no warning. By paragraphs
// (data.text_unit) the blank-line-separated paragraphs are the documents.
TEST(DataE2E, PlainTextIsSplitIntoWindowsByDefault) {
  std::string text;
  for (int p = 0; p < 3; ++p) {
    for (int i = 0; i < 12; ++i)
      text += "Paragraph " + std::to_string(p) + ", line " + std::to_string(i) + ".\n";
    text += "\n";
  }
  const fs::path dir = setup_dir("text", "book.txt", text);
  for (const bool dry : {true, false}) {
    const Result r = run(
        dir, dry ? std::vector<std::string>{"--dry-run"} : std::vector<std::string>{"--overwrite"});
    ASSERT_EQ(r.code, 0) << r.err << r.out;
    EXPECT_TRUE(contains(r.out, "book.txt: 1 examples from 39 lines")) << r.out;
    EXPECT_TRUE(contains(r.out,
                         "truncation to train.seq_len 64 (auto: plain text split into "
                         "windows, other records cut_left)"))
        << r.out;
    EXPECT_TRUE(contains(r.out, "1 split into ")) << r.out;
    EXPECT_TRUE(contains(r.out, "; 0 of ")) << r.out;
    EXPECT_FALSE(contains(r.err, "warning")) << r.err;
  }
  const Result p = run(dir, {"--dry-run", "--set", "data.text_unit=paragraph"});
  ASSERT_EQ(p.code, 0) << p.err << p.out;
  EXPECT_TRUE(contains(p.out, "book.txt: 3 examples from 39 lines")) << p.out;
}

// A JSON array of records (alpaca_data.json) trains like the same records as JSONL.
TEST(DataE2E, JsonArrayFileTrains) {
  const fs::path dir = setup_dir(
      "array", "alpaca_data.json",
      "[\n  {\"instruction\": \"Say hi\", \"input\": \"\", \"output\": \"Hi!\"},\n"
      "  {\"instruction\": \"Add\", \"input\": \"2 and 2\", \"output\": \"4\"}\n]\n");
  const Result r = run(dir, {});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "2 examples")) << r.out;
  EXPECT_TRUE(contains(r.out, "format json array (alpaca)")) << r.out;
}

// train.epochs resolves to steps from the data (6 examples, one per row, batch 2: 3
// micro-batches per epoch; 2 epochs with grad_accum 1 = 6 steps), warmup_ratio to warmup steps;
// the log line and the metrics carry the epoch. A run stopped after step 3 resumes with the same
// schedule, and a resume that resolves other steps is refused (the check compares them).
TEST(DataE2E, EpochsResolveToStepsAndResume) {
  const fs::path dir = setup_dir("epochs", "data.tsv", tsv(6), "  epochs: 2\n");
  const std::vector<std::string> sets = {
      "--set", "data.packing=false", "--set", "optim.schedule.warmup_ratio=0.5",
      "--set", "output.checkpoint_every=3"};
  const Result a = run(dir, sets, "Q4_FAULT=exit:0:4");
  ASSERT_EQ(a.code, 9) << a.err << a.out;  // the injected fault at the start of step 4
  EXPECT_TRUE(contains(a.out, "train.epochs 2 -> train.steps 6 (3 micro-batches per epoch"))
      << a.out;
  EXPECT_TRUE(contains(a.out, "optim.schedule.warmup_ratio 0.5 -> optim.schedule.warmup_steps 3"))
      << a.out;
  EXPECT_TRUE(contains(a.out, "step 1/6 | epoch 0.33 | loss")) << a.out;
  EXPECT_TRUE(contains(a.out, "step 3/6 | epoch 1.00 | loss")) << a.out;
  EXPECT_TRUE(contains(a.out, "steps      6 (train.epochs 2), each 1 micro-batch (1 accumulated"))
      << a.out;
  // The schedule check compares the resolved steps: packing makes 1 micro-batch per epoch.
  const Result changed = run(dir, {"--resume", (dir / "run").string()});
  EXPECT_EQ(changed.code, 2) << changed.out;
  EXPECT_TRUE(contains(changed.err, "train.steps 6 -> 2")) << changed.err;
  std::vector<std::string> resume = sets;
  resume.insert(resume.end(), {"--resume", (dir / "run").string()});
  const Result b = run(dir, resume);
  ASSERT_EQ(b.code, 0) << b.err << b.out;
  EXPECT_TRUE(contains(b.out, "step 6/6 | epoch 2.00 | loss")) << b.out;
  EXPECT_FALSE(contains(b.err, "schedule")) << b.err;
  const auto records = read_jsonl(dir / "run" / "metrics.jsonl");
  ASSERT_EQ(records.size(), 6u);
  EXPECT_DOUBLE_EQ(records[1]["epoch"].get<double>(), 2.0 / 3.0);
  EXPECT_EQ(records[5]["total_steps"], 6);
  EXPECT_LT(records[0]["lr"].get<double>(), records[4]["lr"].get<double>());  // warmup 3
  // Both run lengths in one place is an error naming the keys.
  const Result both =
      run(dir, {"--overwrite", "--set", "train.steps=4", "--set", "train.epochs=1"});
  EXPECT_EQ(both.code, 2) << both.err;
  EXPECT_TRUE(contains(both.err, "train.epochs")) << both.err;
}

// The start summary counts what a step takes: grad_accum micro-batches of up to batch_size rows,
// and says when batch_size is larger than the data (3 short examples pack into one row).
TEST(DataE2E, SummaryCountsRowsAndBatchLargerThanData) {
  const fs::path dir = setup_dir("summary", "data.tsv", tsv(3));
  const Result r = run(dir, {"--set", "train.batch_size=8", "--set", "train.grad_accum=2"});
  ASSERT_EQ(r.code, 0) << r.err << r.out;
  EXPECT_TRUE(contains(r.out, "each 2 micro-batches (2 accumulated x 1 rank) of up to 8 rows"))
      << r.out;
  EXPECT_TRUE(contains(r.out, "3 examples in 1 row (packed)")) << r.out;
  EXPECT_TRUE(contains(r.out, "train.batch_size 8 is larger than the data")) << r.out;
}

// --dry-run reads the data (a malformed line is the run's error, file and line), resolves the
// run length, prints the resolved config, and checks the device; it still loads no weights.
TEST(DataE2E, DryRunReadsDataAndChecksDevice) {
  const fs::path dir = setup_dir("dry", "data.tsv", tsv(4), "  epochs: 1\n");
  const Result ok = run(dir, {"--dry-run"});
  ASSERT_EQ(ok.code, 0) << ok.err << ok.out;
  EXPECT_TRUE(contains(ok.out, "4 examples from 4 lines")) << ok.out;
  EXPECT_TRUE(contains(ok.out, "train.epochs 1 -> train.steps")) << ok.out;
  EXPECT_TRUE(contains(ok.out, "resolved config:")) << ok.out;
  EXPECT_TRUE(contains(ok.out, "dry run ok")) << ok.out;
  EXPECT_FALSE(fs::exists(dir / "run"));
  write_text(dir / "data.tsv", tsv(2) + "no tab here\n");
  const Result bad = run(dir, {"--dry-run"});
  EXPECT_EQ(bad.code, 2) << bad.out;
  EXPECT_TRUE(contains(bad.err, "data.tsv:3:")) << bad.err;
  write_text(dir / "data.tsv", tsv(4));
  if (!at::hasCUDA()) {  // a GPU config on a machine without one: estimated, then refused
    const Result gpu = run(dir, {"--dry-run", "--set", "model.device=cuda"});
    EXPECT_EQ(gpu.code, 2) << gpu.out;
    EXPECT_TRUE(contains(gpu.err, "model.device")) << gpu.err;
    EXPECT_TRUE(contains(gpu.out, "memory estimate")) << gpu.out;
    EXPECT_FALSE(contains(gpu.out, "dry run ok")) << gpu.out;
  }
}

// Config mistakes: one line naming the key or the file and line, exit 2, before anything runs.
TEST(DataE2E, ConfigMistakesNameTheKey) {
  const fs::path dir = setup_dir("keys", "data.tsv", tsv(2));
  Result r = run(dir, {"--set", "train.trainable.layers=last:99"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train.trainable.layers: last:99")) << r.err;
  EXPECT_TRUE(contains(r.err, "1 decoder layer")) << r.err;
  EXPECT_FALSE(contains(r.err, "last_n_layers")) << r.err;
  r = run(dir, {"--set", "train.batch_size=100000000"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train.batch_size")) << r.err;
  r = run(dir, {"--set", "eval.max_new_tokens=100000000000"});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "eval.max_new_tokens")) << r.err;
  // A second YAML document was silently ignored.
  write_text(dir / "two.yaml", read_text(dir / "config.yaml") + "---\ntrain:\n  steps: 50\n");
  const std::string cmd = kQ4train + " --config '" + (dir / "two.yaml").string() + "' >" +
                          (dir / "two.out").string() + " 2>" + (dir / "two.err").string();
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WIFEXITED(status) ? WEXITSTATUS(status) : -1, 2);
  const std::string err = read_text(dir / "two.err");
  EXPECT_TRUE(contains(err, "two.yaml line")) << err;
  EXPECT_TRUE(contains(err, "second YAML document")) << err;
  // ~/ in a --set path is the home directory.
  fs::create_directories(dir / "home");
  write_text(dir / "home" / "mine.tsv", tsv(2));
  r = run(dir, {"--set", "data.files=[~/mine.tsv]"}, "HOME='" + (dir / "home").string() + "'");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, (dir / "home" / "mine.tsv").string())) << r.out;
}

// An empty JSON array was explained with TSV's prompt<TAB>answer rule.
TEST(DataE2E, EmptyJsonArrayIsNamedAsSuch) {
  const fs::path dir = setup_dir("emptyarray", "data.json", "[]\n");
  const Result r = run(dir, {});
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "no training examples")) << r.err;
  EXPECT_TRUE(contains(r.err, "empty JSON array")) << r.err;
  EXPECT_FALSE(contains(r.err, "TSV")) << r.err;
}

}  // namespace

}  // namespace q4::test::data_e2e_test
