// Console, metrics, TensorBoard and report of a run; see run_log.h.
#include "q4/trainer/report/run_log.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>

#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/signals.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

std::string one_line(const std::string& s) {
  std::string o;
  for (char ch : s) o += (ch == '\n') ? ' ' : ch;
  return o;
}

}  // namespace

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

RunLog::RunLog(ReportPlan plan, std::ostream& out, std::ostream& err, bool leader,
               Clock::time_point run_start)
    : plan_(std::move(plan)), out_(out), err_(err), leader_(leader), run_start_(run_start) {
  const auto progress = plan_.progress;
  bar_ = progress == ProgressStyle::kBar ||
         (progress == ProgressStyle::kAuto && ::isatty(STDERR_FILENO) && ::isatty(1));
}

RunLog::~RunLog() = default;

void RunLog::open(bool resume, int64_t start_step, Evaluator& evaluator) {
  const std::string& metrics_path = plan_.metrics_path;
  if (!metrics_path.empty()) {
    metrics_.open(metrics_path, start_step);
    // A resumed run's best validation loss so far, from the kept records.
    if (resume && evaluator.has_validation()) {
      std::ifstream in(metrics_path);
      std::string line;
      while (std::getline(in, line)) {
        const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
        if (j.is_object() && j.contains("val_loss") && j["val_loss"].is_number() &&
            j.contains("step") && j["step"].is_number_integer()) {
          evaluator.note_validation(j["val_loss"].get<double>(), j["step"].get<int64_t>());
        }
      }
    }
  }
  has_validation_ = evaluator.has_validation();
  eval_log_.open((fs::path(plan_.output_dir) / kEvalFile).string(), start_step);
  if (plan_.tensorboard) tb_.open(plan_.output_dir);  // TensorBoard scalars and eval text
}

void RunLog::set_flops(double flops_per_token, std::optional<double> peak_flops) {
  flops_per_token_ = flops_per_token;
  peak_flops_ = peak_flops;
}

std::string plain_export_note(const std::string& path, bool export_dense,
                              const model::Qwen3Model& model) {
  // Qwen3Model::export_to: a trained linear that came as an NVFP4 pair goes back as one (the
  // quantization of its master) unless output.export_dense; dense ones stay dense.
  int64_t pairs = 0;
  for (const auto& p : model.parameters()) pairs += p.trainable && p.quantized;
  if (path.empty()) return "none (output.export_path: none)";
  if (pairs == 0) return path + ": dense, as the trained linears came";
  if (export_dense) {
    return fmt::format(
        "{}: dense, the trained masters of the {} NVFP4 linears as fp16 "
        "(output.export_dense: true)",
        path, pairs);
  }
  return fmt::format(
      "{}: NVFP4, the {} trained linears quantized after training (plain precision "
      "from an NVFP4 model; output.export_dense: true writes their masters dense)",
      path, pairs);
}

