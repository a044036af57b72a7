// Loaded weights must be finite: a NaN/Inf in a raw tensor (embedding, norm) or the NaN code of an
// E4M3 block scale (0x7F/0xFF; E4M3FN has no Inf) is an input error naming the file entry, caught
// at load instead of surfacing later as skipped steps, a NaN export or a nameless quantizer error.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "q4/model/dat_file.h"

namespace q4::model {

// Throws c10::Error "<where>: non-finite value <v> at element [i, j] (...)" when `t` (stored as
// `type`) holds a NaN/Inf float, or a NaN or negative (sign bit) E4M3 scale. Packed E2M1 and
// integer entries always pass.
void check_finite_weight(const at::Tensor& t, ElemType type, const std::string& where);

}  // namespace q4::model
