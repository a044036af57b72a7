// q4eval: held-out evaluation of a Qwen3 model (.dat, q4train run directory, Hugging Face or
// model folder, loaded for inference as q4chat loads it: NVFP4 linears as dequantize(q)) on text
// and chat data files read as the trainer reads them: mean token loss, perplexity, word and byte
// perplexity, bits per byte, and greedy exact match on prompt/answer examples (docs/eval.md).
// One summary line on stdout, or one JSON object with --json.
// Exit codes: 0 ok, 2 usage/config/input error, 1 runtime.
#include <ATen/ATen.h>
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "../tool_main.h"
#include "eval.h"
#include "q4/data/dataset.h"
#include "q4/io/bounded_read.h"
#include "q4/io/enum_names.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/options.h"
#include "session.h"

namespace {

using namespace q4;
using chat::as_input;

// Data files are read line by line; this only bounds what stat accepts.
constexpr size_t kMaxDataBytes = size_t{1} << 40;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Args {
  chat::ModelArgs m;
  std::vector<std::string> files;
  int64_t batch_size = 0, seq_len = 0, max_examples = 0;
  std::string truncation;  // empty: the run's data.truncation (auto)
  std::string text_unit;   // empty: the run's data.text_unit (file)
  bool json = false, quiet = false, no_exact_match = false;
};

// What is evaluated: the run's settings (or the trainer's defaults) with the command line's
// overrides, the model's paths, its tokenizer and the examples of every --data file.
struct Inputs {
  trainer::Config config;
  chat::ModelPaths paths;
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::vector<data::Example> examples;
};

Inputs read_inputs(const Args& a) {
  TORCH_CHECK(a.batch_size >= 0, "--batch-size: expected >= 1 (0: the default), got ",
              a.batch_size);
  // A row scores its next tokens: it needs two (the batcher's own minimum).
  TORCH_CHECK(a.seq_len == 0 || a.seq_len >= 2, "--seq-len: expected >= 2 (0: the default), got ",
              a.seq_len);
  TORCH_CHECK(a.max_examples >= 0, "--max-examples: expected >= 0, got ", a.max_examples);
  for (const auto& f : a.files) io::check_regular_file(f, kMaxDataBytes, "--data");
  Inputs in;
  in.paths = chat::resolve_model_paths(a.m.model, a.m.config, a.m.tokenizer);
  trainer::Config& c = in.config;
  const std::filesystem::path run_config = std::filesystem::path(a.m.model) / "config.yaml";
  if (std::filesystem::is_directory(a.m.model) && std::filesystem::exists(run_config)) {
    c = trainer::load_config(run_config.string());
  } else {
    c.data.files = a.files;
  }
  if (a.batch_size > 0) c.train.batch_size = a.batch_size;
  if (a.seq_len > 0) c.train.seq_len = a.seq_len;
  if (!a.truncation.empty())
    c.data.truncation = io::parse_enum<data::Truncation>(a.truncation, "--truncation");
  if (!a.text_unit.empty())
    c.data.text_unit = io::parse_enum<data::TextUnit>(a.text_unit, "--text-unit");
  if (a.m.system_given()) c.data.system_prompt = a.m.system;
  // The template: --chat-template / --enable-thinking, else the run's, else the model folder's.
  in.paths.chat_template = c.data.chat_template;
  const data::ChatOptions chat_opt = chat::chat_options(a.m, in.paths);
  c.data.chat_template = chat_opt.chat_template;
  if (chat_opt.enable_thinking.has_value()) {
    c.data.enable_thinking =
        *chat_opt.enable_thinking ? trainer::AutoBool::kTrue : trainer::AutoBool::kFalse;
  }
  in.tokenizer = std::make_unique<data::Tokenizer>(chat::load_tokenizer(in.paths));
  data::DatasetOptions dopt = trainer::dataset_options(c);
  // q4eval has no on_error flag (a run's config.yaml may set data.on_error) and scores supervised
  // examples only.
  dopt.skip_hint = "";
  dopt.preference_hint =
      "q4eval scores supervised examples, not preference pairs (give it prompt/completion "
      "records)";
  for (const auto& f : a.files) {
    auto ds = data::load_dataset(f, *in.tokenizer, dopt);
    if (!a.quiet) std::cerr << "q4eval: " << ds.summary.to_string() << "\n";
    for (auto& e : ds.examples) in.examples.push_back(std::move(e));
  }
  TORCH_CHECK(!in.examples.empty(), "--data: no examples in ", a.files[0],
              a.files.size() > 1 ? " and the other files" : "");
  if (a.max_examples > 0 && static_cast<int64_t>(in.examples.size()) > a.max_examples) {
    in.examples.resize(static_cast<size_t>(a.max_examples));
  }
  return in;
}

struct Report {
  eval::Totals totals;
  eval::ExactMatch em;
  data::BatcherOptions batching;
  int64_t scored_examples = 0;
};

void print_report(const Args& a, const Inputs& in, const chat::LoadedModel& loaded,
                  const Report& r) {
  const eval::Metrics m = eval::metrics(r.totals);
  const std::string truncation = data::to_string(in.config.data.truncation);
  const double em_rate =
      r.em.examples > 0 ? static_cast<double>(r.em.matches) / static_cast<double>(r.em.examples)
                        : 0.0;
  if (a.json) {
    nlohmann::json j = {{"model", a.m.model},
                        {"data", a.files},
                        {"examples", static_cast<int64_t>(in.examples.size())},
                        {"scored_examples", r.scored_examples},
                        {"tokens", r.totals.tokens},
                        {"nll", r.totals.nll},
                        {"loss", m.loss},
                        {"perplexity", m.perplexity},
                        {"words", r.totals.words},
                        {"bytes", r.totals.bytes},
                        {"word_perplexity", m.word_perplexity},
                        {"byte_perplexity", m.byte_perplexity},
                        {"bits_per_byte", m.bits_per_byte},
                        {"batch_size", r.batching.batch_size},
                        {"seq_len", r.batching.max_seq_len},
                        {"packing", r.batching.pack},
                        {"truncation", truncation},
                        {"device", a.m.device}};
    if (!a.m.adapter.empty()) {
      const auto& ac = loaded.adapter_config;
      j["adapter"] = {{"path", a.m.adapter},
                      {"rank", ac.lora.rank},
                      {"alpha", ac.lora.alpha},
                      {"targets", ac.lora.targets},
                      {"lora_pairs", loaded.adapter_load.lora_pairs},
                      {"full_tensors", loaded.adapter_load.full_tensors}};
    }
    if (r.em.examples > 0) {
      j["exact_match"] = em_rate;
      j["exact_match_examples"] = r.em.examples;
      j["exact_match_hits"] = r.em.matches;
    }
    std::cout << j.dump() << "\n";
    return;
  }
  std::string line = fmt::format(
      "loss {:.4f}  ppl {:.3f}  word_ppl {:.3f}  bits_per_byte {:.4f}  over {} tokens "
      "({} words, {} bytes) of {} examples",
      m.loss, m.perplexity, m.word_perplexity, m.bits_per_byte, r.totals.tokens, r.totals.words,
      r.totals.bytes, in.examples.size());
  if (r.em.examples > 0) {
    line +=
        fmt::format("  exact_match {}/{} ({:.1f}%)", r.em.matches, r.em.examples, 100.0 * em_rate);
  }
  std::cout << line << "\n";
}

int run(const Args& a) {
  const auto t0 = std::chrono::steady_clock::now();
  Inputs in = as_input([&] { return read_inputs(a); });
  model::ModelOptions opt = chat::inference_options(a.m.device);
  // The run's loss chunking (it orders the fp32 sums of the loss) and, on the run's kind of
  // device, its compute dtype: the trainer's validation arithmetic.
  const model::ModelOptions run_opt = as_input([&] { return trainer::model_options(in.config); });
  opt.loss_chunk_tokens = run_opt.loss_chunk_tokens;
  if (run_opt.device.type() == opt.device.type()) opt.compute_dtype = run_opt.compute_dtype;
  chat::LoadedModel loaded =
      as_input([&] { return chat::load_model(in.paths, *in.tokenizer, opt, a.m.adapter); });
  if (!a.quiet) {
    std::cerr << fmt::format("q4eval: {}: {} ({} layers, hidden {}, {}), loaded in {:.1f} s\n",
                             in.paths.described, in.paths.weights, loaded.config.num_hidden_layers,
                             loaded.config.hidden_size, a.m.device, seconds_since(t0));
    if (!loaded.adapter_summary.empty()) std::cerr << "q4eval: " << loaded.adapter_summary << "\n";
  }
  // The trainer's validation batching on the device evaluated on (shuffle off).
  trainer::Config on_device = in.config;
  on_device.model.device = a.m.device;
  Report r;
  const trainer::ObjectiveNeeds needs = trainer::objective_needs(on_device);
  r.batching =
      trainer::batcher_options(on_device, in.tokenizer->endoftext_id(),
                               trainer::resolved_packing(on_device, needs), needs.group_size());
  r.batching.shuffle = false;
  auto batcher = as_input([&] { return data::Batcher(in.examples, r.batching); });
  const auto& ts = batcher.truncation_stats();
  if (!a.quiet && (ts.truncated || ts.dropped || ts.split)) {
    std::cerr << "q4eval: truncation to " << r.batching.max_seq_len << " tokens ("
              << data::describe(in.config.data.truncation) << "): " << ts.to_string() << "\n";
  }
  // Even with --quiet: a score over part of the data must not pass unnoticed.
  const std::string warn = data::truncation_warning(
      ts, r.batching.max_seq_len, in.config.data.truncation, "--seq-len", "--truncation");
  if (!warn.empty()) std::cerr << "q4eval: warning: " << warn << "\n";
  const auto t1 = std::chrono::steady_clock::now();
  r.totals = eval::score(*loaded.model, batcher, *in.tokenizer);
  r.scored_examples = batcher.num_examples();
  const double score_s = seconds_since(t1);
  // Exact match is reported when there are prompt/answer examples to generate for.
  if (!a.no_exact_match) {
    r.em = eval::exact_match(*loaded.model, in.examples, *in.tokenizer, r.batching.batch_size);
  }
  print_report(a, in, loaded, r);
  if (!a.quiet) {
    std::cerr << fmt::format("q4eval: scored in {:.1f} s, {:.1f} s in all\n", score_s,
                             seconds_since(t0));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4eval: held-out loss, perplexity and exact match of a Qwen3 model"};
  Args a;
  chat::add_model_options(app, a.m);
  app.add_option("--data", a.files,
                 "data files (TSV, JSONL, JSON array, text), as the trainer reads")
      ->required();
  app.add_flag("--json", a.json, "one JSON object on stdout instead of the summary line");
  app.add_option("--batch-size", a.batch_size,
                 "rows per batch, and prompts generated at once for exact match (default: a "
                 "run's train.batch_size)");
  app.add_option("--seq-len", a.seq_len, "tokens per row (default: a run's train.seq_len)");
  app.add_option("--truncation", a.truncation,
                 "examples longer than --seq-len: " + io::enum_choices<data::Truncation>() +
                     " (default: a run's data.truncation, else auto: plain text split into "
                     "windows, every token scored)");
  app.add_option("--text-unit", a.text_unit,
                 "a text file's examples: " + io::enum_choices<data::TextUnit>() +
                     " (default: a run's data.text_unit, else file)");
  app.add_option("--max-examples", a.max_examples, "only the first N examples (0: all)")
      ->capture_default_str();
  app.add_flag("--no-exact-match", a.no_exact_match, "skip the greedy generation of answers");
  app.add_flag("--quiet", a.quiet, "no load lines on stderr");
  tools::run_tool("q4eval", app, argc, argv, [&] { return run(a); });
}
