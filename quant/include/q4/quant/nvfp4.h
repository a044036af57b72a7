// NVFP4 codec: E2M1 values with one FP8 E4M3FN scale per 16 consecutive elements of a row.
// The numerics (docs/design.md#nvfp4-arithmetic) are reproduced bit-exactly by every path: the
// scalar `_ref` functions (the readable definition), the vectorized CPU ATen path, and the CUDA
// kernels. Inputs may be fp32, fp16 or bf16; all arithmetic is fp32 (4-over-6's block errors:
// fp64). Everything that derives a scale from values takes the block rule (block_rule.h; default
// the standard max6); dequantize needs none.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

#include "q4/quant/block_rule.h"

namespace q4::quant {

inline constexpr int64_t kNvfp4BlockSize = 16;

// Packed NVFP4 matrix.
struct Nvfp4Tensor {
  at::Tensor qdata;  // (r, c/2) uint8; element 2j in the low nibble, 2j+1 in the high nibble
  at::Tensor scale;  // (r, c/16) uint8; FP8 E4M3FN bits, row-major, not swizzled
};

// ---- scalar reference (the definition; used by tests and as the spec for the fast paths) ----
uint8_t e4m3_encode_ref(float x);     // RNE, x already clamped to [0, 448]; NaN in -> 0x7F
float e4m3_decode_ref(uint8_t bits);  // exponent 0 subnormal m/8*2^-6; only 0x7F/0xFF NaN
uint8_t e2m1_encode_ref(float d);     // d already clamped to [-6, 6]; thresholds of docs/design.md
float e2m1_decode_ref(uint8_t code);  // code 0..15, bit 3 = sign
// x: (r, c) float tensor on CPU, c % 16 == 0. Per-element C++ loops; small inputs only.
Nvfp4Tensor quantize_nvfp4_ref(const at::Tensor& x, BlockRule rule = BlockRule::kMax6);
at::Tensor dequantize_nvfp4_ref(const at::Tensor& qdata, const at::Tensor& scale);  // fp32

// ---- vectorized element codecs (CPU ATen, any shape; also used by other block formats) ----
// s: float32 CPU tensor of finite values in [0, 448] -> uint8 E4M3FN bits, same as
// e4m3_encode_ref element-wise.
at::Tensor e4m3_encode(const at::Tensor& s);
// bits: uint8 tensor (any device) -> float32 values, same as e4m3_decode_ref element-wise.
at::Tensor e4m3_decode(const at::Tensor& bits);

// ---- fast paths (CPU: vectorized ATen; CUDA: fused kernels), dispatched on x.device() ----
// x: (r, c) fp32/fp16/bf16, c % 16 == 0. NaN/Inf in x is an error naming `name`.
Nvfp4Tensor quantize_nvfp4(const at::Tensor& x, const std::string& name = "tensor",
                           BlockRule rule = BlockRule::kMax6);
// quantize_nvfp4(x) written into out.qdata / out.scale (allocated, same device as x), without
// the NaN/Inf check's device->host sync on CUDA (a block with NaN/Inf gets a NaN scale, so it
// dequantizes to NaN). x may be a device_alias (q4/io/pinned.h) of host memory.
void quantize_nvfp4_into(const at::Tensor& x, const Nvfp4Tensor& out,
                         const std::string& name = "tensor", BlockRule rule = BlockRule::kMax6);
// Returns (r, c) in `dtype` on the device of qdata.
at::Tensor dequantize_nvfp4(const at::Tensor& qdata, const at::Tensor& scale,
                            at::ScalarType dtype = at::kFloat);
// dequantize(quantize(w)) in w's dtype without materializing the packed form where a fused
// kernel exists. No autograd.
at::Tensor fake_quant_nvfp4_forward(const at::Tensor& w, const std::string& name = "tensor",
                                    BlockRule rule = BlockRule::kMax6);
// Same values, but on CUDA without the NaN/Inf check's device->host sync (one per call):
// blocks holding NaN/Inf come out NaN instead of raising. CPU: identical to the checked op.
// out_dtype: return the result in this dtype (default w's); on CUDA fp16 <-> bf16 is written by
// the kernel directly (one pass; the values are exact in both). `name` (the parameter) is named
// by the CPU error.
at::Tensor fake_quant_nvfp4_forward_unchecked(
    const at::Tensor& w, std::optional<at::ScalarType> out_dtype = std::nullopt,
    const std::string& name = "tensor", BlockRule rule = BlockRule::kMax6);
// The unchecked fake quantization of w written into `out` (contiguous, w's shape and device,
// fp32/fp16/bf16; on CUDA in the kernel's store where the dtypes allow, else through a cast):
// a kept forward weight refreshed in place (ModelOptions::forward_weights).
void fake_quant_nvfp4_forward_into(const at::Tensor& w, const at::Tensor& out,
                                   const std::string& name = "tensor",
                                   BlockRule rule = BlockRule::kMax6);
// Autograd op: forward = fake_quant_nvfp4_forward(w), backward = identity (straight-through).
// check_finite=false uses the unchecked forward (no device->host sync on CUDA; the training hot
// path relies on the trainer's non-finite guard on loss and gradients instead).
at::Tensor fake_quant_nvfp4(const at::Tensor& w, bool check_finite = true,
                            BlockRule rule = BlockRule::kMax6);

}  // namespace q4::quant
