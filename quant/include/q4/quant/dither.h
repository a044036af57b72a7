// Dithered NVFP4 masters (docs/design.md#dithered-masters): a weight that sits exactly on its
// NVFP4 grid point (a master loaded from an NVFP4 file) must travel half a code spacing before the
// straight-through quantizer's output changes, so small fine-tuning updates round away. Moving
// every value uniformly inside its own rounding cell keeps fake_quant(w) unchanged while an update
// d then flips a code with probability proportional to d (a dithered quantizer). Runs once, at
// load: vectorized ATen ops on w's device, random numbers from a CPU generator (the same values
// on every device).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>

#include "q4/quant/block_rule.h"

namespace q4::quant {

// What dither_nvfp4 did, in 16-element blocks and elements.
struct DitherStats {
  int64_t blocks = 0;           // blocks of w
  int64_t blocks_dithered = 0;  // blocks whose values moved (the rest kept w's values)
  int64_t elements_moved = 0;   // elements whose value differs from w's
};

// w (r, c) fp32/fp16/bf16, c % 16 == 0, finite (else an error naming `name`). Returns w's values
// moved uniformly inside their NVFP4 rounding cells under `rule`, in w's dtype and device:
// - the cell of an element is the interval the quantizer rounds to its code under the block's
//   scale (the thresholds of numerics::e2m1_threshold, ties away from zero as the quantizer
//   rounds them); the zero code's cell is (-0.25 s, 0.25 s), both signs;
// - the element(s) at the block's largest magnitude keep their values and no other exceeds it,
//   so the block's scale candidates are unchanged (max6: the scale, by construction);
// - every block is checked with the fake quantizer itself: a candidate block whose
//   fake_quant differs from w's (a value rounded by the dtype onto a cell's boundary, or a
//   4-over-6 block whose scale choice the moved values would change) is drawn again, up to
//   kDitherRounds times, then keeps w's values. So fake_quant(result) == fake_quant(w) element
//   for element (as values: a zero weight may change sign, -0 for +0);
// - blocks whose scale is 0 keep their values.
// Deterministic in (w, seed, rule).
at::Tensor dither_nvfp4(const at::Tensor& w, uint64_t seed, const std::string& name = "tensor",
                        BlockRule rule = BlockRule::kMax6, DitherStats* stats = nullptr);

// Draws per block before it keeps its values (rejection sampling: each accepted block is
// uniform over its cells restricted to the draws the rule leaves unchanged).
inline constexpr int kDitherRounds = 16;

}  // namespace q4::quant
