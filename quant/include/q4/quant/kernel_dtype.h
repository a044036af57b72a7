// The kernels' dtype code (DType of q4/quant/cuda_common.h) of a tensor dtype: the one mapping
// that the .cpp callers of the quant, model and optim CUDA launchers use. CUDA builds only.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/Exception.h>

#include "q4/quant/cuda_common.h"

namespace q4::quant::cuda {

// fp32, fp16 or bf16; any other dtype is an error "<what>: unsupported dtype ...".
inline DType dtype_of(c10::ScalarType t, const char* what) {
  switch (t) {
    case c10::ScalarType::Float:
      return DType::kF32;
    case c10::ScalarType::Half:
      return DType::kF16;
    case c10::ScalarType::BFloat16:
      return DType::kBF16;
    default:
      TORCH_CHECK(false, what, ": unsupported dtype ", t, " (expected fp32, fp16 or bf16)");
  }
}

}  // namespace q4::quant::cuda
