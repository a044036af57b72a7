// The training step (docs/design.md#trainer-components): the one step function used by
// training, the probe and the benchmarks. grad_accum micro-batches (world x grad_accum with data
// parallelism, rank r taking its own) from the step's batch source (batch_source.h) -> the
// objective's loss of each -> backward of the loss over the step's units (the token-weighted
// mean: identical to one big batch) -> the step's gradient path (gradient_path.h: buffered,
// in-backward or host-ring updates, or ZeRO-2 reductions) -> one optimizer step with clipping and
// the non-finite guard. The only host waits: the optimizer's global-norm reduction (its clipping
// and guard are decided on the host) and the loss read after it, which was copied before the
// optimizer ran and so waits for nothing more. Data parallel: the step ends with the owners'
// master broadcasts launched, not waited for; the next step's forward waits for each master
// before using it (grad_sync.h).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/plan/run_plan.h"
#include "q4/trainer/step/batch_source.h"
#include "q4/trainer/step/gradient_path.h"

namespace q4::trainer {

// What one optimizer step did.
struct StepOutcome {
  double loss = 0.0;        // the objective's mean over the step's units (CE: tokens)
  int64_t real_tokens = 0;  // non-padding tokens
  int64_t supervised = 0;   // tokens the loss averages
  int64_t units = 0;        // the objective's units (the loss's denominator)
  int64_t slots = 0;        // B * T summed over micro-batches (real + padding)
  optim::StepResult res;
  // The objective's named values, each summed over the step's micro-batches over its units:
  // () device tensors, read on the host only when logged.
  std::vector<std::pair<std::string, at::Tensor>> logged;
  bool stop = false;  // a stop signal reached this rank or (data parallel) any rank
  // output.checkpoint_minutes have passed since the last checkpoint, by rank 0's clock (data
  // parallel: shared through the step's closing allreduce, so every rank checkpoints together).
  bool checkpoint_due = false;
};

// Phase callback of an instrumented step (the probe): called with "batch_ready",
// "forward_done", "backward_done" (per micro-batch) and "optimizer_step_done".
using PhaseHook = std::function<void(const char*)>;

// Makes the step's gradient path with in-backward updates or not, for the step's grad_accum at
// the time of the call (a resume may rescale it: the path is made with the first step).
using GradientPathFactory = std::function<std::unique_ptr<GradientPath>(bool in_backward)>;

class TrainStep {
 public:
  // `in_backward`: optimizer updates from inside the backward (one process); `make_path` makes
  // the gradient path (the first step's and one after disable_in_backward()); `comm`: data
  // parallel (null with one process); `checkpoint_due`: rank 0's checkpoint clock (null: never
  // due).
  TrainStep(const RunPlan& plan, model::Qwen3Model& model, const optim::LrSchedule& schedule,
            Objective& objective, DistComm* comm, bool in_backward, GradientPathFactory make_path,
            std::function<bool()> checkpoint_due = nullptr);
  // The run's paths: make_data_parallel_path with a communicator, else make_local_path over
  // `optimizer_index` (the optimizer's index of each owned parameter).
  TrainStep(const RunPlan& plan, model::Qwen3Model& model, optim::PackedAdamW& optimizer,
            const optim::LrSchedule& schedule, Objective& objective, GradSync& sync, DistComm* comm,
            bool in_backward,
            const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
            std::function<bool()> checkpoint_due = nullptr);
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // Step `step` (0-based) on the next micro-batches of `source`; `mark` instruments phases.
  StepOutcome run(int64_t step, BatchSource& source, const PhaseHook& mark = nullptr);
  StepOutcome run(int64_t step, data::Batcher& batcher, const PhaseHook& mark = nullptr);

  bool in_backward() const { return in_backward_; }
  // Back to updates after the backward (a resume whose grad_accum makes auto choose those).
  void disable_in_backward();

 private:
  // The step's micro-batches: every rank draws the global batch's, keeps its own and counts
  // them all into `o`; from a per-rank source (BatchSource::per_rank) it draws its own and the
  // counts are summed over the ranks.
  std::vector<data::Batch> draw(BatchSource& source, StepOutcome* o);
  // Forward and backward of this rank's micro-batches through `path`; returns the summed loss.
  at::Tensor forward_backward(GradientPath& path, const std::vector<data::Batch>& micro,
                              double denom, StepOutcome* o, const PhaseHook& mark);
  StepOutcome finish_distributed(StepOutcome o, GradientPath& path, const at::Tensor& loss_sum,
                                 const optim::StepArgs& args, double denom, const PhaseHook& mark);

  const RunPlan& plan_;
  model::Qwen3Model& model_;
  const optim::LrSchedule& schedule_;
  Objective& objective_;
  DistComm* comm_;
  bool in_backward_;
  GradientPathFactory make_path_;
  std::function<bool()> checkpoint_due_;
  std::unique_ptr<GradientPath> path_;  // made with the first step
};

}  // namespace q4::trainer
