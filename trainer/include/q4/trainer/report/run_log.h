// The run log (docs/trainer.md#logs, docs/design.md#trainer-components): what a run tells its
// user and its files, from rank 0. The console (the start-up summary, one line per logged step,
// the progress bar, the time estimate, eval answers, the end summary with the files written and
// what to do next), the metrics file (one JSON record per step), the eval log, TensorBoard
// scalars and text, and report.html.
#pragma once

#include <chrono>
#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "q4/trainer/output/evaluator.h"
#include "q4/trainer/plan/component_plans.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/report/report.h"
#include "q4/trainer/report/tfevents.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/metrics.h"
#include "q4/trainer/step/rollout_source.h"
#include "q4/trainer/step/step.h"

namespace q4::trainer {

// How to run a sibling tool: its path next to this executable (relative to the CWD when under
// it, e.g. build/bin/q4chat), or the bare name when it is not there.
std::string tool_command(const std::string& name);

// model.fake_quant: false: what the export will be, said at start (docs/model.md#plain-precision):
// "<path>: NVFP4, the N trained linears quantized after training (...)" when they came as NVFP4
// pairs and output.export_dense is off, else dense.
// `path`: the export (ExportPlan::path), `export_dense`: output.export_dense.
std::string plain_export_note(const std::string& path, bool export_dense,
                              const model::Qwen3Model& model);

// What the loop knows of a step besides its outcome, for the run log.
struct StepRecord {
  int64_t done = 0;               // the step's 1-based number
  double lr = 0.0;                // its learning rate
  double step_ms = 0.0;           // its wall time
  bool log_step = false;          // a log line (and the objective's values read on the host)
  std::optional<Validation> val;  // the validation after it, when one ran
  MemorySnapshot mem;
  const data::Batcher* batcher = nullptr;  // the epoch position (null: not shown)
  int64_t world = 1;                       // ranks (MFU is per GPU)
  // Mixture-of-experts models, logged steps: the routing of the step's last forward
  // (model::Qwen3Model::router_stats, read before any validation forward).
  std::optional<model::RouterStats> router;
};

class RunLog {
 public:
  // `plan`: the plan's slice once resolved (the run length, a resume's grad_accum); `leader`:
  // rank 0 (the other ranks' streams are null; files are rank 0's); `run_start`: when the run
  // started (the end summary's wall time).
  RunLog(ReportPlan plan, std::ostream& out, std::ostream& err, bool leader,
         std::chrono::steady_clock::time_point run_start = std::chrono::steady_clock::now());
  ~RunLog();

  // The metrics file, eval log and TensorBoard writer; a resumed run's best validation loss so
  // far comes from its kept metrics records (into `evaluator`).
  void open(bool resume, int64_t start_step, Evaluator& evaluator);
  // The short start-up summary (the full resolved config is <output.dir>/config.yaml);
  // `budget`: the memory estimate of the run (RunPlan::memory_estimate).
  void print_summary(RunSetup& setup, const Evaluator& evaluator, const MemoryBudget& budget,
                     int64_t ranks, int64_t start_step);
  // Model FLOPs per token and the device's peak (the MFU column).
  void set_flops(double flops_per_token, std::optional<double> peak_flops);

  // Training time starts (the first step's window and timed estimates).
  void start_steps(int64_t start_step);
  // After step `done` (1-based) of the loop: the metrics record, TensorBoard scalars, the log
  // line (`log_step`), the time estimate after the first steps and the progress bar.
  void record_step(const StepOutcome& so, const StepRecord& r);
  // The validation loss as TensorBoard scalars (its metrics ride in the step's record).
  void log_validation(const Validation& v, int64_t step);
  // The validation loss before the first step: its own metrics record and TensorBoard scalars.
  void log_validation_at_start(const Validation& v);
  // The answers to eval.prompts: console, eval log, TensorBoard text, report.
  void log_answers(const std::vector<EvalAnswer>& answers, int64_t step, const char* tag,
                   double ms);
  // GRPO: a few sampled completions of step `step` with their rewards: the eval log (so
  // report.html's table shows them, "when" rollout and the reward) and TensorBoard text.
  void log_rollouts(const std::vector<RolloutSample>& samples, int64_t step);
  // report.html (log.report, rank 0): on the log cadence at most every kReportMinIntervalS (an
  // atomic rewrite per log line would cost more than fast steps), at evals and at the end;
  // A live page reloads itself; the final one does not.
  static constexpr double kReportMinIntervalS = 2.0;
  enum class ReportPage { kLive, kFinal };
  void update_report(ReportPage page, double min_interval_s = 0);

  // The progress bar's line ends before other output (no-op without a bar).
  void end_bar_line();
  void add_tokens(int64_t tokens) { tokens_seen_ += tokens; }
  int64_t tokens_seen() const { return tokens_seen_; }
  void set_tokens_seen(int64_t tokens) { tokens_seen_ = tokens; }
  // The device's peak allocated memory since the last call, into the run's peak.
  void note_run_peak();
  void print_run_peak();
  void close();
  // The end of a run: wall time, losses, the files written and what to do next.
  void print_end_summary(int64_t total, const Evaluator& evaluator);
  // A stop signal ended the run after step `done`: how to resume or export it.
  void print_stopped(int64_t done);

 private:
  // The run-time estimate after step `done` of `total`, once the first steps are timed.
  void print_time_estimate(int64_t done, int64_t total);
  // A step's metrics.jsonl record, and its TensorBoard scalars (validation values under val/).
  void write_record(const nlohmann::json& record, const std::optional<Validation>& val,
                    int64_t step);
  StepMetrics::Router router_metrics(const model::RouterStats& rs) const;
  const ReportPlan plan_;
  std::ostream& out_;
  std::ostream& err_;
  bool leader_;
  bool bar_ = false;             // a progress bar on stderr (log.progress, or auto on a terminal)
  bool has_validation_ = false;  // held-out examples (the time estimate leaves evals out)
  JsonlWriter metrics_;
  JsonlWriter eval_log_;
  std::unique_ptr<ReportWriter> report_;
  TfEventsWriter tb_;
  std::chrono::steady_clock::time_point run_start_;
  int64_t tokens_seen_ = 0;
  double flops_per_token_ = 0;
  std::optional<double> peak_flops_;
  int64_t run_peak_bytes_ = 0;
  // This session's steps (a resume starts a new session).
  int64_t start_step_ = 0;
  double session_ms_ = 0, first_step_ms_ = 0;
  int64_t session_steps_ = 0;
  double window_loss_sum_ = 0;  // supervised-token-weighted losses since the last log line
  int64_t window_tokens_ = 0;
  std::optional<double> last_loss_, last_loss_avg_;
  // The routers' load-balancing loss since the last log line (objective value
  // kRouterAuxLossName): its unit-weighted sum, a device tensor read on log steps only.
  at::Tensor window_aux_sum_;
  int64_t window_aux_units_ = 0;
};

}  // namespace q4::trainer
