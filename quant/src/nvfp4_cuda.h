// Host launchers of the NVFP4 CUDA kernels (nvfp4_kernels.cu). Raw pointers, sizes and a stream;
// no torch types, so the .cu files stay free of torch headers. Tensors are contiguous and viewed
// as n_blocks consecutive 16-element blocks (row-major [r, c] with c % 16 == 0). Each launcher
// returns the launch status; the caller (nvfp4.cpp) checks it with check_cuda (cuda_common.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "q4/quant/block_rule.h"
#include "q4/quant/cuda_common.h"

namespace q4::quant::cuda {

// x: (n_blocks*16) of `kind` -> qdata (n_blocks*8) uint8, scale (n_blocks) uint8 E4M3 bits.
// *nonfinite_flag (device int32, zeroed by the caller) is set to 1 if x has a NaN/Inf. `rule`
// picks each block's scale (block_rule.h), as in every launcher that quantizes.
cudaError_t launch_quantize_nvfp4(const void* x, DType kind, int64_t n_blocks, uint8_t* qdata,
                                  uint8_t* scale, int32_t* nonfinite_flag, BlockRule rule,
                                  cudaStream_t stream);

// qdata (n_blocks*8), scale (n_blocks) -> out (n_blocks*16) of `kind`.
cudaError_t launch_dequantize_nvfp4(const uint8_t* qdata, const uint8_t* scale, int64_t n_blocks,
                                    void* out, DType kind, cudaStream_t stream);

// Fused dequantize(quantize(w)): w and out (n_blocks*16) of `kind`; one read, one write.
// A block with NaN/Inf comes out all NaN; nonfinite_flag may be null (no check).
cudaError_t launch_fake_quant_nvfp4(const void* w, void* out, DType kind, int64_t n_blocks,
                                    int32_t* nonfinite_flag, BlockRule rule, cudaStream_t stream);

// The same with the output in `out_kind`: the pairs (k, k), (fp16, bf16) and (bf16, fp16)
// (equal widths); other pairs return cudaErrorInvalidValue.
cudaError_t launch_fake_quant_nvfp4_cast(const void* w, DType kind, void* out, DType out_kind,
                                         int64_t n_blocks, int32_t* nonfinite_flag, BlockRule rule,
                                         cudaStream_t stream);

}  // namespace q4::quant::cuda
