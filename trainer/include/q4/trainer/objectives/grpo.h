// GRPO's parts as TRL's GRPOTrainer defines them (docs/trainer.md#grpo): group advantages from
// rewards, the clipped surrogate on per-token ratios pi / pi_old with DAPO's clip-higher, the k3
// KL estimator to a reference, and the three aggregations of TRL's loss_type. Everything works on
// a padded (B, L) layout of completion tokens with a mask, in the inputs' device; the loss is a
// sum over its units so that micro-batches accumulate to the step's mean (objective.h):
//   grpo     units = completions, a completion's term is the mean over its tokens
//   dapo     units = completion tokens of the batch
//   dr_grpo  units = completions x max_completion_length
// GrpoObjective feeds the loss from the training forward; the rollout loop that samples and
// scores the completions is step/rollout_source.h.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "q4/trainer/config/config.h"
#include "q4/trainer/objectives/objective.h"

namespace q4::trainer {

// TRL's epsilon in the advantage's denominator: (r - mean) / (std + 1e-4).
inline constexpr double kGrpoStdEpsilon = 1e-4;

struct GroupAdvantages {
  at::Tensor advantages;  // (N) fp32: reward - its group's mean, over the std per scale_rewards
  // (N) fp32: the std each advantage was (or, with scale none, would be) divided by: its group's
  // (unbiased, as torch.std) or the batch's. reward_std logs its mean.
  at::Tensor std;
};
// rewards (N) any float dtype, N = groups x group_size, each group's completions consecutive
// (TRL's order). group_size >= 2. The mean is always the group's; the std per `scale`.
GroupAdvantages group_advantages(const at::Tensor& rewards, int64_t group_size, ScaleRewards scale);

struct GrpoLossOptions {
  GrpoLossType loss_type = GrpoLossType::kDapo;
  double epsilon_low = 0.2;             // ratio clipped below at 1 - epsilon_low
  double epsilon_high = 0.2;            // and above at 1 + epsilon_high
  double beta = 0.0;                    // KL coefficient; 0: ref_logps unused
  int64_t max_completion_length = 256;  // dr_grpo's normalizer
  void validate() const;                // errors name the field
};
// From the grpo: section (epsilon_high 0 -> epsilon).
GrpoLossOptions grpo_loss_options(const GrpoConfig& c);

// One micro-batch of B completions padded to L tokens.
struct GrpoTokens {
  at::Tensor logps;       // (B, L) fp32, differentiable: log softmax(logits / T) of each token
  at::Tensor old_logps;   // (B, L) at sampling; undefined: logps detached (ratio 1, TRL's mu = 1)
  at::Tensor ref_logps;   // (B, L) the reference's; required when beta > 0
  at::Tensor advantages;  // (B)
  at::Tensor mask;        // (B, L) bool or float: 1 where a token trains (completion_mask)
  at::Tensor entropy;     // (B, L) optional: each position's entropy, for logging
};

struct GrpoLossOutput {
  at::Tensor loss_sum;  // () fp32, differentiable: summed over the micro-batch's units
  at::Tensor units;     // () fp32: the units (see the file comment); loss = loss_sum / units
  // Detached () fp32 masked means over the tokens, TRL's names: clip_ratio (region: clipped
  // low with a negative advantage or high with a positive one), clip_ratio/low_mean,
  // clip_ratio/high_mean, kl (beta > 0), entropy (with GrpoTokens::entropy), and tokens (the
  // mask's sum: the weight of these means when micro-batches are combined).
  std::vector<std::pair<std::string, at::Tensor>> logged;
};

// per-token loss = -min(r A, clip(r, 1 - eps_low, 1 + eps_high) A) + beta (e^(ref - logp) -
// (ref - logp) - 1), r = e^(logp - old_logp), aggregated per loss_type.
GrpoLossOutput grpo_loss(const GrpoTokens& tokens, const GrpoLossOptions& options);

// (B, L) float mask of completion tokens: position j < lengths[b] (the end token included);
// with `mask_truncated`, rows whose completion was truncated (no end token) are all 0.
at::Tensor completion_mask(const std::vector<int64_t>& lengths, const std::vector<bool>& truncated,
                           int64_t max_len, bool mask_truncated);

// TRL's completion and reward logs: completions/mean_length, /min_length, /max_length,
// /clipped_ratio (truncated share), /mean_terminated_length; reward (mean of `rewards`),
// reward_std (mean of the advantages' std), frac_reward_zero_std (groups whose rewards are all
// equal); rewards/<name>/mean and /std per reward function (per_function (N, F), names F).
std::vector<std::pair<std::string, double>> grpo_rollout_stats(
    const std::vector<int64_t>& lengths, const std::vector<bool>& truncated,
    const at::Tensor& rewards, const GroupAdvantages& advantages, int64_t group_size,
    const at::Tensor& per_function, const std::vector<std::string>& names);

// The grpo prompt's length check: prompt + grpo.max_completion_length must fit train.seq_len.
// ConfigError naming the keys and `where` (file:line of the prompt).
void check_grpo_prompt_length(int64_t prompt_tokens, int64_t max_completion_length, int64_t seq_len,
                              const std::string& where);

// One line for --dry-run and the start (`g`: grpo.*).
std::string grpo_summary(const GrpoConfig& g);

// (E, L) fp32 of per-token values given in completion order (each example's completion tokens
// consecutive, as Qwen3Model::token_logprobs returns them for rollout rows), zero past each
// completion's end. Differentiable in `values`.
at::Tensor completion_rows(const at::Tensor& values, const std::vector<int64_t>& lengths,
                           int64_t max_len);

// train.objective grpo (docs/trainer.md#grpo): the loss of a micro-batch of rollout rows
// (data::Batch::rollout): the policy's log-probabilities of the completion tokens at
// grpo.temperature from the training forward (Qwen3Model::token_logprobs), the rows' advantages
// and old log-probabilities, and with grpo.beta > 0 the reference's (a frozen copy of the
// starting model) into grpo_loss. Units per loss_type (the file comment). Logs clip_ratio,
// clip_ratio/low_mean, clip_ratio/high_mean, kl (beta > 0) and entropy (the rollout's sampling
// entropies, RolloutRows::entropy), each weighted by the micro-batch's units so that the step's
// value is their mean over the step.
class GrpoObjective final : public Objective {
 public:
  // `reference`: the frozen starting model when beta > 0 (null otherwise).
  GrpoObjective(const GrpoConfig& c, std::unique_ptr<model::Qwen3Model> reference);
  ~GrpoObjective() override;
  std::string name() const override { return "grpo"; }
  ObjectiveNeeds needs() const override;
  int64_t units(const data::Batch& batch) const override;
  std::string units_name() const override;
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override;

 private:
  GrpoLossOptions loss_;
  double temperature_;
  std::unique_ptr<model::Qwen3Model> reference_;
};

struct PromptCheckPlan;  // plan/component_plans.h

// --dry-run: reads data.files and data.eval_files as prompt records with the run's tokenizer,
// prints each file's load summary and checks every prompt's length
// (check_grpo_prompt_length) and its record against the rewards (check_reward_example);
// ConfigError naming the file and line.
void check_grpo_prompts(const PromptCheckPlan& p, std::ostream& out);

}  // namespace q4::trainer
