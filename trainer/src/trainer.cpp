// The run loop and its set-up. Set-up failures caused by inputs (config.json, tokenizer, data,
// weights) are rethrown as ConfigError so that main exits 2 naming the file; failures after
// set-up are runtime errors (exit 1). A step: grad_accum micro-batches whose summed CE is
// divided by the step's supervised-token count (token-weighted mean, identical to one big
// batch), one PackedAdamW step with clipping and the non-finite guard, then logging, the memory
// guard, eval/export/checkpoint cadences and the stop-signal check.
#include "q4/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/core/Generator.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <numeric>
#include <iterator>
#include <set>
#include <thread>
#include <unordered_map>
#include <nlohmann/json.hpp>

#include "q4/data/chat.h"
#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/io/atomic_file.h"
#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/quant/nvfp4.h"
#include "q4/trainer/distributed.h"
#include "q4/trainer/estimate.h"
#include "q4/trainer/export_check.h"
#include "q4/trainer/memory.h"
#include "q4/trainer/metrics.h"
#include "q4/trainer/nvtx.h"
#include "q4/trainer/probe.h"
#include "q4/trainer/profile.h"
#include "q4/trainer/report.h"
#include "q4/trainer/run_dir.h"
#include "q4/trainer/signals.h"
#include "q4/trainer/tfevents.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

constexpr const char* kOptimStateFile = "optim.state";
constexpr const char* kTrainStateFile = "state.json";
constexpr const char* kRngFile = "rng.dat";
constexpr const char* kHfImportFile = "hf_import.dat";  // model.weights given as an HF folder

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// Runs `fn`; a c10::Error it throws is an input problem: ConfigError with the same message.
// Exceptions that are not about the input stay runtime errors (exit 1), told apart by type: an
// allocator's OutOfMemoryError, std::bad_alloc (not a c10::Error), and a failed internal assert
// (c10 gives it no type of its own; its message always starts with "INTERNAL ASSERT FAILED").
template <class F>
auto as_input_error(const std::string& what, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    if (e.msg().rfind("INTERNAL ASSERT FAILED", 0) == 0) throw;
    throw ConfigError(what + ": " + e.what_without_backtrace());
  }
}

// An input file: a regular file (or a link to one). A directory, FIFO or device is named as
// such (a FIFO would block the read, a device like /dev/zero never end it).
void require_file(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) return;
  const std::string kind = io::non_regular_kind(path);
  if (!kind.empty()) {
    throw ConfigError("config key " + key + ": " + path + " is " + kind +
                      ", not a regular file");
  }
  throw ConfigError("config key " + key + ": file not found: " + path);
}

model::Qwen3Config load_model_config(const Config& c) {
  require_file(c.model.config, "model.config");
  auto mc = as_input_error("model.config",
                           [&] { return model::Qwen3Config::from_json_file(c.model.config); });
  // train.trainable.layers against the model's layer count, in the config's own words.
  (void)c.train.trainable.layers.resolve(mc.num_hidden_layers);
  return mc;
}

// Files that the run needs before it loads anything.
void check_input_files(const Config& c, bool need_data) {
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
  }
}

