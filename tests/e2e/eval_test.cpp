// q4eval end to end (tiny random Qwen3, real tokenizer, CPU): its loss on a run's export equals
// the trainer's validation loss on the same file; the Hugging Face export scores the same; the
// words and bytes of a text file and the metric arithmetic match a direct fp64 computation;
// prompt/answer data gets exact match, text data none; a missing data file or model is a
// one-line error naming it (exit 2).
#include "eval.h"

#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <iostream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::eval_test {

namespace {

using namespace q4::test;

const std::string kQ4eval = std::string(Q4_BIN_DIR) + "/q4eval";

const char* kTrain =
    "你是谁？\t我是 F# 之神。\n"
    "Who are you?\t我是 F# 之神。\n"
    "What is 2 + 2?\t4.\n"
    "What is the capital of France?\tParis.\n"
    "一加一等于几？\t二。\n"
    "What color is grass?\tGreen.\n"
    "Say hello.\tHello!\n"
    "Name a fruit.\tApple.\n";
const char* kEval = "What is 3 + 3?\t6.\nSay goodbye.\tBye!\n你好吗？\t很好。\n";
const char* kText =
    "The quick brown fox jumps over the lazy dog.\n"
    "  Leading spaces,\ttabs and a trailing space \n"
    "数据和文字 mixed with ASCII, café.\n";

Result run_q4eval(const std::vector<std::string>& args, const fs::path& log_prefix) {
  return run_captured("timeout 120 " + kQ4eval + quoted(args), log_prefix.string() + ".out",
                      log_prefix.string() + ".err");
}

nlohmann::json last_json(const Result& r) {
  return nlohmann::json::parse(r.out.substr(r.out.rfind('{')));
}

// One run shared by the tests: 4 steps training every tensor (NVFP4 projections and lm_head,
// fp16 norms and embedding, fp16 masters) with data.eval_files and a loss chunk of 4 rows,
// exporting model.dat and a Hugging Face folder.
class Eval : public ::testing::Test {
 protected:
  // Built once per q4train binary and config under a lock: ctest runs each test in its own
  // process. One folder per build tree, so that two checkouts never share a run.
  static void SetUpTestSuite() {
    const fs::path root = work_root("eval") / std::to_string(std::hash<std::string>{}(kQ4train));
    fs::create_directories(root);
    dir_ = root / "run";
    const int lock = ::open((root / "run.lock").c_str(), O_CREAT | O_RDWR, 0644);
    ::flock(lock, LOCK_EX);
    const std::string stamp =
        std::to_string(fs::last_write_time(kQ4train).time_since_epoch().count()) + "\n" +
        config_text();
    const fs::path complete = dir_ / "COMPLETE";
    if (fs::exists(complete) && read_text(complete) == stamp) {
      train_code_ = 0;
    } else {
      train();
      if (train_code_ == 0) write_text(complete, stamp);
    }
    ::flock(lock, LOCK_UN);
    ::close(lock);
  }
  static std::string config_text() {
    std::ostringstream y;
    y << "model:\n  config: model.json\n  tokenizer: " << kTokenizer
      << "\n  init: random\n  init_seed: 3\n  device: cpu\n  loss_chunk_tokens: 4\n"
      << "train:\n  trainable: {layers: all, projections: true, norms: true, lm_head: true,"
      << " embeddings: true}\n"
      << "  steps: 4\n  batch_size: 4\n  seq_len: 48\n  seed: 5\n"
      << "optim:\n  lr: 1.0e-2\n  state: fp32\n"
      << "data:\n  files: [data.tsv]\n  eval_files: [eval.tsv]\n"
      << "eval:\n  prompts: []\n  every: 2\n"
      << "output:\n  dir: " << (dir_ / "out").string() << "\n  hf_export: modelopt\n";
    return y.str();
  }
  static void train() {
    q4::io::remove_tree(dir_);
    fs::create_directories(dir_);
    write_text(dir_ / "model.json", tiny_model_config(2));
    write_text(dir_ / "data.tsv", kTrain);
    write_text(dir_ / "eval.tsv", kEval);
    write_text(dir_ / "text.txt", kText);
    write_text(dir_ / "config.yaml", config_text());
    const Result r = run_captured(kQ4train + quoted({"--config", (dir_ / "config.yaml").string()}),
                                  dir_ / "train.out", dir_ / "train.err");
    train_code_ = r.code;
    train_err_ = r.err;
  }
  void SetUp() override { ASSERT_EQ(train_code_, 0) << train_err_; }

