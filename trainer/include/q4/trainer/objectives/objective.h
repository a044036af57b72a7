// What a training step minimizes, one micro-batch at a time (docs/design.md#trainer-components).
// The step hands each micro-batch to the objective, differentiates the loss it returns and sums
// the values it names for logging; the loop never sees which objective runs. An objective says
// what its micro-batch must carry (labels, paired sequences) so that set-up and the step prepare
// exactly that, and how many units (for
// cross-entropy: supervised tokens) its loss sums over, so the step's loss is the mean over the
// whole step (every micro-batch of every rank) whatever the micro-batch split.
#pragma once

#include <ATen/core/Tensor.h>

#include <iosfwd>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/config/objective_needs.h"

namespace q4::trainer {

// One micro-batch as an objective sees it. Fields an objective does not need stay empty.
struct MicroBatch {
  model::ModelInputs inputs;           // on the model's device; labels on the host
  const data::Batch* batch = nullptr;  // the host batch it came from (token counts, examples)
};

struct ObjectiveOutput {
  // () fp32 on the model's device, differentiable: the micro-batch's loss summed over its units
  // (units(batch) of them). The step differentiates loss_sum / (the step's units).
  at::Tensor loss_sum;
  // Named () device tensors to log, each summed over the step's micro-batches and divided by
  // the step's units; read on the host only when the step is logged, and written to
  // metrics.jsonl and TensorBoard under their names (a name metrics.jsonl already has is not).
  std::vector<std::pair<std::string, at::Tensor>> logged;
};

// Mixture-of-experts models: the routers' load-balancing loss (model::LossOutput::aux_loss, no
// coefficient) as a logged value of the objectives that train through model::Qwen3Model::loss,
// weighted by the micro-batch's supervised tokens (so the step's value is their mean), and the
// router z-loss (LossOutput::z_loss) the same way when train.router_z_loss_coef is on. Nothing
// for a dense model.
inline constexpr const char* kRouterAuxLossName = "moe_aux_loss";
inline constexpr const char* kRouterZLossName = "moe_z_loss";
void log_router_aux_loss(const model::LossOutput& lo, ObjectiveOutput* out);

class Objective {
 public:
  virtual ~Objective() = default;
  virtual std::string name() const = 0;
  virtual ObjectiveNeeds needs() const = 0;
  // The units the micro-batch's loss sums over (the step's mean divides by their total).
  virtual int64_t units(const data::Batch& batch) const = 0;
  // What a unit is, for messages ("tokens": supervised tokens).
  virtual std::string units_name() const { return "tokens"; }
  // Forward of one micro-batch: its summed loss and the values to log.
  virtual ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) = 0;
  // The held-out loss of one micro-batch (the validation loss; autograd off). Default: the
  // training loss. Distillation reports the cross-entropy instead: what the shipped model
  // scores on held-out text, comparable with any other run and with q4eval.
  virtual ObjectiveOutput evaluate(model::Qwen3Model& model, const MicroBatch& micro) {
    return compute(model, micro);
  }
};

// Supervised fine-tuning: next-token cross-entropy over the supervised positions, through the
// model's chunked loss (only supervised rows reach the lm_head; no full logits). Units are
// supervised tokens, so the step's loss is the token-weighted mean, identical to one big batch.
class SupervisedCrossEntropy final : public Objective {
 public:
  std::string name() const override { return "cross_entropy"; }
  ObjectiveNeeds needs() const override { return ObjectiveNeeds{}; }
  int64_t units(const data::Batch& batch) const override { return batch.supervised_tokens; }
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override;
};

struct ObjectivePlan;  // plan/component_plans.h

// The objective a run trains with (`objective`, the plan's slice: train.objective and its
// section): supervised cross-entropy; distillation from distill.teacher loaded on `student`'s
// device (its load reported on `out`), or from distill.topk_file, checked against the examples of
// `train` (the training batcher); or preference tuning, with the reference's log-probabilities of
// `train` and `validation` (null: no held-out examples) read from the run or computed by `student`
// before it trains (written to the run when `leader`).
std::unique_ptr<Objective> make_objective(const ObjectivePlan& objective,
                                          model::Qwen3Model& student, const data::Batcher* train,
                                          const data::Batcher* validation, bool leader,
                                          std::ostream& out);

}  // namespace q4::trainer
