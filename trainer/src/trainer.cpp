// The run loop and its set-up. Set-up failures caused by inputs (config.json, tokenizer, data,
// weights) are rethrown as ConfigError so that main exits 2 naming the file; failures after
// set-up are runtime errors (exit 1). A step: grad_accum micro-batches whose summed CE is
// divided by the step's supervised-token count (token-weighted mean, identical to one big
// batch), one PackedAdamW step with clipping and the non-finite guard, then logging, the memory
// guard, eval/export/checkpoint cadences and the stop-signal check.
#include "q4/trainer/trainer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>

#include "q4/data/chat.h"
#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/quant/nvfp4.h"
#include "q4/trainer/estimate.h"
#include "q4/trainer/memory.h"
#include "q4/trainer/metrics.h"
#include "q4/trainer/nvtx.h"
#include "q4/trainer/probe.h"
#include "q4/trainer/run_dir.h"
#include "q4/trainer/signals.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

constexpr const char* kOptimStateFile = "optim.state";
constexpr const char* kTrainStateFile = "state.json";
constexpr const char* kRngFile = "rng.dat";

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

void require_file(const std::string& path, const std::string& key) {
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) {
    throw ConfigError("config key " + key + ": file not found: " + path);
  }
}

model::Qwen3Config load_model_config(const Config& c) {
  require_file(c.model.config, "model.config");
  return as_input_error("model.config",
                        [&] { return model::Qwen3Config::from_json_file(c.model.config); });
}

