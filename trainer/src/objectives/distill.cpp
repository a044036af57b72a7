// Distillation: the divergences (computed on one chunk of rows at a time) and the online
// objective; see distill.h.
#include "q4/trainer/objectives/distill.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <limits>
#include <ostream>

#include "q4/model/fused_divergence.h"
#include "q4/model/hf_interop.h"
#include "q4/trainer/plan/setup.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

// (n, 1) fp32: T on valid rows, 0 on the others (the gradient's factor).
at::Tensor row_factor(const at::Tensor& valid, double t) {
  return valid.to(at::kFloat).mul(t).unsqueeze(1);
}

// In place: x (n, V) fp32 -> log_softmax(x / t) along the rows.
void log_softmax_at_(at::Tensor& x, double t) {
  if (t != 1.0) x.div_(t);
  x.sub_(at::logsumexp(x, 1, /*keepdim=*/true));
}

}  // namespace

at::Tensor divergence_chunk(at::Tensor& z, const at::Tensor& teacher_logits,
                            const at::Tensor& valid, const DivergenceOptions& opt, bool want_grad) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat &&
                  teacher_logits.sizes() == z.sizes() && valid.dim() == 1 &&
                  valid.size(0) == z.size(0),
              "divergence_chunk: expected fp32 student logits (n, V), teacher logits of the same "
              "shape and valid (n), got ",
              z.sizes(), ", ", teacher_logits.sizes(), ", ", valid.sizes());
  const double t = opt.temperature;
  const at::Tensor vf = valid.to(at::kFloat);
  at::Tensor lt = teacher_logits.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
  log_softmax_at_(lt, t);  // log p_t
  log_softmax_at_(z, t);   // log p_s
  at::Tensor kl;           // (n) per-row divergence
  if (opt.kind == Divergence::kForwardKl) {
    const at::Tensor pt = lt.exp();
    kl = lt.sub_(z).mul_(pt).sum(1);  // sum p_t (log p_t - log p_s)
    if (want_grad) z.exp_().sub_(pt).mul_(row_factor(valid, t));
  } else {
    const at::Tensor ps = z.exp();
    at::Tensor d = lt.neg_().add_(z);  // log p_s - log p_t
    kl = (ps * d).sum(1);
    if (want_grad) z.copy_(d.sub_(kl.unsqueeze(1)).mul_(ps).mul_(row_factor(valid, t)));
  }
  return kl.mul_(vf).sum().mul_(t * t);
}

at::Tensor topk_divergence_chunk(at::Tensor& z, const at::Tensor& ids, const at::Tensor& logprobs,
                                 const at::Tensor& valid, double temperature, bool want_grad) {
  TORCH_CHECK(z.dim() == 2 && z.scalar_type() == at::kFloat && ids.dim() == 2 &&
                  ids.size(0) == z.size(0) && ids.scalar_type() == at::kLong &&
                  logprobs.sizes() == ids.sizes() && valid.dim() == 1 && valid.size(0) == z.size(0),
              "topk_divergence_chunk: expected fp32 student logits (n, V), int64 ids and "
              "log-probabilities (n, K) and valid (n), got ",
              z.sizes(), ", ", ids.sizes(), " ", c10::toString(ids.scalar_type()), ", ",
              logprobs.sizes(), ", ", valid.sizes());
  const double t = temperature;
  const at::Tensor lq = logprobs.to(at::kFloat);  // log q_k, the teacher's at T
  const at::Tensor q = lq.exp();
  log_softmax_at_(z, t);                                 // log p_s
  at::Tensor kl = (q * (lq - z.gather(1, ids))).sum(1);  // (n): the K tokens' part
  // The tail ("any other token"): the teacher's remaining mass q_r against the student's s_r.
  // With K = V there is none (q_r is rounding noise and s_r an empty sum).
  const bool tail = ids.size(1) < z.size(1);
  at::Tensor ratio;  // (n, 1): q_r / s_r, the factor of the student's own tail in the target
  if (tail) {
    const at::Tensor qr = (1.0 - q.sum(1)).clamp_min_(0.0);
    at::Tensor masked = z.clone();
    masked.scatter_(1, ids, -std::numeric_limits<float>::infinity());
    // log s_r; bounded so that a student whose tail underflowed gives a large, finite term.
    const at::Tensor lsr = at::logsumexp(masked, 1).clamp_min_(-80.0);
    masked.reset();
    const at::Tensor has = qr.gt(0.0);
    const at::Tensor log_ratio = qr.clamp_min(1e-30).log() - lsr;
    kl.add_(at::where(has, qr * log_ratio, at::zeros_like(qr)));
    ratio = at::where(has, log_ratio.exp(), at::zeros_like(qr)).unsqueeze(1);
  }
  if (want_grad) {
    // d/dz = T * (p_s - target): target q_k on the K tokens, p_s * q_r / s_r on the others.
    z.exp_();  // p_s
    const at::Tensor top = z.gather(1, ids) - q;
    if (tail) z.mul_(1.0 - ratio);
    z.scatter_(1, ids, top).mul_(row_factor(valid, t));
  }
  return (kl * valid.to(at::kFloat)).sum().mul_(t * t);
}

