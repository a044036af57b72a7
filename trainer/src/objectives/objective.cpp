// The objectives a step can train with; see objective.h for the contract.
#include "q4/trainer/objectives/objective.h"

#include <ATen/ATen.h>

#include "q4/trainer/config/config.h"
#include "q4/trainer/objectives/distill.h"
#include "q4/trainer/objectives/grpo.h"
#include "q4/trainer/objectives/preference.h"
#include "q4/trainer/plan/component_plans.h"
#include "q4/trainer/plan/setup.h"

namespace q4::trainer {

void log_router_aux_loss(const model::LossOutput& lo, ObjectiveOutput* out) {
  if (!lo.aux_loss.defined()) return;
  out->logged.emplace_back(kRouterAuxLossName, lo.aux_loss * lo.num_tokens.to(at::kFloat));
  if (lo.z_loss.defined()) {
    out->logged.emplace_back(kRouterZLossName, lo.z_loss * lo.num_tokens.to(at::kFloat));
  }
}

ObjectiveOutput SupervisedCrossEntropy::compute(model::Qwen3Model& model, const MicroBatch& micro) {
  const model::LossOutput lo = model.loss(micro.inputs);
  ObjectiveOutput out;
  out.loss_sum = lo.loss_sum;
  log_router_aux_loss(lo, &out);
  return out;
}

std::unique_ptr<Objective> make_objective(const ObjectivePlan& c, model::Qwen3Model& student,
                                          const data::Batcher* train,
                                          const data::Batcher* validation, bool leader,
                                          std::ostream& out) {
  switch (c.kind) {
    case ObjectiveKind::kCrossEntropy:
      return std::make_unique<SupervisedCrossEntropy>();
    case ObjectiveKind::kDistill:
      if (!c.distill.topk_file.empty()) {
        TORCH_CHECK(train != nullptr, "offline distillation needs the training batcher");
        auto teacher =
            std::make_unique<TopkTeacher>(c.distill.topk_file, train->examples(),
                                          student.config().vocab_size, c.distill.temperature);
        out << "teacher: " << c.distill.topk_file << " (top " << teacher->k() << ", "
            << teacher->ids().size(0) << " positions)\n";
        return std::make_unique<OfflineDistillation>(c.distill, std::move(teacher), *train);
      }
      return std::make_unique<Distillation>(
          c.distill, load_teacher(c.teacher, student.options(), student.config().vocab_size, out));
    case ObjectiveKind::kPreference: {
      TORCH_CHECK(train != nullptr, "preference tuning needs the training batcher");
      out << preference_summary(c.preference, c.reference_file) << "\n";
      ReferenceLogprobs ref;
      if (c.preference.loss != PreferenceLossKind::kSimpo) {
        ref = reference_logprobs(c, student, *train, validation, leader, out);
      }
      return std::make_unique<PreferenceObjective>(c.preference, std::move(ref));
    }
    case ObjectiveKind::kGrpo: {
      out << grpo_summary(c.grpo) << "\n";
      std::unique_ptr<model::Qwen3Model> reference;
      if (c.grpo.beta > 0) {
        reference = load_frozen_model(c.starting_model, student.options(),
                                      student.config().vocab_size, out);
      }
      return std::make_unique<GrpoObjective>(c.grpo, std::move(reference));
    }
  }
  throw ConfigError("config key train.objective: unknown value");
}

}  // namespace q4::trainer