void RunLog::print_summary(RunSetup& setup, const Evaluator& evaluator, const MemoryBudget& budget,
                           int64_t ranks, int64_t start_step) {
  const ReportPlan& c = plan_;
  const auto& mc = setup.model_config();
  auto* model = &setup.model();
  const auto* batcher = setup.batcher();
  std::string model_src =
      c.init == InitKind::kRandom ? fmt::format("random init (seed {})", c.init_seed) : c.weights;
  const auto trainable = static_cast<double>(model->num_trainable_elements());
  out_ << fmt::format(
      "run summary:\n  model      Qwen3, {} layers, hidden {}, vocab {}; {}; {}, masters {}, "
      "compute {}\n  trainable  {} parameters in {} tensors{}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.vocab_size, model_src, c.device_name,
      to_string(c.master_dtype), to_string(c.compute_dtype),
      trainable >= 1e9   ? fmt::format("{:.2f}B", trainable / 1e9)
      : trainable >= 1e6 ? fmt::format("{:.2f}M", trainable / 1e6)
                         : fmt::format("{:.0f}", trainable),
      model->trainable_parameters().size(),
      c.fake_quant ? "" : "; plain precision (model.fake_quant: false, no NVFP4 quantizer)");
  if (batcher) {
    int64_t tokens = 0, supervised = 0;
    for (const auto& e : batcher->examples()) {
      tokens += static_cast<int64_t>(e.input_ids.size());
      for (auto l : e.labels) supervised += l != data::kIgnoreIndex;
    }
    out_ << fmt::format("  data       {} examples, {} tokens ({} supervised) from {} file{}",
                        batcher->num_examples(), tokens, supervised, c.data_files,
                        c.data_files == 1 ? "" : "s");
    out_ << (evaluator.has_validation()
                 ? fmt::format("; validation {} example{}", evaluator.validation_examples(),
                               evaluator.validation_examples() == 1 ? "" : "s")
                 : std::string())
         << "\n";
  }
  // A step is grad_accum x ranks micro-batches of up to batch_size rows each; a row is one
  // example, or (packing) several. A micro-batch never crosses an epoch's end, so with less
  // data than batch_size rows every micro-batch is a whole epoch, short of rows.
  const int64_t per_step = c.grad_accum * ranks;
  out_ << fmt::format(
      "  steps      {}{}{}, each {} micro-batch{} ({} accumulated x {} rank{}) of up to {} "
      "rows x {} tokens\n",
      c.steps, start_step > 0 ? fmt::format(" (resuming at {})", start_step) : std::string(),
      c.epochs_configured > 0 ? fmt::format(" (train.epochs {})", c.epochs_configured)
                              : std::string(),
      per_step, per_step == 1 ? "" : "es", c.grad_accum, ranks, ranks == 1 ? "" : "s", c.batch_size,
      c.seq_len);
  if (batcher) {
    const auto bpe = batcher->batches_per_epoch();
    const auto rows = batcher->rows_per_epoch();
    const auto examples = batcher->num_examples();
    out_ << fmt::format(
        "  epoch      {} example{} in {} row{}{} and {} micro-batch{}: {:.2f} steps per epoch, "
        "about {:.1f} examples ({:.1f} rows) per step\n",
        examples, examples == 1 ? "" : "s", rows, rows == 1 ? "" : "s",
        c.packing ? " (packed)" : "", bpe, bpe == 1 ? "" : "es",
        static_cast<double>(bpe) / static_cast<double>(per_step),
        static_cast<double>(examples) * static_cast<double>(per_step) / static_cast<double>(bpe),
        static_cast<double>(rows) * static_cast<double>(per_step) / static_cast<double>(bpe));
    if (rows < c.batch_size) {
      out_ << fmt::format(
          "  note       train.batch_size {} is larger than the data: one epoch is {} row{}, so "
          "every micro-batch is a whole epoch of {} row{}, not {}\n",
          c.batch_size, rows, rows == 1 ? "" : "s", rows, rows == 1 ? "" : "s", c.batch_size);
    }
  }
  out_ << fmt::format("  lr         {} ({}, warmup {})\n", c.lr, to_string(c.schedule.kind),
                      c.schedule.warmup_steps);
  out_ << fmt::format("  output     {} (full resolved config in {})\n", c.output_dir, kConfigFile);
  if (!c.fake_quant) {
    out_ << "  export     " << plain_export_note(c.export_path, c.export_dense, *model) << "\n";
  }
  out_ << fmt::format("  memory     about {:.2f} GiB estimated ({}; peak phase: {})\n",
                      to_gib(budget.total_bytes()),
                      c.device.is_cuda() ? "device, one micro-batch" : "tensors, one micro-batch",
                      budget.peak_phase_name());
  out_ << "  time       estimated after the first steps\n" << std::flush;
}
void RunLog::start_steps(int64_t start_step) {
  start_step_ = start_step;
  session_ms_ = first_step_ms_ = 0;
  session_steps_ = 0;
  window_loss_sum_ = 0;
  window_tokens_ = 0;
  window_aux_sum_ = at::Tensor();
  window_aux_units_ = 0;
}

// The routers' metrics of a logged step: the window's mean load-balancing loss (an objective
// that logs none, preference tuning, whose log-probabilities leave the loss out: the last
// forward's) and the last forward's loads and entropy (docs/trainer.md#logs).
StepMetrics::Router RunLog::router_metrics(const model::RouterStats& rs) const {
  StepMetrics::Router out;
  out.aux_loss = window_aux_units_ > 0
                     ? window_aux_sum_.item<double>() / static_cast<double>(window_aux_units_)
                     : rs.aux_loss;
  out.max_load = rs.max_load();
  out.min_load = rs.min_load();
  out.entropy = rs.mean_entropy();
  out.dropped_tokens = rs.dropped_tokens;
  return out;
}

