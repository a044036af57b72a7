// GRPO's rollouts as the step's batch source (docs/trainer.md#grpo): every grpo.num_iterations
// steps it takes the next generation batch of prompts from the prompt order (a batcher over the
// prompts, shuffled per epoch with train.seed), samples grpo.num_generations completions of each
// in one batch with the KV cache through the training model (model::sample_completions), scores
// them with the rewards, computes the group advantages and lays the prompt + completion rows out
// as the run's micro-batches (train.batch_size rows each, labels on the completion tokens only,
// the rows' advantages, masks and, with num_iterations > 1, old log-probabilities in
// data::Batch::rollout). Each completion's sampler draws come from its own generator, seeded from
// train.seed, the generation batch's index in the prompt order and the completion's row in the
// generation batch, so a resume (which restores the prompt order) continues the same sequence
// and any rank layout samples the same completions. Data parallel: every rank takes the same
// generation batch from the prompt order and samples and scores its share of the prompts (rank
// r the r-th of world equal parts, whole groups); the rewards are gathered so that every rank
// computes the advantages and the logs over the whole generation batch, as one process does.
#pragma once

#include <ATen/Tensor.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/data/prompt_dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/distributed/distributed.h"
#include "q4/trainer/plan/component_plans.h"
#include "q4/trainer/rewards/rewards.h"
#include "q4/trainer/step/batch_source.h"

namespace q4::trainer {

// One sampled completion with its reward, for the run log.
struct RolloutSample {
  std::string prompt;      // the prompt as the data gives it
  std::string completion;  // the text (special tokens stripped)
  double reward = 0;       // the total
  bool truncated = false;  // no stop id within grpo.max_completion_length
};

class RolloutSource final : public BatchSource {
 public:
  // Checks every prompt before anything samples: its length against train.seq_len
  // (check_grpo_prompt_length) and its record against the rewards (check_reward_example);
  // ConfigError naming its file:line. `order`'s examples are the prompts (RunSetup::prompts), one
  // batch per generation batch (with `comm`, every rank's prompts). Borrows everything; `comm`
  // (data parallel) may be null.
  RolloutSource(RolloutPlan plan, model::Qwen3Model& model, const at::Device& device,
                const data::Tokenizer& tokenizer, const std::vector<data::PromptRecord>& prompts,
                const std::vector<std::string>& origins, data::Batcher& order, Rewards& rewards,
                DistComm* comm = nullptr);

  // The next micro-batch; a new generation batch when the current one has served
  // grpo.num_iterations passes. RewardError: a reward could not be computed (the prompt order is
  // then as it was before the generation batch, so a checkpoint resumes with it); data parallel:
  // on every rank, with the first failing rank's message.
  data::Batch next() override;
  // Data parallel: this rank's micro-batches only (its share of the generation batch).
  bool per_rank() const override { return comm_ != nullptr; }

  // The newest generation batch's TRL logs (grpo_rollout_stats, over every rank's completions)
  // and a few of its completions (the first completion of each of this rank's first `kSamples`
  // prompts).
  static constexpr int64_t kSamples = 3;
  const std::vector<std::pair<std::string, double>>& stats() const { return stats_; }
  const std::vector<RolloutSample>& samples() const { return samples_; }
  // Generation batches sampled so far (all sessions: the prompt order's count).
  int64_t generations() const;
  // Whether the next micro-batch starts a new generation batch.
  bool at_generation_boundary() const;

 private:
  void generate();
  // Scores `inputs`; RewardError on every rank when any rank's rewards fail (the order restored).
  RewardScores score(const std::vector<RewardInput>& inputs, const data::BatcherState& before);
  // The micro-batches of `rows` completions (prompt index, tokens, per-token sampling entropies)
  // with their advantages.
  void build_micro_batches(const std::vector<int64_t>& prompt_of_row,
                           const std::vector<std::vector<int64_t>>& completions,
                           const std::vector<std::vector<float>>& entropies,
                           const std::vector<bool>& truncated, const at::Tensor& advantages);

  const RolloutPlan p_;
  model::Qwen3Model& model_;
  at::Device device_;
  const data::Tokenizer& tok_;
  const std::vector<data::PromptRecord>& prompts_;
  const std::vector<std::string>& origins_;
  std::vector<nlohmann::json> fields_;  // each prompt's record fields, for the rewards
  data::Batcher& order_;
  Rewards& rewards_;
  DistComm* comm_;
  std::vector<data::Batch> micro_;  // the current generation batch's micro-batches
  size_t next_micro_ = 0;           // the next one to serve
  int64_t passes_ = 0;              // passes over micro_ served (grpo.num_iterations per batch)
  std::vector<std::pair<std::string, double>> stats_;
  std::vector<RolloutSample> samples_;
};

}  // namespace q4::trainer
