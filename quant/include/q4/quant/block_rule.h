// How an NVFP4 block picks its E4M3 scale (docs/design.md#nvfp4-arithmetic, step 1): the
// standard rule maps the block's amax to 6; 4-over-6 also tries amax -> 4 and keeps the scale
// whose dequantized block has the smaller squared error. The choice lives only in the scale
// byte, so files, dequantize and every reader are the same under both rules; only what
// derives a scale from values (quantize, fake-quant) takes the rule. No torch headers: the CUDA
// launchers take it too.
#pragma once

#include <cstdint>

namespace q4::quant {

enum class BlockRule : uint8_t {
  kMax6,        // s = E4M3(amax / 6): the NVFP4 standard
  kFourOverSix  // s = E4M3(amax / 6) or E4M3(amax / 4), the lower block squared error
};

}  // namespace q4::quant
