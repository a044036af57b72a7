// The run as configured, resolved once (docs/design.md#trainer-components): the config with its
// run length known (train.epochs and optim.schedule.warmup_ratio turned into steps once the data
// is batched), the command-line options, the device, and the values every component asks for
// (steps, global batch, checkpoint cadence, export path, the memory guard). Components read
// their settings from here; the loop owns the one RunPlan of a run.
#pragma once

#include <ATen/core/TensorBody.h>
#include <c10/core/Device.h>

#include <chrono>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "q4/model/qwen3_config.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/config/objective_needs.h"
#include "q4/trainer/distributed/distributed.h"
#include "q4/trainer/plan/component_plans.h"
#include "q4/trainer/plan/options.h"

namespace q4::trainer {

struct MemoryBudget;  // plan/estimate.h

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
  WorldInfo world;  // data-parallel rank and size (torchrun / --nproc); default: alone
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

// How a step updates the weights (docs/optim.md, "In-backward updates"), decided once.
struct StepPlan {
  // Optimizer updates run inside the backward, each parameter's as its gradient completes
  // (optim.in_backward resolved; one process, or the probe); else after it (buffered).
  bool in_backward = false;
  // The summed gradients of offloaded masters (optim.offload: all) add up in pinned host memory
  // over a step's micro-batches (one process on CUDA, grad_accum > 1).
  bool host_accumulation = false;
  int64_t grad_accum = 1;      // micro-batches per rank and step
  int64_t world = 1;           // data-parallel ranks
  double max_grad_norm = 1.0;  // train.max_grad_norm (0: no clipping)
};

// What lives in host memory instead of the GPU (optim.offload, docs/optim.md).
struct PlacementPlan {
  bool moments_on_host = false;    // optim.offload moments or all, on CUDA
  bool masters_on_host = false;    // optim.offload all, on CUDA (the GPU keeps NVFP4 codes)
  bool gradients_on_host = false;  // StepPlan::host_accumulation
};

// How the data is laid out for the objective (ObjectiveNeeds resolved against data.*).
struct DataPlan {
  int64_t group_size = 1;       // rows kept together (2: preference pairs)
  bool paired_records = false;  // data files hold preference records
  bool packing = true;          // data.packing as applied (resolved_packing)
  bool reference_pass = false;  // reference log-probabilities computed before the first step
  bool prompt_records = false;  // data files hold prompts to sample from (GRPO)
};

// The run, resolved (docs/design.md#trainer-components). A plan never changes: each stage that
// learns something (the warmup against the run, the run length once the data is batched, the
// recompute once the free memory is known, the grad_accum of a resume on another world size)
// makes a new plan from the previous one with `with_*`, and the run's owner keeps the newest.
class RunPlan {
 public:
  // `probe`: the VRAM probe (training set-up and step, nothing written but the report).
  // `needs`: the objective's (objectives/registry.h objective_needs; resolve_plan there makes a
  // plan from a config).
  RunPlan(const Config& config, const RunOptions& options, const ObjectiveNeeds& needs,
          bool probe = false);

  // The configuration as resolved so far (after with_length: the steps-based config; after
  // with_recompute: the recompute chosen). The resolver's (plan/, the objective registry): the
  // components take their slices (component_plans.h; docs/design.md#trainer-layers).
  const Config& config() const { return config_; }
  const RunOptions& options() const { return options_; }
  const at::Device& device() const { return device_; }
  bool probe() const { return probe_; }
  bool resuming() const { return options_.resume.has_value(); }
  const ObjectiveNeeds& objective_needs() const { return needs_; }

  const StepPlan& step() const { return step_; }
  const RecomputePlan& recompute() const { return recompute_; }
  const PlacementPlan& placement() const { return placement_; }
  const DataPlan& data() const { return data_; }

  // The run length in optimizer steps (train.steps, or from train.epochs once resolved).
  int64_t steps() const { return steps_; }
  // Micro-batches accumulated per rank and step (rescaled by a resume on another world size).
  int64_t grad_accum() const { return step_.grad_accum; }
  // train.epochs as configured (config().train.epochs is 0 once resolved).
  double epochs_configured() const { return epochs_; }
  // train.epochs or warmup_ratio: the run length is known only once the data is batched.
  bool length_from_data() const { return length_from_data_; }
  // Checkpoints are on by default: every output.checkpoint_every steps and/or every
  // output.checkpoint_minutes of training, and at the end of the run.
  bool checkpoints_on() const;
  // Where the model is exported ("" for none), output.export_path resolved against output.dir.
  std::string export_path() const;
  // <output.dir>/<log.metrics>, or "" when the metrics file is off.
  std::string metrics_path() const;
  // The config a run writes to its config.yaml: config() with the recompute settings and
  // model.forward_weights as configured (auto stays auto, so a resume, maybe on another GPU,
  // decides again).
  Config config_to_save() const;
  // The plan as --dry-run prints it: a few lines, each starting "plan: ".
  std::string describe() const;

