// The words of the export check (output.verify_export): which differences between the reloaded
// export and the trained model are the expected effect of re-quantization and which are a
// failure. A trained NVFP4 weight reloads as dequantize(quantize(master)), which is its forward
// weight fake_quant(master) exactly, so a reload normally matches bit for bit; a small share of
// a trained tensor's elements that differs is still reported as re-quantization (blocks that
// quantize(dequantize(q)) moves, about 0.1-0.5%: docs/design.md, "NVFP4 arithmetic"), and
// anything else that differs (a raw or frozen tensor, a shape, a missing tensor, a large share of
// a tensor) is a failure.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace q4::trainer {

struct ExportCheckReport {
  std::vector<std::string> lines;     // what to print, one line each (no '\n')
  std::vector<std::string> failures;  // the entries of `differ` that are failures
};

// `differ`: Qwen3Model::compare_forward_weights' entries ("name (k of n elements)", "name
// (shape)", "name (missing)"); `tensors`: parameters compared; `requantized(name)`: whether the
// parameter is a trained NVFP4 tensor (the export re-quantizes it).
ExportCheckReport summarize_export_check(const std::vector<std::string>& differ, int64_t tensors,
                                         const std::function<bool(const std::string&)>& requantized,
                                         double seconds);

// The most elements of a re-quantized tensor of `elements` elements that may differ and still be
// the expected effect of re-quantization (see export_check.cpp).
int64_t expected_requantization_diff(int64_t elements);

}  // namespace q4::trainer
