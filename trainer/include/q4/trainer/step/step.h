// The training step (docs/design.md#trainer-components): the one step function used by
// training, the probe and the benchmarks. grad_accum micro-batches (world x grad_accum with data
// parallelism, rank r taking its own) -> the objective's loss of each -> backward of the loss
// over the step's units (the token-weighted mean: identical to one big batch) -> gradient sync
// (in-backward updates or ZeRO-2 reductions) -> one optimizer step with clipping and the
// non-finite guard. The only host waits: the optimizer's global-norm reduction (its clipping
// and guard are decided on the host) and the loss read after it, which was copied before the
// optimizer ran and so waits for nothing more. Data parallel: the step ends with the owners'
// master broadcasts launched, not waited for; the next step's forward waits for each master
// before using it (grad_sync.h).
#pragma once

#include <functional>
#include <memory>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/step/host_accumulation.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/plan/run_plan.h"

namespace q4::trainer {

// What one optimizer step did.
struct StepOutcome {
  double loss = 0.0;          // the objective's mean over the step's units (CE: tokens)
  int64_t real_tokens = 0;    // non-padding tokens
  int64_t supervised = 0;     // tokens the loss averages
  int64_t units = 0;          // the objective's units (the loss's denominator)
  int64_t slots = 0;          // B * T summed over micro-batches (real + padding)
  optim::StepResult res;
  // The objective's named values, each summed over the step's micro-batches over its units:
  // () device tensors, read on the host only when logged.
  std::vector<std::pair<std::string, at::Tensor>> logged;
  bool stop = false;          // a stop signal reached this rank or (data parallel) any rank
  // output.checkpoint_minutes have passed since the last checkpoint, by rank 0's clock (data
  // parallel: shared through the step's closing allreduce, so every rank checkpoints together).
  bool checkpoint_due = false;
};

// Phase callback of an instrumented step (the probe): called with "batch_ready",
// "forward_done", "backward_done" (per micro-batch) and "optimizer_step_done".
using PhaseHook = std::function<void(const char*)>;

class TrainStep {
 public:
  // `in_backward`: optimizer updates from inside the backward (one process, one micro-batch a
  // step); `optimizer_index`: the optimizer's index of each owned parameter for them.
  // `checkpoint_due`: rank 0's checkpoint clock (null: never due).
  TrainStep(const RunPlan& plan, model::Qwen3Model& model, optim::PackedAdamW& optimizer,
            const optim::LrSchedule& schedule, Objective& objective, GradSync& sync,
            DistComm* comm, bool in_backward,
            const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
            std::function<bool()> checkpoint_due = nullptr);
  ~TrainStep();
  TrainStep(const TrainStep&) = delete;
  TrainStep& operator=(const TrainStep&) = delete;

  // Step `step` (0-based) on the next micro-batches of `batcher`; `mark` instruments phases.
  StepOutcome run(int64_t step, data::Batcher& batcher, const PhaseHook& mark = nullptr);

  bool in_backward() const { return in_backward_; }
  // Back to updates after the backward (a resume whose grad_accum makes auto choose those).
  void disable_in_backward();

 private:
  StepOutcome finish_distributed(StepOutcome o, const at::Tensor& loss_sum,
                                 const optim::StepArgs& step_args, double denom,
                                 const PhaseHook& mark);
  // optim.offload: all with grad_accum > 1 (one process): the gradients of masters in pinned
  // host memory add up in pinned host memory too (host_accumulation.h).
  bool accumulates_on_host() const;
  // The model's grad-ready hook (in-backward updates, or sums in host memory) gets each
  // parameter's complete micro-batch gradient. Before the last micro-batch of an in-backward
  // step, and in every micro-batch of a buffered one, the gradient is summed on: an offloaded
  // master's in its host buffer (then freed), any other kept and put back after the
  // micro-batch (the next backward adds into it). In the last micro-batch of an in-backward
  // step the complete sum is applied at once.
  void on_gradient(model::Parameter& p);
  // In-backward steps: the updates of sums the last micro-batch's backward did not reach.
  void apply_unreached();

  const RunPlan& plan_;
  model::Qwen3Model& model_;
  optim::PackedAdamW& optimizer_;
  const optim::LrSchedule& schedule_;
  Objective& objective_;
  GradSync& sync_;
  DistComm* comm_;
  bool in_backward_;
  std::function<bool()> checkpoint_due_;
  std::vector<const model::Parameter*> by_index_;  // the parameter of each optimizer index
  std::unordered_map<const model::Parameter*, int64_t> index_;  // and the reverse
  // Offloaded masters whose codes the optimizer's master-updated hook refreshed.
  std::unordered_set<const model::Parameter*> refreshed_;
  std::unique_ptr<HostGradientAccumulator> host_sums_;          // created with the first such step
  at::Tensor staging_;  // with in-backward updates: the optimizer's share of the ring's memory
  std::vector<std::pair<model::Parameter*, at::Tensor>> kept_;  // device gradients to put back
  bool last_micro_ = false;  // the micro-batch being back-propagated is the step's last
};

}  // namespace q4::trainer
