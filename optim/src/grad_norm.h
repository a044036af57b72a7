// The gradient norm (grad_norm.cpp): the global sum of squares the step clips with and guards
// against non-finite gradients, shared by PackedAdamW::step and the in-backward steps (adamw.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace q4::optim::detail {

// Squared global norm over grads (undefined entries skipped), combined in double. `parts`
// (empty, or one per gradient): CUDA partial rows already taken (gradient_sumsq_parts), which
// take the place of the launch for that gradient; the rows keep their order, so the sum is the
// same bits either way.
double global_sumsq(const std::vector<at::Tensor>& grads, int64_t chunk_elems, Scratch& s,
                    const std::vector<at::Tensor>& parts);

#if Q4_WITH_CUDA
// The kernels' dtype code (cuda_launch.h) of an fp32/fp16/bf16 scalar type.
int cuda_dtype(at::ScalarType t);
#endif

}  // namespace q4::optim::detail
