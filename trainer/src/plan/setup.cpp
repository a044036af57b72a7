// Set-up of a run: model, tokenizer, data and optimizer (see setup.h).
#include "q4/trainer/plan/setup.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <numeric>

#include "q4/io/atomic_file.h"
#include "q4/model/dat_file.h"
#include "q4/model/hf_interop.h"
#include "q4/data/prompt_dataset.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/metrics.h"
#include "q4/trainer/runtime/nvtx.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

constexpr const char* kHfImportFile = "hf_import.dat";  // model.weights given as an HF folder

// splitmix64: the portable generator behind the held-out split (same on every platform).
uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// Loads the model: from model.weights, or a random init written once to <dir>/init.dat (so the
// export has a source file and loading follows the same path as real weights).
struct LoadedModel {
  std::unique_ptr<model::Qwen3Model> model;
  std::string source_path;  // the .dat export_to() copies from
};

// `in_memory`: a random init stays in memory (the probe: nothing written, no export source).
LoadedModel load_weights(const Config& c, const model::Qwen3Config& mc, std::ostream& out,
                         bool in_memory = false) {
  LoadedModel lm;
  const auto opt = as_input_error("model", [&] {
    auto o = model_options(c);
    o.validate();
    o.trainable.validate(mc.num_hidden_layers);
    return o;
  });
  if (c.model.init == InitKind::kRandom && in_memory) {
    lm.model = std::make_unique<model::Qwen3Model>(
        model::Qwen3Model::random_init(mc, opt, c.model.init_seed, c.model.init_std));
    return lm;
  }
  if (c.model.init == InitKind::kRandom) {
    lm.source_path = (fs::path(c.output.dir) / kInitFile).string();
    if (!fs::exists(lm.source_path)) {
      auto init_opt = opt;
      init_opt.trainable = model::TrainableSpec::nothing();
      init_opt.lora = model::LoraSpec{};  // the base model; adapters start at load
      init_opt.master_dtype = at::kFloat;
      init_opt.compute_dtype = at::kFloat;
      init_opt.device = at::kCPU;
      auto init = model::Qwen3Model::random_init(mc, init_opt, c.model.init_seed, c.model.init_std);
      // Plain precision starts from dense weights: its export is then the trained
      // full-precision model (16-bit linears), not a quantization of it.
      model::write_dat(init, lm.source_path, c.model.quantize_lm_head && c.model.fake_quant,
                       /*quantize_linears=*/c.model.fake_quant);
      out << "random init (seed " << c.model.init_seed << ") written to " << lm.source_path << "\n";
    }
  } else if (model::is_hf_folder(c.model.weights)) {
    // A Hugging Face folder is imported once per run into the shipped .dat layout, which is
    // then loaded and exported like any .dat (docs/interop.md). Plain precision keeps dense
    // linears dense: quantizing them would change the model it trains.
    lm.source_path = (fs::path(c.output.dir) / kHfImportFile).string();
    const auto t0 = Clock::now();
    model::HfImportOptions import_opt;
    import_opt.keep_dense = !c.model.fake_quant;
    import_opt.block_rule = c.quant.block_rule;
    const auto rep = as_input_error("model.weights", [&] {
      return model::import_hf(c.model.weights, lm.source_path, import_opt);
    });
    out << fmt::format("imported {} ({} checkpoint) to {} in {:.1f} s\n", c.model.weights,
                       rep.source_format, lm.source_path, ms_since(t0) / 1000.0);
  } else {
    lm.source_path = c.model.weights;
  }
  const std::string src = lm.source_path;
  lm.model = as_input_error("model.weights", [&] {
    model::DatReader reader(src);
    return std::make_unique<model::Qwen3Model>(model::Qwen3Model::load(mc, reader, opt));
  });
  return lm;
}

}  // namespace

// An input file: a regular file (or a link to one). A directory, FIFO or device is named as
// such (a FIFO would block the read, a device like /dev/zero never end it).
void require_file(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return;
  const std::string kind = io::non_regular_kind(path);
  if (!kind.empty()) {
    throw ConfigError("config key " + key + ": " + path + " is " + kind + ", not a regular file");
  }
  throw ConfigError("config key " + key + ": file not found: " + path);
}

