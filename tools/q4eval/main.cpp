// q4eval: held-out evaluation of a Qwen3 model (.dat, q4train run directory, Hugging Face or
// model folder, loaded for inference as q4chat loads it: NVFP4 linears as dequantize(q)) on text
// and chat data files read as the trainer reads them: mean token loss, perplexity, word and byte
// perplexity, bits per byte, and greedy exact match on prompt/answer examples (docs/eval.md).
// One summary line on stdout, or one JSON object with --json.
// Exit codes: 0 ok, 2 usage/config/input error, 1 runtime.
#include <fmt/format.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "eval.h"
#include "q4/data/dataset.h"
#include "q4/io/bounded_read.h"
#include "q4/trainer/config.h"
#include "q4/trainer/estimate.h"
#include "session.h"

namespace {

using q4::chat::as_input;

// Data files are read line by line; this only bounds what stat accepts.
constexpr size_t kMaxDataBytes = size_t{1} << 40;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4eval: held-out loss, perplexity and exact match of a Qwen3 model"};
  std::string model_arg, config, tokenizer, system, device = "cpu";
  std::vector<std::string> files;
  int64_t batch_size = 0, seq_len = 0, max_examples = 0;
  bool json = false, quiet = false, no_exact_match = false;
  app.add_option("--model", model_arg,
                 "a .dat file, a q4train run directory, a Hugging Face folder or a model folder")
      ->required();
  app.add_option("--data", files, "data files (TSV, JSONL, JSON array, text), as the trainer reads")
      ->required();
  app.add_flag("--json", json, "one JSON object on stdout instead of the summary line");
  app.add_option("--config", config, "Qwen3 config.json (default: found from --model)");
  app.add_option("--tokenizer", tokenizer, "tokenizer.json (default: found from --model)");
  auto* system_opt =
      app.add_option("--system", system, "system prompt (default: a run's data.system_prompt)");
  app.add_option("--batch-size", batch_size, "rows per batch (default: a run's train.batch_size)");
  app.add_option("--seq-len", seq_len, "tokens per row (default: a run's train.seq_len)");
  app.add_option("--max-examples", max_examples, "only the first N examples (0: all)")
      ->capture_default_str();
  app.add_flag("--no-exact-match", no_exact_match, "skip the greedy generation of answers");
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_flag("--quiet", quiet, "no load lines on stderr");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  return q4::chat::run_tool("q4eval", [&] {
    using namespace q4;
    const auto t0 = std::chrono::steady_clock::now();
    model::ModelOptions opt = chat::inference_options(device);
    // The run's settings (or the trainer's defaults): data options, batching and truncation.
    trainer::Config c;
    chat::ModelPaths paths;
    std::unique_ptr<data::Tokenizer> tok;
    std::vector<data::Example> examples;
    as_input([&] {
      TORCH_CHECK(batch_size >= 0, "--batch-size: expected >= 1 (0: the default), got ",
                  batch_size);
      TORCH_CHECK(seq_len >= 0, "--seq-len: expected >= 1 (0: the default), got ", seq_len);
      TORCH_CHECK(max_examples >= 0, "--max-examples: expected >= 0, got ", max_examples);
      for (const auto& f : files) io::check_regular_file(f, kMaxDataBytes, "--data");
      paths = chat::resolve_model_paths(model_arg, config, tokenizer);
      const std::filesystem::path run_config = std::filesystem::path(model_arg) / "config.yaml";
      if (std::filesystem::is_directory(model_arg) && std::filesystem::exists(run_config)) {
        c = trainer::load_config(run_config.string());
      } else {
        c.data.files = files;  // data.truncation auto resolves on the files evaluated
      }
      if (batch_size > 0) c.train.batch_size = batch_size;
      if (seq_len > 0) c.train.seq_len = seq_len;
      if (system_opt->count() > 0) c.data.system_prompt = system;
      tok = std::make_unique<data::Tokenizer>(chat::load_tokenizer(paths));
      const data::DatasetOptions dopt = trainer::dataset_options(c);
      for (const auto& f : files) {
        auto ds = data::load_dataset(f, *tok, dopt);
        if (!quiet) std::cerr << "q4eval: " << ds.summary.to_string() << "\n";
        for (auto& e : ds.examples) examples.push_back(std::move(e));
      }
      TORCH_CHECK(!examples.empty(), "--data: no examples in ", files[0],
                  files.size() > 1 ? " and the other files" : "");
      if (max_examples > 0 && static_cast<int64_t>(examples.size()) > max_examples) {
        examples.resize(static_cast<size_t>(max_examples));
      }
    });
    // The run's loss chunking (it orders the fp32 sums of the loss) and, on the run's kind of
    // device, its compute dtype: the trainer's validation arithmetic.
    const model::ModelOptions run_opt = as_input([&] { return trainer::model_options(c); });
    opt.loss_chunk_tokens = run_opt.loss_chunk_tokens;
    if (run_opt.device.type() == opt.device.type()) opt.compute_dtype = run_opt.compute_dtype;
    chat::LoadedModel loaded = as_input([&] { return chat::load_model(paths, *tok, opt); });
    if (!quiet) {
      std::cerr << fmt::format("q4eval: {}: {} ({} layers, hidden {}, {}), loaded in {:.1f} s\n",
                               paths.described, paths.weights, loaded.config.num_hidden_layers,
                               loaded.config.hidden_size, device, seconds_since(t0));
    }
    // The trainer's validation batching (trainer.cpp batcher_options, shuffle off).
    data::BatcherOptions bo;
    bo.batch_size = c.train.batch_size;
    bo.max_seq_len = c.train.seq_len;
    bo.seed = static_cast<uint64_t>(c.train.seed);
    bo.shuffle = false;
    bo.pack = c.data.packing;
    bo.pack_window = c.data.pack_window;
    const trainer::Truncation truncation = trainer::resolved_truncation(c);
    bo.truncation = trainer::to_data(truncation);
    bo.pad_id = tok->endoftext_id();
    if (opt.device.is_cuda()) {
      bo.fixed_len = bo.pack;
      bo.pad_multiple = 64;
      bo.flatten = true;
    }
    auto batcher = as_input([&] { return data::Batcher(examples, bo); });
    const auto& ts = batcher.truncation_stats();
    if (!quiet && (ts.truncated || ts.dropped)) {
      std::cerr << "q4eval: truncation to " << bo.max_seq_len << " tokens ("
                << trainer::to_string(truncation) << "): " << ts.to_string() << "\n";
    }
    const auto t1 = std::chrono::steady_clock::now();
    const eval::Totals totals = eval::score(*loaded.model, batcher, *tok);
    const eval::Metrics m = eval::metrics(totals);
    const double score_s = seconds_since(t1);
    // Exact match is reported when there are prompt/answer examples to generate for.
    const eval::ExactMatch em =
        no_exact_match ? eval::ExactMatch{} : eval::exact_match(*loaded.model, examples, *tok);
    if (json) {
      nlohmann::json j = {{"model", model_arg},
                          {"data", files},
                          {"examples", static_cast<int64_t>(examples.size())},
                          {"scored_examples", batcher.num_examples()},
                          {"tokens", totals.tokens},
                          {"nll", totals.nll},
                          {"loss", m.loss},
                          {"perplexity", m.perplexity},
                          {"words", totals.words},
                          {"bytes", totals.bytes},
                          {"word_perplexity", m.word_perplexity},
                          {"byte_perplexity", m.byte_perplexity},
                          {"bits_per_byte", m.bits_per_byte},
                          {"batch_size", bo.batch_size},
                          {"seq_len", bo.max_seq_len},
                          {"packing", bo.pack},
                          {"truncation", trainer::to_string(truncation)},
                          {"device", device}};
      if (em.examples > 0) {
        j["exact_match"] = static_cast<double>(em.matches) / static_cast<double>(em.examples);
        j["exact_match_examples"] = em.examples;
        j["exact_match_hits"] = em.matches;
      }
      std::cout << j.dump() << "\n";
    } else {
      std::string line = fmt::format(
          "loss {:.4f}  ppl {:.3f}  word_ppl {:.3f}  bits_per_byte {:.4f}  over {} tokens "
          "({} words, {} bytes) of {} examples",
          m.loss, m.perplexity, m.word_perplexity, m.bits_per_byte, totals.tokens, totals.words,
          totals.bytes, examples.size());
      if (em.examples > 0) {
        line +=
            fmt::format("  exact_match {}/{} ({:.1f}%)", em.matches, em.examples,
                        100.0 * static_cast<double>(em.matches) / static_cast<double>(em.examples));
      }
      std::cout << line << "\n";
    }
    if (!quiet) {
      std::cerr << fmt::format("q4eval: scored in {:.1f} s, {:.1f} s in all\n", score_s,
                               seconds_since(t0));
    }
    return 0;
  });
}