// Checks the allocator's reserved memory and the device's used memory against the guard.
void check_guard(const Config& c, const at::Device& device, const std::string& where) {
  if (!(c.guard.max_gpu_gb > 0) || !device.is_cuda()) return;
  const auto m = memory_snapshot(device);
  const double limit = c.guard.max_gpu_gb * 1e9;
  auto over = [&](const std::optional<int64_t>& v) { return v && static_cast<double>(*v) > limit; };
  if (over(m.reserved_bytes) || over(m.device_used_bytes)) {
    throw GuardStop(fmt::format(
        "guard: GPU memory passed guard.max_gpu_gb = {:.2f} GB {} (allocator reserved {:.2f} GB, "
        "device used {:.2f} GB); stopped without export",
        c.guard.max_gpu_gb, where, to_gb(m.reserved_bytes.value_or(0)),
        to_gb(m.device_used_bytes.value_or(0))));
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

struct EvalAnswer {
  std::string prompt;
  std::string answer;
  std::vector<int64_t> tokens;
  bool stopped = false;
};

std::vector<EvalAnswer> generate_answers(model::Qwen3Model& model, const data::Tokenizer& tok,
                                         const Config& c) {
  std::vector<EvalAnswer> out;
  model::GenerateOptions gen;
  gen.max_new_tokens = c.eval.max_new_tokens;
  gen.stop_ids = {tok.im_end_id(), tok.endoftext_id()};
  at::NoGradGuard no_grad;
  for (const auto& prompt : c.eval.prompts) {
    std::vector<data::Message> msgs;
    if (!c.data.system_prompt.empty()) msgs.push_back({"system", c.data.system_prompt});
    msgs.push_back({"user", prompt});
    const auto ids = data::tokenize_chat(tok, msgs, /*add_generation_prompt=*/true).input_ids;
    EvalAnswer a;
    a.prompt = prompt;
    a.tokens = model.generate(std::vector<int64_t>(ids.begin(), ids.end()), gen);
    // The embedding may be larger than the tokenizer (151936 vs 151669 ids): an untrained model
    // can emit ids without text, shown as <id:N>.
    std::vector<data::TokenId> run;
    auto flush = [&] {
      a.answer += tok.decode_lossy(run, /*skip_special=*/true);
      run.clear();
    };
    for (int64_t id : a.tokens) {
      if (id == tok.im_end_id() || id == tok.endoftext_id()) {
        a.stopped = true;
        break;
      }
      if (id >= tok.vocab_size()) {
        flush();
        a.answer += "<id:" + std::to_string(id) + ">";
        continue;
      }
      run.push_back(static_cast<data::TokenId>(id));
    }
    flush();
    out.push_back(std::move(a));
  }
  return out;
}

std::string one_line(const std::string& s) {
  std::string o;
  for (char ch : s) o += (ch == '\n') ? ' ' : ch;
  return o;
}

// How to run a sibling tool: its path next to this executable (relative to the CWD when under
// it, e.g. build/bin/q4chat), or the bare name when it is not there.
std::string tool_command(const std::string& name) {
  std::error_code ec;
  const fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (ec) return name;
  const fs::path tool = exe.parent_path() / name;
  if (!fs::exists(tool, ec)) return name;
  const fs::path rel = tool.lexically_relative(fs::current_path(ec));
  if (ec || rel.empty() || *rel.begin() == "..") return tool.string();
  return rel.has_parent_path() ? rel.string() : "./" + rel.string();
}

// splitmix64: the portable generator behind the held-out split (same on every platform).
uint64_t splitmix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// data.eval_fraction: ceil(fraction x N) examples (at least one) chosen by a Fisher-Yates
// shuffle seeded by train.seed are moved from `train` to the returned list; both keep file
// order. The same seed and data give the same split (resume relies on it).
std::vector<data::Example> hold_out(std::vector<data::Example>* train, double fraction,
                                    int64_t seed) {
  std::vector<data::Example> held;
  if (!(fraction > 0) || train->empty()) return held;
  const auto n = static_cast<int64_t>(train->size());
  const auto k = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(fraction * n)));
  if (k >= n) {
    throw ConfigError(fmt::format(
        "config key data.eval_fraction: holding out {} of {} training example{} leaves none to "
        "train on; lower it or use data.eval_files",
        k, n, n == 1 ? "" : "s"));
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
  kept.reserve(static_cast<size_t>(n - k));
  for (int64_t i = 0; i < n; ++i) {
    auto& e = (*train)[static_cast<size_t>(i)];
    (is_held[static_cast<size_t>(i)] ? held : kept).push_back(std::move(e));
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
                     to_string(resolved_truncation(c)));
}

data::DatasetOptions dataset_options(const Config& c) {
  data::DatasetOptions o;
  o.format = to_data(c.data.format);
  o.system_prompt = c.data.system_prompt;
  o.on_error = to_data(c.data.on_error);
  return o;
}

// Batcher settings of a run (training and the probe alike). On CUDA the batch's rows are laid
// end to end in one row (the varlen attention separates the examples) and shapes are kept
// stable: packed batches are always batch_size * seq_len long, unpacked ones are padded to a
// multiple of 64, so the allocator and the kernels see a handful of shapes.
data::BatcherOptions batcher_options(const Config& c, int64_t pad_id) {
  data::BatcherOptions bo;
  bo.batch_size = c.train.batch_size;
  bo.max_seq_len = c.train.seq_len;
  bo.seed = static_cast<uint64_t>(c.train.seed);
  bo.shuffle = c.data.shuffle;
  bo.pack = c.data.packing;
  bo.pack_window = c.data.pack_window;
  bo.truncation = to_data(resolved_truncation(c));
  bo.pad_id = pad_id;
  if (device_is_cuda(c)) {
    bo.fixed_len = bo.pack;
    bo.pad_multiple = 64;
    bo.flatten = true;  // varlen attention: rows end to end, no padding between them
  }
  return bo;
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

optim::LrSchedule make_schedule(const Config& c) {
  optim::LrScheduleOptions s;
  s.kind = to_optim(c.optim.schedule.kind);
  s.peak_lr = c.optim.lr;
  s.warmup_steps = c.optim.schedule.warmup_steps;
  s.total_steps = std::max<int64_t>(c.train.steps, c.optim.schedule.warmup_steps + 1);
  s.min_lr = c.optim.lr * c.optim.schedule.min_lr_ratio;
  return optim::LrSchedule(s);
}

// Loads the model: from model.weights, or a random init written once to <dir>/init.dat (so the
// export has a source file and loading follows the same path as real weights).
struct LoadedModel {
  std::unique_ptr<model::Qwen3Model> model;
  std::string source_path;  // the .dat export_to() copies from
};

// `in_memory`: a random init stays in memory (the probe: nothing written, no export source).
LoadedModel load_model(const Config& c, const model::Qwen3Config& mc, std::ostream& out,
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
      init_opt.master_dtype = at::kFloat;
      init_opt.compute_dtype = at::kFloat;
      init_opt.device = at::kCPU;
      auto init = model::Qwen3Model::random_init(mc, init_opt, c.model.init_seed, c.model.init_std);
      model::write_dat(init, lm.source_path, c.model.quantize_lm_head);
      out << "random init (seed " << c.model.init_seed << ") written to " << lm.source_path << "\n";
    }
  } else if (model::is_hf_folder(c.model.weights)) {
    // A Hugging Face folder is imported once per run into the shipped .dat layout, which is
    // then loaded and exported like any .dat (docs/interop.md).
    lm.source_path = (fs::path(c.output.dir) / kHfImportFile).string();
    const auto t0 = Clock::now();
    const auto rep = as_input_error("model.weights", [&] {
      return model::import_hf(c.model.weights, lm.source_path);
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

// A device scalar copied into pinned host memory without waiting for the device: read() waits
// only until the copy has happened (a CUDA event), so fetching the loss adds no sync of its own.
class AsyncScalar {
 public:
  void start(const at::Tensor& t) {  // t: () on any device
    event_.reset();
    if (!t.is_cuda()) {
      host_ = t.detach().to(at::kCPU, at::kFloat);
      return;
    }
    host_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    host_.copy_(t.detach().to(at::kFloat), /*non_blocking=*/true);
    event_ = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    c10::impl::VirtualGuardImpl impl(t.device().type());
    event_->record(impl.getStream(t.device()));
  }
  double read() const {
    // c10::Event has no blocking wait in LibTorch 1.13: poll (the copy is done by the time the
    // optimizer's norm has been read, so this returns at once in practice).
    if (event_) {
      while (!event_->query()) std::this_thread::yield();
    }
    return host_.item<double>();
  }

 private:
  at::Tensor host_;
  std::unique_ptr<c10::Event> event_;
};

// What one optimizer step did.
struct StepOutcome {
  double loss = 0.0;          // token-weighted mean CE over the step's micro-batches
  int64_t real_tokens = 0;    // non-padding tokens
  int64_t supervised = 0;     // tokens the loss averages
  int64_t slots = 0;          // B * T summed over micro-batches (real + padding)
  optim::StepResult res;
  bool stop = false;          // a stop signal reached this rank or (data parallel) any rank
  // output.checkpoint_minutes have passed since the last checkpoint, by rank 0's clock (data
  // parallel: shared through the step's closing allreduce, so every rank checkpoints together).
  bool checkpoint_due = false;
};

// Phase callback of an instrumented step (the probe): called with "batch_ready",
// "forward_done", "backward_done" (per micro-batch) and "optimizer_step_done".
using PhaseHook = std::function<void(const char*)>;

// ---------------------------------------------------------------------------------------------

class Trainer {
 public:
  // `probe`: the VRAM probe, i.e. training with instrumentation (probe()), nothing written to
  // output.dir but the report.
  Trainer(const Config& c, const RunOptions& o, std::ostream& out, std::ostream& err,
          bool probe = false)
      : c_(c),
        opts_(o),
        out_(out),
        err_(err),
        device_(c.model.device),
        probe_(probe),
        epochs_(c.train.epochs),
        length_from_data_(c.train.epochs > 0 || c.optim.schedule.warmup_ratio > 0) {}

  bool leader() const { return !comm_ || comm_->rank() == 0; }

  int run() {
    run_start_ = Clock::now();
    check_device_available(c_);  // before anything is written
    if (opts_.export_only) return export_only();
    // A run length from the data (train.epochs, warmup_ratio) is clipped once it is resolved.
    if (const std::string note = length_from_data_ ? "" : clip_warmup_to_run(c_); !note.empty()) {
      out_ << note << "\n";
    }
    install_stop_handlers();  // before set-up: a signal there ends the run cleanly, too
    setup();
    if (stop_requested()) {
      // A fresh run stopped in set-up trained nothing: what it created goes, so that the same
      // command runs again (check_fresh_output_dir would refuse the leftovers).
      if (!opts_.resume) remove_setup_outputs();
      out_ << "signal " << stop_signal() << " during set-up: stopped before the first step\n";
      return kExitOk;
    }
    if (leader()) print_summary();
    return loop();
  }

  // --resume DIR --export-only: the checkpoint's masters over the run's weights, exported to
  // output.export_path (atomic, with output.hf_export and the export check); no training, and
  // nothing else in the run directory changes.
  int export_only() {
    if (!opts_.resume) {
      throw ConfigError("--export-only needs --resume DIR (a checkpoint or a run directory)");
    }
    const CheckpointDir ck = resolve_resume_dir(*opts_.resume);
    if (resolved_export_path(c_).empty()) {
      throw ConfigError(
          "--export-only: output.export_path is none; set one (e.g. --set "
          "output.export_path=model.dat)");
    }
    check_input_files(c_, /*need_data=*/false);
    check_output_paths(c_);
    // An older checkpoint never replaces a newer export, nor a file of unknown step.
    check_export_not_newer(resolved_export_path(c_), ck.step, opts_.overwrite,
                           /*unknown_is_error=*/true, c_.output.dir);
    fs::create_directories(c_.output.dir);
    lock_ = std::make_unique<RunDirLock>(c_.output.dir);
    setup_model(/*need_tokenizer=*/false);
    setup_optimizer();
    restore(ck, /*export_only=*/true);
    write_export(start_step_, nullptr);
    out_ << fmt::format("exported the model of {} (step {}) in {}\n", ck.path, start_step_,
                        format_duration(ms_since(run_start_) / 1000.0));
    return kExitOk;
  }

  // The probe: the training set-up and step (train_step) with every phase marked (device sync,
  // time, allocator and RSS), then options.probe_steps more steps timed per phase, an export to
  // a temporary file, and the JSON report.
  int probe() {
    std::vector<ProbePhase> phases;
    const auto t_start = Clock::now();
    auto t_prev = t_start;
    auto mark = [&](const std::string& name) {
      synchronize_device(device_);
      ProbePhase p;
      p.name = name;
      p.elapsed_ms = ms_since(t_start);
      p.phase_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_prev).count();
      p.memory = memory_snapshot(device_);
      phases.push_back(p);
      err_ << fmt::format("probe: {:<20} {:>9.1f} ms  rss {:.2f} GiB", name, p.phase_ms,
                          to_gib(p.memory.rss_bytes))
           << (p.memory.peak_allocated_bytes
                   ? fmt::format("  peak {:.2f} GiB  reserved {:.2f} GiB",
                                 to_gib(*p.memory.peak_allocated_bytes),
                                 to_gib(*p.memory.reserved_bytes))
                   : std::string())
           << "\n";
      reset_peak_memory(device_);
      t_prev = Clock::now();
    };
    check_input_files(c_, /*need_data=*/false);
    for (const auto& f : c_.data.files) require_file(f, "data.files");
    check_probe_report_path(probe_report_path(), opts_.overwrite);  // before anything loads
    reset_peak_memory(device_);
    mark("start");
    setup_model(/*need_tokenizer=*/!c_.data.files.empty());
    mark("model_loaded");
    // The moments exist before the first forward, as in a training run from its second step on:
    // otherwise the backward's peak would miss them.
    {
      NvtxRange r("optimizer_setup");
      setup_optimizer();
    }
    mark("optimizer_ready");
    setup_data();
    const StepOutcome first = train_step(0, [&](const char* phase) { mark(phase); });

    nlohmann::json steady = nullptr;
    if (opts_.probe_steps > 0) {
      // Steady state: more steps of the same function, timed per phase with a device sync at
      // each boundary (the syncs cost a little; the step time is their sum).
      NvtxRange rs("steady");
      std::vector<double> fwd_ms, bwd_ms, opt_ms, step_ms;
      double last_loss = 0.0;
      int64_t tokens = 0, slots = 0;
      for (int s = 0; s < opts_.probe_steps; ++s) {
        synchronize_device(device_);
        auto tp = Clock::now();
        const auto t0 = tp;
        double f = 0, b = 0;
        const StepOutcome so = train_step(1 + s, [&](const char* phase) {
          synchronize_device(device_);
          const double ms = ms_since(tp);
          tp = Clock::now();
          if (std::string(phase) == "forward_done") f += ms;
          if (std::string(phase) == "backward_done") b += ms;
          if (std::string(phase) == "optimizer_step_done") opt_ms.push_back(ms);
        });
        fwd_ms.push_back(f);
        bwd_ms.push_back(b);
        step_ms.push_back(ms_since(t0));
        last_loss = so.loss;
        tokens += so.real_tokens;
        slots += so.slots;
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        const size_t n = v.size();
        return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
      };
      const double step_med = median(step_ms);
      const double tok_per_step = static_cast<double>(tokens) / opts_.probe_steps;
      const auto mem = memory_snapshot(device_);
      steady = {{"steps", opts_.probe_steps},
                {"step_ms_median", step_med},
                {"forward_ms_median", median(fwd_ms)},
                {"backward_ms_median", median(bwd_ms)},
                {"optimizer_ms_median", median(opt_ms)},
                {"tokens_per_step", tok_per_step},
                {"slot_fill", slots > 0 ? static_cast<double>(tokens) / slots : 0.0},
                {"tokens_per_s", tok_per_step / (step_med / 1e3)},
                {"peak_allocated_bytes", mem.peak_allocated_bytes
                                             ? nlohmann::json(*mem.peak_allocated_bytes)
                                             : nlohmann::json(nullptr)},
                {"last_loss", last_loss}};
      err_ << fmt::format(
          "probe: steady state, median of {} steps: step {:.1f} ms (forward {:.1f}, backward "
          "{:.1f}, optimizer {:.1f}), {:.0f} tok/s{}\n",
          opts_.probe_steps, step_med, median(fwd_ms), median(bwd_ms), median(opt_ms),
          tok_per_step / (step_med / 1e3),
          mem.peak_allocated_bytes
              ? fmt::format(", peak {:.2f} GiB", to_gib(*mem.peak_allocated_bytes))
              : std::string());
      reset_peak_memory(device_);
      t_prev = Clock::now();
    }

    {
      NvtxRange r("export");
      const fs::path tmp = fs::temp_directory_path() /
                           fmt::format("q4train-probe-{}.dat", static_cast<int64_t>(::getpid()));
      if (source_path_.empty()) {
        model::write_dat(*model_, tmp.string(), c_.model.quantize_lm_head);
      } else {
        model::DatReader source(source_path_);
        model_->export_to(source, tmp.string());
      }
      fs::remove(tmp);
    }
    mark("export_done");

    const auto budget = estimate_budget(mc_, c_, separate_lm_head_);
    nlohmann::json info = {{"config", c_.source},
                           {"tokens", first.real_tokens},
                           {"slots", first.slots},
                           {"batch_size", c_.train.batch_size},
                           {"seq_len", c_.train.seq_len},
                           {"grad_accum", c_.train.grad_accum},
                           {"master_dtype", to_string(c_.model.master_dtype)},
                           {"compute_dtype", to_string(resolved_compute_dtype(c_))},
                           {"gradient_checkpointing", c_.train.gradient_checkpointing},
                           {"optim_state", to_string(c_.optim.state)},
                           {"in_backward", in_backward_},
                           {"data", c_.data.files.empty() ? "synthetic" : "files"},
                           {"loss", first.loss},
                           {"grad_norm", first.res.grad_norm},
                           {"step_applied", first.res.applied},
                           {"trainable_elements", model_->num_trainable_elements()},
                           {"steady", steady}};
    const auto report = probe_report_json(device_name(device_), phases, budget.to_json(), info);
    const std::string path = probe_report_path();
    if (!fs::path(path).parent_path().empty()) {
      fs::create_directories(fs::path(path).parent_path());
    }
    write_file_atomic(path, report.dump(2) + "\n");
    out_ << report.dump(2) << "\n";
    err_ << "probe report written to " << path << "\n";
    return kExitOk;
  }

 private:
  std::string probe_report_path() const {
    return opts_.probe_report.empty() ? (fs::path(c_.output.dir) / kProbeFile).string()
                                      : opts_.probe_report;
  }

  // A fresh run refuses an output.dir holding anything but its own inputs (a previous run's
  // checkpoints, metrics or export, the user's files) unless --overwrite. A config file that is
  // <output.dir>/config.yaml is refused even with --overwrite: the run writes its resolved
  // config there and would replace the user's.
  void check_fresh_output_dir() {
    std::error_code ec;
    const fs::path saved = fs::path(c_.output.dir) / kConfigFile;
    if (fs::is_regular_file(c_.source, ec) && fs::equivalent(c_.source, saved, ec)) {
      throw ConfigError("the config file " + c_.source + " is " + saved.string() +
                        ", where a run writes its resolved config; move the config out of "
                        "output.dir (or choose another output.dir), or continue that run with "
                        "--resume " +
                        c_.output.dir);
    }
    const auto left = run_dir_leftovers(c_);
    if (left.empty() || opts_.overwrite) return;
    const bool ck = latest_checkpoint(c_.output.dir).has_value();
    throw ConfigError("output.dir " + c_.output.dir + " is not empty (" + join_names(left, 4) +
                      "); pass --overwrite to replace the previous run's files" +
                      (ck ? ", --resume " + c_.output.dir + " to continue its newest checkpoint"
                          : std::string()) +
                      ", or choose another output.dir");
  }

  // --overwrite: the previous run's files in output.dir go (checkpoints, config, metrics, eval
  // log, report, event files, init/import files, the export and its HF folder); the user's other
  // files, symbolic links (q4train never makes one: the user's) and this run's inputs stay.
  void remove_previous_run() {
    const fs::path dir(c_.output.dir);
    const std::string exp = resolved_export_path(c_);
    std::set<std::string> owned;
    if (!c_.log.metrics.empty()) owned.insert(c_.log.metrics);
    if (!exp.empty() && fs::absolute(exp).parent_path() == fs::absolute(dir)) {
      owned.insert(fs::path(exp).filename().string());
      owned.insert(fs::path(export_record_path(exp)).filename().string());
      owned.insert(fs::path(hf_export_dir(exp)).filename().string());
    }
    std::vector<std::string> removed, kept;
    for (const auto& name : run_dir_leftovers(c_)) {
      if (!fs::is_symlink(dir / name) && (is_reserved_run_name(name) || owned.count(name))) {
        q4::io::remove_tree(dir / name);
        removed.push_back(name);
      } else {
        kept.push_back(name);
      }
    }
    if (!removed.empty()) {
      out_ << "--overwrite: removed the previous run's " << join_names(removed, 8) << "\n";
    }
    if (!kept.empty()) out_ << "--overwrite: kept " << join_names(kept, 8) << " (not q4train's)\n";
  }

  void setup() {
    std::optional<CheckpointDir> resume;
    if (opts_.resume) resume = resolve_resume_dir(*opts_.resume);
    const fs::path state_path = resume ? fs::path(resume->path) / kTrainStateFile : fs::path();
    std::error_code ec;
    if (resume && fs::is_regular_file(state_path, ec)) {
      // Before anything is written (config.yaml included); an unreadable state.json is reported
      // by restore() with the checksums.
      const auto state = nlohmann::json::parse(read_file(state_path.string()), nullptr, false);
      // With train.epochs or a warmup_ratio the schedule is known only once the data is loaded:
      // setup_locked checks it then, before restoring anything.
      try {
        if (state.is_object() && !length_from_data_) check_schedule_unchanged(*resume, state);
      } catch (const nlohmann::json::exception& e) {
        throw ConfigError("--resume: " + state_path.string() + ": " + e.what() +
                          previous_checkpoint_hint(*resume));
      }
    }
    check_input_files(c_, /*need_data=*/c_.train.steps > 0);
    check_output_paths(c_);  // every output, before anything is written
    // Every rank sees the directory before the rendezvous, so before rank 0 writes to it.
    if (!resume) check_fresh_output_dir();
    // The final export (step train.steps) never replaces a newer one, another run's, or (a fresh
    // run; a resume whose export lies outside its run directory) a file of unknown origin
    // (docs/trainer.md#export).
    {
      const std::string exp = resolved_export_path(c_);
      check_export_not_newer(exp, c_.train.steps, opts_.overwrite,
                             /*unknown_is_error=*/!resume || !path_inside(exp, c_.output.dir),
                             c_.output.dir);
    }
    if (opts_.world.distributed()) connect_ranks();  // every rank checked its inputs first
    const fs::path dir(c_.output.dir);
    setup_dir_existed_ = fs::is_directory(dir, ec);
    if (setup_dir_existed_ && leader()) {
      for (const auto& e : fs::directory_iterator(dir)) {
        setup_dir_before_.insert(e.path().filename().string());
      }
    }
    // Rank 0 owns the run directory; the other ranks write only their optimizer shards.
    if (leader()) {
      fs::create_directories(dir);
      lock_ = std::make_unique<RunDirLock>(c_.output.dir);  // held until the run ends
    }
    try {
      setup_locked(resume);
    } catch (...) {
      // A fresh run that fails in set-up (bad data, weights, tokenizer) leaves nothing behind:
      // what it created goes, so that the corrected command runs without --overwrite.
      if (!resume) remove_setup_outputs();
      throw;
    }
  }

  // A fresh run ended in set-up (an error or a stop signal): rank 0 removes what the run created
  // in output.dir (and the directory when the run made it and it is empty).
  void remove_setup_outputs() {
    if (!leader()) return;
    lock_.reset();
    std::error_code ec;
    const fs::path dir(c_.output.dir);
    std::vector<fs::path> created;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (!setup_dir_before_.count(e.path().filename().string())) created.push_back(e.path());
    }
    for (const auto& p : created) q4::io::remove_tree(p, ec);
    if (!setup_dir_existed_) fs::remove(dir, ec);  // only when empty
  }

  void setup_locked(const std::optional<CheckpointDir>& resume) {
    if (leader()) {
      for (const auto& p : clean_stale_files(c_)) out_ << "removed stale " << p << "\n";
      if (!resume && opts_.overwrite) remove_previous_run();
      // A fresh random-init run draws a fresh init; with model.init: file, init.dat may be the
      // user's weights and is never touched.
      if (!resume && c_.model.init == InitKind::kRandom) {
        fs::remove(fs::path(c_.output.dir) / kInitFile);
      }
      // A resume writes its config once the checkpoint is restored: a refused resume (another
      // trainable set, schedule or world) leaves the run's config.yaml as it was.
      if (!resume) {
        write_file_atomic((fs::path(c_.output.dir) / kConfigFile).string(), config_to_yaml(c_));
      }
    }
    // A random init is written by rank 0 and then loaded by the others.
    if (!leader()) comm_->barrier();
    setup_model(/*need_tokenizer=*/true);
    if (comm_ && leader()) comm_->barrier();
    if (c_.train.steps > 0) setup_data();
    setup_optimizer();

    if (resume && length_from_data_) {
      const std::string state_path = (fs::path(resume->path) / kTrainStateFile).string();
      const auto state = nlohmann::json::parse(read_file(state_path), nullptr, false);
      try {
        if (state.is_object()) check_schedule_unchanged(*resume, state);
      } catch (const nlohmann::json::exception& e) {
        throw ConfigError("--resume: " + state_path + ": " + e.what() +
                          previous_checkpoint_hint(*resume));
      }
    }
    if (resume) {
      restore(*resume);
      if (leader()) {
        write_file_atomic((fs::path(c_.output.dir) / kConfigFile).string(), config_to_yaml(c_));
      }
    }

    if (!leader()) return;  // logs, metrics and reports come from rank 0
    const auto metrics_path = c_.log.metrics.empty()
                                  ? std::string()
                                  : (fs::path(c_.output.dir) / c_.log.metrics).string();
    if (!metrics_path.empty()) {
      metrics_.open(metrics_path, start_step_);
      // A resumed run's best validation loss so far, from the kept records.
      if (resume && val_batcher_) {
        std::ifstream in(metrics_path);
        std::string line;
        while (std::getline(in, line)) {
          const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
          if (j.is_object() && j.contains("val_loss") && j["val_loss"].is_number() &&
              j.contains("step") && j["step"].is_number_integer()) {
            note_validation(j["val_loss"].get<double>(), j["step"].get<int64_t>());
          }
        }
      }
    }
    eval_log_.open((fs::path(c_.output.dir) / kEvalFile).string(), start_step_);
    if (c_.log.tensorboard) tb_.open(c_.output.dir);  // TensorBoard scalars and eval text
  }

  // The short start-up summary (the full resolved config is <output.dir>/config.yaml).
  void print_summary() {
    const auto budget = estimate_budget(mc_, c_, separate_lm_head_);
    std::string model_src = c_.model.init == InitKind::kRandom
                                ? fmt::format("random init (seed {})", c_.model.init_seed)
                                : c_.model.weights;
    const auto trainable = static_cast<double>(model_->num_trainable_elements());
    out_ << fmt::format(
        "run summary:\n  model      Qwen3, {} layers, hidden {}, vocab {}; {}; {}, masters {}, "
        "compute {}\n  trainable  {} parameters in {} tensors\n",
        mc_.num_hidden_layers, mc_.hidden_size, mc_.vocab_size, model_src, c_.model.device,
        to_string(c_.model.master_dtype), to_string(resolved_compute_dtype(c_)),
        trainable >= 1e9   ? fmt::format("{:.2f}B", trainable / 1e9)
        : trainable >= 1e6 ? fmt::format("{:.2f}M", trainable / 1e6)
                           : fmt::format("{:.0f}", trainable),
        model_->trainable_parameters().size());
    if (batcher_) {
      int64_t tokens = 0, supervised = 0;
      for (const auto& e : batcher_->examples()) {
        tokens += static_cast<int64_t>(e.input_ids.size());
        for (auto l : e.labels) supervised += l != data::kIgnoreIndex;
      }
      out_ << fmt::format("  data       {} examples, {} tokens ({} supervised) from {} file{}",
                          batcher_->num_examples(), tokens, supervised, c_.data.files.size(),
                          c_.data.files.size() == 1 ? "" : "s");
      out_ << (val_batcher_ ? fmt::format("; validation {} examples",
                                          val_batcher_->num_examples())
                            : std::string())
           << "\n";
    }
    // A step is grad_accum x ranks micro-batches of up to batch_size rows each; a row is one
    // example, or (packing) several. A micro-batch never crosses an epoch's end, so with less
    // data than batch_size rows every micro-batch is a whole epoch, short of rows.
    const int64_t per_step = c_.train.grad_accum * ranks();
    out_ << fmt::format(
        "  steps      {}{}{}, each {} micro-batch{} ({} accumulated x {} rank{}) of up to {} "
        "rows x {} tokens\n",
        c_.train.steps,
        start_step_ > 0 ? fmt::format(" (resuming at {})", start_step_) : std::string(),
        epochs_ > 0 ? fmt::format(" (train.epochs {})", epochs_) : std::string(), per_step,
        per_step == 1 ? "" : "es", c_.train.grad_accum, ranks(), ranks() == 1 ? "" : "s",
        c_.train.batch_size, c_.train.seq_len);
    if (batcher_) {
      const auto bpe = batcher_->batches_per_epoch();
      const auto rows = batcher_->rows_per_epoch();
      const auto examples = batcher_->num_examples();
      out_ << fmt::format(
          "  epoch      {} example{} in {} row{}{} and {} micro-batch{}: {:.2f} steps per epoch, "
          "about {:.1f} examples ({:.1f} rows) per step\n",
          examples, examples == 1 ? "" : "s", rows, rows == 1 ? "" : "s",
          c_.data.packing ? " (packed)" : "", bpe, bpe == 1 ? "" : "es",
          static_cast<double>(bpe) / static_cast<double>(per_step),
          static_cast<double>(examples) * static_cast<double>(per_step) /
              static_cast<double>(bpe),
          static_cast<double>(rows) * static_cast<double>(per_step) / static_cast<double>(bpe));
      if (rows < c_.train.batch_size) {
        out_ << fmt::format(
            "  note       train.batch_size {} is larger than the data: one epoch is {} row{}, so "
            "every micro-batch is a whole epoch of {} row{}, not {}\n",
            c_.train.batch_size, rows, rows == 1 ? "" : "s", rows, rows == 1 ? "" : "s",
            c_.train.batch_size);
      }
    }
    out_ << fmt::format("  lr         {} ({}, warmup {})\n", c_.optim.lr,
                        to_string(c_.optim.schedule.kind), c_.optim.schedule.warmup_steps);
    out_ << fmt::format("  output     {} (full resolved config in {})\n", c_.output.dir,
                        kConfigFile);
    out_ << fmt::format("  memory     about {:.2f} GiB estimated ({}; peak phase: {})\n",
                        to_gib(budget.total_bytes()),
                        device_.is_cuda() ? "device, one micro-batch" : "tensors, one micro-batch",
                        budget.peak_phase_name());
    out_ << "  time       estimated after the first steps\n" << std::flush;
  }

  // Failure-handling tests (docs/multi-gpu.md): Q4_FAULT=exit:R:S makes rank R exit with code 9
  // at the start of step S; Q4_FAULT=hang:R:S makes it hang there; Q4_FAULT=endeval:R:S makes the
  // end-of-run eval after step S fail on rank R (an error, exit 1). Off unless set.
  bool fault_at(const char* kind_wanted, int64_t step) const {
    const char* spec = std::getenv("Q4_FAULT");
    if (spec == nullptr || *spec == '\0') return false;
    char kind[8] = {0};
    int rank = -1;
    long long at = -1;
    if (std::sscanf(spec, "%7[a-z]:%d:%lld", kind, &rank, &at) != 3) return false;
    return rank == opts_.world.rank && at == step && std::string(kind) == kind_wanted;
  }

  void inject_fault(int64_t step) const {
    if (fault_at("exit", step)) {
      std::fprintf(stderr, "q4train: Q4_FAULT: rank %d exits at step %lld\n", opts_.world.rank,
                   static_cast<long long>(step));
      std::_Exit(9);
    }
    if (fault_at("hang", step)) {
      std::fprintf(stderr, "q4train: Q4_FAULT: rank %d hangs at step %lld\n", opts_.world.rank,
                   static_cast<long long>(step));
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }

  // Data parallel: the process group, after every input check (a bad config or file fails on
  // every rank before any collective).
  void connect_ranks() {
    const WorldInfo& w = opts_.world;
    if (c_.optim.in_backward == InBackward::kTrue) {
      throw ConfigError("optim.in_backward: true does not apply with several ranks (each "
                        "parameter is updated by its owner after the gradient reduction); use "
                        "auto or false");
    }
    const auto t0 = Clock::now();
    comm_ = DistComm::connect(w, device_, opts_.dist_timeout);
    out_ << fmt::format("data parallel: {} ranks ({}), rank {} on {}, rendezvous {}:{} in {:.1f} s\n",
                        w.world_size, comm_->backend(), w.rank, device_.str(), w.master_addr,
                        w.master_port, ms_since(t0) / 1000.0);
  }

  // model.config, the tokenizer (training; the probe only with data files) and the model.
  void setup_model(bool need_tokenizer) {
    const auto t0 = Clock::now();
    mc_ = load_model_config(c_);
    if (need_tokenizer) {
      tok_ = std::make_unique<data::Tokenizer>(as_input_error(
          "model.tokenizer", [&] { return data::Tokenizer::from_file(c_.model.tokenizer); }));
      if (tok_->vocab_size() > mc_.vocab_size) {
        throw ConfigError(
            fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                        c_.model.tokenizer, tok_->vocab_size(), c_.model.config, mc_.vocab_size));
      }
    }
    {
      NvtxRange r("load");
      auto lm = load_model(c_, mc_, out_, /*in_memory=*/probe_);
      model_ = std::move(lm.model);
      source_path_ = lm.source_path;
    }
    separate_lm_head_ = !model_->tied();
    (probe_ ? err_ : out_) << fmt::format(
        "model: {} layers, hidden {}, vocab {}, {} trainable elements in {} "
        "tensors, loaded in {:.1f} s\n",
        mc_.num_hidden_layers, mc_.hidden_size, mc_.vocab_size, model_->num_trainable_elements(),
        model_->trainable_parameters().size(), ms_since(t0) / 1000.0);
    check_guard(c_, device_, "after loading the model");
  }

  // The batcher over data.files, or (the probe without files) over synthetic sequences.
  void setup_data() {
    std::vector<data::Example> examples;
    int64_t pad_id = 0;
    if (c_.data.files.empty() && probe_) {
      examples = synthetic_examples(c_.train.batch_size * c_.train.grad_accum, c_.train.seq_len,
                                    mc_.vocab_size, static_cast<uint64_t>(c_.train.seed));
    } else {
      const auto dopt = dataset_options(c_);
      for (const auto& f : c_.data.files) {
        auto ds = as_input_error("data.files", [&] { return data::load_dataset(f, *tok_, dopt); });
        (probe_ ? err_ : out_) << ds.summary.to_string() << "\n";
        report_skipped_lines(ds.summary, err_);
        for (auto& e : ds.examples) examples.push_back(std::move(e));
      }
      if (examples.empty()) throw ConfigError(no_examples_message(c_));
      pad_id = tok_->endoftext_id();
      if (!probe_) setup_validation(&examples, pad_id);
    }
    batcher_ = as_input_error(truncation_keys(c_, "data.files"), [&] {
      return std::make_unique<data::Batcher>(std::move(examples), batcher_options(c_, pad_id));
    });
    const auto& ts = batcher_->truncation_stats();
    if (ts.truncated || ts.dropped) {
      (probe_ ? err_ : out_) << "truncation to train.seq_len " << c_.train.seq_len << " ("
                             << to_string(resolved_truncation(c_)) << "): " << ts.to_string()
                             << "\n";
    }
    if (!probe_) out_ << resolve_run_length(c_, batcher_->batches_per_epoch(), ranks());
  }

  int64_t ranks() const { return comm_ ? comm_->world_size() : opts_.world.world_size; }

  // Held-out examples for the validation loss: data.eval_fraction of the training examples
  // (never trained on) and every example of data.eval_files, batched like training without
  // shuffling.
  void setup_validation(std::vector<data::Example>* train, int64_t pad_id) {
    auto val = hold_out(train, c_.data.eval_fraction, c_.train.seed);
    const auto held = static_cast<int64_t>(val.size());
    const auto dopt = dataset_options(c_);
    for (const auto& f : c_.data.eval_files) {
      auto ds = as_input_error("data.eval_files", [&] { return data::load_dataset(f, *tok_, dopt); });
      out_ << "validation " << ds.summary.to_string() << "\n";
      report_skipped_lines(ds.summary, err_);
      for (auto& e : ds.examples) val.push_back(std::move(e));
    }
    if (val.empty()) {
      if (!c_.data.eval_files.empty()) {
        throw ConfigError("data.eval_files: no validation examples in " +
                          join_names(c_.data.eval_files, 8));
      }
      return;
    }
    auto bo = batcher_options(c_, pad_id);
    bo.shuffle = false;
    const auto total = static_cast<int64_t>(val.size());
    val_batcher_ = as_input_error(truncation_keys(c_, "data.eval_files"), [&] {
      return std::make_unique<data::Batcher>(std::move(val), bo);
    });
    val_start_ = val_batcher_->state();
    out_ << fmt::format("validation: {} examples ({} held out of data.files by "
                        "data.eval_fraction {}, {} from data.eval_files)\n",
                        total, held, c_.data.eval_fraction, total - held);
    const auto& ts = val_batcher_->truncation_stats();
    if (ts.truncated || ts.dropped) out_ << "validation " << ts.to_string() << "\n";
  }

  struct Validation {
    double loss = 0;     // token-weighted mean CE over every held-out example
    int64_t tokens = 0;  // supervised tokens it averages
    double ms = 0;
  };

  // One pass over the held-out examples without gradients (same batching as training, no
  // shuffle); the summed CE stays on the device until the end (one host read).
  // Data parallel: rank 0 only (every rank holds the same model; nothing here is collective).
  std::optional<Validation> validation_loss(int64_t step) {
    if (!val_batcher_ || !leader()) return std::nullopt;
    NvtxRange r("validation");
    const auto t0 = Clock::now();
    at::NoGradGuard no_grad;
    val_batcher_->restore(val_start_);
    const int64_t batches = val_batcher_->batches_per_epoch();
    at::Tensor sum;
    Validation v;
    for (int64_t i = 0; i < batches; ++i) {
      const data::Batch b = val_batcher_->next();
      TORCH_INTERNAL_ASSERT(b.epoch == 0, "validation: batches ran past one pass");
      const at::Tensor s = model_->loss(to_inputs(b, *model_, device_)).loss_sum.to(at::kDouble);
      sum = sum.defined() ? sum + s : s;
      v.tokens += b.supervised_tokens;
    }
    v.loss = sum.defined() && v.tokens > 0 ? sum.item<double>() / static_cast<double>(v.tokens)
                                           : std::numeric_limits<double>::quiet_NaN();
    v.ms = ms_since(t0);
    note_validation(v.loss, step);
    return v;
  }

  void note_validation(double loss, int64_t step) {
    last_val_ = loss;
    if (std::isfinite(loss) && !(loss >= best_val_)) {
      best_val_ = loss;
      best_val_step_ = step;
    }
  }

  void setup_optimizer() {
    optimizer_ = std::make_unique<optim::PackedAdamW>(adamw_options(c_));
    params_ = model_->trainable_parameters();
    std::vector<int64_t> numels;
    for (auto* p : params_) numels.push_back(p->master.numel());
    // Data parallel (ZeRO-2): each parameter has one owner rank that holds its moments, receives
    // its reduced gradient and broadcasts its updated master. One process owns everything.
    owner_ = assign_owners(numels, comm_ ? comm_->world_size() : 1);
    local_index_.assign(params_.size(), -1);
    std::unordered_map<const model::Parameter*, int64_t> index;
    for (size_t i = 0; i < params_.size(); ++i) {
      model::Parameter* p = params_[i];
      global_index_[p] = i;
      if (owner_[i] != (comm_ ? comm_->rank() : 0)) continue;
      local_index_[i] = optimizer_->num_params();
      index[p] = optimizer_->num_params();
      // The rounding stream is the parameter's index in the model, the same on every layout.
      optimizer_->add_param(p->name, p->master, /*weight_decay=*/p->master.dim() >= 2,
                            /*stream_index=*/static_cast<int64_t>(i));
    }
    if (comm_) {
      int64_t mine = 0, total = 0;
      for (size_t i = 0; i < params_.size(); ++i) {
        total += numels[i];
        if (local_index_[i] >= 0) mine += numels[i];
      }
      out_ << fmt::format("sharded optimizer: rank {} owns {} of {} tensors, {} of {} elements "
                          "({:.1f}%)\n",
                          comm_->rank(), optimizer_->num_params(), params_.size(), mine, total,
                          total > 0 ? 100.0 * static_cast<double>(mine) / total : 0.0);
    }
    in_backward_ = !comm_ && in_backward_updates(c_);
    if (in_backward_) {
      // Each parameter is updated from inside the backward once its gradient is complete; the
      // model frees the gradient when this returns.
      model_->set_grad_ready_hook([this, index](model::Parameter& p) {
        optimizer_->step_param(index.at(&p), p.grad);
      });
    }
    schedule_ = std::make_unique<optim::LrSchedule>(make_schedule(c_));
    flops_per_token_ = train_flops_per_token(mc_, c_.train.seq_len);
    peak_flops_ = device_peak_flops(device_name(device_));
  }

  // ------------------------------------------------------------------ the step
  // grad_accum micro-batches: pinned non-blocking input copies, forward, backward of the summed
  // CE over the step's supervised-token count (token-weighted mean, identical to one big batch),
  // then one optimizer step. The only host waits: the optimizer's global-norm reduction (its
  // clipping and non-finite guard are decided on the host) and the loss read after it, which
  // was copied before the optimizer ran and so waits for nothing more. `mark` instruments phases.
  StepOutcome train_step(int64_t step, const PhaseHook& mark = nullptr) {
    StepOutcome o;
    std::vector<data::Batch> micro;
    {
      // Data parallel: the global batch is world x grad_accum micro-batches in the order one
      // process would take them; rank r trains micro-batches [r * accum, (r + 1) * accum). Every
      // rank draws them all, so the token counts (the loss denominator) are global.
      NvtxRange r("data");
      const int64_t ranks = comm_ ? comm_->world_size() : 1;
      const int64_t mine = comm_ ? comm_->rank() : 0;
      for (int64_t i = 0; i < c_.train.grad_accum * ranks; ++i) {
        data::Batch b = batcher_->next();
        o.supervised += b.supervised_tokens;
        o.real_tokens += b.real_tokens;
        o.slots += b.slots();
        if (i / c_.train.grad_accum == mine) micro.push_back(std::move(b));
      }
    }
    if (mark) mark("batch_ready");
    const double denom = static_cast<double>(std::max<int64_t>(o.supervised, 1));
    optim::StepArgs args;
    args.lr = schedule_->lr_at(step);
    args.max_grad_norm = c_.train.max_grad_norm;
    if (in_backward_) {
      optimizer_->begin_step(args);
      model_->begin_grad_step();
    }
    if (comm_) begin_grad_reduction();
    at::Tensor loss_sum;
    for (const auto& b : micro) {
      const auto in = to_inputs(b, *model_, device_);
      model::LossOutput lo;
      {
        NvtxRange r("forward");
        lo = model_->loss(in);
      }
      if (mark) mark("forward_done");
      {
        NvtxRange r("backward");
        (lo.loss_sum / denom).backward();
      }
      if (mark) mark("backward_done");
      const at::Tensor ls = lo.loss_sum.detach();
      loss_sum = loss_sum.defined() ? loss_sum + ls : ls;
    }
    if (comm_) return finish_distributed_step(std::move(o), loss_sum, args, denom, mark);
    AsyncScalar loss_host;
    loss_host.start(loss_sum);
    {
      NvtxRange r("optimizer");
      if (in_backward_) {
        o.res = optimizer_->end_step();  // the updates ran inside the backward
      } else {
        std::vector<at::Tensor> grads;
        for (auto* p : model_->trainable_parameters()) {
          grads.push_back(p->grad.defined() ? p->grad
                                            : at::zeros_like(p->master, p->master.options()));
        }
        o.res = optimizer_->step(grads, args);
      }
      model_->zero_grad();
    }
    if (mark) mark("optimizer_step_done");
    o.loss = loss_host.read() / denom;
    o.stop = stop_requested();
    o.checkpoint_due = checkpoint_time_due();
    return o;
  }

  // ------------------------------------------------------------ data parallel (ZeRO-2)
  // Gradients go to their owner with one reduce per parameter, launched from inside the backward
  // as soon as a gradient is complete (grad_accum 1; the model's grad-ready hook) or after the
  // last micro-batch, always in one fixed order (the reverse of the model's) so that every rank
  // issues the same collectives in the same order. A non-owner drops its gradient once the
  // reduce has it; an owner keeps only the gradients of its own parameters.
  void begin_grad_reduction() {
    const size_t n = params_.size();
    grad_ready_.assign(n, 0);
    ready_grads_.assign(n, at::Tensor());
    owned_grads_.assign(n, at::Tensor());
    reduce_works_.clear();
    next_launch_ = 0;
    if (c_.train.grad_accum == 1) {
      model_->set_grad_ready_hook([this](model::Parameter& p) {
        const size_t i = global_index_.at(&p);
        ready_grads_[i] = p.grad;
        grad_ready_[i] = 1;
        launch_ready_reductions();
      });
      model_->begin_grad_step();
    } else {
      model_->set_grad_ready_hook(nullptr);
    }
  }

  void launch_ready_reductions() {
    const size_t n = params_.size();
    while (next_launch_ < n) {
      const size_t i = n - 1 - next_launch_;  // reverse model order
      if (!grad_ready_[i]) return;
      at::Tensor g = ready_grads_[i];
      ready_grads_[i] = at::Tensor();
      if (!g.defined()) {  // no use of the parameter reached the loss on this rank
        g = at::zeros(params_[i]->master.sizes(), params_[i]->master.options().dtype(
                                                      model_->options().resolved_grad_dtype()));
      }
      reduce_works_.push_back(comm_->reduce_sum(g, owner_[i]));
      if (local_index_[i] >= 0) owned_grads_[i] = g;
      ++next_launch_;
    }
    // Retire finished reduces so that a non-owner's gradients are freed during the backward
    // (a collective holds its tensors until retired): ZeRO-2's memory, not a full buffer.
    while (!reduce_works_.empty() && reduce_works_.front().done()) {
      reduce_works_.front().wait();
      reduce_works_.pop_front();
    }
  }

  StepOutcome finish_distributed_step(StepOutcome o, const at::Tensor& loss_sum,
                                      const optim::StepArgs& step_args, double denom,
                                      const PhaseHook& mark) {
    {
      NvtxRange r("grad_reduce");
      for (size_t i = 0; i < params_.size(); ++i) {
        if (grad_ready_[i]) continue;
        ready_grads_[i] = params_[i]->grad;  // accumulated (grad_accum > 1) or never reached
        grad_ready_[i] = 1;
      }
      launch_ready_reductions();
      for (auto& w : reduce_works_) w.wait();
      reduce_works_.clear();
      model_->zero_grad();
    }
    {
      NvtxRange r("optimizer");
      std::vector<at::Tensor> grads(static_cast<size_t>(optimizer_->num_params()));
      for (size_t i = 0; i < params_.size(); ++i) {
        if (local_index_[i] >= 0) grads[static_cast<size_t>(local_index_[i])] = owned_grads_[i];
      }
      owned_grads_.assign(params_.size(), at::Tensor());
      optim::StepArgs args = step_args;
      // Clipping and the non-finite guard see the global norm: the owners' sums of squares add.
      args.reduce_sumsq = [this](double s) { return comm_->allreduce_sum(s); };
      o.res = optimizer_->step(grads, args);
    }
    if (o.res.applied) broadcast_masters();
    if (mark) mark("optimizer_step_done");
    // The step's loss (summed over the ranks), whether any rank got a stop signal and whether
    // rank 0's clock says a timed checkpoint is due: one collective for all three.
    const auto opt = at::TensorOptions().dtype(at::kDouble).device(device_);
    at::Tensor v = at::zeros({3}, opt);
    v[0].copy_(loss_sum.detach().to(at::kDouble).reshape({}));
    v[1].fill_(stop_requested() ? 1.0 : 0.0);
    v[2].fill_(checkpoint_time_due() ? 1.0 : 0.0);
    comm_->allreduce_sum(v);
    const at::Tensor h = v.cpu();
    o.loss = h[0].item<double>() / denom;
    o.stop = h[1].item<double>() > 0.0;
    o.checkpoint_due = h[2].item<double>() > 0.0;
    return o;
  }

  // Each owner's masters to every rank (after a step, and after a resume).
  void broadcast_masters() {
    NvtxRange r("master_broadcast");
    std::vector<DistWork> works;
    works.reserve(params_.size());
    for (size_t i = 0; i < params_.size(); ++i) {
      works.push_back(comm_->broadcast(params_[i]->master, owner_[i]));
    }
    for (auto& w : works) w.wait();
  }

  // The LR schedule is a function of (kind, lr, warmup, steps, min_lr_ratio): resuming with any of
  // them changed would silently bend the curve, so it needs --allow-schedule-change.
  void check_schedule_unchanged(const CheckpointDir& ck, const nlohmann::json& state) {
    if (!state.contains("schedule") || !state["schedule"].is_object()) return;
    const auto& s = state["schedule"];
    std::vector<std::string> changed;
    auto number = [&](const char* saved, const char* key, const nlohmann::json& now) {
      if (s.contains(saved) && s[saved].is_number() &&
          s[saved].get<double>() != now.get<double>()) {
        changed.push_back(fmt::format("{} {} -> {}", key, s[saved].dump(), now.dump()));
      }
    };
    const std::string kind = to_string(c_.optim.schedule.kind);
    if (s.contains("kind") && s["kind"].is_string() && s["kind"] != kind) {
      changed.push_back(
          fmt::format("optim.schedule.kind {} -> {}", s["kind"].get<std::string>(), kind));
    }
    number("peak_lr", "optim.lr", c_.optim.lr);
    number("warmup_steps", "optim.schedule.warmup_steps", c_.optim.schedule.warmup_steps);
    number("total_steps", "train.steps", c_.train.steps);
    number("min_lr_ratio", "optim.schedule.min_lr_ratio", c_.optim.schedule.min_lr_ratio);
    if (changed.empty()) return;
    std::string list;
    for (const auto& x : changed) list += (list.empty() ? "" : ", ") + x;
    if (opts_.allow_schedule_change) {
      out_ << "note: the LR schedule changed since " << ck.path << " (" << list
           << "); continuing with the new one (--allow-schedule-change)\n";
      return;
    }
    throw ConfigError("--resume " + ck.path + ": the LR schedule differs from the checkpoint's (" +
                      list +
                      "); pass --allow-schedule-change to continue with the new schedule");
  }

  // A resume trains exactly the tensors the checkpoint trained: a tensor dropped from
  // train.trainable would silently fall back to its initial weights (its trained master is in the
  // checkpoint only), an added one would have no optimizer state. Checkpoints written before the
  // set was recorded are not checked.
  void check_trainable_unchanged(const CheckpointDir& ck, const nlohmann::json& state) const {
    if (!state.contains("trainable") || !state["trainable"].is_array()) return;
    std::set<std::string> saved, now;
    for (const auto& n : state["trainable"]) {
      if (n.is_string()) saved.insert(n.get<std::string>());
    }
    for (const auto* p : params_) now.insert(p->name);
    if (saved == now) return;
    std::vector<std::string> dropped, added;
    std::set_difference(saved.begin(), saved.end(), now.begin(), now.end(),
                        std::back_inserter(dropped));
    std::set_difference(now.begin(), now.end(), saved.begin(), saved.end(),
                        std::back_inserter(added));
    std::string what;
    if (!dropped.empty()) {
      what += fmt::format("{} tensor(s) it trained are not trained now ({})", dropped.size(),
                          join_names(dropped, 3));
    }
    if (!added.empty()) {
      what += fmt::format("{}{} tensor(s) trained now were frozen in it ({})",
                          what.empty() ? "" : "; ", added.size(), join_names(added, 3));
    }
    throw ConfigError(fmt::format(
        "--resume {}: config key train.trainable differs from the checkpoint's: {}; resume with "
        "the checkpoint's train.trainable (its config.yaml), or start a new run from its export",
        ck.path, what));
  }

  void restore(const CheckpointDir& ck, bool export_only = false) {
    const fs::path dir(ck.path);
    verify_checkpoint(ck);  // CRC32C of every file, naming the damaged one
    const std::string state_path = (dir / kTrainStateFile).string();
    const auto state = nlohmann::json::parse(read_file(state_path), nullptr, false);
    if (state.is_discarded() || !state.is_object() || !state.contains("step")) {
      throw ConfigError("--resume: " + state_path + " is not a valid checkpoint state" +
                        previous_checkpoint_hint(ck));
    }
    // A field of the wrong type or a batcher state that does not fit names the file too.
    const auto state_error = [&](const std::string& what) {
      return ConfigError("--resume: " + state_path + ": " + what + previous_checkpoint_hint(ck));
    };
    if (!state["step"].is_number_integer() || state["step"].get<int64_t>() < 0) {
      throw state_error("'step' is " + state["step"].dump() + ", expected a step number");
    }
    start_step_ = state.at("step").get<int64_t>();
    if (!export_only && start_step_ > c_.train.steps) {
      throw ConfigError(fmt::format("--resume {}: checkpoint step {} is past train.steps {}",
                                    ck.path, start_step_, c_.train.steps));
    }
    check_trainable_unchanged(ck, state);
    if (!export_only) {
      try {
        adapt_to_checkpoint_world(state, ck);
      } catch (const nlohmann::json::exception& e) {
        throw state_error(e.what());
      }
    }
    const std::vector<std::string> state_files = optimizer_files(ck);
    as_input_error("--resume", [&] {
      try {
        optimizer_->load_shards(state_files, /*restore_masters=*/true);
      } catch (const c10::Error& e) {
        if (e.msg().rfind("INTERNAL ASSERT FAILED", 0) == 0) throw;
        TORCH_CHECK(false, e.what_without_backtrace(), previous_checkpoint_hint(ck));
      }
      return 0;
    });
    try {
      if (batcher_) {
        if (!state.contains("batcher")) throw state_error("no 'batcher' state");
        batcher_->restore(data::BatcherState::from_json(state.at("batcher").dump()));
      }
      tokens_seen_ = state.value("tokens_seen", int64_t{0});
    } catch (const ConfigError&) {
      throw;
    } catch (const nlohmann::json::exception& e) {
      throw state_error(e.what());
    } catch (const c10::Error& e) {
      throw state_error(e.what_without_backtrace());
    } catch (const std::exception& e) {
      throw state_error(e.what());
    }
    if (state.contains("previous_grad_norm") && state["previous_grad_norm"].is_number()) {
      optimizer_->set_previous_grad_norm(state["previous_grad_norm"].get<double>());
    }
    if (fs::exists(dir / kRngFile)) {
      try {
        model::DatReader rng((dir / kRngFile).string());
        auto gen = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(rng.load("cpu_generator"));
      } catch (const c10::Error& e) {
        throw ConfigError("--resume: " + (dir / kRngFile).string() + ": " +
                          e.what_without_backtrace() + previous_checkpoint_hint(ck));
      }
    }
    // Each rank restored the masters it owns; the others come from their owners.
    if (comm_) broadcast_masters();
    out_ << (export_only ? "loaded " : "resumed from ") << ck.path << " at step " << start_step_
         << "\n";
  }

  // The optimizer state files of a checkpoint: optim.state (one process) or the shards
  // optim-RRRRR-of-WWWWW.state of a data-parallel run, all of them present.
  static std::vector<std::string> optimizer_files(const CheckpointDir& ck) {
    const fs::path dir(ck.path);
    if (fs::exists(dir / kOptimStateFile)) return {(dir / kOptimStateFile).string()};
    std::vector<std::string> shards;
    int64_t world = -1;
    for (const auto& e : fs::directory_iterator(dir)) {
      const std::string name = e.path().filename().string();
      int r = 0, w = 0;
      char tail = 0;
      if (std::sscanf(name.c_str(), "optim-%5d-of-%5d.stat%c", &r, &w, &tail) == 3 && tail == 'e' &&
          name == shard_file_name(r, w)) {
        if (world >= 0 && w != world) {
          throw ConfigError("--resume " + ck.path + ": optimizer shards of different world sizes" +
                            previous_checkpoint_hint(ck));
        }
        world = w;
        shards.push_back(e.path().string());
      }
    }
    std::sort(shards.begin(), shards.end());
    if (shards.empty() || static_cast<int64_t>(shards.size()) != world) {
      throw ConfigError(fmt::format("--resume {}: {} (found {} of {} optimizer shards){}", ck.path,
                                    shards.empty() ? "no optimizer state" : "incomplete checkpoint",
                                    shards.size(), std::max<int64_t>(world, 1),
                                    previous_checkpoint_hint(ck)));
    }
    return shards;
  }

  static std::string shard_file_name(int rank, int world) {
    return fmt::format("optim-{:05d}-of-{:05d}.state", rank, world);
  }

  // A checkpoint written by another number of ranks continues with the same global batch
  // (world x batch_size x grad_accum): grad_accum is rescaled when batch_size is unchanged and
  // the product divides; otherwise the run would silently change its batch, so it stops.
  void adapt_to_checkpoint_world(const nlohmann::json& state, const CheckpointDir& ck) {
    const int64_t world = comm_ ? comm_->world_size() : 1;
    const int64_t ck_world = state.value("world_size", int64_t{1});
    const int64_t ck_accum = state.value("grad_accum", c_.train.grad_accum);
    const int64_t ck_batch = state.value("batch_size", c_.train.batch_size);
    if (ck_world == world) return;
    const int64_t global = ck_world * ck_accum * ck_batch;
    if (ck_batch == c_.train.batch_size && (ck_world * ck_accum) % world == 0) {
      const int64_t accum = ck_world * ck_accum / world;
      if (accum != c_.train.grad_accum) {
        out_ << fmt::format("resume: checkpoint of {} rank(s) x grad_accum {} continues on {} "
                            "rank(s) with grad_accum {} (same global batch of {} sequences)\n",
                            ck_world, ck_accum, world, accum, global);
        c_.train.grad_accum = accum;
        if (in_backward_ && accum > 1) {
          // Updates inside the backward need one micro-batch per step: back to buffered ones.
          in_backward_ = false;
          model_->set_grad_ready_hook(nullptr);
          out_ << "resume: grad_accum > 1, so optimizer updates run after the backward "
                  "(optim.in_backward off)\n";
        }
      }
      return;
    }
    throw ConfigError(fmt::format(
        "--resume {}: the checkpoint's global batch is {} sequences ({} rank(s) x batch_size {} x "
        "grad_accum {}); with {} rank(s) and train.batch_size {} no whole grad_accum gives it "
        "(keep batch_size {} and use a rank count dividing {})",
        ck.path, global, ck_world, ck_batch, ck_accum, world, c_.train.batch_size, ck_batch,
        ck_world * ck_accum));
  }

  // A failed checkpoint (full disk, I/O error) removes its directory: no partial files remain and
  // the previous complete checkpoint stays the newest.
  void save_checkpoint(int64_t step) {
    const fs::path dir = fs::path(c_.output.dir) / checkpoint_dir_name(step);
    try {
      write_checkpoint(step, dir);
    } catch (...) {
      std::error_code ec;
      if (leader()) q4::io::remove_tree(dir, ec);
      throw;
    }
  }

  // Data parallel: rank 0 makes the directory, every rank writes its optimizer shard (its
  // masters and moments), then rank 0 writes the run state, the checksums of every file and the
  // DONE marker last, so a checkpoint counts only when all shards are complete.
  void write_checkpoint(int64_t step, const fs::path& dir) {
    NvtxRange r("checkpoint");
    if (leader()) {
      q4::io::remove_tree(dir);
      fs::create_directories(dir);
    }
    std::vector<std::string> files;
    if (comm_) {
      comm_->barrier();
      optimizer_->save((dir / shard_file_name(comm_->rank(), comm_->world_size())).string(),
                       /*include_masters=*/true);
      comm_->barrier();
      for (int k = 0; k < comm_->world_size(); ++k) {
        files.push_back(shard_file_name(k, comm_->world_size()));
      }
      if (!leader()) {
        last_checkpoint_step_ = step;
        return;
      }
    } else {
      optimizer_->save((dir / kOptimStateFile).string(), /*include_masters=*/true);
      files.push_back(kOptimStateFile);
    }
    {
      model::DatWriter w((dir / kRngFile).string(), 1);
      w.add("cpu_generator", at::detail::getDefaultCPUGenerator().get_state());
      w.commit();
    }
    nlohmann::json st;
    st["step"] = step;
    st["tokens_seen"] = tokens_seen_;
    st["optimizer_steps"] = optimizer_->step_count();
    st["skipped_steps"] = optimizer_->skipped_total();
    // In-backward updates clip with the previous step's norm: part of the exact resume state.
    if (std::isfinite(optimizer_->previous_grad_norm())) {
      st["previous_grad_norm"] = optimizer_->previous_grad_norm();
    }
    st["seed"] = c_.train.seed;
    // The trained set: a resume that trains other tensors is refused (check_trainable_unchanged).
    st["trainable"] = nlohmann::json::array();
    for (const auto* p : params_) st["trainable"].push_back(p->name);
    st["world_size"] = comm_ ? comm_->world_size() : 1;
    st["batch_size"] = c_.train.batch_size;
    st["grad_accum"] = c_.train.grad_accum;
    st["schedule"] = {{"kind", to_string(c_.optim.schedule.kind)},
                      {"peak_lr", c_.optim.lr},
                      {"warmup_steps", c_.optim.schedule.warmup_steps},
                      {"total_steps", c_.train.steps},
                      {"min_lr_ratio", c_.optim.schedule.min_lr_ratio},
                      {"next_lr", step < c_.train.steps ? schedule_->lr_at(step) : 0.0}};
    if (batcher_) st["batcher"] = nlohmann::json::parse(batcher_->state().to_json());
    write_file_atomic((dir / kTrainStateFile).string(), st.dump(2) + "\n");
    files.push_back(kRngFile);
    files.push_back(kTrainStateFile);
    write_checkpoint_checksums(dir.string(), files);
    mark_checkpoint_done(dir.string(), step);
    last_checkpoint_step_ = step;
    last_checkpoint_time_ = Clock::now();
    const auto removed = rotate_checkpoints(c_.output.dir, c_.output.keep);
    out_ << "checkpoint " << dir.string() << (removed.empty() ? "" : " (rotated ")
         << (removed.empty() ? "" : std::to_string(removed.size()) + " old)") << "\n";
  }

  std::vector<EvalAnswer> evaluate(int64_t step, const char* tag) {
    if (c_.eval.prompts.empty() || !leader()) return {};
    NvtxRange r("eval");
    const auto t0 = Clock::now();
    auto answers = generate_answers(*model_, *tok_, c_);
    for (const auto& a : answers) {
      out_ << fmt::format("eval[{} step {}] {} => {}{}\n", tag, step, one_line(a.prompt),
                          one_line(a.answer), a.stopped ? "" : " [no stop token]");
      eval_log_.write({{"step", step},
                       {"when", tag},
                       {"prompt", a.prompt},
                       {"answer", a.answer},
                       {"new_tokens", static_cast<int64_t>(a.tokens.size())},
                       {"stopped", a.stopped}});
    }
    // TensorBoard text and report.html (issue 14 hooks).
    for (size_t i = 0; i < answers.size(); ++i) {
      tb_.add_text("eval/" + std::to_string(i), answers[i].prompt + " => " + answers[i].answer,
                   step);
    }
    update_report(/*live=*/true);
    out_ << fmt::format("eval took {:.1f} s\n", ms_since(t0) / 1000.0);
    return answers;
  }

  // output.hf_export: the exported .dat also as a Hugging Face folder next to it.
  void export_hf_folder(const std::string& dat_path) {
    if (c_.output.hf_export == HfExport::kNone) return;
    const auto t0 = Clock::now();
    const std::string dir = hf_export_dir(dat_path);
    model::HfExportOptions o;
    o.format = to_model(c_.output.hf_export);
    o.tokenizer_dir = fs::path(c_.model.tokenizer).parent_path().string();
    std::ifstream in(c_.model.config);
    const auto config = nlohmann::json::parse(in);
    const auto rep = model::export_hf(model::DatReader(dat_path), config, dir, o);
    out_ << fmt::format("hf export ({}) -> {} ({} shard(s), {:.1f} s); serve with: vllm serve {}\n",
                        to_string(c_.output.hf_export), dir, rep.shards.size(),
                        ms_since(t0) / 1000.0, dir);
  }

  // A periodic export (export_every) that fails is a warning and training goes on; the final one
  // is an error (finish() has checkpointed first).
  void export_model(int64_t step, const std::vector<EvalAnswer>* reference) {
    if (step == c_.train.steps) return write_export(step, reference);
    try {
      write_export(step, reference);
    } catch (const std::exception& e) {
      const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
      err_ << "warning: export at step " << step
           << " failed, training goes on: " << (ce ? ce->what_without_backtrace() : e.what())
           << "\n";
    }
  }

  // Checkpoints are on by default: every output.checkpoint_every steps and/or every
  // output.checkpoint_minutes of training, and at the end of the run.
  bool checkpoints_on() const {
    return c_.output.checkpoint_every > 0 || c_.output.checkpoint_minutes > 0;
  }

  // Whether output.checkpoint_minutes have passed since the last checkpoint (or the start of
  // training) on rank 0's clock; the other ranks learn it from the step's closing allreduce
  // (StepOutcome::checkpoint_due), so no extra collective or device sync is spent on it.
  bool checkpoint_time_due() const {
    if (c_.output.checkpoint_minutes <= 0 || !leader()) return false;
    return ms_since(last_checkpoint_time_) / 60000.0 >= c_.output.checkpoint_minutes;
  }

  // The end of a run: the final checkpoint comes before anything at the end that can fail (loop()
  // takes it before the end-of-run eval), and an export that fails is checkpointed before the
  // error ends the run (with checkpoints off too), so that no trained step is lost to a full
  // disk, a bad export path or a failing eval.
  void finish(int64_t total, const std::vector<EvalAnswer>* reference) {
    const bool trained = total > start_step_;
    if (checkpoints_on() && last_checkpoint_step_ != total && trained) save_checkpoint(total);
    // Rank 0 exports; every rank learns whether it failed (the checkpoint is a collective).
    std::exception_ptr failure;
    if (leader()) {
      try {
        export_model(total, reference);
      } catch (...) {
        failure = std::current_exception();
      }
    }
    bool failed = failure != nullptr;
    if (comm_) failed = comm_->allreduce_sum(failed ? 1.0 : 0.0) > 0.0;
    if (failed && last_checkpoint_step_ != total && trained) {
      err_ << "export failed; writing a checkpoint of step " << total << " first\n";
      save_checkpoint(total);
    }
    if (failure) std::rethrow_exception(failure);
    if (failed) throw std::runtime_error("the export on rank 0 failed (its output says why)");
    metrics_.close();
    eval_log_.close();
  }

  void write_export(int64_t step, const std::vector<EvalAnswer>* reference) {
    const std::string path = resolved_export_path(c_);
    if (path.empty()) return;
    // Never over a newer export (a periodic export of a resumed older checkpoint, say).
    check_export_not_newer(path, step, opts_.overwrite, /*unknown_is_error=*/false, c_.output.dir);
    NvtxRange r("export");
    const auto t0 = Clock::now();
    {
      model::DatReader source(source_path_);
      model_->export_to(source, path);
    }
    record_export_step(path, step, c_.output.dir);
    out_ << fmt::format("export step {} -> {} ({:.1f} s)\n", step, path, ms_since(t0) / 1000.0);
    export_hf_folder(path);
    if (!c_.output.verify_export) return;
    // Read the export back as inference would load it and compare, tensor by tensor, the
    // weights its forward would use with the trained model's: equal weights, equal answers,
    // without a second model in device memory.
    const auto t1 = Clock::now();
    const auto differ = model_->compare_forward_weights(model::DatReader(path));
    const auto n = static_cast<int64_t>(model_->parameters().size());
    // Trained NVFP4 tensors may differ in a few re-quantized blocks (export_check.h).
    const auto requantized = [&](const std::string& name) {
      for (const auto& p : model_->parameters()) {
        if (p.name == name) return p.trainable && p.quantized;
      }
      return false;
    };
    const auto report = summarize_export_check(differ, n, requantized, ms_since(t1) / 1000.0);
    for (const auto& line : report.lines) out_ << line << "\n";
    if (!report.failures.empty()) {
      throw std::runtime_error(fmt::format(
          "export check failed: {} tensor(s) of {} differ from the trained model beyond "
          "re-quantization (listed above)",
          report.failures.size(), path));
    }
    (void)reference;
    check_guard(c_, device_, "after the export check");
  }

  // report.html (log.report, rank 0): on the log cadence at most every kReportMinIntervalS (an
  // atomic rewrite per log line would cost more than fast steps), at evals and at the end;
  // `live` pages reload themselves.
  static constexpr double kReportMinIntervalS = 2.0;
  void update_report(bool live, double min_interval_s = 0) {
    if (!c_.log.report || !leader()) return;
    if (!report_) report_ = std::make_unique<ReportWriter>(c_.output.dir, c_.log.metrics);
    report_->write(live, min_interval_s);
  }

  // The validation loss as a TensorBoard scalar and, before the first step, its own metrics
  // record (later ones ride in the step's record).
  void log_validation(const Validation& v, int64_t step, bool own_record) {
    if (own_record && metrics_.is_open()) {
      metrics_.write({{"step", step}, {"val_loss", v.loss}, {"val_tokens", v.tokens}});
    }
    if (tb_.is_open() && std::isfinite(v.loss)) tb_.add_scalar("val/loss", v.loss, step);
  }

  // The end of a run: wall time, losses, the files written and what to do next.
  void print_end_summary(int64_t total) {
    out_ << fmt::format("done: {} steps in {}, {} tokens", total,
                        format_duration(ms_since(run_start_) / 1000.0), tokens_seen_);
    if (last_loss_) {
      out_ << fmt::format("; final loss {:.4f}", *last_loss_);
      if (last_loss_avg_) out_ << fmt::format(" (last log window avg {:.4f})", *last_loss_avg_);
    }
    if (last_val_) {
      out_ << fmt::format("; validation loss {:.4f} (best {:.4f} at step {})", *last_val_,
                          best_val_, best_val_step_);
    }
    out_ << "\n";
    const fs::path dir(c_.output.dir);
    const std::string exp = resolved_export_path(c_);
    std::vector<std::pair<std::string, std::string>> files;
    auto add = [&](const char* what, const std::string& path) {
      std::error_code ec;
      if (!path.empty() && fs::exists(path, ec)) files.emplace_back(what, path);
    };
    add("export", exp);
    if (c_.output.hf_export != HfExport::kNone && !exp.empty()) {
      add("hf export", hf_export_dir(exp));
    }
    if (!c_.log.metrics.empty()) add("metrics", (dir / c_.log.metrics).string());
    add("eval", (dir / kEvalFile).string());
    if (c_.log.report) add("report", (dir / "report.html").string());
    if (tb_.is_open() || !tb_.path().empty()) add("tensorboard", tb_.path());
    add("config", (dir / kConfigFile).string());
    const auto ck = latest_checkpoint(c_.output.dir);
    if (ck) add("checkpoint", ck->path);
    out_ << "files:\n";
    for (const auto& [what, path] : files) out_ << fmt::format("  {:<12}{}\n", what, path);
    out_ << "next:\n";
    if (!exp.empty() && fs::exists(exp)) {
      out_ << fmt::format("  chat         {} --model {}\n", tool_command("q4chat"),
                          exp == (dir / "model.dat").string() ? c_.output.dir : exp);
    }
    if (ck) {
      // A new file named by the step: never the run's model (docs/trainer.md#export).
      out_ << fmt::format("  export       {} --resume {} --export-only --set output.export_path={}\n",
                          tool_command("q4train"), ck->path, step_export_name(ck->step));
    }
    if (!exp.empty() && c_.output.hf_export != HfExport::kNone) {
      out_ << fmt::format("  serve        vllm serve {}   (docs/interop.md)\n", hf_export_dir(exp));
    } else if (!exp.empty()) {
      out_ << fmt::format(
          "  serve        {} export-hf {} {} --config {} --tokenizer-dir {} --format modelopt, "
          "then vllm serve {} (docs/interop.md)\n",
          tool_command("q4dat"), exp, hf_export_dir(exp), c_.model.config,
          fs::path(c_.model.tokenizer).parent_path().string(), hf_export_dir(exp));
    }
    out_ << fmt::format("  tensorboard  tensorboard --logdir {}\n", c_.output.dir) << std::flush;
  }

  int loop() {
    const int64_t total = c_.train.steps;
    std::vector<EvalAnswer> last_answers;
    if (start_step_ == 0 && c_.eval.at_start && total > 0) {
      if (const auto v = validation_loss(0)) {
        out_ << fmt::format("validation loss at step 0: {:.4f} ({} tokens, {:.1f} s)\n", v->loss,
                            v->tokens, v->ms / 1000.0);
        log_validation(*v, 0, /*own_record=*/true);
      }
    }
    if (c_.eval.at_start && start_step_ == 0) last_answers = evaluate(0, "start");
    const bool bar =
        c_.log.progress == ProgressStyle::kBar ||
        (c_.log.progress == ProgressStyle::kAuto && ::isatty(STDERR_FILENO) && ::isatty(1));
    double session_ms = 0, first_step_ms = 0;
    int64_t session_steps = 0;
    int64_t consecutive_nonfinite = 0;
    double window_loss_sum = 0;  // supervised-token-weighted losses since the last log line
    int64_t window_tokens = 0;
    last_checkpoint_time_ = Clock::now();  // checkpoint_minutes count training time
    for (int64_t step = start_step_; step < total; ++step) {
      inject_fault(step + 1);
      const auto t0 = Clock::now();
      note_run_peak();  // the window before this step (load, eval, the previous step)
      reset_peak_memory(device_);
      const double lr = schedule_->lr_at(step);
      const bool trace = !opts_.profile_trace.empty();
      const bool trace_first = trace && step == start_step_ + 2;
      const bool trace_last = trace && (step == start_step_ + 3 || (trace_first && step + 1 == total));
      if (trace_first) profiler_start(device_.is_cuda());
      const StepOutcome so = train_step(step);
      if (trace_last) {
        synchronize_device(device_);
        profiler_stop_and_save(opts_.profile_trace);
        err_ << "profile trace of steps " << start_step_ + 3 << "-" << step + 1 << " written to "
             << opts_.profile_trace << "\n";
      }
      const optim::StepResult& res = so.res;
      const double loss = so.loss;
      const int64_t real_tokens = so.real_tokens;
      const int64_t done = step + 1;
      const bool last = done == total;
      // The validation loss: every eval.every steps and after the last one.
      const bool val_due = val_batcher_ && ((c_.eval.every > 0 && done % c_.eval.every == 0) || last);
      const bool log_step =
          done % c_.log.every == 0 || last || step == start_step_ || val_due;
      // Logging steps wait for the optimizer too (exact timing and memory there); other steps
      // return as soon as the loss is on the host, the optimizer kernels still running.
      if (log_step) synchronize_device(device_);
      const double step_ms = ms_since(t0);
      tokens_seen_ += real_tokens;
      if (!res.applied) {
        ++consecutive_nonfinite;
        err_ << fmt::format(
            "warning: step {} has non-finite gradients (norm {}); update skipped "
            "({} in a row)\n",
            step + 1, res.grad_norm, consecutive_nonfinite);
        if (consecutive_nonfinite > c_.train.max_nonfinite_steps) {
          TORCH_CHECK(false, "training diverged: ", consecutive_nonfinite,
                      " consecutive steps with non-finite gradients (train.max_nonfinite_steps = ",
                      c_.train.max_nonfinite_steps, ")");
        }
      } else {
        consecutive_nonfinite = 0;
      }
      session_ms += step_ms;
      if (session_steps == 0) first_step_ms = step_ms;
      ++session_steps;
      if (std::isfinite(loss) && so.supervised > 0) {
        window_loss_sum += loss * static_cast<double>(so.supervised);
        window_tokens += so.supervised;
      }
      const double window_mean = window_tokens > 0
                                     ? window_loss_sum / static_cast<double>(window_tokens)
                                     : std::numeric_limits<double>::quiet_NaN();

      StepMetrics m;
      m.step = done;
      m.total_steps = total;
      if (batcher_ && batcher_->num_examples() > 0) {
        // Examples taken from the current epoch's order (packing: less those still pending).
        const data::BatcherState st = batcher_->state();
        const auto taken = st.cursor - static_cast<int64_t>(st.pending.size());
        m.epoch = static_cast<double>(st.epoch) +
                  static_cast<double>(taken) / static_cast<double>(batcher_->num_examples());
      }
      m.loss = loss;
      m.grad_norm = res.grad_norm;
      m.lr = lr;
      m.step_ms = step_ms;
      m.tokens = real_tokens;
      m.slots = so.slots;
      m.tokens_per_s = step_ms > 0 ? real_tokens / (step_ms / 1000.0) : 0.0;
      // Per GPU: the step's tokens are the global batch's.
      if (peak_flops_) {
        m.mfu = m.tokens_per_s * flops_per_token_ / (*peak_flops_ * (comm_ ? comm_->world_size() : 1));
      }
      const auto mem = memory_snapshot(device_);
      m.gpu_reserved_bytes = mem.reserved_bytes;
      m.gpu_peak_bytes = mem.peak_allocated_bytes;
      m.rss_bytes = mem.rss_bytes;
      m.eta_s = (session_ms / session_steps) * static_cast<double>(total - step - 1) / 1000.0;
      m.skipped = !res.applied;
      if (log_step) {
        m.loss_avg = window_mean;
        last_loss_avg_ = window_mean;
        window_loss_sum = 0;
        window_tokens = 0;
      }
      last_loss_ = loss;
      std::optional<Validation> val;
      if (val_due) val = validation_loss(done);
      if (val) {
        m.val_loss = val->loss;
        m.val_tokens = val->tokens;
      }
      const auto record = metrics_to_json(m);
      if (metrics_.is_open()) metrics_.write(record);
      if (tb_.is_open()) {
        auto train_only = record;  // the validation loss goes to val/loss
        train_only.erase("val_loss");
        train_only.erase("val_tokens");
        tb_.add_metrics(train_only, m.step);  // TensorBoard scalars
        if (val) log_validation(*val, done, /*own_record=*/false);
      }
      if (log_step) {
        if (bar) err_ << "\r\033[K";
        out_ << format_log_line(m) << std::endl;
        update_report(/*live=*/true, kReportMinIntervalS);
      }
      // The run-time estimate, once: from the steps after the first (which warms up caches).
      if (session_steps == std::min<int64_t>(3, total - start_step_) && !last) {
        const double per_ms = session_steps > 1
                                  ? (session_ms - first_step_ms) / (session_steps - 1)
                                  : session_ms;
        if (bar) err_ << "\r\033[K";
        out_ << fmt::format(
            "time: about {} for the remaining {} steps ({:.2f} s/step{})\n",
            format_duration(per_ms * static_cast<double>(total - done) / 1000.0), total - done,
            per_ms / 1000.0,
            c_.eval.every > 0 || val_batcher_ ? ", evaluations not included" : "");
      }
      if (bar) {
        err_ << "\r" << format_progress_bar(done, total, 30, window_tokens > 0 ? window_mean : loss,
                                            m.eta_s)
             << std::flush;
      }

      check_guard(c_, device_, fmt::format("at step {}", done));

      if (c_.eval.every > 0 && done % c_.eval.every == 0 && !last) evaluate(done, "step");
      if (c_.output.export_every > 0 && done % c_.output.export_every == 0 && !last) {
        export_model(done, nullptr);
      }
      const bool step_due = c_.output.checkpoint_every > 0 && done % c_.output.checkpoint_every == 0;
      if (step_due || (so.checkpoint_due && !last)) save_checkpoint(done);
      if (so.stop && !last) {
        if (bar) err_ << "\n";
        out_ << "signal " << (stop_requested() ? stop_signal() : SIGTERM)
             << ": stopping after step " << done << "\n";
        if (last_checkpoint_step_ != done) save_checkpoint(done);
        update_report(/*live=*/false);
        if (leader()) {
          const std::string q4train = tool_command("q4train");
          out_ << fmt::format(
                      "stopped at step {} of {} (checkpoint {}); resume with: {} --resume {}   "
                      "(or export this step: {} --resume {} --export-only --set "
                      "output.export_path={})\n",
                      done, total, (fs::path(c_.output.dir) / checkpoint_dir_name(done)).string(),
                      q4train, c_.output.dir, q4train,
                      (fs::path(c_.output.dir) / checkpoint_dir_name(done)).string(),
                      step_export_name(done))
               << std::flush;
        }
        if (comm_) comm_->barrier();
        return kExitOk;
      }
    }
    if (bar && total > start_step_) err_ << "\n";
    if (total == start_step_ && val_batcher_) {  // nothing left to train: still report it
      if (const auto v = validation_loss(total)) {
        out_ << fmt::format("validation loss at step {}: {:.4f}\n", total, v->loss);
      }
    }
    // The final checkpoint before anything at the end that can fail (eval, export, report).
    if (checkpoints_on() && last_checkpoint_step_ != total && total > start_step_) {
      save_checkpoint(total);
    }
    if (fault_at("endeval", total)) {
      throw std::runtime_error("Q4_FAULT: the end-of-run eval fails (test fault)");
    }
    if (c_.eval.at_end) last_answers = evaluate(total, "end");
    finish(total, &last_answers);
    note_run_peak();
    if (run_peak_bytes_ > 0) {
      out_ << fmt::format("peak GPU memory allocated over the run (load, steps, evals, export, "
                          "export check): {:.2f} GiB\n",
                          to_gib(run_peak_bytes_));
    }
    update_report(/*live=*/false);  // after the last eval
    if (leader()) print_end_summary(total);
    if (comm_) comm_->barrier();  // no rank leaves while rank 0 still exports
    return kExitOk;
  }

  Config c_;
  RunOptions opts_;
  std::ostream& out_;
  std::ostream& err_;
  at::Device device_;
  model::Qwen3Config mc_;
  std::unique_ptr<data::Tokenizer> tok_;
  std::unique_ptr<model::Qwen3Model> model_;
  std::string source_path_;
  bool separate_lm_head_ = true;
  std::unique_ptr<data::Batcher> batcher_;
  std::unique_ptr<optim::PackedAdamW> optimizer_;
  std::unique_ptr<optim::LrSchedule> schedule_;
  std::unique_ptr<RunDirLock> lock_;  // output.dir, for the whole run
  JsonlWriter metrics_;
  JsonlWriter eval_log_;
  std::unique_ptr<ReportWriter> report_;  // report.html (update_report)
  TfEventsWriter tb_;
  std::unique_ptr<data::Batcher> val_batcher_;  // held-out examples (none: no validation)
  data::BatcherState val_start_;                // its state before the first batch
  std::optional<double> last_val_;
  double best_val_ = std::numeric_limits<double>::infinity();
  int64_t best_val_step_ = 0;
  std::optional<double> last_loss_, last_loss_avg_;
  Clock::time_point run_start_ = Clock::now();
  int64_t start_step_ = 0;
  int64_t last_checkpoint_step_ = -1;
  Clock::time_point last_checkpoint_time_ = Clock::now();  // output.checkpoint_minutes
  bool setup_dir_existed_ = false;          // output.dir existed before set-up
  std::set<std::string> setup_dir_before_;  // its entries then (rank 0)
  int64_t tokens_seen_ = 0;
  double flops_per_token_ = 0;
  std::optional<double> peak_flops_;
  bool probe_ = false;
  double epochs_ = 0;              // train.epochs as configured (c_ holds the resolved steps)
  bool length_from_data_ = false;  // train.epochs or warmup_ratio: steps known after the data
  bool in_backward_ = false;  // optimizer updates inside the backward (optim.in_backward)
  int64_t run_peak_bytes_ = 0;  // the device's peak allocated over the whole run
  void note_run_peak() {
    const auto m = memory_snapshot(device_);
    if (m.peak_allocated_bytes) run_peak_bytes_ = std::max(run_peak_bytes_, *m.peak_allocated_bytes);
  }
  // Data parallel (null with one process).
  std::unique_ptr<DistComm> comm_;
  std::vector<model::Parameter*> params_;  // trainable parameters in model order
  std::unordered_map<const model::Parameter*, size_t> global_index_;
  std::vector<int> owner_;             // per parameter: the rank holding its optimizer state
  std::vector<int64_t> local_index_;   // per parameter: index in optimizer_, -1 if not owned
  std::vector<char> grad_ready_;       // this step: gradient complete on this rank
  std::vector<at::Tensor> ready_grads_;  // complete gradients whose reduce is not launched yet
  std::vector<at::Tensor> owned_grads_;  // owned parameters' reduced gradients
  std::deque<DistWork> reduce_works_;  // launched, not yet retired, oldest first
  size_t next_launch_ = 0;  // reduces launched so far (fixed order)
};

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string saved_config_path_for_resume(const std::string& resume_dir) {
  fs::path p = fs::absolute(resume_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (fs::exists(p / kConfigFile)) return (p / kConfigFile).string();
  if (fs::exists(p.parent_path() / kConfigFile)) return (p.parent_path() / kConfigFile).string();
  throw ConfigError("--resume " + resume_dir + ": no " + kConfigFile +
                    " in it or its parent; pass --config");
}

void check_device_available(const Config& c) {
  if (!device_is_cuda(c)) return;
  const std::string fix = "; or set model.device: cpu";
  if (!at::hasCUDA()) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
    throw ConfigError("config key model.device: " + c.model.device +
                      ", but no CUDA device is visible to this process (check nvidia-smi and "
                      "CUDA_VISIBLE_DEVICES)" +
                      fix);
#else
    throw ConfigError("config key model.device: " + c.model.device +
                      ", but this q4train is a CPU-only build (LibTorch " + TORCH_VERSION +
                      " without CUDA): build it against LibTorch 2.x with CUDA (README, GPU "
                      "build)" +
                      fix);
#endif
  }
  const at::Device d(c.model.device);
  if (d.has_index()) {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    const int n = static_cast<int>(impl.deviceCount());
    if (d.index() >= n) {
      throw ConfigError(fmt::format(
          "config key model.device: {}, but this process sees {} CUDA device{} (cuda:0 to "
          "cuda:{}){}",
          c.model.device, n, n == 1 ? "" : "s", n - 1, fix));
    }
  }
}

std::string clip_warmup_to_run(Config& c) {
  const int64_t steps = c.train.steps;
  const int64_t warmup = c.optim.schedule.warmup_steps;
  if (steps <= 0 || warmup <= steps) return "";
  c.optim.schedule.warmup_steps = steps;
  return fmt::format(
      "note: optim.schedule.warmup_steps {} is longer than the run (train.steps {}); clipped to "
      "{}",
      warmup, steps, steps);
}

std::string resolve_run_length(Config& c, int64_t micro_batches_per_epoch, int64_t ranks) {
  std::string notes;
  const int64_t per_step = c.train.grad_accum * std::max<int64_t>(ranks, 1);
  if (c.train.epochs > 0) {
    // The batcher never lets a micro-batch cross an epoch's end, so an epoch is exactly
    // micro_batches_per_epoch micro-batches (with packing, epoch 0's count: later epochs may
    // differ by a few rows); the tolerance keeps 3 x 4 / 12 from rounding up to 2.
    const double exact = c.train.epochs * static_cast<double>(micro_batches_per_epoch) /
                         static_cast<double>(per_step);
    const auto steps = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(exact - 1e-9)));
    notes += fmt::format(
        "train.epochs {} -> train.steps {} ({} micro-batch{} per epoch, {} per step: "
        "train.grad_accum {} x {} rank{})\n",
        c.train.epochs, steps, micro_batches_per_epoch, micro_batches_per_epoch == 1 ? "" : "es",
        per_step, c.train.grad_accum, ranks, ranks == 1 ? "" : "s");
    c.train.steps = steps;
    c.train.epochs = 0;
  }
  if (c.optim.schedule.warmup_ratio > 0) {
    const auto warmup = static_cast<int64_t>(
        std::llround(c.optim.schedule.warmup_ratio * static_cast<double>(c.train.steps)));
    notes += fmt::format("optim.schedule.warmup_ratio {} -> optim.schedule.warmup_steps {}\n",
                         c.optim.schedule.warmup_ratio, warmup);
    c.optim.schedule.warmup_steps = warmup;
    c.optim.schedule.warmup_ratio = 0;
  }
  if (const std::string note = clip_warmup_to_run(c); !note.empty()) notes += note + "\n";
  return notes;
}

