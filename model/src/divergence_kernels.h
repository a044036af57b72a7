// Host launchers of the fused distillation loss kernels (divergence_kernels.cu): per logit row,
// the cross-entropy, a divergence from the teacher and the gradient of their mix written over
// the row, in one kernel (docs/model.md#fused-divergence). Raw pointers, sizes and a stream, no
// torch types; each returns the launch status, which fused_divergence.cpp checks with check_cuda.
// All tensors contiguous; labels outside [0, V) mark rows that give 0 and a zero gradient.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "q4/quant/cuda_common.h"

namespace q4::model::cuda {

using quant::cuda::DType;

// Student logits (rows, V) and teacher logits (rows, V), both `dt`; labels (rows) int64.
// ce_rows[r] = CE of row r at temperature 1; term_rows[r] = T^2 * KL(p_t || p_s) (or, reverse,
// KL(p_s || p_t)) with p = softmax(logits / T); both fp32. With want_grad the student's row is
// overwritten by d((1 - weight) * CE + weight * term)/d(logits), rounded to `dt`.
cudaError_t launch_distill_xent(void* logits, const void* teacher, const int64_t* labels,
                                float* ce_rows, float* term_rows, int64_t rows, int64_t V,
                                bool reverse, double temperature, double weight, bool want_grad,
                                DType dt, cudaStream_t stream);

// The same against a teacher known by its top K per row: ids (rows, K) int64 in [0, V), distinct
// within a row, and their log-probabilities at T, logprobs (rows, K) fp32; the term is
// topk_divergence_chunk's forward KL over the K tokens and the remaining mass (trainer's
// distill.h). Needs topk_distill_smem_bytes(V, K) <= kTopkSmemLimit (else cudaErrorInvalidValue).
constexpr size_t kTopkSmemLimit = 47 * 1024;  // dynamic shared memory without an opt-in
size_t topk_distill_smem_bytes(int64_t V, int64_t K);
cudaError_t launch_topk_distill_xent(void* logits, const int64_t* ids, const float* logprobs,
                                     const int64_t* labels, float* ce_rows, float* term_rows,
                                     int64_t rows, int64_t V, int64_t K, double temperature,
                                     double weight, bool want_grad, DType dt, cudaStream_t stream);

}  // namespace q4::model::cuda