model::Qwen3Config load_model_config(const Config& c) {
  require_file(c.model.config, "model.config");
  auto mc = as_input_error("model.config",
                           [&] { return model::Qwen3Config::from_json_file(c.model.config); });
  // train.trainable.layers against the model's layer count, in the config's own words.
  (void)c.train.trainable.layers.resolve(mc.num_hidden_layers);
  if (c.train.recompute_layers > mc.num_hidden_layers) {
    throw ConfigError(fmt::format(
        "config key train.recompute_layers: {} is more than the {} decoder layers of {}",
        c.train.recompute_layers, mc.num_hidden_layers, c.model.config));
  }
  const int64_t recomputed =
      c.train.recompute_layers < 0 ? mc.num_hidden_layers : c.train.recompute_layers;
  const int64_t kept = c.train.recompute_keep_attention + c.train.recompute_keep_mlp;
  if (c.train.gradient_checkpointing == Recompute::kTrue && kept > recomputed) {
    throw ConfigError(fmt::format(
        "config keys train.recompute_keep_attention + train.recompute_keep_mlp: {} + {} is more "
        "than the {} recomputed decoder layers (train.recompute_layers)",
        c.train.recompute_keep_attention, c.train.recompute_keep_mlp, recomputed));
  }
  // lora.rank against the adapted linears' dimensions, before anything is sized from it.
  if (c.train.method == TrainMethod::kLora) {
    model::LoraSpec lora;
    lora.rank = c.lora.rank;
    lora.alpha = c.lora.alpha;
    lora.targets = c.lora.targets;
    lora.merge_aware = c.lora.merge_aware;
    try {
      lora.validate(mc);
    } catch (const c10::Error& e) {
      throw ConfigError("config key " + std::string(e.what_without_backtrace()));
    }
  }
  return mc;
}

// Files that the run needs before it loads anything.
void check_input_files(const Config& c, const ObjectiveNeeds& needs, bool need_data) {
  require_file(c.model.config, "model.config");
  require_file(c.model.tokenizer, "model.tokenizer");
  if (c.model.init == InitKind::kFile && !model::is_hf_folder(c.model.weights)) {
    require_file(c.model.weights, "model.weights");
  }
  if (need_data) {
    if (c.data.files.empty()) {
      throw ConfigError("config key data.files: at least one training file is required");
    }
    for (const auto& f : c.data.files) require_file(f, "data.files");
    for (const auto& f : c.data.eval_files) require_file(f, "data.eval_files");
    // The teacher (or its top-K file) before anything is written or loaded.
    for (const auto& [key, path] : needs.required_files) require_file(path, key);
    if (needs.teacher_forward) {
      const FrozenModelSpec teacher = resolved_frozen_spec(teacher_spec(c));
      if (!model::is_hf_folder(teacher.path)) require_file(teacher.path, "distill.teacher");
    }
  }
}

// on_error: skip: a warning on stderr naming every reported line and its reason (the summary on
// stdout is easy to miss among the resolved config).
void report_skipped_lines(const data::LoadSummary& s, std::ostream& err) {
  if (s.skipped == 0) return;
  err << fmt::format("warning: {}: skipped {} malformed line{} (data.on_error: skip)\n", s.path,
                     s.skipped, s.skipped == 1 ? "" : "s");
  for (const auto& k : s.first_skipped) {
    err << fmt::format("warning: {}:{}: skipped: {}\n", s.path, k.line, k.reason);
  }
  const auto shown = static_cast<int64_t>(s.first_skipped.size());
  if (s.skipped > shown) err << fmt::format("warning: ... and {} more\n", s.skipped - shown);
}

// No example at all (empty, blank, comment-only or all-skipped files): say so, rather than
// blaming train.seq_len.
std::string no_examples_message(const Config& c) {
  std::string files;
  for (const auto& f : c.data.files) files += (files.empty() ? "" : ", ") + f;
  // The reason depends on the format: name each file's.
  bool tsv = false;
  for (const auto& f : c.data.files) tsv |= fs::path(f).extension() == ".tsv";
  return "data.files: no training examples in " + files +
         " (every line or record is blank, a comment, a header, an empty JSON array or skipped as "
         "malformed" +
         (tsv ? std::string("; a TSV line is prompt<TAB>answer") : std::string()) +
         "; formats: docs/data.md)";
}