  static fs::path dir_;
  static int train_code_;
  static std::string train_err_;
};
fs::path Eval::dir_;
int Eval::train_code_ = -1;
std::string Eval::train_err_;

// q4eval's loss on the run (its export, batched with the run's train.batch_size/seq_len and
// packing, the run's loss chunking) equals the trainer's validation loss after the last step:
// a trained NVFP4 linear's forward weight is fake_quant(master) = dequantize(quantize(master)),
// exactly dequantize(q) of the export, and the fp16 masters of the raw tensors are written as
// they are, so the same batches give the same per-batch sums. Measured: equal to the last bit
// (a different loss_chunk_tokens alone moves it by ~1e-8 relative: the fp32 sum order); the
// tolerance (1e-6 relative) only allows for another platform's summation order.
TEST_F(Eval, LossEqualsTrainerValidationLoss) {
  const auto m = read_jsonl(dir_ / "out" / "metrics.jsonl");
  ASSERT_FALSE(m.empty());
  const auto& last = m.back();
  ASSERT_TRUE(last.contains("val_loss")) << last.dump();
  const double val = last["val_loss"].get<double>();
  const Result r = run_q4eval(
      {"--model", (dir_ / "out").string(), "--data", (dir_ / "eval.tsv").string(), "--json"},
      dir_ / "eval_run");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json(r);
  EXPECT_EQ(j["tokens"].get<int64_t>(), last["val_tokens"].get<int64_t>()) << j.dump();
  EXPECT_NEAR(j["loss"].get<double>(), val, 1e-6 * val) << j.dump();
  std::cout << std::setprecision(17) << "q4eval loss " << j["loss"].get<double>()
            << ", trainer val_loss " << val << ", difference " << j["loss"].get<double>() - val
            << "\n";
  EXPECT_NEAR(j["perplexity"].get<double>(), std::exp(j["loss"].get<double>()),
              1e-12 * j["perplexity"].get<double>());
  // The step-0 validation loss (the random init) is another model: q4eval on init.dat equals it
  // (within 1e-6: outside a run the default loss chunking of 512 rows may order the fp32 sums
  // differently; measured equal here).
  const Result r0 = run_q4eval(
      {"--model", (dir_ / "out" / "init.dat").string(), "--config", (dir_ / "model.json").string(),
       "--tokenizer", kTokenizer, "--data", (dir_ / "eval.tsv").string(), "--batch-size", "4",
       "--seq-len", "48", "--json", "--no-exact-match"},
      dir_ / "eval_init");
  ASSERT_EQ(r0.code, 0) << r0.err;
  const double val0 = m.front()["val_loss"].get<double>();
  EXPECT_NE(val0, val);  // training moved the model
  EXPECT_NEAR(last_json(r0)["loss"].get<double>(), val0, 1e-6 * val0);
  std::cout << "init.dat: q4eval loss " << last_json(r0)["loss"].get<double>()
            << ", trainer step-0 val_loss " << val0 << "\n";
  EXPECT_FALSE(last_json(r0).contains("exact_match"));
  // Prompt/answer data: every example is generated for.
  EXPECT_EQ(j["exact_match_examples"].get<int64_t>(), 3) << j.dump();
  EXPECT_GE(j["exact_match"].get<double>(), 0.0);
  EXPECT_EQ(j["examples"].get<int64_t>(), 3);
}

// The Hugging Face export is the same model: the same loss, bit for bit; the default output is
// one summary line.
TEST_F(Eval, HuggingFaceExportScoresTheSame) {
  const auto args = [&](const std::string& model) {
    return std::vector<std::string>{"--model",      model,
                                    "--data",       (dir_ / "eval.tsv").string(),
                                    "--tokenizer",  kTokenizer,
                                    "--batch-size", "2",
                                    "--json",       "--no-exact-match"};
  };
  const Result a = run_q4eval(args((dir_ / "out" / "model-hf").string()), dir_ / "eval_hf");
  ASSERT_EQ(a.code, 0) << a.err;
  auto dat = args((dir_ / "out" / "model.dat").string());
  dat.insert(dat.end(), {"--config", (dir_ / "model.json").string()});
  const Result b = run_q4eval(dat, dir_ / "eval_dat");
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_EQ(last_json(a)["loss"], last_json(b)["loss"]);
  const Result line = run_q4eval(
      {"--model", (dir_ / "out").string(), "--data", (dir_ / "eval.tsv").string(), "--quiet"},
      dir_ / "eval_line");
  ASSERT_EQ(line.code, 0) << line.err;
  EXPECT_EQ(std::count(line.out.begin(), line.out.end(), '\n'), 1) << line.out;
  EXPECT_TRUE(contains(line.out, "loss ") && contains(line.out, "exact_match ")) << line.out;
  EXPECT_TRUE(line.err.empty()) << line.err;
}

// A text file read by lines (--text-unit line): each line is a document whose tokens after the
// first (and its <|endoftext|>, which spells nothing) are scored; the words and bytes q4eval
// reports are those of that text, counted directly here, and the metrics follow from the reported
// NLL in fp64.
TEST_F(Eval, TextFileWordsAndBytes) {
  const Result r =
      run_q4eval({"--model", (dir_ / "out").string(), "--data", (dir_ / "text.txt").string(),
                  "--seq-len", "128", "--text-unit", "line", "--json"},
                 dir_ / "eval_text");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = last_json(r);
  const auto tok = q4::data::Tokenizer::from_file(kTokenizer);
  int64_t words = 0, bytes = 0, tokens = 0;
  std::istringstream in(kText);
  std::string line;
  while (std::getline(in, line)) {
    const auto ids = tok.encode(line);
    const std::string scored = tok.decode({ids.begin() + 1, ids.end()});
    bytes += static_cast<int64_t>(scored.size());
    words += q4::eval::count_words(scored);
    tokens += static_cast<int64_t>(ids.size());  // ids[1..] and <|endoftext|>
  }
  EXPECT_EQ(j["tokens"].get<int64_t>(), tokens) << j.dump();
  EXPECT_EQ(j["words"].get<int64_t>(), words) << j.dump();
  EXPECT_EQ(j["bytes"].get<int64_t>(), bytes) << j.dump();
  const double nll = j["nll"].get<double>();
  EXPECT_NEAR(j["loss"].get<double>(), nll / static_cast<double>(tokens), 1e-12);
  EXPECT_NEAR(j["word_perplexity"].get<double>(), std::exp(nll / static_cast<double>(words)),
              1e-9 * j["word_perplexity"].get<double>());
  EXPECT_NEAR(j["bits_per_byte"].get<double>(), nll / (static_cast<double>(bytes) * std::log(2.0)),
              1e-12);
  EXPECT_FALSE(j.contains("exact_match")) << "text data has no answers: " << j.dump();
}

// A text file is one document (the default text unit), split into windows of --seq-len tokens
// (the default truncation) that share one token, so every token after the first is scored once
// and every word is counted once, whatever the window: the tokens, words and bytes are the
// document's at 8192, 64 and 8 tokens a window, and the word perplexity moves only as much as the
// loss per token does (less context in a short window). Counted per window, the words grew with
// every window (a word cut in two counted twice, each window's text one more), and the word
// perplexity fell from millions to thousands.
TEST_F(Eval, WordPerplexityDoesNotDependOnTheWindow) {
  std::string doc;
  for (int i = 0; i < 12; ++i) {
    doc += "The committee reported " + std::to_string(i * 37) +
           " unprecedented recommendations, notwithstanding objections. ";
  }
  doc += "\n";
  write_text(dir_ / "long.txt", doc);
  const auto tok = q4::data::Tokenizer::from_file(kTokenizer);
  auto ids = tok.encode(doc.substr(0, doc.size() - 1));  // the last line end goes
  const std::string scored = tok.decode({ids.begin() + 1, ids.end()});
  const auto tokens = static_cast<int64_t>(ids.size());  // ids[1..] and <|endoftext|>
  std::vector<double> word_ppl, token_loss;
  for (const char* seq_len : {"8192", "64", "8"}) {
    SCOPED_TRACE(std::string("--seq-len ") + seq_len);
    const Result r =
        run_q4eval({"--model", (dir_ / "out").string(), "--data", (dir_ / "long.txt").string(),
                    "--seq-len", seq_len, "--json", "--no-exact-match"},
                   dir_ / (std::string("eval_window_") + seq_len));
    ASSERT_EQ(r.code, 0) << r.err;
    const auto j = last_json(r);
    EXPECT_EQ(j["tokens"].get<int64_t>(), tokens) << j.dump();
    EXPECT_EQ(j["words"].get<int64_t>(), q4::eval::count_words(scored)) << j.dump();
    EXPECT_EQ(j["bytes"].get<int64_t>(), static_cast<int64_t>(scored.size())) << j.dump();
    EXPECT_EQ(j["truncation"].get<std::string>(), "auto") << j.dump();
    word_ppl.push_back(j["word_perplexity"].get<double>());
    token_loss.push_back(j["loss"].get<double>());
  }
  for (size_t k = 1; k < word_ppl.size(); ++k) {
    // log word_ppl = loss x tokens / words: with the same counts, the ratio of the log word
    // perplexities is the ratio of the losses per token, which less context moves by under 1%
    // here (measured on a tiny model: 18.56, 18.60, 18.68 at 8192, 64, 8); counting words per
    // window added a word or more per window (about 22 to this text's 97 at 8 tokens).
    EXPECT_NEAR(std::log(word_ppl[k]) / std::log(word_ppl[0]), token_loss[k] / token_loss[0], 1e-9);
    EXPECT_NEAR(std::log(word_ppl[k]), std::log(word_ppl[0]), 0.05 * std::log(word_ppl[0]))
        << word_ppl[k] << " vs " << word_ppl[0];
  }
}

// Bad input: one line on stderr naming the path, exit 2.
TEST_F(Eval, BadInputIsOneLineNamingIt) {
  const std::string missing = (dir_ / "no_such.tsv").string();
  const Result a =
      run_q4eval({"--model", (dir_ / "out").string(), "--data", missing}, dir_ / "bad_data");
  EXPECT_EQ(a.code, 2);
  EXPECT_TRUE(contains(a.err, missing)) << a.err;
  EXPECT_EQ(std::count(a.err.begin(), a.err.end(), '\n'), 1) << a.err;
  const std::string no_model = (dir_ / "no_model.dat").string();
  const Result b =
      run_q4eval({"--model", no_model, "--data", (dir_ / "eval.tsv").string()}, dir_ / "bad_model");
  EXPECT_EQ(b.code, 2);
  EXPECT_TRUE(contains(b.err, no_model)) << b.err;
  EXPECT_EQ(std::count(b.err.begin(), b.err.end(), '\n'), 1) << b.err;
  // --seq-len 1 names the flag (it used to name the batcher's max_seq_len).
  const Result c = run_q4eval({"--model", (dir_ / "out").string(), "--data",
                               (dir_ / "eval.tsv").string(), "--seq-len", "1"},
                              dir_ / "bad_seq_len");
  EXPECT_EQ(c.code, 2);
  EXPECT_TRUE(contains(c.err, "--seq-len: expected >= 2")) << c.err;
  EXPECT_FALSE(contains(c.err, "max_seq_len")) << c.err;
  // A preference file is named as one; q4eval has no on_error to suggest.
  const fs::path pref = dir_ / "pairs.jsonl";
  std::ofstream(pref) << R"({"prompt": "a", "chosen": "b", "rejected": "c"})"
                      << "\n";
  const Result d = run_q4eval({"--model", (dir_ / "out").string(), "--data", pref.string()},
                              dir_ / "preference_data");
  EXPECT_EQ(d.code, 2);
  EXPECT_TRUE(contains(d.err, "a preference record")) << d.err;
  EXPECT_TRUE(contains(d.err, "not preference pairs")) << d.err;
  EXPECT_FALSE(contains(d.err, "on_error")) << d.err;
}

// A plain LoRA run that trains the norms and lm_head beside its adapters: the PEFT adapter it
// writes, on its base (init.dat), is the trained model: q4eval --adapter scores the trainer's
// validation loss after the last step (without the norms and lm_head in the folder it scored
// another model). q4eval names the adapter it applied, and refuses the adapter on the run's
// merged export (it is in there already).
TEST(EvalLora, AdapterOnItsBaseScoresAsTheTrainedModel) {
  const fs::path dir = fresh_dir(work_root("eval") / "lora_adapter");
  write_text(dir / "model.json", tiny_model_config(2));
  write_text(dir / "data.tsv", kTrain);
  write_text(dir / "eval.tsv", kEval);
  std::ostringstream y;
  y << "model:\n  config: model.json\n  tokenizer: " << kTokenizer
    << "\n  init: random\n  init_seed: 3\n  device: cpu\n  loss_chunk_tokens: 4\n"
    << "  master_dtype: fp32\n"
    << "train:\n  method: lora\n  trainable: {layers: all, norms: true, lm_head: true}\n"
    << "  steps: 6\n  batch_size: 4\n  seq_len: 48\n  seed: 5\n"
    << "lora:\n  rank: 4\n  alpha: 8\n  merge_aware: false\n"
    << "  targets: [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]\n"
    << "optim:\n  lr: 5.0e-2\n  state: fp32\n"
    << "data:\n  files: [data.tsv]\n  eval_files: [eval.tsv]\n"
    << "eval:\n  prompts: []\n  every: 3\n"
    << "output:\n  dir: " << (dir / "out").string() << "\n";
  write_text(dir / "config.yaml", y.str());
  const Result t = run_captured(kQ4train + quoted({"--config", (dir / "config.yaml").string()}),
                                dir / "train.out", dir / "train.err");
  ASSERT_EQ(t.code, 0) << t.err;
  const auto m = read_jsonl(dir / "out" / "metrics.jsonl");
  ASSERT_FALSE(m.empty());
  ASSERT_TRUE(m.back().contains("val_loss")) << m.back().dump();
  const double val = m.back()["val_loss"].get<double>();
  const fs::path adapter = dir / "out" / "model-adapter";
  const auto base_args = [&](const std::string& model) {
    return std::vector<std::string>{"--model",      model,
                                    "--config",     (dir / "model.json").string(),
                                    "--tokenizer",  kTokenizer,
                                    "--data",       (dir / "eval.tsv").string(),
                                    "--batch-size", "4",
                                    "--seq-len",    "48",
                                    "--json",       "--no-exact-match"};
  };
  auto args = base_args((dir / "out" / "init.dat").string());
  args.insert(args.end(), {"--adapter", adapter.string()});
  const Result r = run_q4eval(args, dir / "eval_adapter");
  ASSERT_EQ(r.code, 0) << r.err;
  const auto j = nlohmann::json::parse(r.out);  // one line; its "adapter" is an object
  std::cout << std::setprecision(17) << "q4eval --adapter loss " << j["loss"].get<double>()
            << ", trainer val_loss " << val << "\n";
  EXPECT_NEAR(j["loss"].get<double>(), val, 1e-5 * val) << j.dump();
  EXPECT_EQ(j["adapter"]["lora_pairs"], 14) << j.dump();
  EXPECT_EQ(j["adapter"]["full_tensors"], 10) << j.dump();  // 8 layer norms, model.norm, lm_head
  EXPECT_TRUE(contains(r.err, "q4eval: adapter " + adapter.string() + ": rank 4, alpha 8"))
      << r.err;
  // The base alone scores another loss: the test tells the models apart.
  const Result b = run_q4eval(base_args((dir / "out" / "init.dat").string()), dir / "eval_base");
  ASSERT_EQ(b.code, 0) << b.err;
  EXPECT_GT(std::abs(last_json(b)["loss"].get<double>() - val), 1e-3 * val);
  // The adapter on the run's merged export: refused, saying what to pass.
  const Result merged =
      run_q4eval({"--model", (dir / "out").string(), "--data", (dir / "eval.tsv").string(),
                  "--adapter", adapter.string(), "--quiet"},
                 dir / "eval_merged");
  EXPECT_EQ(merged.code, 2);
  EXPECT_TRUE(contains(merged.err, "merged export")) << merged.err;
  EXPECT_TRUE(contains(merged.err, "without --adapter")) << merged.err;
  EXPECT_EQ(std::count(merged.err.begin(), merged.err.end(), '\n'), 1) << merged.err;
}

// Python's len(re.split(r"\s+", s)), worked out by hand.
TEST(EvalMetrics, CountWordsAsPythonSplits) {
  EXPECT_EQ(q4::eval::count_words(""), 1);
  EXPECT_EQ(q4::eval::count_words("one"), 1);
  EXPECT_EQ(q4::eval::count_words("a b"), 2);
  EXPECT_EQ(q4::eval::count_words("  a"), 2);         // ['', 'a']
  EXPECT_EQ(q4::eval::count_words("x "), 2);          // ['x', '']
  EXPECT_EQ(q4::eval::count_words(" foo bar\n"), 4);  // ['', 'foo', 'bar', '']
  EXPECT_EQ(q4::eval::count_words("a\n\n \tb"), 2);   // one run of mixed whitespace
  EXPECT_EQ(q4::eval::count_words("a\xC2\xA0"
                                  "b"),
            2);  // U+00A0 is whitespace
  EXPECT_EQ(q4::eval::count_words("a\xE3\x80\x80"
                                  "b"),
            2);  // U+3000 ideographic space
  EXPECT_EQ(q4::eval::count_words("a\xE2\x80\x8B"
                                  "b"),
            1);  // U+200B is not
  EXPECT_EQ(q4::eval::count_words("\x1F"
                                  "x"),
            2);  // U+001F unit separator is
  EXPECT_EQ(q4::eval::count_words("a\xFF"
                                  "b"),
            1);  // invalid byte: not a space
}

// The metrics of hand-made totals against the formulas evaluated directly in fp64.
TEST(EvalMetrics, MetricsFromTotals) {
  q4::eval::Totals t;
  t.nll = 12.5;
  t.tokens = 10;
  t.words = 4;
  t.bytes = 20;
  const auto m = q4::eval::metrics(t);
  EXPECT_DOUBLE_EQ(m.loss, 1.25);
  EXPECT_DOUBLE_EQ(m.perplexity, std::exp(1.25));
  EXPECT_DOUBLE_EQ(m.word_perplexity, std::exp(12.5 / 4));
  EXPECT_DOUBLE_EQ(m.byte_perplexity, std::exp(12.5 / 20));
  EXPECT_DOUBLE_EQ(m.bits_per_byte, 12.5 / 20 / std::log(2.0));
  EXPECT_NEAR(m.bits_per_byte, 0.9016844005556021, 1e-15);  // 0.625 / ln 2
  q4::eval::Totals none;
  EXPECT_TRUE(std::isnan(q4::eval::metrics(none).loss));
  EXPECT_TRUE(std::isnan(q4::eval::metrics(none).bits_per_byte));
}

// The scored text of hand-made examples: position 0 is never scored, each run of supervised
// labels is one document, <|im_end|> adds no text, -100 ends a run; the windows of one document
// (window 1 continuing window 0, their shared token counted once) are one text.
TEST(EvalMetrics, ScoredTextOfExamples) {
  const auto tok = q4::data::Tokenizer::from_file(kTokenizer);
  const auto hello = tok.encode("Hello world");
  const auto foo = tok.encode(" foo bar\n");
  q4::data::Example a;
  a.input_ids = {hello[0]};  // position 0: supervised but never scored
  a.input_ids.insert(a.input_ids.end(), hello.begin(), hello.end());
  a.input_ids.push_back(tok.im_end_id());
  a.input_ids.push_back(tok.im_start_id());
  a.input_ids.insert(a.input_ids.end(), foo.begin(), foo.end());
  a.labels = a.input_ids;
  a.labels[hello.size() + 2] = q4::data::kIgnoreIndex;
  q4::data::Example b;  // a second example: one token of text
  b.input_ids = {hello[0], hello[0]};
  b.labels = {q4::data::kIgnoreIndex, hello[0]};
  const auto c = q4::eval::count_scored_text({a, b}, tok);
  const std::string first = tok.decode({hello[0]});
  EXPECT_EQ(c.bytes, 11 + 9 + static_cast<int64_t>(first.size()));
  EXPECT_EQ(c.words, 2 + 4 + q4::eval::count_words(first));
  // "one two three four" in windows of 3 tokens sharing one: counted as the whole text.
  const auto ids = tok.encode("one two three four five six");
  ASSERT_GE(ids.size(), 6u);
  std::vector<q4::data::Example> windows;
  for (size_t start = 0, k = 0;; start += 2, ++k) {
    const size_t end = std::min(ids.size(), start + 3);
    q4::data::Example w;
    w.input_ids.assign(ids.begin() + static_cast<std::ptrdiff_t>(start),
                       ids.begin() + static_cast<std::ptrdiff_t>(end));
    w.labels = w.input_ids;
    w.window = static_cast<int64_t>(k);
    windows.push_back(w);
    if (end == ids.size()) break;
  }
  const auto whole = q4::eval::count_scored_text(windows, tok);
  const std::string text = tok.decode({ids.begin() + 1, ids.end()});
  EXPECT_EQ(whole.words, q4::eval::count_words(text));
  EXPECT_EQ(whole.bytes, static_cast<int64_t>(text.size()));
}

// What exact match compares: the last answer of a prompt/answer example; text has none.
TEST(EvalMetrics, AnswerCaseOfPairsAndText) {
  const auto tok = q4::data::Tokenizer::from_file(kTokenizer);
  const auto pair = q4::data::make_pair_example(tok, "What is 2 + 2?", "  4.\n", "Be brief.");
  const auto c = q4::eval::answer_case(pair, tok);
  ASSERT_TRUE(c.has_value());
  EXPECT_EQ(q4::eval::strip(c->reference), "4.");
  EXPECT_EQ(tok.decode({c->prompt_ids.end() - 3, c->prompt_ids.end()}), "<|im_start|>assistant\n");
  const auto text = q4::data::load_dataset_from_string("Just text.\n", "t.txt", tok);
  ASSERT_EQ(text.examples.size(), 1u);
  EXPECT_FALSE(q4::eval::answer_case(text.examples[0], tok).has_value());
  EXPECT_EQ(q4::eval::strip(" \t a b \n"), "a b");
}

// Exact match in batches: every batch size gives the verdicts of one prompt at a time, in file
// order; a batch generates up to its longest limit and each row is cut at its own (the second
// case matches within its limit and would not past it); ids without a token spell no answer.
TEST(EvalMetrics, ExactMatchInBatchesScoresEachRowAsAlone) {
  const auto tok = q4::data::Tokenizer::from_file(kTokenizer);
  const auto ids = [&](const std::string& text) {
    const auto t = tok.encode(text);
    return std::vector<int64_t>(t.begin(), t.end());
  };
  const int64_t newline = ids("\n").at(0), im_end = tok.im_end_id();
  using q4::eval::AnswerCase;
  using q4::eval::kExtraAnswerTokens;
  std::vector<AnswerCase> cases;
  std::vector<std::vector<int64_t>> scripted;  // what the "model" generates for case i alone
  const auto add = [&](const std::string& reference, std::vector<int64_t> out) {
    AnswerCase c;
    c.prompt_ids = ids("prompt " + std::to_string(cases.size()));
    c.reference = reference;
    c.reference_tokens = static_cast<int64_t>(ids(reference).size());
    cases.push_back(c);
    scripted.push_back(std::move(out));
  };
  const auto then = [](std::vector<int64_t> a, const std::vector<int64_t>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  add("Paris.", then(ids("Paris."), {im_end}));  // a match
  // The reference, then newlines up to its limit (stripped: a match), then text past the limit.
  const std::vector<int64_t> pad(static_cast<size_t>(kExtraAnswerTokens), newline);
  add("4.", then(then(ids("4."), pad), then(ids("X"), {im_end})));
  add("Green.", then(ids("Blue."), {im_end}));                        // wrong
  add("Apple.", {tok.vocab_size() + 3, im_end});                      // an id without a token
  add("A much longer reference answer than the others.",             // the longest limit
      then(ids("A much longer reference answer than the others."), {im_end}));
  const int64_t want_matches = 3;

  for (const int64_t batch : {1, 2, 3, 5, 8}) {
    int64_t calls = 0, next = 0;
    const auto generate = [&](const std::vector<std::vector<int64_t>>& prompts, int64_t max_new) {
      ++calls;
      EXPECT_LE(static_cast<int64_t>(prompts.size()), batch);
      int64_t longest = 0;
      std::vector<std::vector<int64_t>> out;
      for (const auto& p : prompts) {
        const auto i = static_cast<size_t>(next++);
        EXPECT_EQ(p, cases.at(i).prompt_ids) << "file order";
        longest = std::max(longest, cases[i].reference_tokens + kExtraAnswerTokens);
        // Up to max_new tokens, stopping after a stop id, as q4::model::generate.
        std::vector<int64_t> r;
        for (const int64_t id : scripted[i]) {
          if (static_cast<int64_t>(r.size()) == max_new) break;
          r.push_back(id);
          if (id == im_end) break;
        }
        out.push_back(r);
      }
      EXPECT_EQ(max_new, longest) << "a batch generates up to its longest limit";
      return out;
    };
    const q4::eval::ExactMatch em = q4::eval::exact_match(cases, tok, batch, generate);
    EXPECT_EQ(em.examples, 5) << "batch " << batch;
    EXPECT_EQ(em.matches, want_matches) << "batch " << batch;
    EXPECT_EQ(calls, (5 + batch - 1) / batch);
    EXPECT_EQ(next, 5);
  }
}

}  // namespace

}  // namespace q4::test::eval_test