ObjectiveOutput distillation_output(model::Qwen3Model& model, const MicroBatch& micro,
                                    const model::LossTerm& term) {
  const model::LossOutput lo = model.loss(micro.inputs, &term);
  ObjectiveOutput out;
  out.loss_sum = lo.loss_sum;
  out.logged = {{"distill_ce", lo.ce_sum}, {"distill_divergence", lo.term_sum}};
  log_router_aux_loss(lo, &out);
  return out;
}

Distillation::Distillation(const DistillConfig& c, std::unique_ptr<model::Qwen3Model> teacher)
    : alpha_(c.alpha), div_{c.divergence, c.temperature}, teacher_(std::move(teacher)) {
  const std::string head = teacher_->tied() ? "model.embed_tokens.weight" : "lm_head.weight";
  lm_head_ = teacher_->parameter(head).master;
}

ObjectiveOutput Distillation::compute(model::Qwen3Model& model, const MicroBatch& micro) {
  at::Tensor hidden;  // the teacher's final hidden states, (B * T, H_teacher)
  {
    at::NoGradGuard no_grad;
    hidden = teacher_->hidden_states(micro.inputs);
    hidden = hidden.reshape({-1, hidden.size(-1)});
  }
  at::Tensor rows_hidden;  // the supervised rows' hidden states, in the student loss's order
  model::LossTerm term;
  term.weight = alpha_;
  term.prepare = [&](const at::Tensor& rows) { rows_hidden = hidden.index_select(0, rows); };
  const auto teacher_logits = [&](int64_t row_begin, int64_t n) {
    return at::matmul(rows_hidden.narrow(0, row_begin, n), lm_head_.t());
  };
  term.chunk = [&](at::Tensor& z, const at::Tensor& valid, int64_t row_begin, bool want_grad) {
    return divergence_chunk(z, teacher_logits(row_begin, z.size(0)), valid, div_, want_grad);
  };
  term.fused = [&](at::Tensor& z, const at::Tensor& labels, int64_t row_begin, bool want_grad) {
    if (!model::fused_distill_applies(z, labels)) return model::LossRows{};
    return model::fused_distill_xent_(z, labels, teacher_logits(row_begin, z.size(0)),
                                      div_.kind == Divergence::kReverseKl, div_.temperature,
                                      alpha_, want_grad);
  };
  return distillation_output(model, micro, term);
}

ObjectiveOutput Distillation::evaluate(model::Qwen3Model& model, const MicroBatch& micro) {
  return SupervisedCrossEntropy().compute(model, micro);
}

std::unique_ptr<model::Qwen3Model> load_teacher(const FrozenModelSpec& teacher,
                                                const model::ModelOptions& student,
                                                int64_t vocab_size, std::ostream& out) {
  return load_frozen_model(teacher, student, vocab_size, out);
}

}  // namespace q4::trainer
