// The objectives a step can train with; see objective.h for the contract.
#include "q4/trainer/objective.h"

namespace q4::trainer {

ObjectiveOutput SupervisedCrossEntropy::compute(model::Qwen3Model& model,
                                                const MicroBatch& micro) {
  ObjectiveOutput out;
  out.loss_sum = model.loss(micro.inputs).loss_sum;
  return out;
}

std::unique_ptr<Objective> make_objective() { return std::make_unique<SupervisedCrossEntropy>(); }

}  // namespace q4::trainer