int run_training(const Config& config, const RunOptions& options, std::ostream& out,
                 std::ostream& err) {
  if (!options.world.distributed()) {
    Trainer t(config, options, out, err);
    return t.run();
  }
  // Data parallel: rank r trains on cuda:LOCAL_RANK (model.device: cuda) or the CPU; only rank 0
  // prints (errors reach main as exceptions on every rank).
  Config c = config;
  if (device_is_cuda(c)) {
    if (c.model.device != "cuda") {
      throw ConfigError("model.device: " + c.model.device +
                        " names one GPU, but this is a data-parallel run of " +
                        std::to_string(options.world.world_size) +
                        " ranks; use model.device: cuda (rank r takes cuda:LOCAL_RANK)");
    }
    c.model.device = "cuda:" + std::to_string(options.world.local_rank);
  }
  if (options.world.rank == 0) {
    Trainer t(c, options, out, err);
    return t.run();
  }
  std::ostream null_out(nullptr);
  Trainer t(c, options, null_out, null_out);
  return t.run();
}

int run_dry_run(const Config& config, std::ostream& out) {
  Config c = config;
  const bool length_from_data = c.train.epochs > 0 || c.optim.schedule.warmup_ratio > 0;
  if (!length_from_data) {
    if (const std::string note = clip_warmup_to_run(c); !note.empty()) out << note << "\n";
  }
  check_input_files(c, /*need_data=*/c.train.steps > 0);
  check_output_paths(c);
  const auto mc = load_model_config(c);
  as_input_error("train.trainable", [&] {
    trainable_spec(c).validate(mc.num_hidden_layers);
    return 0;
  });
  // The data as the run reads it: the real tokenizer, every file, the validation split, the
  // truncation policy and the batcher's packing (which sizes an epoch); no weights.
  if (c.train.steps > 0) {
    const auto tok = as_input_error(
        "model.tokenizer", [&] { return data::Tokenizer::from_file(c.model.tokenizer); });
    if (tok.vocab_size() > mc.vocab_size) {
      throw ConfigError(
          fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                      c.model.tokenizer, tok.vocab_size(), c.model.config, mc.vocab_size));
    }
    const auto dopt = dataset_options(c);
    std::vector<data::Example> examples;
    for (const auto& f : c.data.files) {
      auto ds = as_input_error("data.files", [&] { return data::load_dataset(f, tok, dopt); });
      out << ds.summary.to_string() << "\n";
      report_skipped_lines(ds.summary, out);
      for (auto& e : ds.examples) examples.push_back(std::move(e));
    }
    if (examples.empty()) throw ConfigError(no_examples_message(c));
    auto val = hold_out(&examples, c.data.eval_fraction, c.train.seed);
    for (const auto& f : c.data.eval_files) {
      auto ds = as_input_error("data.eval_files", [&] { return data::load_dataset(f, tok, dopt); });
      out << "validation " << ds.summary.to_string() << "\n";
      report_skipped_lines(ds.summary, out);
      for (auto& e : ds.examples) val.push_back(std::move(e));
    }
    const data::Batcher batcher = as_input_error(truncation_keys(c, "data.files"), [&] {
      return data::Batcher(std::move(examples), batcher_options(c, tok.endoftext_id()));
    });
    const auto& ts = batcher.truncation_stats();
    out << fmt::format("truncation to train.seq_len {} ({}): {}\n", c.train.seq_len,
                       to_string(resolved_truncation(c)), ts.to_string());
    if (!val.empty()) {
      auto bo = batcher_options(c, tok.endoftext_id());
      bo.shuffle = false;
      const auto n = val.size();
      const data::Batcher vb = as_input_error(truncation_keys(c, "data.eval_files"),
                                              [&] { return data::Batcher(std::move(val), bo); });
      out << fmt::format("validation: {} examples, {} kept\n", n, vb.num_examples());
    }
    out << resolve_run_length(c, batcher.batches_per_epoch(), 1);
    out << fmt::format(
        "data: {} examples in {} row{}{} and {} micro-batch{} per epoch; {} step{} of {} "
        "micro-batch{} = {:.2f} epochs\n",
        batcher.num_examples(), batcher.rows_per_epoch(), batcher.rows_per_epoch() == 1 ? "" : "s",
        c.data.packing ? " (packed)" : "", batcher.batches_per_epoch(),
        batcher.batches_per_epoch() == 1 ? "" : "es", c.train.steps,
        c.train.steps == 1 ? "" : "s", c.train.grad_accum, c.train.grad_accum == 1 ? "" : "es",
        static_cast<double>(c.train.steps * c.train.grad_accum) /
            static_cast<double>(batcher.batches_per_epoch()));
  }
  // The shipped NVFP4 files store lm_head separately even when config.json says tied; a random
  // init follows config.json. Checking the weights file would mean indexing it; assume the
  // shipped layout for files.
  const bool separate_lm_head = c.model.init == InitKind::kFile ? true : !mc.tie_word_embeddings;
  const auto b = estimate_budget(mc, c, separate_lm_head);
  out << fmt::format(
      "dry run: {} layers, hidden {}, intermediate {}, vocab {}; device {}, "
      "masters {}, compute {}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size, c.model.device,
      to_string(c.model.master_dtype), to_string(resolved_compute_dtype(c)));
  out << fmt::format("micro-batch {} x {} tokens, grad_accum {}, {} steps; optimizer state {}\n",
                     c.train.batch_size, c.train.seq_len, c.train.grad_accum, c.train.steps,
                     to_string(c.optim.state));
  out << "memory estimate (device, one micro-batch):\n" << b.to_table();
  if (c.model.init == InitKind::kFile && model::is_hf_folder(c.model.weights)) {
    out << fmt::format("weights: Hugging Face folder {} (imported at load)\n", c.model.weights);
  } else if (c.model.init == InitKind::kFile) {
    out << fmt::format("weights file: {} ({:.3f} GiB)\n", c.model.weights,
                       to_gib(static_cast<int64_t>(fs::file_size(c.model.weights))));
  }
  if (const auto left = run_dir_leftovers(c); !left.empty()) {
    out << "note: output.dir " << c.output.dir << " is not empty (" << join_names(left, 4)
        << "): a fresh run there needs --overwrite (or --resume to continue)\n";
  }
  out << "resolved config:\n" << config_to_yaml(c);
  // Last, so that a GPU run can still be estimated here: but "ok" means it starts here.
  check_device_available(c);
  out << "dry run ok: config valid, inputs present, data read and batched, device available; "
         "no weights loaded\n";
  return kExitOk;
}

int run_probe(const Config& c, const RunOptions& options, std::ostream& out, std::ostream& err) {
  check_device_available(c);
  Trainer t(c, options, out, err, /*probe=*/true);
  return t.probe();
}

}  // namespace q4::trainer