// data.eval_fraction: ceil(fraction x N) groups of `group` consecutive examples (at least one;
// preference pairs are groups of 2) chosen by a Fisher-Yates shuffle seeded by train.seed are
// moved from `train` to the returned list; both keep file order. The same seed and data give the
// same split (resume relies on it).
std::vector<data::Example> hold_out(std::vector<data::Example>* train, double fraction,
                                    int64_t seed, int64_t group) {
  std::vector<data::Example> held;
  if (!(fraction > 0) || train->empty()) return held;
  TORCH_CHECK(group >= 1 && static_cast<int64_t>(train->size()) % group == 0,
              "hold_out: ", train->size(), " examples are not whole groups of ", group);
  const auto n = static_cast<int64_t>(train->size()) / group;
  const char* unit = group == 2 ? "pair" : "training example";
  const auto k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * n)));
  if (k >= n) {
    throw ConfigError(
        fmt::format("config key data.eval_fraction: holding out {} of {} {}{} leaves none to "
                    "train on; lower it or use data.eval_files",
                    k, n, unit, n == 1 ? "" : "s"));
  }
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t{0});
  uint64_t state = static_cast<uint64_t>(seed) ^ 0x6576616C5F737031ULL;  // "eval_sp1"
  for (int64_t i = n - 1; i > 0; --i) {
    const auto j = static_cast<int64_t>(splitmix64(&state) % static_cast<uint64_t>(i + 1));
    std::swap(order[static_cast<size_t>(i)], order[static_cast<size_t>(j)]);
  }
  std::vector<char> is_held(static_cast<size_t>(n), 0);
  for (int64_t t = 0; t < k; ++t) is_held[static_cast<size_t>(order[static_cast<size_t>(t)])] = 1;
  std::vector<data::Example> kept;
  kept.reserve(static_cast<size_t>((n - k) * group));
  for (int64_t i = 0; i < n * group; ++i) {
    auto& e = (*train)[static_cast<size_t>(i)];
    (is_held[static_cast<size_t>(i / group)] ? held : kept).push_back(std::move(e));
  }
  *train = std::move(kept);
  return held;
}

std::string join_names(const std::vector<std::string>& v, size_t max_shown) {
  std::string out;
  for (size_t i = 0; i < v.size() && i < max_shown; ++i) out += (i ? ", " : "") + v[i];
  if (v.size() > max_shown) out += fmt::format(", ... ({} in all)", v.size());
  return out;
}

// The keys a batcher error (nothing left after truncation) is about, for its message.
std::string truncation_keys(const Config& c, const std::string& files_key) {
  return fmt::format("{} (train.seq_len {}, data.truncation {})", files_key, c.train.seq_len,
                     to_string(c.data.truncation));
}

void report_truncation(const Config& c, const data::TruncationStats& stats, const std::string& what,
                       std::ostream& out, std::ostream& err) {
  if (stats.truncated == 0 && stats.dropped == 0 && stats.split == 0) return;
  out << fmt::format("{}truncation to train.seq_len {} ({}): {}\n", what, c.train.seq_len,
                     describe(c.data.truncation), stats.to_string());
  const std::string w = data::truncation_warning(stats, c.train.seq_len, c.data.truncation,
                                                 "train.seq_len", "data.truncation");
  if (!w.empty()) err << "warning: " << what << w << "\n";
}

// The probe's data when the config names no files: `count` random-token sequences of exactly
// seq_len tokens, every position supervised, drawn from train.seed. They flow through the same
// batcher and step as real data (packed rows of one example each).
std::vector<data::Example> synthetic_examples(int64_t count, int64_t seq_len, int64_t vocab,
                                              uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor ids =
      at::randint(0, vocab, {count, seq_len}, gen, at::TensorOptions().dtype(at::kLong));
  const int64_t* p = ids.data_ptr<int64_t>();
  std::vector<data::Example> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    auto& e = out[static_cast<size_t>(i)];
    e.input_ids.assign(p + i * seq_len, p + (i + 1) * seq_len);
    e.labels = e.input_ids;
    e.source_line = i + 1;
  }
  return out;
}

