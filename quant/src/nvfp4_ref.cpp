// Scalar reference of the NVFP4 codec (docs/design.md#nvfp4-arithmetic): the readable definition
// that the vectorized CPU path and the CUDA kernels must reproduce bit-exactly. E4M3 encoding here
// is a brute-force nearest search over all finite codes (ties to the even code), deliberately
// independent of the bit tricks used by the fast paths. The 4-over-6 block rule (BlockRule) is
// written out here as well. Per-element loops: small inputs only.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "q4/quant/nvfp4.h"

namespace q4::quant {
namespace {

constexpr float kE2m1Values[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
// |d| >= kE2m1Thresholds[i] selects code i + 1 (ties go away from zero).
constexpr float kE2m1Thresholds[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};

void check_float_matrix_ref(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.dim() == 2, fn, ": expected a 2-D tensor [rows, cols], found ", x.dim(),
              "-D with shape ", x.sizes());
  TORCH_CHECK(x.size(1) % kNvfp4BlockSize == 0, fn,
              ": expected cols % 16 == 0, found cols = ", x.size(1));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf ||
                  x.scalar_type() == at::kBFloat16,
              fn, ": expected dtype float32, float16 or bfloat16, found ", x.scalar_type());
}

// Decoded E4M3 scale of a block with amax `amax` whose amax maps to `target` (6 or 4):
// E4M3(clamp(amax / target, 2^-16, 448)).
float block_scale_ref(float amax, float target, uint8_t* bits) {
  *bits =
      e4m3_encode_ref(std::min(std::max(amax / target, 1.52587890625e-05f /* 2^-16 */), 448.0f));
  return e4m3_decode_ref(*bits);
}

// A block's squared error under the decoded scale s: sum over its 16 elements of
// (x - E2M1(clamp(x / (s + 1e-12), -6, 6)) * s)^2, each term in fp64, summed as a pairwise tree
// of adjacent elements ((e0 + e1) + (e2 + e3)) + ..., the one order every path uses.
double block_sq_err_ref(const float* blk, float s) {
  double e[kNvfp4BlockSize];
  for (int64_t i = 0; i < kNvfp4BlockSize; ++i) {
    const float d = std::min(std::max(blk[i] / (s + 1e-12f), -6.0f), 6.0f);
    const float q = e2m1_decode_ref(e2m1_encode_ref(d)) * s;
    const double diff = static_cast<double>(blk[i]) - static_cast<double>(q);
    e[i] = diff * diff;
  }
  for (int64_t w = kNvfp4BlockSize; w > 1; w /= 2) {
    for (int64_t i = 0; i < w / 2; ++i) e[i] = e[2 * i] + e[2 * i + 1];
  }
  return e[0];
}

}  // namespace

float e4m3_decode_ref(uint8_t bits) {
  const bool neg = (bits & 0x80) != 0;
  const int exp = (bits >> 3) & 0xF;
  const int man = bits & 0x7;
  if (exp == 0xF && man == 0x7) return std::numeric_limits<float>::quiet_NaN();
  float mag;
  if (exp == 0) {
    mag = std::ldexp(static_cast<float>(man) / 8.0f, -6);
  } else {
    mag = std::ldexp(1.0f + static_cast<float>(man) / 8.0f, exp - 7);
  }
  return neg ? -mag : mag;
}

uint8_t e4m3_encode_ref(float x) {
  if (std::isnan(x)) return 0x7F;
  // Nearest of the 127 finite non-negative codes 0x00..0x7E (values increase with the code);
  // on a tie the even code wins. Differences are computed in double: exact for these values.
  const double v = x < 0.0f ? 0.0 : static_cast<double>(x);
  int best = 0;
  double best_err = std::fabs(v);
  for (int c = 1; c <= 0x7E; ++c) {
    const double err = std::fabs(v - static_cast<double>(e4m3_decode_ref(static_cast<uint8_t>(c))));
    if (err < best_err || (err == best_err && (c & 1) == 0 && (best & 1) == 1)) {
      best = c;
      best_err = err;
    }
  }
  return static_cast<uint8_t>(best);
}

float e2m1_decode_ref(uint8_t code) {
  const float mag = kE2m1Values[code & 0x7];
  return (code & 0x8) ? -mag : mag;
}

uint8_t e2m1_encode_ref(float d) {
  const float a = std::fabs(d);
  uint8_t code = 0;
  for (float t : kE2m1Thresholds) {
    if (a >= t) ++code;
  }
  if (d < 0.0f) code |= 0x8;
  return code;
}

