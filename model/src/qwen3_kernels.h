// Host launchers of the fused Qwen3 kernels (qwen3_kernels.cu): RMSNorm forward/backward,
// rotate-half RoPE forward/backward, SwiGLU and the loss's softmax cross-entropy. Raw pointers,
// sizes and a stream, no torch types; each returns the launch status, which fused_ops.cpp checks
// with check_cuda (q4/quant/cuda_common.h).
// Tensors are contiguous; RMSNorm rows have n elements with n a multiple of 16 bytes' worth of
// elements and 16-byte-aligned pointers (the caller checks and otherwise takes the ATen path).
// fused_ops.cpp wraps them in autograd functions; the ATen ops in qwen3_ops.cpp are the reference.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "q4/quant/cuda_common.h"

namespace q4::model::cuda {

using quant::cuda::DType;

// y = w * cast(x * rsqrt(mean(x^2) + eps)) per row (HF Qwen3RMSNorm): x, y (rows, n), w (n),
// all `dt`; rstd (rows) fp32 out.
cudaError_t launch_rms_norm_fwd(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                                int64_t n, float eps, DType dt, cudaStream_t stream);

// dx (rows, n) from dy, x, w, rstd. With dw_partial non-null, also per-block partial sums of
// dy * cast(x * rstd) into dw_partial (dw_blocks, n) fp32, dw_blocks =
// rms_norm_bwd_blocks(rows); the caller sums them over dim 0.
int64_t rms_norm_bwd_blocks(int64_t rows);
cudaError_t launch_rms_norm_bwd(const void* dy, const void* x, const void* w, const float* rstd,
                                void* dx, float* dw_partial, int64_t rows, int64_t n, DType dt,
                                cudaStream_t stream);

// Rotate-half RoPE on x (tokens, heads, d) with cos/sin (tokens, d), all `dt`:
// forward y = x * cos + rotate_half(x) * sin; backward (inverse = true) the transpose map.
cudaError_t launch_rope(const void* x, const void* cos, const void* sin, void* y, int64_t tokens,
                        int64_t heads, int64_t d, bool backward, DType dt, cudaStream_t stream);

// SwiGLU h = silu(g) * u over n elements (g, u, h of `dt`, rounded as ATen's two ops round:
// silu to `dt`, then the product). Backward: dg, du from dh, g, u (ATen's formulas, fp32 math).
// Pointers 16-byte aligned when n is a multiple of the vector width (else elementwise).
cudaError_t launch_swiglu_fwd(const void* g, const void* u, void* h, int64_t n, DType dt,
                              cudaStream_t stream);
cudaError_t launch_swiglu_bwd(const void* dh, const void* g, const void* u, void* dg, void* du,
                              int64_t n, DType dt, cudaStream_t stream);

// Softmax cross-entropy of `rows` logit rows (rows, V) of `dt`, labels (rows) int64 on the
// device (outside [0, V): unlabelled): loss_rows[r] = lse(row) - logit[label] in fp32 (0 when
// unlabelled) and, with want_grad, the row overwritten in place by its gradient
// softmax - onehot(label) (0 for an unlabelled row), rounded to `dt`.
cudaError_t launch_softmax_xent(void* logits, const int64_t* labels, float* loss_rows, int64_t rows,
                                int64_t V, bool want_grad, DType dt, cudaStream_t stream);

}  // namespace q4::model::cuda