// One micro-batch on the model's device. CUDA: pinned staging and non-blocking copies, queued on
// the current stream without waiting for it. Labels stay on the host (loss() finds the
// supervised rows there). The varlen path needs cu_seqlens only; the masked path the segments.
model::ModelInputs to_inputs(const data::Batch& b, const model::Qwen3Model& model,
                             const at::Device& device) {
  auto move = [&](const at::Tensor& t) {
    return device.is_cuda() ? t.pin_memory().to(device, /*non_blocking=*/true) : t.to(device);
  };
  model::ModelInputs in;
  in.labels = b.labels;
  in.cu_seqlens = b.cu_seqlens;
  in.max_seqlen = b.max_seqlen;
  const bool varlen = model.uses_varlen_attention(in);
  in.input_ids = move(b.input_ids);
  in.position_ids = move(b.position_ids);
  if (varlen) {
    in.cu_seqlens = move(b.cu_seqlens);
  } else {
    in.cu_seqlens = at::Tensor();
    in.attention_mask = move(b.attention_mask);
    in.segment_ids = move(b.segment_ids);
  }
  return in;
}

// The examples of one data file: its records, or (train.objective preference) its pairs laid out
// as chosen, rejected, chosen, ... (the batcher keeps each pair together). The summary is printed.
std::vector<data::Example> load_examples(const Config& c, bool pairs, const std::string& file,
                                         const data::Tokenizer& tok, const std::string& key,
                                         const std::string& prefix, std::ostream& out,
                                         std::ostream& err) {
  const auto dopt = dataset_options(c);
  std::vector<data::Example> examples;
  data::LoadSummary summary;
  if (pairs) {
    auto ds = as_input_error(key, [&] { return data::load_preference_dataset(file, tok, dopt); });
    for (auto& p : ds.pairs) {
      examples.push_back(std::move(p.chosen));
      examples.push_back(std::move(p.rejected));
    }
    summary = std::move(ds.summary);
  } else {
    auto ds = as_input_error(key, [&] { return data::load_dataset(file, tok, dopt); });
    examples = std::move(ds.examples);
    summary = std::move(ds.summary);
  }
  out << prefix << summary.to_string() << "\n";
  report_skipped_lines(summary, err);
  return examples;
}

FrozenModelSpec teacher_spec(const Config& c) {
  // A full-precision teacher stays full precision (its dense linears dense).
  return {
      c.distill.teacher, c.distill.teacher_config, "distill.teacher",   "distill.teacher_config",
      "teacher",         c.model.config,           /*keep_dense=*/true, /*fake_quant=*/true};
}

FrozenModelSpec starting_model_spec(const Config& c) {
  std::string path = c.model.weights;
  if (c.model.init == InitKind::kRandom) {
    path = (fs::path(c.output.dir) / kInitFile).string();
  } else if (model::is_hf_folder(c.model.weights)) {
    path = (fs::path(c.output.dir) / kHfImportFile).string();
  }
  return {path,
          c.model.config,
          "model.weights",
          "model.config",
          "reference",
          c.model.config,
          /*keep_dense=*/!c.model.fake_quant,
          c.model.fake_quant};
}

FrozenModelSpec reference_spec(const Config& c) {
  return {c.preference.reference,
          c.preference.reference_config,
          "preference.reference",
          "preference.reference_config",
          "reference",
          c.model.config,
          /*keep_dense=*/!c.model.fake_quant,
          c.model.fake_quant};
}

ObjectivePlan objective_plan(const Config& c) {
  ObjectivePlan p;
  p.kind = c.train.objective;
  p.distill = c.distill;
  p.preference = c.preference;
  p.grpo = c.grpo;
  p.reward = c.reward;
  p.teacher = teacher_spec(c);
  p.reference = reference_spec(c);
  p.starting_model = starting_model_spec(c);
  p.reference_file = (fs::path(c.output.dir) / kReferenceFile).string();
  p.model = model_options(c);
  return p;
}

PromptCheckPlan prompt_check_plan(const Config& c) {
  PromptCheckPlan p;
  p.tokenizer = c.model.tokenizer;
  p.dataset = dataset_options(c);
  p.files = c.data.files;
  p.eval_files = c.data.eval_files;
  p.max_completion_length = c.grpo.max_completion_length;
  p.seq_len = c.train.seq_len;
  p.reward = c.reward;
  return p;
}

FrozenModelSpec resolved_frozen_spec(const FrozenModelSpec& spec) {
  FrozenModelSpec r = spec;
  std::optional<RunDirModel> run;
  try {
    run = run_dir_model(spec.path, "config key " + spec.key + ":");
  } catch (const c10::Error& e) {
    throw ConfigError(e.what_without_backtrace());
  }
  if (!run) return r;
  r.path = run->weights;
  if (r.config_path.empty()) r.config_path = run->config;
  return r;
}