Nvfp4Tensor quantize_nvfp4_ref(const at::Tensor& x_in, BlockRule rule) {
  check_float_matrix_ref(x_in, "quantize_nvfp4_ref");
  const at::Tensor x = x_in.to(at::kCPU, at::kFloat).contiguous();  // (r, c)
  const int64_t rows = x.size(0), cols = x.size(1), nb = cols / kNvfp4BlockSize;
  at::Tensor qdata = at::empty({rows, cols / 2}, at::kByte);  // (r, c/2)
  at::Tensor scale = at::empty({rows, nb}, at::kByte);        // (r, c/16)
  const float* xp = x.data_ptr<float>();
  uint8_t* qp = qdata.data_ptr<uint8_t>();
  uint8_t* sp = scale.data_ptr<uint8_t>();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* blk = xp + r * cols + b * kNvfp4BlockSize;
      float amax = 0.0f;
      for (int64_t i = 0; i < kNvfp4BlockSize; ++i) {
        TORCH_CHECK(std::isfinite(blk[i]), "quantize_nvfp4_ref: non-finite value ", blk[i], " at [",
                    r, ", ", b * kNvfp4BlockSize + i, "]");
        amax = std::max(amax, std::fabs(blk[i]));
      }
      uint8_t sbits = 0;
      float s = block_scale_ref(amax, 6.0f, &sbits);
      if (rule == BlockRule::kFourOverSix) {
        // 4-over-6: amax -> 4 instead where that scale's error is smaller (ties keep amax -> 6).
        uint8_t bits4 = 0;
        const float s4 = block_scale_ref(amax, 4.0f, &bits4);
        if (block_sq_err_ref(blk, s4) < block_sq_err_ref(blk, s)) {
          sbits = bits4;
          s = s4;
        }
      }
      sp[r * nb + b] = sbits;
      uint8_t* q = qp + r * (cols / 2) + b * (kNvfp4BlockSize / 2);
      for (int64_t i = 0; i < kNvfp4BlockSize; i += 2) {
        const float d0 = std::min(std::max(blk[i] / (s + 1e-12f), -6.0f), 6.0f);
        const float d1 = std::min(std::max(blk[i + 1] / (s + 1e-12f), -6.0f), 6.0f);
        q[i / 2] = static_cast<uint8_t>(e2m1_encode_ref(d0) | (e2m1_encode_ref(d1) << 4));
      }
    }
  }
  return {qdata, scale};
}

at::Tensor dequantize_nvfp4_ref(const at::Tensor& qdata_in, const at::Tensor& scale_in) {
  TORCH_CHECK(qdata_in.dim() == 2 && scale_in.dim() == 2,
              "dequantize_nvfp4_ref: expected 2-D qdata and scale, found ", qdata_in.sizes(),
              " and ", scale_in.sizes());
  TORCH_CHECK(qdata_in.scalar_type() == at::kByte && scale_in.scalar_type() == at::kByte,
              "dequantize_nvfp4_ref: expected uint8 qdata and scale, found ",
              qdata_in.scalar_type(), " and ", scale_in.scalar_type());
  const int64_t rows = qdata_in.size(0), cols = qdata_in.size(1) * 2;
  TORCH_CHECK(scale_in.size(0) == rows && scale_in.size(1) * kNvfp4BlockSize == cols,
              "dequantize_nvfp4_ref: expected scale shape [", rows, ", ", cols / kNvfp4BlockSize,
              "] for qdata ", qdata_in.sizes(), ", found ", scale_in.sizes());
  const at::Tensor qdata = qdata_in.to(at::kCPU).contiguous();
  const at::Tensor scale = scale_in.to(at::kCPU).contiguous();
  at::Tensor out = at::empty({rows, cols}, at::kFloat);  // (r, c)
  const uint8_t* qp = qdata.data_ptr<uint8_t>();
  const uint8_t* sp = scale.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t nb = cols / kNvfp4BlockSize;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < cols; ++j) {
      const uint8_t byte = qp[r * (cols / 2) + j / 2];
      const uint8_t code = (j % 2 == 0) ? (byte & 0xF) : (byte >> 4);
      op[r * cols + j] = e2m1_decode_ref(code) * e4m3_decode_ref(sp[r * nb + j / kNvfp4BlockSize]);
    }
  }
  return out;
}

}  // namespace q4::quant