void RunLog::record_step(const StepOutcome& so, const StepRecord& r) {
  const int64_t done = r.done;
  const double step_ms = r.step_ms;
  const bool log_step = r.log_step;
  const std::optional<Validation>& val = r.val;
  const data::Batcher* batcher = r.batcher;
  const int64_t total = plan_.steps;
  const bool last = done == total;
  session_ms_ += step_ms;
  if (session_steps_ == 0) first_step_ms_ = step_ms;
  ++session_steps_;
  if (std::isfinite(so.loss) && so.supervised > 0) {
    window_loss_sum_ += so.loss * static_cast<double>(so.supervised);
    window_tokens_ += so.supervised;
  }
  // The routers' load-balancing loss joins its window like the loss (device tensors: no sync).
  for (const auto& [name, value] : so.logged) {
    if (name != kRouterAuxLossName || so.units <= 0) continue;
    const at::Tensor w = value * static_cast<double>(so.units);
    window_aux_sum_ = window_aux_sum_.defined() ? window_aux_sum_ + w : w;
    window_aux_units_ += so.units;
  }
  const double window_mean = window_tokens_ > 0
                                 ? window_loss_sum_ / static_cast<double>(window_tokens_)
                                 : std::numeric_limits<double>::quiet_NaN();
  StepMetrics m;
  m.step = done;
  m.total_steps = total;
  if (batcher && batcher->num_examples() > 0) {
    // Examples taken from the current epoch's order (packing: less those still pending).
    const data::BatcherState st = batcher->state();
    const auto taken = st.cursor - static_cast<int64_t>(st.pending.size());
    m.epoch = static_cast<double>(st.epoch) +
              static_cast<double>(taken) / static_cast<double>(batcher->num_examples());
  }
  m.loss = so.loss;
  m.grad_norm = so.res.grad_norm;
  m.lr = r.lr;
  m.step_ms = step_ms;
  m.tokens = so.real_tokens;
  m.slots = so.slots;
  m.tokens_per_s = step_ms > 0 ? so.real_tokens / (step_ms / 1000.0) : 0.0;
  // Per GPU: the step's tokens are the global batch's.
  if (peak_flops_) m.mfu = m.tokens_per_s * flops_per_token_ / (*peak_flops_ * r.world);
  m.gpu_reserved_bytes = r.mem.reserved_bytes;
  m.gpu_peak_bytes = r.mem.peak_allocated_bytes;
  m.rss_bytes = r.mem.rss_bytes;
  m.eta_s = (session_ms_ / session_steps_) * static_cast<double>(total - done) / 1000.0;
  m.skipped = !so.res.applied;
  if (log_step) {
    m.loss_avg = window_mean;
    last_loss_avg_ = window_mean;
    window_loss_sum_ = 0;
    window_tokens_ = 0;
    if (r.router) m.router = router_metrics(*r.router);
    window_aux_sum_ = at::Tensor();
    window_aux_units_ = 0;
  }
  last_loss_ = so.loss;
  if (val) {
    m.val_loss = val->loss;
    m.val_tokens = val->tokens;
  }
  auto record = metrics_to_json(m);
  // The objective's own values (a distillation term, a preference margin), under the names it
  // gives them; read on the host only on logged steps.
  if (log_step) {
    for (const auto& [name, value] : so.logged) {
      if (!record.contains(name)) record[name] = value.item<double>();
    }
  }
  if (val) {
    for (const auto& [name, value] : val->values) record["eval_" + name] = value;
  }
  write_record(record, val, done);
  if (log_step) {
    if (bar_) err_ << "\r\033[K";
    out_ << format_log_line(m) << std::endl;
    if (val && !val->values.empty()) {
      out_ << fmt::format("step {} validation: {}\n", m.step, val->values_line());
    }
    update_report(ReportPage::kLive, kReportMinIntervalS);
  }
  if (!last) print_time_estimate(done, total);
  if (bar_) {
    err_ << "\r"
         << format_progress_bar(done, total, 30, window_tokens_ > 0 ? window_mean : so.loss,
                                m.eta_s)
         << std::flush;
  }
}