std::string frozen_config_path(const FrozenModelSpec& frozen) {
  const FrozenModelSpec spec = resolved_frozen_spec(frozen);
  if (!spec.config_path.empty()) return spec.config_path;
  return model::is_hf_folder(spec.path) ? (fs::path(spec.path) / "config.json").string()
                                        : spec.default_config;
}

model::Qwen3Config check_frozen_model_config(const FrozenModelSpec& frozen, int64_t vocab_size) {
  const FrozenModelSpec spec = resolved_frozen_spec(frozen);
  if (!model::is_hf_folder(spec.path)) require_file(spec.path, spec.key);
  const std::string config_path = frozen_config_path(spec);
  require_file(config_path,
               spec.config_path.empty() ? spec.key + " (its config.json)" : spec.config_key);
  const auto cfg = as_input_error(spec.config_key,
                                  [&] { return model::Qwen3Config::from_json_file(config_path); });
  if (cfg.vocab_size != vocab_size) {
    throw ConfigError(fmt::format(
        "config key {}: the {}'s vocabulary ({} tokens, {}) is not the trained model's ({}): "
        "they must score the same tokens",
        spec.key, spec.role, cfg.vocab_size, config_path, vocab_size));
  }
  return cfg;
}

std::unique_ptr<model::Qwen3Model> load_frozen_model(const FrozenModelSpec& frozen,
                                                     const model::ModelOptions& student,
                                                     int64_t vocab_size, std::ostream& out) {
  const auto t0 = Clock::now();
  const FrozenModelSpec spec = resolved_frozen_spec(frozen);
  const model::Qwen3Config cfg = check_frozen_model_config(spec, vocab_size);
  model::ModelOptions opt;
  opt.device = student.device;
  opt.compute_dtype = student.compute_dtype;
  opt.master_dtype = student.compute_dtype;
  opt.fake_quant = spec.fake_quant;
  opt.block_rule = student.block_rule;
  opt.trainable = model::TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  opt.loss_chunk_tokens = student.loss_chunk_tokens;
  model::HfImportOptions import;
  import.keep_dense = spec.keep_dense;
  import.block_rule = student.block_rule;
  auto m = as_input_error(spec.key, [&] {
    return std::make_unique<model::Qwen3Model>(model::load_dat_or_hf(cfg, spec.path, opt, import));
  });
  // Flushed: a long pass may follow (--write-teacher-topk's), and a log file should show it began.
  out << fmt::format("{} {}: {} layers, hidden {}, loaded in {:.1f} s\n", spec.role, spec.path,
                     cfg.num_hidden_layers, cfg.hidden_size, ms_since(t0) / 1000.0)
      << std::flush;
  return m;
}

RunSetup::RunSetup(std::ostream& out, std::ostream& err, bool probe)
    : out_(out), err_(err), log_(probe ? err : out) {}

RunSetup::~RunSetup() = default;

