// The GRPO objective over rollout rows (see grpo.h; docs/trainer.md#grpo).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>

#include "q4/trainer/objectives/grpo.h"

namespace q4::trainer {

at::Tensor completion_rows(const at::Tensor& values, const std::vector<int64_t>& lengths,
                           int64_t max_len) {
  const auto E = static_cast<int64_t>(lengths.size());
  std::vector<int64_t> dest;
  for (int64_t e = 0; e < E; ++e) {
    TORCH_CHECK(lengths[e] >= 0 && lengths[e] <= max_len, "completion_rows: completion ", e,
                " has ", lengths[e], " tokens, outside [0, ", max_len, "]");
    for (int64_t j = 0; j < lengths[e]; ++j) dest.push_back(e * max_len + j);
  }
  TORCH_CHECK(values.dim() == 1 && values.size(0) == static_cast<int64_t>(dest.size()),
              "completion_rows: ", values.sizes(), " values for ", dest.size(),
              " completion tokens");
  const at::Tensor index = at::tensor(dest, at::kLong).to(values.device());
  return at::zeros({E * max_len}, values.options().dtype(at::kFloat))
      .index_add(0, index, values.to(at::kFloat))
      .view({E, max_len});
}

GrpoObjective::GrpoObjective(const GrpoConfig& c, std::unique_ptr<model::Qwen3Model> reference)
    : loss_(grpo_loss_options(c)), temperature_(c.temperature), reference_(std::move(reference)) {
  loss_.validate();
  TORCH_CHECK(loss_.beta == 0 || reference_ != nullptr,
              "grpo.beta > 0 needs the reference model");
}

GrpoObjective::~GrpoObjective() = default;

ObjectiveNeeds GrpoObjective::needs() const {
  ObjectiveNeeds n;
  n.packing_allowed = false;
  n.prompt_records = true;
  n.sections = {"grpo", "reward"};
  return n;
}

namespace {

const data::RolloutRows& rollout_of(const data::Batch& b) {
  TORCH_CHECK(b.rollout != nullptr,
              "train.objective grpo: a micro-batch without rollout rows (not from the rollout "
              "source)");
  return *b.rollout;
}

}  // namespace

int64_t GrpoObjective::units(const data::Batch& batch) const {
  const data::RolloutRows& r = rollout_of(batch);
  const auto E = static_cast<int64_t>(r.completion_lengths.size());
  switch (loss_.loss_type) {
    case GrpoLossType::kGrpo:
      return E;
    case GrpoLossType::kDapo:
      return static_cast<int64_t>(std::llround(r.mask.sum().item<double>()));
    case GrpoLossType::kDrGrpo:
      return E * loss_.max_completion_length;
  }
  return E;
}

std::string GrpoObjective::units_name() const {
  return loss_.loss_type == GrpoLossType::kDapo ? "completion tokens" : "completions";
}

ObjectiveOutput GrpoObjective::compute(model::Qwen3Model& model, const MicroBatch& micro) {
  const data::RolloutRows& r = rollout_of(*micro.batch);
  const int64_t L = r.mask.size(1);
  const at::Device dev = micro.inputs.input_ids.device();
  GrpoTokens t;
  t.logps = completion_rows(model.token_logprobs(micro.inputs, temperature_).logprobs,
                            r.completion_lengths, L);
  if (r.old_logprobs.defined()) t.old_logps = r.old_logprobs.to(dev);
  if (loss_.beta > 0) {
    at::NoGradGuard no_grad;
    t.ref_logps = completion_rows(reference_->token_logprobs(micro.inputs, temperature_).logprobs,
                                  r.completion_lengths, L);
  }
  t.advantages = r.advantages.to(dev);
  t.mask = r.mask.to(dev);
  if (r.entropy.defined()) t.entropy = r.entropy.to(dev);
  GrpoLossOutput lo = grpo_loss(t, loss_);
  ObjectiveOutput out;
  out.loss_sum = lo.loss_sum;
  // The step divides every logged value by its units: a mean weighted by the micro-batches'.
  const auto weight = static_cast<double>(units(*micro.batch));
  for (auto& [name, v] : lo.logged) {
    if (name != "tokens") out.logged.emplace_back(name, v * weight);
  }
  return out;
}

}  // namespace q4::trainer