  // The components' slices (component_plans.h), from the plan as resolved so far: a component
  // takes its slice when it is made, after the stages it depends on.
  MemoryGuard guard() const;
  EvalPlan eval_plan() const;
  ExportPlan export_plan() const;
  CheckpointPlan checkpoint_plan() const;
  ReportPlan report_plan() const;
  LoopPlan loop_plan() const;
  ProbePlan probe_plan() const;
  ObjectivePlan objective_plan() const;
  PromptCheckPlan prompt_check_plan() const;
  // The training batcher's settings (options.h batcher_options, as the data plan lays the rows
  // out), `pad_id` the tokenizer's padding.
  data::BatcherOptions batcher_options(int64_t pad_id) const;
  // GRPO's rollout source's slice (`pad_id` the tokenizer's padding).
  RolloutPlan rollout_plan(int64_t pad_id) const;
  // The settings a probe report records (the config file, the micro-batch, dtypes, the recompute
  // as resolved, the optimizer state, the data's kind): a JSON object.
  nlohmann::json probe_settings() const;
  // The memory estimate of one micro-batch of the loaded model (estimate.h estimate_budget).
  MemoryBudget memory_estimate(const model::Qwen3Config& mc, bool separate_lm_head) const;
  // Model FLOPs per trained token (estimate.h train_flops_per_token).
  double flops_per_token(const model::Qwen3Config& mc, bool separate_lm_head) const;
  // The loaded model's experts line and LoRA-on-experts note (estimate.h moe_summary,
  // moe_lora_note; "" for none).
  std::string moe_summary(const model::Qwen3Config& mc, bool separate_lm_head) const;
  std::string moe_lora_note(const model::Qwen3Config& mc) const;

  // A run whose length is configured in steps: the warmup clipped to it (`note`: the note, or
  // ""). A run whose length comes from the data is unchanged (with_length clips).
  RunPlan with_warmup_clipped(std::string* note) const;
  // A run whose length comes from the data: resolve_run_length (`notes`: its notes, or "").
  RunPlan with_length(int64_t micro_batches_per_epoch, int64_t ranks, std::string* notes) const;
  // train.gradient_checkpointing auto resolved (estimate.h choose_recompute) against
  // `free_bytes`; `line`: its line, or "" when the recompute was not auto.
  RunPlan with_recompute(const model::Qwen3Config& mc, bool separate_lm_head, int64_t free_bytes,
                         std::string* line) const;
  // model.forward_weights auto resolved on CUDA against `free_bytes` (after with_recompute, with
  // the recompute chosen): kept, else codes, else sweep, the first whose estimate fits
  // device_budget's usable bytes; `line`: its line, or "" when nothing was decided here (a
  // setting, the CPU: sweep, optim.offload all: codes).
  RunPlan with_forward_weights(const model::Qwen3Config& mc, bool separate_lm_head,
                               int64_t free_bytes, std::string* line) const;
  // A resume on another world size keeps the global batch with this many micro-batches a step
  // (the step plan decided again: auto's in-backward updates need grad_accum 1).
  RunPlan with_grad_accum(int64_t grad_accum) const;

  // The run's checks before anything is written, over the resolved config: the device
  // (check_device_available), the settings the objective ignores (a warning, or ""), the input
  // files (setup.h check_input_files; `need_data`: the data too) and every output path
  // (run_dir.h check_output_paths with --overwrite).
  void check_device() const;
  std::string ignored_settings_warning() const;
  void check_inputs(bool need_data) const;
  void check_outputs() const;
  // output.dir's entries of a previous run or the user (run_dir.h run_dir_leftovers), and the
  // stale temporary files removed there (run_dir.h clean_stale_files).
  std::vector<std::string> run_dir_leftovers() const;
  std::vector<std::string> clean_stale_files() const;

  // guard().check(where): the allocator's reserved memory and the device's used memory against
  // guard.max_gpu_gb (GuardStop naming `where`); nothing on the CPU or with the guard off.
  void check_guard(const std::string& where) const { guard().check(where); }

 private:
  // The plan structs from config_ (after any stage).
  void decide();

  Config config_;
  TrainConfig configured_train_;  // train.* before with_recompute
  ForwardWeightsOrAuto configured_forward_weights_;  // before with_forward_weights
  RunOptions options_;
  ObjectiveNeeds needs_;
  at::Device device_;
  bool probe_ = false;
  int64_t steps_ = 0;
  double epochs_ = 0;
  bool length_from_data_ = false;
  StepPlan step_;
  RecomputePlan recompute_;
  PlacementPlan placement_;
  DataPlan data_;
};

}  // namespace q4::trainer