RunPlan RunSetup::load_model(const RunPlan& plan, bool need_tokenizer, bool load_weights_too) {
  const Config& c = plan.config();
  const auto t0 = Clock::now();
  mc_ = load_model_config(c);
  if (need_tokenizer) {
    tok_ = std::make_unique<data::Tokenizer>(as_input_error(
        "model.tokenizer", [&] { return data::Tokenizer::from_file(c.model.tokenizer); }));
    if (tok_->vocab_size() > mc_.vocab_size) {
      throw ConfigError(
          fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                      c.model.tokenizer, tok_->vocab_size(), c.model.config, mc_.vocab_size));
    }
  }
  if (!load_weights_too) return plan;
  // gradient_checkpointing auto plans with the memory that is free before the model loads; with
  // recompute set by hand, an estimate over it is said before the load, with what would fit.
  const bool auto_recompute = plan.recompute().recompute_auto;
  int64_t free_before = 0;
  if (plan.device().is_cuda()) {
    const auto snap = memory_snapshot(plan.device());
    free_before = snap.device_total_bytes.value_or(0) - snap.device_used_bytes.value_or(0);
  }
  if (plan.device().is_cuda() && !auto_recompute) {
    // The shipped layout (a separate lm_head) for a file, as --dry-run assumes.
    const bool separate = c.model.init == InitKind::kFile || !mc_.tie_word_embeddings;
    const PlacementAdvice a =
        advise_placements(mc_, c, separate, free_before, plan.objective_needs());
    if (!a.config_fits) {
      err_ << fmt::format(
          "warning: memory estimate {:.1f} GiB is over the {:.1f} GiB usable of {:.1f} GiB {}: "
          "this run will likely run out of memory; {}\n",
          to_gib(a.config_bytes), to_gib(a.budget.usable_bytes), to_gib(a.budget.budget_bytes),
          a.budget.source, a.summary());
    }
  }
  {
    NvtxRange r("load");
    auto lm = load_weights(c, mc_, out_, /*in_memory=*/plan.probe());
    model_ = std::move(lm.model);
    source_path_ = lm.source_path;
  }
  separate_lm_head_ = !model_->tied();
  std::string line;
  RunPlan resolved =
      auto_recompute ? plan.with_recompute(mc_, separate_lm_head_, free_before, &line) : plan;
  if (auto_recompute) {
    log_ << line << "\n";
    const auto o = model_options(resolved.config(), resolved.recompute());
    model_->set_recompute(o.gradient_checkpointing, o.recompute_layers, o.offload_layer_inputs,
                          o.recompute_keep_attention, o.recompute_keep_mlp);
    model_->set_cache_adapted_weights(o.cache_adapted_weights);
  }
  resolved = resolved.with_forward_weights(mc_, separate_lm_head_, free_before, &line);
  if (!line.empty()) log_ << line << "\n";
  model_->set_forward_weights(model_options(resolved.config()).forward_weights);
  log_ << fmt::format(
      "model: {} layers, hidden {}, vocab {}, {} trainable elements in {} "
      "tensors, loaded in {:.1f} s\n",
      mc_.num_hidden_layers, mc_.hidden_size, mc_.vocab_size, model_->num_trainable_elements(),
      model_->trainable_parameters().size(), ms_since(t0) / 1000.0);
  if (const auto lora = lora_summary(mc_, resolved.config(), separate_lm_head_); !lora.empty()) {
    log_ << lora << "\n";
  }
  resolved.check_guard("after loading the model");
  return resolved;
}

RunPlan RunSetup::load_data(const RunPlan& plan, int64_t ranks) {
  const Config& c = plan.config();
  const bool probe = plan.probe();
  if (plan.data().prompt_records && !probe) return load_prompts(plan);
  std::vector<data::Example> examples;
  int64_t pad_id = 0;
  if (c.data.files.empty() && probe) {
    examples = synthetic_examples(c.train.batch_size * c.train.grad_accum, c.train.seq_len,
                                  mc_.vocab_size, static_cast<uint64_t>(c.train.seed));
  } else {
    for (const auto& f : c.data.files) {
      for (auto& e :
           load_examples(c, plan.data().paired_records, f, *tok_, "data.files", "", log_, err_)) {
        examples.push_back(std::move(e));
      }
    }
    if (examples.empty()) throw ConfigError(no_examples_message(c));
    pad_id = tok_->endoftext_id();
    if (!probe) load_validation(plan, &examples, pad_id);
  }
  batcher_ = as_input_error(truncation_keys(c, "data.files"), [&] {
    return std::make_unique<data::Batcher>(
        std::move(examples),
        batcher_options(c, pad_id, plan.data().packing, plan.data().group_size));
  });
  report_truncation(c, batcher_->truncation_stats(), "", log_, err_);
  if (probe) return plan;
  std::string notes;
  RunPlan resolved = plan.with_length(batcher_->batches_per_epoch(), ranks, &notes);
  out_ << notes;
  return resolved;
}