void RunLog::write_record(const nlohmann::json& record, const std::optional<Validation>& val,
                          int64_t step) {
  if (metrics_.is_open()) metrics_.write(record);
  if (!tb_.is_open()) return;
  auto train_only = record;  // the validation values go to val/<name>
  train_only.erase("val_loss");
  train_only.erase("val_tokens");
  if (val) {
    for (const auto& kv : val->values) train_only.erase("eval_" + kv.first);
  }
  tb_.add_metrics(train_only, step);  // TensorBoard scalars
  if (val) log_validation(*val, step);
}

void RunLog::print_time_estimate(int64_t done, int64_t total) {
  // Once: from the steps after the first (which warms up caches).
  if (session_steps_ != std::min<int64_t>(3, total - start_step_)) return;
  const double per_ms =
      session_steps_ > 1 ? (session_ms_ - first_step_ms_) / (session_steps_ - 1) : session_ms_;
  if (bar_) err_ << "\r\033[K";
  out_ << fmt::format("time: about {} for the remaining {} steps ({:.2f} s/step{})\n",
                      format_duration(per_ms * static_cast<double>(total - done) / 1000.0),
                      total - done, per_ms / 1000.0,
                      plan_.eval_every > 0 || has_validation_ ? ", evaluations not included" : "");
}

void RunLog::log_validation_at_start(const Validation& v) {
  if (metrics_.is_open()) {
    nlohmann::json record = {{"step", 0}, {"val_loss", v.loss}, {"val_tokens", v.tokens}};
    for (const auto& [name, value] : v.values) record["eval_" + name] = value;
    metrics_.write(record);
  }
  log_validation(v, 0);
}

void RunLog::log_validation(const Validation& v, int64_t step) {
  if (tb_.is_open() && std::isfinite(v.loss)) tb_.add_scalar("val/loss", v.loss, step);
  if (tb_.is_open()) {
    for (const auto& [name, value] : v.values) {
      if (std::isfinite(value)) tb_.add_scalar("val/" + name, value, step);
    }
  }
}

void RunLog::log_answers(const std::vector<EvalAnswer>& answers, int64_t step, const char* tag,
                         double ms) {
  for (const auto& a : answers) {
    // "eval[end step 60]", "eval[start step 0]"; periodic ones "eval[step 50]".
    const std::string when = std::string(tag) == "step" ? fmt::format("step {}", step)
                                                        : fmt::format("{} step {}", tag, step);
    out_ << fmt::format("eval[{}] {} => {}{}\n", when, one_line(a.prompt), one_line(a.answer),
                        a.stopped ? "" : " [no stop token]");
    eval_log_.write({{"step", step},
                     {"when", tag},
                     {"prompt", a.prompt},
                     {"answer", a.answer},
                     {"new_tokens", static_cast<int64_t>(a.tokens.size())},
                     {"stopped", a.stopped}});
  }
  // TensorBoard text and report.html.
  for (size_t i = 0; i < answers.size(); ++i) {
    tb_.add_text("eval/" + std::to_string(i), answers[i].prompt + " => " + answers[i].answer, step);
  }
  update_report(ReportPage::kLive);
  out_ << fmt::format("eval took {:.1f} s\n", ms / 1000.0);
}

void RunLog::log_rollouts(const std::vector<RolloutSample>& samples, int64_t step) {
  for (size_t i = 0; i < samples.size(); ++i) {
    const RolloutSample& s = samples[i];
    eval_log_.write({{"step", step},
                     {"when", fmt::format("rollout, reward {:.4g}", s.reward)},
                     {"prompt", s.prompt},
                     {"answer", s.completion},
                     {"reward", s.reward},
                     {"stopped", !s.truncated}});
    tb_.add_text("rollouts/" + std::to_string(i),
                 fmt::format("{} => {} (reward {:.4g})", s.prompt, s.completion, s.reward), step);
  }
}

void RunLog::update_report(ReportPage page, double min_interval_s) {
  if (!plan_.report || !leader_) return;
  if (!report_) report_ = std::make_unique<ReportWriter>(plan_.output_dir, plan_.metrics);
  report_->write(page == ReportPage::kLive, min_interval_s);
}

void RunLog::end_bar_line() {
  if (bar_) err_ << "\n";
}

