// Evaluation during a run (docs/trainer.md#evaluation, docs/design.md#trainer-components): the
// validation loss over the held-out examples (one pass without gradients, batched like training
// without shuffling, through the run's objective) with the best value so far, and the answers
// of the model to eval.prompts (greedy generation in the chat template). Rank 0 only: every rank
// holds the same model and nothing here is collective.
#pragma once

#include <cstdint>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/plan/component_plans.h"

namespace q4::trainer {

struct EvalAnswer {
  std::string prompt;
  std::string answer;
  std::vector<int64_t> tokens;
  bool stopped = false;
};

struct Validation {
  double loss = 0;     // the objective's mean over every held-out example (CE: per token)
  int64_t tokens = 0;  // units it averages (CE: supervised tokens)
  double ms = 0;
  // The objective's logged values over the held-out examples, each a mean over the units
  // (preference: rewards/accuracies, ...); metrics.jsonl has them as eval_<name>.
  std::vector<std::pair<std::string, double>> values;
  std::string values_line() const;  // "rewards/accuracies 0.9500, ..." ("" without values)
};

// The model's answers to `plan.prompts` (system prompt data.system_prompt), at most
// max_new_tokens each, stopping at <|im_end|> or <|endoftext|>. Ids past the tokenizer show as
// <id:N>.
std::vector<EvalAnswer> generate_answers(model::Qwen3Model& model, const data::Tokenizer& tok,
                                         const EvalPlan& plan);

class Evaluator {
 public:
  // `leader`: rank 0 (the other ranks evaluate nothing).
  Evaluator(EvalPlan plan, bool leader);

  // The model, tokenizer and objective (borrowed) and the held-out batcher (owned; null: no
  // validation).
  void attach(model::Qwen3Model& model, const data::Tokenizer* tok, Objective& objective,
              std::unique_ptr<data::Batcher> validation);

  bool has_validation() const { return val_batcher_ != nullptr; }
  int64_t validation_examples() const { return val_batcher_ ? val_batcher_->num_examples() : 0; }
  // One pass over the held-out examples (nullopt: none, or not rank 0); the summed loss stays
  // on the device until the end (one host read). Noted as the latest (and maybe best) value.
  // A stop signal (signals.h) ends the pass before its next batch: nullopt, nothing noted (a
  // loss over part of the examples would not compare with the others).
  std::optional<Validation> validation_loss(int64_t step);
  // A validation loss of `step` (from a resumed run's metrics file, or just measured).
  void note_validation(double loss, int64_t step);
  std::optional<double> last_validation() const { return last_val_; }
  double best_validation() const { return best_val_; }
  int64_t best_validation_step() const { return best_val_step_; }

  // The answers to eval.prompts (empty without prompts, or not rank 0).
  std::vector<EvalAnswer> answer_prompts();

 private:
  const EvalPlan plan_;
  bool leader_;
  model::Qwen3Model* model_ = nullptr;
  const data::Tokenizer* tok_ = nullptr;
  Objective* objective_ = nullptr;
  std::unique_ptr<data::Batcher> val_batcher_;
  data::BatcherState val_start_;  // its state before the first batch
  std::optional<double> last_val_;
  double best_val_ = std::numeric_limits<double>::infinity();
  int64_t best_val_step_ = 0;
};

}  // namespace q4::trainer
