// The q4train run: load masters (from a .dat or a random init written to <dir>/init.dat),
// tokenize data, then train with gradient accumulation, clipping, schedule and the non-finite
// guard; eval, export, checkpoints (DONE marker last, newest K kept), resume, graceful stop on
// SIGINT/SIGTERM and the GPU-memory guard. Also --dry-run (estimate only) and --probe (one
// instrumented step with a JSON report). Output goes to the given streams; nothing calls exit().
#pragma once

#include <chrono>
#include <iosfwd>
#include <optional>
#include <stdexcept>
#include <string>

#include "q4/model/qwen3.h"
#include "q4/trainer/config.h"
#include "q4/trainer/distributed.h"

namespace q4::trainer {

// The memory guard fired (exit code 3).
class GuardStop : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Process exit codes.
inline constexpr int kExitOk = 0;
inline constexpr int kExitRuntime = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitGuard = 3;

struct RunOptions {
  std::optional<std::string> resume;  // --resume DIR (a checkpoint or a run directory)
  std::string probe_report;           // --probe: report path (default <output.dir>/probe.json)
  int probe_steps = 0;  // --probe-steps N: N more timed steady-state steps after the probe's one
  std::string profile_trace;  // --profile-trace FILE: Kineto trace of the run's steps 3-4
  // --overwrite: a fresh run in a non-empty output.dir removes the previous run's files there
  // (checkpoints, metrics, logs, export) instead of refusing.
  bool overwrite = false;
  // --export-only (with --resume): export the checkpoint's model and exit; trains nothing.
  bool export_only = false;
  // --allow-schedule-change: resume even though the LR schedule (train.steps, optim.lr,
  // optim.schedule.*) differs from the checkpoint's.
  bool allow_schedule_change = false;
  WorldInfo world;            // data-parallel rank and size (torchrun / --nproc); default: alone
  std::chrono::milliseconds dist_timeout{std::chrono::minutes(10)};  // rendezvous, collectives
};

// model.device cuda/cuda:N without a usable CUDA device (a CPU-only build, no visible GPU, an
// index past the device count): ConfigError naming the fix. Run, probe and export call it before
// anything is written; --dry-run calls it after printing its estimate (so that a GPU run can be
// estimated on any machine, and "ok" still means the run starts here).
void check_device_available(const Config& config);

// optim.schedule.warmup_steps longer than train.steps (> 0) is clipped to train.steps (a short
// smoke run with `--set train.steps=3` just works). Returns the one-line note to print, or ""
// when nothing changed.
std::string clip_warmup_to_run(Config& config);

// The run length from the data (docs/trainer.md#epochs), once the training batcher exists and
// before anything reads train.steps for the schedule: train.epochs E > 0 becomes
//   train.steps = max(1, ceil(E x micro_batches_per_epoch / (train.grad_accum x ranks)))
// (micro_batches_per_epoch: the batcher's batches of epoch 0, packed rows included), then
// optim.schedule.warmup_ratio r > 0 becomes warmup_steps = round(r x train.steps); both are
// then 0 in `config`, which reads as the steps-based config it resolved to. Last, the warmup is
// clipped to the run (clip_warmup_to_run). Returns the notes to print (one line each), or "".
std::string resolve_run_length(Config& config, int64_t micro_batches_per_epoch, int64_t ranks);

// Trains as configured. Returns kExitOk (also after a signal-triggered checkpoint); throws
// ConfigError for input problems (files, data, shapes), GuardStop, or c10::Error at runtime.
int run_training(const Config& config, const RunOptions& options, std::ostream& out,
                 std::ostream& err);

// Checks what a run checks before its first step without loading weights: inputs exist,
// config.json parses, the data loads (formats, counts, truncation, tokens with the real
// tokenizer, the batcher's packing), the run length resolves, the device is usable. Prints the
// memory estimate (whole-run terms, each phase of a step, the peak phase) and the resolved
// config. Returns kExitOk or throws ConfigError.
int run_dry_run(const Config& config, std::ostream& out);

// The training set-up and step function with instrumentation: one step with every phase marked
// (sync, time, memory), on the configured data or, without data.files, on synthetic random-token
// rows through the same batcher; prints the JSON report and writes it to options.probe_report.
// With options.probe_steps > 0, that many more steps follow, each phase timed with a device
// sync; their medians, tokens/s, slot fill and peak memory go to the report's info.steady.
int run_probe(const Config& config, const RunOptions& options, std::ostream& out,
              std::ostream& err);

// The config that a run directory saved (`<run_dir>/config.yaml`) for `--resume DIR` without
// --config; DIR may be the run directory or one of its checkpoints.
std::string saved_config_path_for_resume(const std::string& resume_dir);

}  // namespace q4::trainer