void RunLog::note_run_peak() {
  const auto m = memory_snapshot(plan_.device);
  if (m.peak_allocated_bytes) run_peak_bytes_ = std::max(run_peak_bytes_, *m.peak_allocated_bytes);
}

void RunLog::print_run_peak() {
  if (run_peak_bytes_ <= 0) return;
  out_ << fmt::format(
      "peak GPU memory allocated over the run (load, steps, evals, export, "
      "export check): {:.2f} GiB\n",
      to_gib(run_peak_bytes_));
}

void RunLog::close() {
  metrics_.close();
  eval_log_.close();
}

void RunLog::print_stopped(int64_t done) {
  if (!leader_) return;
  const std::string q4train = tool_command("q4train");
  const std::string& dir = plan_.output_dir;
  const std::string ck = (fs::path(dir) / checkpoint_dir_name(done)).string();
  out_ << fmt::format(
              "stopped at step {} of {} (checkpoint {}); resume with: {} --resume {}   "
              "(or export this step: {} --resume {} --export-only --set "
              "output.export_path={})\n",
              done, plan_.steps, ck, q4train, dir, q4train, ck, step_export_name(done))
       << std::flush;
}

void RunLog::print_end_summary(int64_t total, const Evaluator& evaluator) {
  const ReportPlan& c = plan_;
  out_ << fmt::format("done: {} steps in {}, {} tokens", total,
                      format_duration(ms_since(run_start_) / 1000.0), tokens_seen_);
  if (last_loss_) {
    out_ << fmt::format("; final loss {:.4f}", *last_loss_);
    if (last_loss_avg_) out_ << fmt::format(" (last log window avg {:.4f})", *last_loss_avg_);
  }
  if (const auto last_val = evaluator.last_validation()) {
    out_ << fmt::format("; validation loss {:.4f} (best {:.4f} at step {})", *last_val,
                        evaluator.best_validation(), evaluator.best_validation_step());
  }
  out_ << "\n";
  const fs::path dir(c.output_dir);
  const std::string& exp = c.export_path;
  std::vector<std::pair<std::string, std::string>> files;
  auto add = [&](const char* what, const std::string& path) {
    std::error_code ec;
    if (!path.empty() && fs::exists(path, ec)) files.emplace_back(what, path);
  };
  add("export", exp);
  if (c.hf_export != HfExport::kNone && !exp.empty()) {
    add("hf export", hf_export_dir(exp));
  }
  if (!c.metrics.empty()) add("metrics", (dir / c.metrics).string());
  add("eval", (dir / kEvalFile).string());
  if (c.report) add("report", (dir / "report.html").string());
  if (tb_.is_open() || !tb_.path().empty()) add("tensorboard", tb_.path());
  add("config", (dir / kConfigFile).string());
  const auto ck = latest_checkpoint(c.output_dir);
  if (ck) add("checkpoint", ck->path);
  out_ << "files:\n";
  for (const auto& [what, path] : files) out_ << fmt::format("  {:<12}{}\n", what, path);
  out_ << "next:\n";
  if (!exp.empty() && fs::exists(exp)) {
    out_ << fmt::format("  chat         {} --model {}\n", tool_command("q4chat"),
                        exp == (dir / "model.dat").string() ? c.output_dir : exp);
  }
  if (ck) {
    // A new file named by the step: never the run's model (docs/trainer.md#export).
    out_ << fmt::format("  export       {} --resume {} --export-only --set output.export_path={}\n",
                        tool_command("q4train"), ck->path, step_export_name(ck->step));
  }
  if (!exp.empty() && c.hf_export != HfExport::kNone) {
    out_ << fmt::format("  serve        vllm serve {}   (docs/interop.md)\n", hf_export_dir(exp));
  } else if (!exp.empty()) {
    out_ << fmt::format(
        "  serve        {} export-hf {} {} --config {} --tokenizer-dir {} --format modelopt, "
        "then vllm serve {} (docs/interop.md)\n",
        tool_command("q4dat"), exp, hf_export_dir(exp), c.model_config,
        fs::path(c.tokenizer).parent_path().string(), hf_export_dir(exp));
  }
  out_ << fmt::format("  tensorboard  tensorboard --logdir {}\n", c.output_dir) << std::flush;
}

}  // namespace q4::trainer
