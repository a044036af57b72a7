// The distillation loss of one chunk of logit rows in one CUDA kernel (divergence_kernels.cu;
// docs/model.md#fused-divergence): per row the student's cross-entropy, its divergence from the
// teacher at temperature T (scaled by T^2) and the gradient of (1 - w) * CE + w * divergence with
// respect to the student's logits, written over them. No softmax or log-softmax is materialised:
// a first sweep gathers each row's max and sums of exponentials online, a second one (reverse
// KL: a third) forms the value and the gradient. The trainer's ATen divergences
// (trainer/objectives/distill.h) are the reference and the CPU path; a LossTerm's `fused` form
// calls these where *_applies says the inputs allow it.
#pragma once

#include <ATen/core/Tensor.h>

#include "q4/model/qwen3.h"

namespace q4::model {

// CUDA logits (n, V) of fp32, fp16 or bf16, contiguous; labels (n) int64, contiguous, same device.
bool fused_distill_applies(const at::Tensor& logits, const at::Tensor& labels);

// Online distillation: `teacher_logits` (n, V) (read in the logits' dtype). Forward KL
// KL(p_t || p_s) or, `reverse`, KL(p_s || p_t), p = softmax(logits / T); per row T^2 * KL and the
// CE at T = 1, 0 on rows whose label is outside [0, V). With want_grad, `logits` is overwritten
// by d((1 - weight) * CE + weight * T^2 * KL)/d(logits) in its dtype (0 on those rows).
LossRows fused_distill_xent_(at::Tensor& logits, const at::Tensor& labels,
                             const at::Tensor& teacher_logits, bool reverse, double temperature,
                             double weight, bool want_grad);

// The offline form's check: also `ids` (n, K) and the shared memory a row needs (a bit per
// vocabulary entry and K floats: V = 151,936 allows K up to about 7,000).
bool fused_topk_distill_applies(const at::Tensor& logits, const at::Tensor& labels,
                                const at::Tensor& ids);

// Offline distillation from the teacher's top K per row: ids (n, K) int64 in [0, V), distinct
// within a row, and their log-probabilities at T, logprobs (n, K) fp32; the divergence is the
// forward KL over the K tokens and the remaining mass (the trainer's topk_divergence_chunk).
LossRows fused_topk_distill_xent_(at::Tensor& logits, const at::Tensor& labels,
                                  const at::Tensor& ids, const at::Tensor& logprobs,
                                  double temperature, double weight, bool want_grad);

}  // namespace q4::model
