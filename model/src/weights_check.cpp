// Finiteness check of loaded weight entries (see weights_check.h).
#include "q4/model/weights_check.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include "shape_text.h"

namespace q4::model {
namespace {

std::string index_str(int64_t flat, at::IntArrayRef sizes) {
  std::vector<int64_t> idx(sizes.size());
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 1; d >= 0; --d) {
    idx[d] = sizes[d] > 0 ? flat % sizes[d] : 0;
    flat = sizes[d] > 0 ? flat / sizes[d] : 0;
  }
  return bracketed(idx);
}

}  // namespace

void check_finite_weight(const at::Tensor& t, ElemType type, const std::string& where) {
  if (type == ElemType::kE4M3Scale) {
    const at::Tensor nan = at::eq(at::bitwise_and(t, 0x7F), 0x7F).reshape({-1});
    if (nan.any().item<bool>()) {
      const int64_t i = at::argmax(nan.to(at::kByte)).item<int64_t>();
      TORCH_CHECK(false, where, ": E4M3 block scale is NaN (byte 0x", std::hex,
                  static_cast<int>(t.reshape({-1})[i].item<uint8_t>()), std::dec, ") at element ",
                  index_str(i, t.sizes()),
                  "; the weights file is corrupt or was written from a diverged model");
    }
    // NVFP4 block scales are >= 0 (the sign lives in each 4-bit code); a sign bit means a
    // corrupt file, and the HF layouts cannot carry it.
    const at::Tensor neg = at::ne(at::bitwise_and(t, 0x80), 0).reshape({-1});
    if (!neg.any().item<bool>()) return;
    const int64_t i = at::argmax(neg.to(at::kByte)).item<int64_t>();
    TORCH_CHECK(false, where, ": E4M3 block scale is negative (byte 0x", std::hex,
                static_cast<int>(t.reshape({-1})[i].item<uint8_t>()), std::dec, ") at element ",
                index_str(i, t.sizes()),
                "; block scales must be >= 0, the weights file is corrupt");
  }
  if (!at::isFloatingType(t.scalar_type())) return;
  const at::Tensor bad = at::logical_not(at::isfinite(t)).reshape({-1});
  if (!bad.any().item<bool>()) return;
  const int64_t i = at::argmax(bad.to(at::kByte)).item<int64_t>();
  TORCH_CHECK(false, where, ": non-finite value (", t.reshape({-1})[i].item<double>(),
              ") at element ", index_str(i, t.sizes()),
              "; the weights file is corrupt or was written from a diverged model");
}

}  // namespace q4::model
