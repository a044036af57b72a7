// Preference-tuning losses over per-pair log-probabilities, as TRL defines them: DPO's sigmoid
// loss (with conservative label smoothing), IPO, and the reference-free SimPO. The inputs are
// each answer's summed log-probability under the policy (differentiable) and under the frozen
// reference, and its token count; IPO and SimPO use per-token averages (sum / tokens), as TRL's
// trainers do. Everything is element-wise over pairs, in the inputs' dtype and device, so the
// caller sums the per-pair losses over its micro-batch and differentiates.
#pragma once

#include <ATen/core/Tensor.h>

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/plan/component_plans.h"

namespace q4::trainer {

// PreferenceLossKind (config.h):
//   sigmoid  DPO: -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z),
//            z = (pi_c - pi_r) - (ref_c - ref_r) on summed log-probabilities
//   ipo      IPO: (z - 1 / (2 beta))^2, z on per-token averages
//   simpo    SimPO, reference-free: the sigmoid loss of z = avg_c - avg_r - gamma / beta

struct PreferenceLossOptions {
  PreferenceLossKind kind = PreferenceLossKind::kSigmoid;
  double beta = 0.1;             // > 0: the implicit reward's scale
  double label_smoothing = 0.0;  // sigmoid and SimPO: in [0, 0.5), the chance a label is flipped
  double simpo_gamma = 0.5;      // SimPO: the target reward margin (TRL's simpo_gamma)
  void validate() const;         // errors name the field
};

// One micro-batch of pairs (P of them), each tensor (P).
struct PreferencePairs {
  at::Tensor chosen_logps;    // policy, summed over the chosen answer's tokens (differentiable)
  at::Tensor rejected_logps;  // policy, rejected answer
  at::Tensor chosen_tokens;   // answer token counts (> 0), any numeric dtype
  at::Tensor rejected_tokens;
  at::Tensor ref_chosen_logps;  // the reference's sums (undefined for SimPO)
  at::Tensor ref_rejected_logps;
};

struct PreferenceLossOutput {
  at::Tensor losses;            // (P) per pair, differentiable
  at::Tensor chosen_rewards;    // (P) detached: beta (pi_c - ref_c), SimPO beta avg_c
  at::Tensor rejected_rewards;  // (P) detached
};

PreferenceLossOutput preference_loss(const PreferencePairs& pairs,
                                     const PreferenceLossOptions& options);

// ---------------------------------------------------------------- the objective
//
// train.objective: preference (docs/trainer.md#preference-tuning). Batches hold whole pairs,
// chosen then rejected (data::BatcherOptions::group 2); an answer's log-probability is the sum over
// its supervised tokens (Qwen3Model::token_logprobs), so the prompt never counts.

PreferenceLossOptions preference_loss_options(const PreferenceConfig& c);

// The summed log-probabilities of each sequence of `batch` (its examples in the order of
// batch.example_indices), from a forward of `in` (`batch` on the model's device).
struct SequenceLogprobs {
  at::Tensor sums;    // (n) fp32 on the model's device; differentiable when grad mode is on
  at::Tensor tokens;  // (n) int64 on the host: supervised tokens of each sequence
};
SequenceLogprobs sequence_logprobs(model::Qwen3Model& model, const model::ModelInputs& in,
                                   const data::Batch& batch);

// Every example's summed log-probability under `model` (no autograd), in the batcher's example
// order: one pass over `examples` in unshuffled batches of `options`.
std::vector<double> sequence_logprobs_of(model::Qwen3Model& model,
                                         const std::vector<data::Example>& examples,
                                         data::BatcherOptions options, std::ostream& out,
                                         const std::string& what);

// The reference's log-probabilities of the training and held-out examples (each in its batcher's
// example order), kept in <output.dir>/reference_logprobs.dat:
//   reference.train / reference.validation                fp64 (E)  summed log-probabilities
//   reference.train_hashes / reference.validation_hashes  int64 (E) example_hash of each example
struct ReferenceLogprobs {
  std::vector<double> train, validation;
};

// The run's reference log-probabilities: read from `objective`.reference_file when the file
// describes these examples (a resumed run), else computed by preference.reference (loaded with
// `objective`.model's options), or by `policy` itself (which must still hold the starting
// weights), and written there when `write` (rank 0).
ReferenceLogprobs reference_logprobs(const ObjectivePlan& objective, model::Qwen3Model& policy,
                                     const data::Batcher& train, const data::Batcher* validation,
                                     bool write, std::ostream& out);

// One line for --dry-run and the start: the loss, its constants (`p`: preference.*) and where the
// reference comes from (and is kept: `reference_file`).
std::string preference_summary(const PreferenceConfig& p, const std::string& reference_file);

// The preference objective: the pairs' loss (preference_loss, plus sft_weight x the chosen
// answer's mean cross-entropy) summed over the micro-batch's pairs, its units. Logs, as TRL names
// them (each a mean over pairs): rewards/chosen, rewards/rejected, rewards/margins,
// rewards/accuracies (a tie counts 1/2: before the first update the policy is the reference), and
// logps/chosen, logps/rejected; nll_loss with sft_weight. The held-out loss is the same loss on
// the held-out pairs.
class PreferenceObjective final : public Objective {
 public:
  PreferenceObjective(const PreferenceConfig& c, ReferenceLogprobs reference);
  std::string name() const override { return "preference"; }
  ObjectiveNeeds needs() const override;
  int64_t units(const data::Batch& batch) const override {
    return static_cast<int64_t>(batch.example_indices.size()) / 2;
  }
  std::string units_name() const override { return "pairs"; }
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override;
  ObjectiveOutput evaluate(model::Qwen3Model& model, const MicroBatch& micro) override;

 private:
  ObjectiveOutput pairs_output(model::Qwen3Model& model, const MicroBatch& micro,
                               const std::vector<double>& reference) const;
  PreferenceLossOptions loss_;
  double sft_weight_;
  ReferenceLogprobs reference_;
};

}  // namespace q4::trainer
