// Distillation from a full-precision teacher (train.objective: distill;
// docs/trainer.md#distillation): the student learns the teacher's next-token distribution on the
// supervised positions. The divergence is computed inside the student's chunked loss
// (model::LossTerm), a chunk of rows at a time, from the teacher's logits for the same rows (its
// own lm_head on its final hidden states, online) or from its stored top-K log-probabilities
// (offline), so that neither model's [tokens, vocab] logits ever exist.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
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

struct DivergenceOptions {
  Divergence kind = Divergence::kForwardKl;
  double temperature = 1.0;
};

// One chunk's divergence between the teacher's and the student's distributions at temperature T
// (softmax(logits / T)), summed over the rows where `valid` is true and scaled by T^2 so that its
// gradient keeps the size of the cross-entropy's whatever T (Hinton et al.):
//   forward_kl: T^2 * sum_v p_t (log p_t - log p_s), gradient T * (p_s - p_t)
//   reverse_kl: T^2 * sum_v p_s (log p_s - log p_t), gradient T * p_s * (log p_s - log p_t - KL)
// student_logits (n, V) fp32, overwritten: with the gradient with respect to the student's
// logits when `want_grad` (0 on invalid rows). teacher_logits (n, V), any floating dtype.
// Returns () fp32.
at::Tensor divergence_chunk(at::Tensor& student_logits, const at::Tensor& teacher_logits,
                            const at::Tensor& valid, const DivergenceOptions& opt, bool want_grad);

// The offline form: the teacher known by its top K tokens per row, `ids` (n, K) int64 and their
// log-probabilities `logprobs` (n, K) under its full distribution at temperature T, q_k. Forward
// KL over K + 1 outcomes, the K tokens and "any other token" (the teacher's remaining mass
// q_r = 1 - sum_k q_k against the student's s_r = 1 - sum_k p_s[ids_k]):
//   T^2 * (sum_k q_k (log q_k - log p_s[ids_k]) + q_r (log q_r - log s_r)),
// gradient T * (p_s - target), target q_k on the K tokens and p_s * q_r / s_r elsewhere. So the
// student is not pushed to put the tail's mass on the K tokens (renormalizing the top K would),
// and with K = V this is divergence_chunk's forward_kl exactly.
at::Tensor topk_divergence_chunk(at::Tensor& student_logits, const at::Tensor& ids,
                                 const at::Tensor& logprobs, const at::Tensor& valid,
                                 double temperature, bool want_grad);

// A distillation micro-batch's loss through the student's chunked loss with `term`, and its
// logged values: "distill_ce" and "distill_divergence" (each summed over the supervised tokens).
ObjectiveOutput distillation_output(model::Qwen3Model& model, const MicroBatch& micro,
                                    const model::LossTerm& term);

// Online distillation: `teacher` (frozen, on the student's device) runs each micro-batch's
// forward without autograd; loss = alpha * divergence + (1 - alpha) * CE, per supervised token.
// Logs "distill_ce" and "distill_divergence" (each per supervised token). Its held-out loss is
// the student's cross-entropy (Objective::evaluate).
class Distillation final : public Objective {
 public:
  Distillation(const DistillConfig& c, std::unique_ptr<model::Qwen3Model> teacher);
  std::string name() const override { return "distill"; }
  ObjectiveNeeds needs() const override { return ObjectiveNeeds{}; }
  int64_t units(const data::Batch& batch) const override { return batch.supervised_tokens; }
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override;
  ObjectiveOutput evaluate(model::Qwen3Model& model, const MicroBatch& micro) override;
  const model::Qwen3Model& teacher() const { return *teacher_; }

 private:
  double alpha_;
  DivergenceOptions div_;
  std::unique_ptr<model::Qwen3Model> teacher_;
  at::Tensor lm_head_;  // the teacher's output projection (V, H_teacher), compute dtype
};

// The teacher (`teacher`: distill.teacher, distill.teacher_config; plan/setup.h teacher_spec)
// loaded beside a student computing with `student` options: same device and compute dtype, nothing
// trainable, its vocabulary `vocab_size` (the student's). Errors name the key.
std::unique_ptr<model::Qwen3Model> load_teacher(const FrozenModelSpec& teacher,
                                                const model::ModelOptions& student,
                                                int64_t vocab_size, std::ostream& out);

// ---------------------------------------------------------------- offline: the top-K file
//
// distill.topk_file (docs/trainer.md#offline-distillation), a .dat container with
//   topk.ids             int32 (S, K)  the teacher's K most likely next tokens at every
//   topk.logprobs        fp32 (S, K)   supervised position of every training example, in example
//                                      order then position order, and their log-probabilities
//                                      at topk.temperature (most likely first)
//   topk.example_offsets int64 (E + 1) example e's rows are [offsets[e], offsets[e + 1])
//   topk.example_hashes  int64 (E)     FNV-1a of each example's tokens and labels
//   topk.vocab_size      int64 (1)
//   topk.temperature     fp64 (1)      distill.temperature when written; training must use it
// "Training examples" are the batcher's (after data.eval_fraction and truncation): the file is
// refused unless they are the same, example by example.

// 64-bit FNV-1a of an example's input ids then labels.
int64_t example_hash(const data::Example& e);

// For each flat (B * T) position of `batch`: the file row holding the teacher's prediction of the
// next token there, or -1 where that token is not supervised. `offsets` as in the file.
std::vector<int64_t> topk_rows_of_batch(const data::Batch& batch,
                                        const std::vector<data::Example>& examples,
                                        const std::vector<int64_t>& offsets);

// `q4train --write-teacher-topk`: runs distill.teacher over the training examples of `c` once and
// writes distill.topk_file (K = distill.topk). An existing file is an error unless `overwrite`.
int run_write_teacher_topk(const Config& c, bool overwrite, std::ostream& out, std::ostream& err);

// The teacher as its top-K file, checked against the training examples it must describe.
class TopkTeacher {
 public:
  TopkTeacher(const std::string& path, const std::vector<data::Example>& examples,
              int64_t vocab_size, double temperature);
  int64_t k() const { return ids_.size(1); }
  const at::Tensor& ids() const { return ids_; }            // (S, K) int32, host
  const at::Tensor& logprobs() const { return logprobs_; }  // (S, K) fp32, host
  const std::vector<int64_t>& offsets() const { return offsets_; }

 private:
  // Every row finite, <= 0 and of probability mass <= 1 (fp32 tolerances); else an input error
  // naming the file, the row, its example and line.
  void check_logprobs(const std::string& path, const std::vector<data::Example>& examples) const;

  at::Tensor ids_, logprobs_;
  std::vector<int64_t> offsets_;
};

// Offline distillation: forward KL against the top-K file's teacher (topk_divergence_chunk), the
// rows of each micro-batch looked up by its examples; otherwise as Distillation.
class OfflineDistillation final : public Objective {
 public:
  OfflineDistillation(const DistillConfig& c, std::unique_ptr<TopkTeacher> teacher,
                      const data::Batcher& train);
  std::string name() const override { return "distill_topk"; }
  ObjectiveNeeds needs() const override { return ObjectiveNeeds{}; }
  int64_t units(const data::Batch& batch) const override { return batch.supervised_tokens; }
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override;
  ObjectiveOutput evaluate(model::Qwen3Model& model, const MicroBatch& micro) override;

 private:
  double alpha_, temperature_;
  std::unique_ptr<TopkTeacher> teacher_;
  const data::Batcher& train_;
};

}  // namespace q4::trainer
