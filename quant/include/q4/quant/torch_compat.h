// The one place that gates LibTorch APIs that differ between 1.13 (Debian CPU builds, CI) and
// 2.x (GPU hosts). Everything else in the project includes this header instead of testing
// TORCH_VERSION_MAJOR itself.
#pragma once

#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#define Q4_HAS_SDPA 1  // at::scaled_dot_product_attention
#define Q4_HAS_FLOAT8 1  // at::kFloat8_e4m3fn
#else
#define Q4_HAS_SDPA 0
#define Q4_HAS_FLOAT8 0
#endif

// at::_grouped_mm (bf16 grouped GEMM with offsets, differentiable; CUTLASS on sm_90 and newer).
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 9)
#define Q4_HAS_GROUPED_MM 1
#else
#define Q4_HAS_GROUPED_MM 0
#endif

// at::_flash_attention_forward with cumulative sequence lengths (variable-length batches) and
// a differentiable output (its backward is at::_flash_attention_backward). CUDA tensors only.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 4)
#define Q4_HAS_FLASH_VARLEN 1
#else
#define Q4_HAS_FLASH_VARLEN 0
#endif