// Files that the run needs before it loads anything.
void check_input_files(const Config& c, bool need_data) {
  require_file(c.model.config, "model.config");
  require_file(c.model.tokenizer, "model.tokenizer");
  if (c.model.init == "file") require_file(c.model.weights, "model.weights");
  if (need_data) {
    if (c.data.files.empty()) {
      throw ConfigError("config key data.files: at least one training file is required");
    }
    for (const auto& f : c.data.files) require_file(f, "data.files");
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
  return "data.files: no training examples in " + files +
         " (every line is blank, a comment, a header or skipped as malformed; a TSV line is "
         "prompt<TAB>answer)";
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

data::DatasetOptions dataset_options(const Config& c) {
  data::DatasetOptions o;
  o.format = data::parse_data_format(c.data.format);
  o.system_prompt = c.data.system_prompt;
  o.on_error = data::parse_on_error(c.data.on_error);
  return o;
}

// Batcher settings of a run (training and the probe's first batch alike).
data::BatcherOptions batcher_options(const Config& c, int64_t pad_id) {
  data::BatcherOptions bo;
  bo.batch_size = c.train.batch_size;
  bo.max_seq_len = c.train.seq_len;
  bo.seed = static_cast<uint64_t>(c.train.seed);
  bo.shuffle = c.data.shuffle;
  bo.pack = c.data.packing;
  bo.truncation = data::parse_truncation(resolved_truncation(c));
  bo.pad_id = pad_id;
  return bo;
}

model::ModelInputs to_inputs(const data::Batch& b, const at::Device& device) {
  model::ModelInputs in;
  in.input_ids = b.input_ids.to(device);
  in.labels = b.labels;  // host: loss() finds the supervised rows without a device sync
  in.attention_mask = b.attention_mask.to(device);
  in.position_ids = b.position_ids.to(device);
  in.segment_ids = b.segment_ids.to(device);
  return in;
}

optim::LrSchedule make_schedule(const Config& c) {
  optim::LrScheduleOptions s;
  s.kind = optim::parse_lr_schedule_kind(c.optim.schedule.kind);
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

LoadedModel load_model(const Config& c, const model::Qwen3Config& mc, std::ostream& out) {
  LoadedModel lm;
  const auto opt = as_input_error("model", [&] {
    auto o = model_options(c);
    o.validate();
    o.trainable.validate(mc.num_hidden_layers);
    return o;
  });
  if (c.model.init == "random") {
    lm.source_path = (fs::path(c.output.dir) / kInitFile).string();
    if (!fs::exists(lm.source_path)) {
      auto init_opt = opt;
      init_opt.trainable = model::TrainableSpec::nothing();
      init_opt.master_dtype = at::kFloat;
      init_opt.compute_dtype = at::kFloat;
      init_opt.device = at::kCPU;
      auto init = model::Qwen3Model::random_init(mc, init_opt, c.model.init_seed, c.model.init_std);
      write_model_dat(init, lm.source_path, c.model.quantize_lm_head);
      out << "random init (seed " << c.model.init_seed << ") written to " << lm.source_path << "\n";
    }
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

// ---------------------------------------------------------------------------------------------

class Trainer {
 public:
  Trainer(const Config& c, const RunOptions& o, std::ostream& out, std::ostream& err)
      : c_(c), opts_(o), out_(out), err_(err), device_(c.model.device) {}

  int run() {
    install_stop_handlers();  // before set-up: a signal there ends the run cleanly, too
    setup();
    if (stop_requested()) {
      out_ << "signal " << stop_signal() << " during set-up: stopped before the first step\n";
      return kExitOk;
    }
    return loop();
  }

 private:
  void setup() {
    std::optional<CheckpointDir> resume;
    if (opts_.resume) resume = resolve_resume_dir(*opts_.resume);
    check_input_files(c_, /*need_data=*/c_.train.steps > 0);
    check_output_paths(c_);  // every output, before anything is written
    fs::create_directories(c_.output.dir);
    lock_ = std::make_unique<RunDirLock>(c_.output.dir);  // held until the run ends
    for (const auto& p : clean_stale_files(c_)) out_ << "removed stale " << p << "\n";
    if (!resume) {
      if (latest_checkpoint(c_.output.dir)) {
        throw ConfigError("output.dir " + c_.output.dir +
                          " already holds checkpoints; pass --resume " + c_.output.dir +
                          " to continue, or choose another output.dir");
      }
      // A fresh random-init run draws a fresh init; with model.init: file, init.dat may be the
      // user's weights and is never touched.
      if (c_.model.init == "random") fs::remove(fs::path(c_.output.dir) / kInitFile);
    }
    write_file_atomic((fs::path(c_.output.dir) / kConfigFile).string(), config_to_yaml(c_));

    const auto t0 = Clock::now();
    mc_ = load_model_config(c_);
    tok_ = std::make_unique<data::Tokenizer>(as_input_error(
        "model.tokenizer", [&] { return data::Tokenizer::from_file(c_.model.tokenizer); }));
    if (tok_->vocab_size() > mc_.vocab_size) {
      throw ConfigError(
          fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                      c_.model.tokenizer, tok_->vocab_size(), c_.model.config, mc_.vocab_size));
    }
    {
      NvtxRange r("load");
      auto lm = load_model(c_, mc_, out_);
      model_ = std::move(lm.model);
      source_path_ = lm.source_path;
    }
    separate_lm_head_ = !model_->tied();
    out_ << fmt::format(
        "model: {} layers, hidden {}, vocab {}, {} trainable elements in {} "
        "tensors, loaded in {:.1f} s\n",
        mc_.num_hidden_layers, mc_.hidden_size, mc_.vocab_size, model_->num_trainable_elements(),
        model_->trainable_parameters().size(), ms_since(t0) / 1000.0);
    check_guard(c_, device_, "after loading the model");

    if (c_.train.steps > 0) {
      std::vector<data::Example> examples;
      const auto dopt = dataset_options(c_);
      for (const auto& f : c_.data.files) {
        auto ds = as_input_error("data.files", [&] { return data::load_dataset(f, *tok_, dopt); });
        out_ << ds.summary.to_string() << "\n";
        report_skipped_lines(ds.summary, err_);
        for (auto& e : ds.examples) examples.push_back(std::move(e));
      }
      if (examples.empty()) throw ConfigError(no_examples_message(c_));
      batcher_ = std::make_unique<data::Batcher>(std::move(examples),
                                                 batcher_options(c_, tok_->endoftext_id()));
      const auto& ts = batcher_->truncation_stats();
      if (ts.truncated || ts.dropped) out_ << ts.to_string() << "\n";
      if (batcher_->num_examples() == 0) {
        throw ConfigError("data.files: no training example fits train.seq_len " +
                          std::to_string(c_.train.seq_len));
      }
    }

    optimizer_ = std::make_unique<optim::PackedAdamW>(adamw_options(c_));
    for (auto* p : model_->trainable_parameters()) {
      optimizer_->add_param(p->name, p->master, /*weight_decay=*/p->master.dim() >= 2);
    }
    schedule_ = std::make_unique<optim::LrSchedule>(make_schedule(c_));
    flops_per_token_ = train_flops_per_token(mc_, c_.train.seq_len);
    peak_flops_ = device_peak_flops(device_name(device_));

    if (resume) restore(*resume);

    const auto metrics_path = c_.log.metrics.empty()
                                  ? std::string()
                                  : (fs::path(c_.output.dir) / c_.log.metrics).string();
    if (!metrics_path.empty()) metrics_.open(metrics_path, start_step_);
    eval_log_.open((fs::path(c_.output.dir) / kEvalFile).string(), start_step_);
  }

  void restore(const CheckpointDir& ck) {
    const fs::path dir(ck.path);
    verify_checkpoint(ck);  // CRC32C of every file, naming the damaged one
    const std::string state_path = (dir / kTrainStateFile).string();
    const auto state = nlohmann::json::parse(read_file(state_path), nullptr, false);
    if (state.is_discarded() || !state.is_object() || !state.contains("step")) {
      throw ConfigError("--resume: " + state_path + " is not a valid checkpoint state" +
                        previous_checkpoint_hint(ck));
    }
    start_step_ = state.at("step").get<int64_t>();
    if (start_step_ > c_.train.steps) {
      throw ConfigError(fmt::format("--resume {}: checkpoint step {} is past train.steps {}",
                                    ck.path, start_step_, c_.train.steps));
    }
    as_input_error("--resume", [&] {
      try {
        optimizer_->load((dir / kOptimStateFile).string(), /*restore_masters=*/true);
      } catch (const c10::Error& e) {
        if (e.msg().rfind("INTERNAL ASSERT FAILED", 0) == 0) throw;
        TORCH_CHECK(false, e.what_without_backtrace(), previous_checkpoint_hint(ck));
      }
      return 0;
    });
    if (batcher_) {
      batcher_->restore(data::BatcherState::from_json(state.at("batcher").dump()));
    }
    tokens_seen_ = state.value("tokens_seen", int64_t{0});
    if (fs::exists(dir / kRngFile)) {
      model::DatReader rng((dir / kRngFile).string());
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng.load("cpu_generator"));
    }
    out_ << "resumed from " << ck.path << " at step " << start_step_ << "\n";
  }

  // A failed checkpoint (full disk, I/O error) removes its directory: no partial files remain and
  // the previous complete checkpoint stays the newest.
  void save_checkpoint(int64_t step) {
    const fs::path dir = fs::path(c_.output.dir) / checkpoint_dir_name(step);
    try {
      write_checkpoint(step, dir);
    } catch (...) {
      std::error_code ec;
      fs::remove_all(dir, ec);
      throw;
    }
  }

  void write_checkpoint(int64_t step, const fs::path& dir) {
    NvtxRange r("checkpoint");
    fs::remove_all(dir);
    fs::create_directories(dir);
    optimizer_->save((dir / kOptimStateFile).string(), /*include_masters=*/true);
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
    st["seed"] = c_.train.seed;
    st["schedule"] = {{"kind", c_.optim.schedule.kind},
                      {"peak_lr", c_.optim.lr},
                      {"warmup_steps", c_.optim.schedule.warmup_steps},
                      {"total_steps", c_.train.steps},
                      {"next_lr", step < c_.train.steps ? schedule_->lr_at(step) : 0.0}};
    if (batcher_) st["batcher"] = nlohmann::json::parse(batcher_->state().to_json());
    write_file_atomic((dir / kTrainStateFile).string(), st.dump(2) + "\n");
    write_checkpoint_checksums(dir.string(), {kOptimStateFile, kRngFile, kTrainStateFile});
    mark_checkpoint_done(dir.string(), step);
    last_checkpoint_step_ = step;
    const auto removed = rotate_checkpoints(c_.output.dir, c_.output.keep);
    out_ << "checkpoint " << dir.string() << (removed.empty() ? "" : " (rotated ")
         << (removed.empty() ? "" : std::to_string(removed.size()) + " old)") << "\n";
  }

  std::vector<EvalAnswer> evaluate(int64_t step, const char* tag) {
    if (c_.eval.prompts.empty()) return {};
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
    out_ << fmt::format("eval took {:.1f} s\n", ms_since(t0) / 1000.0);
    return answers;
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

  // The end of a run: the final checkpoint (with checkpoint_every > 0) comes before the final
  // export, and an export that fails is checkpointed before the error ends the run, so that no
  // trained step is lost to a full disk or a bad export path.
  void finish(int64_t total, const std::vector<EvalAnswer>* reference) {
    const bool trained = total > start_step_;
    if (c_.output.checkpoint_every > 0 && last_checkpoint_step_ != total && trained) {
      save_checkpoint(total);
    }
    try {
      export_model(total, reference);
    } catch (...) {
      if (last_checkpoint_step_ != total && trained) {
        err_ << "export failed; writing a checkpoint of step " << total << " first\n";
        save_checkpoint(total);
      }
      throw;
    }
    metrics_.close();
    eval_log_.close();
  }

  void write_export(int64_t step, const std::vector<EvalAnswer>* reference) {
    const std::string path = resolved_export_path(c_);
    if (path.empty()) return;
    NvtxRange r("export");
    const auto t0 = Clock::now();
    {
      model::DatReader source(source_path_);
      model_->export_to(source, path);
    }
    out_ << fmt::format("export step {} -> {} ({:.1f} s)\n", step, path, ms_since(t0) / 1000.0);
    if (!c_.output.verify_export || !reference || reference->empty()) return;
    // Reload the export as inference would and compare greedy answers with the trained model.
    auto opt = model_options(c_);
    opt.trainable = model::TrainableSpec::nothing();
    model::DatReader reader(path);
    auto reloaded = model::Qwen3Model::load(mc_, reader, opt);
    const auto again = generate_answers(reloaded, *tok_, c_);
    int64_t same = 0;
    for (size_t i = 0; i < again.size(); ++i) same += again[i].tokens == (*reference)[i].tokens;
    out_ << fmt::format("export check: {}/{} answers of the reloaded export are identical\n", same,
                        again.size());
    for (size_t i = 0; i < again.size(); ++i) {
      if (again[i].tokens != (*reference)[i].tokens) {
        out_ << fmt::format("  differs: {} => {}\n", one_line(again[i].prompt),
                            one_line(again[i].answer));
      }
    }
  }

  int loop() {
    const int64_t total = c_.train.steps;
    std::vector<EvalAnswer> last_answers;
    if (c_.eval.at_start && start_step_ == 0) last_answers = evaluate(0, "start");
    const bool bar = c_.log.progress == "bar" ||
                     (c_.log.progress == "auto" && ::isatty(STDERR_FILENO) && ::isatty(1));
    double session_ms = 0;
    int64_t session_steps = 0;
    int64_t consecutive_nonfinite = 0;
    for (int64_t step = start_step_; step < total; ++step) {
      const auto t0 = Clock::now();
      reset_peak_memory(device_);
      const double lr = schedule_->lr_at(step);
      std::vector<data::Batch> micro;
      int64_t supervised = 0, real_tokens = 0;
      {
        NvtxRange r("data");
        for (int64_t i = 0; i < c_.train.grad_accum; ++i) {
          micro.push_back(batcher_->next());
          supervised += micro.back().supervised_tokens;
          real_tokens += micro.back().real_tokens;
        }
      }
      at::Tensor loss_sum;
      for (const auto& b : micro) {
        const auto in = to_inputs(b, device_);
        model::LossOutput lo;
        {
          NvtxRange r("forward");
          lo = model_->loss(in);
        }
        {
          NvtxRange r("backward");
          (lo.loss_sum / static_cast<double>(std::max<int64_t>(supervised, 1))).backward();
        }
        const at::Tensor ls = lo.loss_sum.detach();
        loss_sum = loss_sum.defined() ? loss_sum + ls : ls;
      }
      optim::StepResult res;
      {
        NvtxRange r("optimizer");
        std::vector<at::Tensor> grads;
        for (auto* p : model_->trainable_parameters()) {
          grads.push_back(p->grad.defined() ? p->grad
                                            : at::zeros_like(p->master, p->master.options()));
        }
        optim::StepArgs args;
        args.lr = lr;
        args.max_grad_norm = c_.train.max_grad_norm;
        res = optimizer_->step(grads, args);
        model_->zero_grad();
      }
      const double loss =
          loss_sum.item<double>() / static_cast<double>(std::max<int64_t>(supervised, 1));
      synchronize_device(device_);
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
      ++session_steps;

      StepMetrics m;
      m.step = step + 1;
      m.total_steps = total;
      m.loss = loss;
      m.grad_norm = res.grad_norm;
      m.lr = lr;
      m.step_ms = step_ms;
      m.tokens = real_tokens;
      m.tokens_per_s = step_ms > 0 ? real_tokens / (step_ms / 1000.0) : 0.0;
      if (peak_flops_) m.mfu = m.tokens_per_s * flops_per_token_ / *peak_flops_;
      const auto mem = memory_snapshot(device_);
      m.gpu_reserved_bytes = mem.reserved_bytes;
      m.gpu_peak_bytes = mem.peak_allocated_bytes;
      m.rss_bytes = mem.rss_bytes;
      m.eta_s = (session_ms / session_steps) * static_cast<double>(total - step - 1) / 1000.0;
      m.skipped = !res.applied;
      if (metrics_.is_open()) metrics_.write(metrics_to_json(m));
      const bool last = step + 1 == total;
      if ((step + 1) % c_.log.every == 0 || last || step == start_step_) {
        if (bar) err_ << "\r\033[K";
        out_ << format_log_line(m) << std::endl;
      }
      if (bar) err_ << "\r" << format_progress_bar(step + 1, total) << std::flush;

      check_guard(c_, device_, fmt::format("at step {}", step + 1));

      const int64_t done = step + 1;
      if (c_.eval.every > 0 && done % c_.eval.every == 0 && !last) evaluate(done, "step");
      if (c_.output.export_every > 0 && done % c_.output.export_every == 0 && !last) {
        export_model(done, nullptr);
      }
      if (c_.output.checkpoint_every > 0 && done % c_.output.checkpoint_every == 0) {
        save_checkpoint(done);
      }
      if (stop_requested() && !last) {
        if (bar) err_ << "\n";
        out_ << "signal " << stop_signal() << ": stopping after step " << done << "\n";
        if (last_checkpoint_step_ != done) save_checkpoint(done);
        return kExitOk;
      }
    }
    if (bar && total > start_step_) err_ << "\n";
    if (c_.eval.at_end) last_answers = evaluate(total, "end");
    if (c_.eval.at_end || !c_.output.verify_export) {
      finish(total, &last_answers);
    } else {
      const auto ref = generate_answers(*model_, *tok_, c_);
      finish(total, &ref);
    }
    out_ << fmt::format("done: {} steps, {} tokens\n", total, tokens_seen_);
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
  int64_t start_step_ = 0;
  int64_t last_checkpoint_step_ = -1;
  int64_t tokens_seen_ = 0;
  double flops_per_token_ = 0;
  std::optional<double> peak_flops_;
};

}  // namespace

// ---------------------------------------------------------------------------------------------

void write_model_dat(const model::Qwen3Model& m, const std::string& path, bool quantize_lm_head) {
  const auto& params = m.parameters();
  uint64_t count = 0;
  auto quantized = [&](const model::Parameter& p) {
    if (p.name == "lm_head.weight") return quantize_lm_head;
    return p.quantized;
  };
  for (const auto& p : params) count += quantized(p) ? 2 : 1;
  model::DatWriter w(path, count);
  for (const auto& p : params) {
    if (quantized(p)) {
      const auto q = quant::quantize_nvfp4(p.master.to(at::kFloat), p.name);
      w.add(p.name + ".qdata", q.qdata.cpu(), model::ElemType::kE2M1Packed);
      w.add(p.name + ".scale", q.scale.cpu(), model::ElemType::kE4M3Scale);
    } else {
      w.add(p.name, p.master.to(at::kCPU, at::kHalf).contiguous(), model::ElemType::kFloat16);
    }
  }
  w.commit();
}

std::string saved_config_path_for_resume(const std::string& resume_dir) {
  fs::path p = fs::absolute(resume_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (fs::exists(p / kConfigFile)) return (p / kConfigFile).string();
  if (fs::exists(p.parent_path() / kConfigFile)) return (p.parent_path() / kConfigFile).string();
  throw ConfigError("--resume " + resume_dir + ": no " + kConfigFile +
                    " in it or its parent; pass --config");
}

int run_training(const Config& config, const RunOptions& options, std::ostream& out,
                 std::ostream& err) {
  Trainer t(config, options, out, err);
  return t.run();
}

int run_dry_run(const Config& c, std::ostream& out) {
  check_input_files(c, /*need_data=*/c.train.steps > 0);
  check_output_paths(c);
  const auto mc = load_model_config(c);
  as_input_error("train.trainable", [&] {
    trainable_spec(c).validate(mc.num_hidden_layers);
    return 0;
  });
  // The shipped NVFP4 files store lm_head separately even when config.json says tied; a random
  // init follows config.json. Checking the weights file would mean indexing it; assume the
  // shipped layout for files.
  const bool separate_lm_head = c.model.init == "file" ? true : !mc.tie_word_embeddings;
  const auto b = estimate_budget(mc, c, separate_lm_head);
  out << fmt::format(
      "dry run: {} layers, hidden {}, intermediate {}, vocab {}; device {}, "
      "masters {}, compute {}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size, c.model.device,
      c.model.master_dtype, resolved_compute_dtype(c));
  out << fmt::format("micro-batch {} x {} tokens, grad_accum {}, {} steps; optimizer state {}\n",
                     c.train.batch_size, c.train.seq_len, c.train.grad_accum, c.train.steps,
                     c.optim.state);
  out << "memory estimate (device, one micro-batch):\n" << b.to_table();
  if (c.model.init == "file") {
    out << fmt::format("weights file: {} ({:.3f} GiB)\n", c.model.weights,
                       to_gib(static_cast<int64_t>(fs::file_size(c.model.weights))));
  }
  out << "dry run ok: config valid, inputs present, nothing loaded\n";
  return kExitOk;
}

int run_probe(const Config& c, const RunOptions& options, std::ostream& out, std::ostream& err) {
  const at::Device device(c.model.device);
  std::vector<ProbePhase> phases;
  const auto t_start = Clock::now();
  auto t_prev = t_start;
  auto mark = [&](const std::string& name) {
    synchronize_device(device);
    ProbePhase p;
    p.name = name;
    p.elapsed_ms = ms_since(t_start);
    p.phase_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_prev).count();
    p.memory = memory_snapshot(device);
    phases.push_back(p);
    err << fmt::format("probe: {:<20} {:>9.1f} ms  rss {:.2f} GiB", name, p.phase_ms,
                       to_gib(p.memory.rss_bytes))
        << (p.memory.peak_allocated_bytes ? fmt::format("  peak {:.2f} GiB  reserved {:.2f} GiB",
                                                        to_gib(*p.memory.peak_allocated_bytes),
                                                        to_gib(*p.memory.reserved_bytes))
                                          : std::string())
        << "\n";
    reset_peak_memory(device);
    t_prev = Clock::now();
  };
  check_input_files(c, /*need_data=*/false);
  for (const auto& f : c.data.files) require_file(f, "data.files");
  const auto mc = load_model_config(c);
  reset_peak_memory(device);
  mark("start");

  // Model: random init in memory (nothing written) or load from the weights file.
  auto opt = as_input_error("model", [&] {
    auto o = model_options(c);
    o.validate();
    o.trainable.validate(mc.num_hidden_layers);
    return o;
  });
  std::unique_ptr<model::Qwen3Model> model;
  {
    NvtxRange r("load");
    if (c.model.init == "random") {
      model = std::make_unique<model::Qwen3Model>(
          model::Qwen3Model::random_init(mc, opt, c.model.init_seed, c.model.init_std));
    } else {
      model = as_input_error("model.weights", [&] {
        model::DatReader reader(c.model.weights);
        return std::make_unique<model::Qwen3Model>(model::Qwen3Model::load(mc, reader, opt));
      });
    }
  }
  mark("model_loaded");

  // The optimizer and its moment state exist before the first forward, as in a training run from
  // its second step on: otherwise the backward's peak would miss the moments (measured: the
  // steady-state peak was 0.9 GiB above a probe that allocated them at the first step).
  optim::PackedAdamW optimizer(adamw_options(c));
  {
    NvtxRange r("optimizer_setup");
    for (auto* p : model->trainable_parameters()) {
      optimizer.add_param(p->name, p->master, p->master.dim() >= 2);
    }
  }
  mark("optimizer_ready");

  // Batch: the first batch of the data, or batch_size x seq_len random tokens, all supervised.
  model::ModelInputs in;
  int64_t tokens = 0;
  {
    NvtxRange r("data");
    if (!c.data.files.empty()) {
      auto tok = as_input_error("model.tokenizer",
                                [&] { return data::Tokenizer::from_file(c.model.tokenizer); });
      std::vector<data::Example> examples;
      for (const auto& f : c.data.files) {
        auto ds = as_input_error("data.files",
                                 [&] { return data::load_dataset(f, tok, dataset_options(c)); });
        for (auto& e : ds.examples) examples.push_back(std::move(e));
      }
      data::Batcher batcher(std::move(examples), batcher_options(c, tok.endoftext_id()));
      if (batcher.num_examples() == 0) {
        throw ConfigError("data.files: no training example fits train.seq_len");
      }
      const auto b = batcher.next();
      in = to_inputs(b, device);
      tokens = b.real_tokens;
    } else {
      at::Generator gen = at::detail::createCPUGenerator(static_cast<uint64_t>(c.train.seed));
      const auto ids = at::randint(0, mc.vocab_size, {c.train.batch_size, c.train.seq_len}, gen,
                                   at::TensorOptions().dtype(at::kLong));
      in.input_ids = ids.to(device);
      in.labels = ids;  // host, as in training (no device sync in loss())
      tokens = c.train.batch_size * c.train.seq_len;
    }
  }
  mark("batch_ready");

  model::LossOutput lo;
  {
    NvtxRange r("forward");
    lo = model->loss(in);
  }
  mark("forward_done");
  {
    NvtxRange r("backward");
    lo.loss.backward();
  }
  mark("backward_done");

  optim::StepResult res;
  nlohmann::json steady = nullptr;  // --probe-steps: medians of the steady-state steps
  {
    NvtxRange r("optimizer");
    std::vector<at::Tensor> grads;
    for (auto* p : model->trainable_parameters()) {
      grads.push_back(p->grad.defined() ? p->grad : at::zeros_like(p->master));
    }
    optim::StepArgs args;
    args.max_grad_norm = c.train.max_grad_norm;
    res = optimizer.step(grads, args);
    model->zero_grad();
    grads.clear();
    mark("optimizer_step_done");

    // Steady state: options.probe_steps more full steps on the same batch with the same
    // optimizer (its state allocated by now), each phase ended by a device sync.
    if (options.probe_steps > 0) {
      NvtxRange rs("steady");
      std::vector<double> fwd_ms, bwd_ms, opt_ms, step_ms;
      double last_loss = 0.0;
      for (int s = 0; s < options.probe_steps; ++s) {
        const auto t0 = Clock::now();
        model::LossOutput l = model->loss(in);
        synchronize_device(device);
        const auto t1 = Clock::now();
        l.loss.backward();
        synchronize_device(device);
        const auto t2 = Clock::now();
        for (auto* p : model->trainable_parameters()) {
          grads.push_back(p->grad.defined() ? p->grad : at::zeros_like(p->master));
        }
        optimizer.step(grads, args);
        model->zero_grad();
        grads.clear();
        synchronize_device(device);
        const auto t3 = Clock::now();
        auto ms = [](Clock::time_point a, Clock::time_point b) {
          return std::chrono::duration<double, std::milli>(b - a).count();
        };
        fwd_ms.push_back(ms(t0, t1));
        bwd_ms.push_back(ms(t1, t2));
        opt_ms.push_back(ms(t2, t3));
        step_ms.push_back(ms(t0, t3));
        last_loss = l.loss.item<double>();
      }
      auto median = [](std::vector<double> v) {
        std::sort(v.begin(), v.end());
        const size_t n = v.size();
        return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
      };
      const double step_med = median(step_ms);
      const auto mem = memory_snapshot(device);
      steady = {{"steps", options.probe_steps},
                {"step_ms_median", step_med},
                {"forward_ms_median", median(fwd_ms)},
                {"backward_ms_median", median(bwd_ms)},
                {"optimizer_ms_median", median(opt_ms)},
                {"tokens_per_s", static_cast<double>(tokens) / (step_med / 1e3)},
                {"peak_allocated_bytes", mem.peak_allocated_bytes
                                             ? nlohmann::json(*mem.peak_allocated_bytes)
                                             : nlohmann::json(nullptr)},
                {"last_loss", last_loss}};
      err << fmt::format(
          "probe: steady state, median of {} steps: step {:.1f} ms (forward {:.1f}, backward "
          "{:.1f}, optimizer {:.1f}), {:.0f} tok/s{}\n",
          options.probe_steps, step_med, median(fwd_ms), median(bwd_ms), median(opt_ms),
          static_cast<double>(tokens) / (step_med / 1e3),
          mem.peak_allocated_bytes
              ? fmt::format(", peak {:.2f} GiB", to_gib(*mem.peak_allocated_bytes))
              : std::string());
      reset_peak_memory(device);
      t_prev = Clock::now();
    }

    NvtxRange r2("export");
    const fs::path tmp = fs::temp_directory_path() /
                         fmt::format("q4train-probe-{}.dat", static_cast<int64_t>(::getpid()));
    if (c.model.init == "random") {
      write_model_dat(*model, tmp.string(), c.model.quantize_lm_head);
    } else {
      model::DatReader source(c.model.weights);
      model->export_to(source, tmp.string());
    }
    fs::remove(tmp);
    mark("export_done");
  }

  const bool separate_lm_head = !model->tied();
  const auto budget = estimate_budget(mc, c, separate_lm_head);
  nlohmann::json info = {{"config", c.source},
                         {"tokens", tokens},
                         {"batch_size", c.train.batch_size},
                         {"seq_len", c.train.seq_len},
                         {"master_dtype", c.model.master_dtype},
                         {"compute_dtype", resolved_compute_dtype(c)},
                         {"gradient_checkpointing", c.train.gradient_checkpointing},
                         {"optim_state", c.optim.state},
                         {"loss", lo.loss.item<double>()},
                         {"grad_norm", res.grad_norm},
                         {"step_applied", res.applied},
                         {"trainable_elements", model->num_trainable_elements()},
                         {"steady", steady}};
  const auto report = probe_report_json(device_name(device), phases, budget.to_json(), info);
  const std::string path = options.probe_report.empty()
                               ? (fs::path(c.output.dir) / "probe.json").string()
                               : options.probe_report;
  if (!fs::path(path).parent_path().empty()) fs::create_directories(fs::path(path).parent_path());
  write_file_atomic(path, report.dump(2) + "\n");
  out << report.dump(2) << "\n";
  err << "probe report written to " << path << "\n";
  return kExitOk;
}

}  // namespace q4::trainer