// The prompts of data.files and their order (docs/trainer.md#grpo): each prompt is one example
// of a batcher whose batch is one generation batch's prompts (train.batch_size x
// train.grad_accum / grpo.num_generations of them per rank, every rank's together: each rank
// samples its share, RolloutSource), shuffled per epoch with train.seed; its
// state (checkpointed like any batcher's) is the position in the prompt order. The labels are
// the prompt's ids only so that the batcher keeps every prompt; nothing trains on them.
RunPlan RunSetup::load_prompts(const RunPlan& plan) {
  const Config& c = plan.config();
  const auto dopt = dataset_options(c);
  std::vector<data::Example> examples;
  for (const auto& f : c.data.files) {
    auto ds = as_input_error("data.files", [&] { return data::load_prompt_dataset(f, *tok_, dopt); });
    log_ << ds.summary.to_string() << "\n";
    report_skipped_lines(ds.summary, err_);
    for (auto& r : ds.prompts) {
      data::Example e;
      e.input_ids = r.prompt_ids;
      e.labels = r.prompt_ids;
      e.source_line = r.source_line;
      examples.push_back(std::move(e));
      prompt_origins_.push_back(f + ":" + std::to_string(r.source_line));
      prompts_.push_back(std::move(r));
    }
  }
  if (prompts_.empty()) throw ConfigError("config key data.files: no prompts (train.objective grpo)");
  const int64_t ranks = plan.options().world.world_size;
  const int64_t per_step =
      c.train.batch_size * c.train.grad_accum / c.grpo.num_generations * ranks;
  if (static_cast<int64_t>(prompts_.size()) < per_step) {
    throw ConfigError(fmt::format(
        "config key data.files: {} prompts, fewer than the {} of one generation batch "
        "(train.batch_size {} x train.grad_accum {} / grpo.num_generations {}{})",
        prompts_.size(), per_step, c.train.batch_size, c.train.grad_accum,
        c.grpo.num_generations, ranks > 1 ? fmt::format(" x {} ranks", ranks) : ""));
  }
  data::BatcherOptions bo;
  bo.batch_size = per_step;
  bo.max_seq_len = c.train.seq_len;
  bo.seed = static_cast<uint64_t>(c.train.seed);
  bo.shuffle = c.data.shuffle;
  bo.drop_last = true;  // every generation batch has its full count of prompts
  bo.truncation = data::Truncation::kDrop;
  batcher_ = as_input_error("data.files", [&] {
    return std::make_unique<data::Batcher>(std::move(examples), bo);
  });
  if (batcher_->num_examples() != static_cast<int64_t>(prompts_.size())) {
    throw ConfigError(fmt::format(
        "config key train.seq_len: {} of {} prompts are longer than train.seq_len {}",
        static_cast<int64_t>(prompts_.size()) - batcher_->num_examples(), prompts_.size(),
        c.train.seq_len));
  }
  // Each generation batch serves grpo.num_iterations steps of train.grad_accum micro-batches.
  std::string notes;
  RunPlan resolved = plan.with_length(
      batcher_->batches_per_epoch() * c.train.grad_accum * c.grpo.num_iterations, 1, &notes);
  out_ << notes;
  return resolved;
}

// Held-out examples for the validation loss: data.eval_fraction of the training examples
// (never trained on) and every example of data.eval_files, batched like training without
// shuffling.
void RunSetup::load_validation(const RunPlan& plan, std::vector<data::Example>* train,
                               int64_t pad_id) {
  const Config& c = plan.config();
  const int64_t group = plan.data().group_size;
  auto val = hold_out(train, c.data.eval_fraction, c.train.seed, group);
  const auto held = static_cast<int64_t>(val.size());
  for (const auto& f : c.data.eval_files) {
    for (auto& e : load_examples(c, plan.data().paired_records, f, *tok_, "data.eval_files",
                                 "validation ", out_, err_)) {
      val.push_back(std::move(e));
    }
  }
  if (val.empty()) {
    if (!c.data.eval_files.empty()) {
      throw ConfigError("data.eval_files: no validation examples in " +
                        join_names(c.data.eval_files, 8));
    }
    return;
  }
  auto bo = batcher_options(c, pad_id, plan.data().packing, plan.data().group_size);
  bo.shuffle = false;
  const auto total = static_cast<int64_t>(val.size());
  val_batcher_ = as_input_error(truncation_keys(c, "data.eval_files"), [&] {
    return std::make_unique<data::Batcher>(std::move(val), bo);
  });
  // Preference runs count pairs (two sequences each).
  const char* unit = group == 2 ? "pair" : "example";
  out_ << fmt::format(
      "validation: {} {}{} ({} held out of data.files by "
      "data.eval_fraction {}, {} from data.eval_files)\n",
      total / group, unit, total / group == 1 ? "" : "s", held / group, c.data.eval_fraction,
      (total - held) / group);
  report_truncation(c, val_batcher_->truncation_stats(), "validation ", out_, err_);
}

void RunSetup::make_optimizer(const RunPlan& plan, GradSync& sync) {
  optimizer_ = std::make_unique<optim::PackedAdamW>(adamw_options(plan.config()));
  optimizer_index_ = sync.add_owned_params(*optimizer_);
  out_ << sync.ownership_summary(optimizer_->num_params());
  schedule_ = std::make_unique<optim::LrSchedule>(lr_schedule_options(plan.config(), plan.steps()));
}

}  // namespace q4::trainer
