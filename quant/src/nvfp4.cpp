// NVFP4 ops: validation, device dispatch, the vectorized CPU path and the straight-through
// autograd function. The CPU path walks row chunks (temporaries stay O(kCpuChunkElems)) and
// uses a handful of ATen passes per chunk: block amax -> scales (E4M3 RNE by int32 bit
// manipulation), one exact fp32 division, an int32 key from the bits of the quotient, one
// table gather that yields the E2M1 code or value, one multiply (4-over-6: the same passes once
// more per candidate scale, and the blocks' fp64 squared errors). CUDA tensors go to the fused
// kernels (nvfp4_kernels.cu).
#include "q4/quant/nvfp4.h"

#include "q4/quant/numerics.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <string>

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "nvfp4_cuda.h"
#include "q4/quant/kernel_dtype.h"
#endif

namespace q4::quant {
namespace {

// Elements per CPU chunk: the fp32/int32 temporaries of one chunk (a few MiB) stay cache-sized.
constexpr int64_t kCpuChunkElems = int64_t{1} << 17;

// E2M1 code from the bits of d: every threshold (0.25 ... 5) has at most 2 mantissa bits, so
// |d| >= t depends only on |d|'s exponent and top 2 mantissa bits. The key (bits >> 21) + 1024
// (arithmetic shift) is mag_key = (exponent << 2 | m2) for d < 0 and 1024 + mag_key for d >= 0,
// so one 2048-entry gather gives the code (or its value) with no clamp: |d| >= 6 lands in code
// 7's keys. -0.0 is first turned into +0.0 (d + 0.0), so the negative keys hold only true
// negatives (tiny ones -> code 8), exactly as `d < 0` in the reference.
constexpr int64_t kKeyShift = 21;
constexpr int64_t kKeyCount = 2048;

struct KeyTables {
  std::array<uint8_t, kKeyCount> code{};
  std::array<float, kKeyCount> value{};
};

const KeyTables& key_tables() {
  static const KeyTables kT = [] {
    KeyTables t;
    for (int64_t k = 0; k < kKeyCount; ++k) {
      const bool neg = k < 1024;
      const uint32_t mag_key = static_cast<uint32_t>(neg ? k : k - 1024);
      uint32_t lo_bits = mag_key << kKeyShift;             // smallest |d| with this key
      if ((lo_bits >> 23) == 0xFF) lo_bits = 0x40C00000u;  // Inf/NaN keys: never hit; use 6.0
      float lo;
      std::memcpy(&lo, &lo_bits, sizeof(lo));
      const uint8_t code = static_cast<uint8_t>(numerics::e2m1_encode(lo) | (neg ? 0x8 : 0x0));
      t.code[k] = code;
      t.value[k] = numerics::e2m1_decode(code);
    }
    return t;
  }();
  return kT;
}

at::Tensor const_tensor(const float* data, int64_t n) {
  return at::from_blob(const_cast<float*>(data), {n}, at::kFloat);
}
at::Tensor const_tensor(const uint8_t* data, int64_t n) {
  return at::from_blob(const_cast<uint8_t*>(data), {n}, at::kByte);
}

// (256) fp32: E4M3FN decode table.
const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> kT = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i) t[i] = numerics::e4m3_decode(static_cast<uint8_t>(i));
    return t;
  }();
  return kT;
}

// (256, 2) fp32: byte -> (E2M1 value of the low nibble, of the high nibble).
const std::array<float, 512>& e2m1_pair_table() {
  static const std::array<float, 512> kT = [] {
    std::array<float, 512> t{};
    for (int b = 0; b < 256; ++b) {
      t[2 * b] = numerics::e2m1_decode(static_cast<uint32_t>(b & 0xF));
      t[2 * b + 1] = numerics::e2m1_decode(static_cast<uint32_t>(b >> 4));
    }
    return t;
  }();
  return kT;
}

bool is_supported_float(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

void check_input(const at::Tensor& x, const char* fn, const std::string& name) {
  TORCH_CHECK(x.defined(), fn, ": tensor '", name, "' is undefined");
  TORCH_CHECK(x.dim() == 2, fn, ": tensor '", name, "' expected 2-D [rows, cols], found ", x.dim(),
              "-D with shape ", x.sizes());
  TORCH_CHECK(x.size(1) % kNvfp4BlockSize == 0, fn, ": tensor '", name,
              "' expected cols % 16 == 0, found shape ", x.sizes());
  TORCH_CHECK(is_supported_float(x.scalar_type()), fn, ": tensor '", name,
              "' expected dtype float32, float16 or bfloat16, found ", x.scalar_type());
  TORCH_CHECK(x.device().is_cpu() || x.device().is_cuda(), fn, ": tensor '", name,
              "' expected a CPU or CUDA tensor, found device ", x.device());
}

[[noreturn]] void fail_nonfinite(const at::Tensor& x, const char* fn, const std::string& name) {
  const at::Tensor bad = at::nonzero(at::logical_not(at::isfinite(x))).cpu();  // (k, 2)
  if (bad.size(0) > 0) {
    const int64_t r = bad[0][0].item<int64_t>(), c = bad[0][1].item<int64_t>();
    TORCH_CHECK(false, fn, ": tensor '", name, "' has a non-finite value (", x[r][c].item<float>(),
                ") at [", r, ", ", c, "]; NaN/Inf weights cannot be NVFP4-encoded");
  }
  TORCH_CHECK(false, fn, ": tensor '", name, "' has a non-finite value; NaN/Inf weights cannot ",
              "be NVFP4-encoded");
}

// E2M1 keys (nb, 16) int32 (see key_tables) of xb (nb, 16) fp32 under the decoded block scales
// s (nb, 1) fp32.
at::Tensor element_keys(const at::Tensor& xb, const at::Tensor& s) {
  at::Tensor d = xb / (s + 1e-12);  // (nb, 16) exact fp32 division
  d.add_(0.0);                      // -0.0 -> +0.0 (IEEE), everything else unchanged
  return at::bitwise_right_shift(d.view(at::kInt), kKeyShift).add_(1024);
}

// E4M3 bits (nb, 1) uint8 of scale_input(amax) for block amaxes a (nb, 1) fp32 (contiguous), with
// the shared scalar codec: one value per 16 elements.
at::Tensor encode_scales(const at::Tensor& a, float (*scale_input)(float)) {
  at::Tensor bits = at::empty(a.sizes(), a.options().dtype(at::kByte));
  const float* ap = a.data_ptr<float>();
  uint8_t* bp = bits.data_ptr<uint8_t>();
  for (int64_t i = 0; i < a.numel(); ++i) bp[i] = numerics::e4m3_encode(scale_input(ap[i]));
  return bits;
}

// Squared error (nb, 1) fp64 of each block of xb (nb, 16) fp32 under its decoded scale s (nb, 1):
// numerics::nvfp4_sq_err per element, summed in numerics::pairwise_sum's order (adjacent pairs).
at::Tensor block_sq_err(const at::Tensor& xb, const at::Tensor& s) {
  const at::Tensor value_of_key = const_tensor(key_tables().value.data(), kKeyCount);
  at::Tensor q = at::index_select(value_of_key, 0, element_keys(xb, s).reshape({-1}));
  q = q.view(xb.sizes()).mul_(s);  // dequantized values, exact in fp32
  const at::Tensor diff = xb.to(at::kDouble) - q.to(at::kDouble);  // exact
  at::Tensor e = diff * diff;                                      // (nb, w), w = 16 ... 1
  for (int64_t w = kNvfp4BlockSize; w > 1; w /= 2) {
    const at::Tensor pairs = e.view({-1, w / 2, 2});
    e = pairs.select(2, 0) + pairs.select(2, 1);
  }
  return e;
}

// 4-over-6 (docs/design.md#nvfp4-arithmetic): where the scale from amax / 4 gives a block a
// smaller squared error than its amax / 6 scale, it replaces that one in bits (nb, 1) uint8 and
// s (nb, 1) fp32. a: block amaxes (nb, 1) fp32, contiguous.
void choose_four_over_six(const at::Tensor& xb, const at::Tensor& a, at::Tensor* bits,
                          at::Tensor* s) {
  const at::Tensor bits4 = encode_scales(a, numerics::nvfp4_scale_input_over4);
  const at::Tensor s4 = e4m3_decode(bits4);
  const at::Tensor use4 = at::lt(block_sq_err(xb, s4), block_sq_err(xb, *s));  // ties: max6
  *bits = at::where(use4, bits4, *bits);
  *s = at::where(use4, s4, *s);
}

// One CPU chunk: xb (nb, 16) fp32 -> scale bits (nb, 1) uint8, scale (nb, 1) fp32, and the
// E2M1 key (nb, 16) int32 of every element (see key_tables). Returns false on NaN/Inf.
bool cpu_chunk_keys(const at::Tensor& xb, BlockRule rule, at::Tensor* bits, at::Tensor* s,
                    at::Tensor* key) {
  // Block amax as a tree of elementwise maxima over column halves (16 -> 8 -> 4 -> 2 -> 1):
  // ATen's reductions over a 16-wide inner dim are several times slower. NaN propagates.
  at::Tensor amax = at::abs(xb);  // (nb, 16), then (nb, 8) ... (nb, 1)
  for (int64_t w = kNvfp4BlockSize / 2; w >= 1; w /= 2) {
    amax = at::maximum(amax.narrow(1, 0, w), amax.narrow(1, w, w));
  }
  if (!at::isfinite(amax).all().item<bool>()) return false;
  const at::Tensor a = amax.contiguous();  // (nb, 1)
  *bits = encode_scales(a, numerics::nvfp4_scale_input);
  *s = e4m3_decode(*bits);
  if (rule == BlockRule::kFourOverSix) choose_four_over_six(xb, a, bits, s);
  *key = element_keys(xb, *s);
  return true;
}

// Calls fn(r0, nr) over row chunks of about kCpuChunkElems elements.
template <typename Fn>
void for_row_chunks(int64_t rows, int64_t cols, Fn&& fn) {
  const int64_t step = std::max<int64_t>(1, kCpuChunkElems / std::max<int64_t>(cols, 1));
  for (int64_t r0 = 0; r0 < rows; r0 += step) fn(r0, std::min(step, rows - r0));
}

// A chunk's cpu_chunk_keys: scale bits, decoded scales and element keys.
struct ChunkKeys {
  at::Tensor bits, s, key;
};

// Calls fn(r0, nr, keys) over the row chunks of x (rows, cols), scales chosen by `rule`; a chunk
// with a NaN/Inf fails, naming `fn_name` and the tensor.
template <typename Fn>
void for_key_chunks(const at::Tensor& x, const char* fn_name, const std::string& name,
                    BlockRule rule, Fn&& fn) {
  for_row_chunks(x.size(0), x.size(1), [&](int64_t r0, int64_t nr) {
    const at::Tensor xc = x.narrow(0, r0, nr);
    const at::Tensor xb = xc.to(at::kFloat).reshape({-1, kNvfp4BlockSize});  // (nb, 16)
    ChunkKeys k;
    if (!cpu_chunk_keys(xb, rule, &k.bits, &k.s, &k.key)) fail_nonfinite(xc, fn_name, name);
    fn(r0, nr, k);
  });
}

Nvfp4Tensor quantize_cpu(const at::Tensor& x, const std::string& name, BlockRule rule) {
  const int64_t rows = x.size(0), cols = x.size(1);
  at::Tensor qdata = at::empty({rows, cols / 2}, x.options().dtype(at::kByte));   // (r, c/2)
  at::Tensor scale = at::empty({rows, cols / kNvfp4BlockSize}, qdata.options());  // (r, c/16)
  const at::Tensor codes_of_key = const_tensor(key_tables().code.data(), kKeyCount);
  for_key_chunks(x, "quantize_nvfp4", name, rule, [&](int64_t r0, int64_t nr, const ChunkKeys& k) {
    const at::Tensor codes =
        at::index_select(codes_of_key, 0, k.key.reshape({-1})).view({-1, 2});  // (n/2, 2)
    const at::Tensor packed =
        at::bitwise_or(codes.select(1, 0), at::bitwise_left_shift(codes.select(1, 1), 4));
    qdata.narrow(0, r0, nr).copy_(packed.view({nr, cols / 2}));
    scale.narrow(0, r0, nr).copy_(k.bits.view({nr, cols / kNvfp4BlockSize}));
  });
  return {qdata, scale};
}

at::Tensor fake_quant_cpu(const at::Tensor& w, const std::string& name, BlockRule rule) {
  const int64_t rows = w.size(0), cols = w.size(1);
  at::Tensor out = at::empty({rows, cols}, w.options());  // (r, c) in w's dtype
  const at::Tensor value_of_key = const_tensor(key_tables().value.data(), kKeyCount);
  for_key_chunks(
      w, "fake_quant_nvfp4", name, rule, [&](int64_t r0, int64_t nr, const ChunkKeys& k) {
        const at::Tensor val =
            at::index_select(value_of_key, 0, k.key.reshape({-1})).view({-1, kNvfp4BlockSize});
        at::Tensor dst = out.narrow(0, r0, nr).view({-1, kNvfp4BlockSize});  // (nb, 16)
        // E2M1 value * E4M3 scale has <= 6 significant bits and lies in [2^-10, 2688]: exact in
        // fp32, fp16 and bf16, so the cast to w's dtype is exact too.
        at::mul_out(dst, val, k.s);
      });
  return out;
}

at::Tensor dequantize_cpu(const at::Tensor& qdata, const at::Tensor& scale, at::ScalarType dtype) {
  const int64_t rows = qdata.size(0), cols = qdata.size(1) * 2;
  at::Tensor out = at::empty({rows, cols}, qdata.options().dtype(dtype));  // (r, c)
  const at::Tensor pair_table = const_tensor(e2m1_pair_table().data(), 512).view({256, 2});
  for_row_chunks(rows, cols, [&](int64_t r0, int64_t nr) {
    const at::Tensor q = qdata.narrow(0, r0, nr).reshape({-1}).to(at::kInt);
    const at::Tensor val =
        at::index_select(pair_table, 0, q).view({-1, kNvfp4BlockSize});          // (nb, 16)
    const at::Tensor s = e4m3_decode(scale.narrow(0, r0, nr).reshape({-1, 1}));  // (nb, 1)
    at::Tensor dst = out.narrow(0, r0, nr).view({-1, kNvfp4BlockSize});
    at::mul_out(dst, val, s);
  });
  return out;
}

#if Q4_WITH_CUDA
// The kernels flag NaN/Inf on the device; reading the flag synchronizes with the stream.
void check_flag(const at::Tensor& flag, const at::Tensor& x, const char* fn,
                const std::string& name) {
  if (flag.item<int32_t>() != 0) fail_nonfinite(x, fn, name);
}
#endif

[[noreturn]] void fail_no_cuda(const char* fn) {
  TORCH_CHECK(false, fn, ": got a CUDA tensor but q4_quant was built without CUDA kernels ",
              "(configure with -DQ4_ENABLE_CUDA=ON or a CUDA LibTorch)");
}

}  // namespace

at::Tensor e4m3_encode(const at::Tensor& s_in) {
  TORCH_CHECK(s_in.scalar_type() == at::kFloat && s_in.device().is_cpu(),
              "e4m3_encode: expected a float32 CPU tensor, found ", s_in.scalar_type(), " on ",
              s_in.device());
  const at::Tensor s = s_in.contiguous();
  at::Tensor out = at::empty(s.sizes(), s.options().dtype(at::kByte));
  const float* sp = s.data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  for (int64_t i = 0; i < s.numel(); ++i) op[i] = numerics::e4m3_encode(sp[i]);
  return out;
}

at::Tensor e4m3_decode(const at::Tensor& bits) {
  TORCH_CHECK(bits.scalar_type() == at::kByte, "e4m3_decode: expected uint8 bits, found ",
              bits.scalar_type());
  const at::Tensor table = const_tensor(e4m3_table().data(), 256).to(bits.device());
  return at::index_select(table, 0, bits.reshape({-1}).to(at::kInt)).view(bits.sizes());
}

Nvfp4Tensor quantize_nvfp4(const at::Tensor& x_in, const std::string& name, BlockRule rule) {
  check_input(x_in, "quantize_nvfp4", name);
  const at::Tensor x = x_in.contiguous();
  if (x.is_cuda()) {
#if Q4_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    const int64_t rows = x.size(0), cols = x.size(1);
    at::Tensor qdata = at::empty({rows, cols / 2}, x.options().dtype(at::kByte));
    at::Tensor scale = at::empty({rows, cols / kNvfp4BlockSize}, qdata.options());
    at::Tensor flag = at::zeros({1}, x.options().dtype(at::kInt));
    cuda::check_cuda(
        cuda::launch_quantize_nvfp4(x.data_ptr(), cuda::dtype_of(x.scalar_type(), "nvfp4"),
                                    x.numel() / kNvfp4BlockSize, qdata.data_ptr<uint8_t>(),
                                    scale.data_ptr<uint8_t>(), flag.data_ptr<int32_t>(), rule,
                                    at::cuda::getCurrentCUDAStream()),
        "quantize_nvfp4");
    check_flag(flag, x, "quantize_nvfp4", name);
    return {qdata, scale};
#else
    fail_no_cuda("quantize_nvfp4");
#endif
  }
  return quantize_cpu(x, name, rule);
}

void quantize_nvfp4_into(const at::Tensor& x_in, const Nvfp4Tensor& out, const std::string& name,
                         BlockRule rule) {
  check_input(x_in, "quantize_nvfp4_into", name);
  const int64_t rows = x_in.size(0), cols = x_in.size(1);
  const auto want = [&](const at::Tensor& t, int64_t c, const char* what) {
    TORCH_CHECK(t.defined() && t.scalar_type() == at::kByte && t.is_contiguous() &&
                    t.dim() == 2 && t.size(0) == rows && t.size(1) == c &&
                    t.device() == x_in.device(),
                "quantize_nvfp4_into: ", what, " of '", name,
                "' must be a contiguous uint8 [", rows, ", ", c, "] tensor on ", x_in.device());
  };
  want(out.qdata, cols / 2, "qdata");
  want(out.scale, cols / kNvfp4BlockSize, "scale");
  const at::Tensor x = x_in.contiguous();
  if (x.is_cuda()) {
#if Q4_WITH_CUDA
    const c10::cuda::CUDAGuard guard(x.device());
    cuda::check_cuda(
        cuda::launch_quantize_nvfp4(x.data_ptr(), cuda::dtype_of(x.scalar_type(), "nvfp4"),
                                    x.numel() / kNvfp4BlockSize, out.qdata.data_ptr<uint8_t>(),
                                    out.scale.data_ptr<uint8_t>(), nullptr, rule,
                                    at::cuda::getCurrentCUDAStream()),
        "quantize_nvfp4_into");
    return;
#else
    fail_no_cuda("quantize_nvfp4_into");
#endif
  }
  const Nvfp4Tensor q = quantize_cpu(x, name, rule);
  out.qdata.copy_(q.qdata);
  out.scale.copy_(q.scale);
}

at::Tensor dequantize_nvfp4(const at::Tensor& qdata_in, const at::Tensor& scale_in,
                            at::ScalarType dtype) {
  TORCH_CHECK(qdata_in.dim() == 2 && scale_in.dim() == 2,
              "dequantize_nvfp4: expected 2-D qdata [rows, cols/2] and scale [rows, cols/16], "
              "found ",
              qdata_in.sizes(), " and ", scale_in.sizes());
  TORCH_CHECK(qdata_in.scalar_type() == at::kByte && scale_in.scalar_type() == at::kByte,
              "dequantize_nvfp4: expected uint8 qdata and scale, found ", qdata_in.scalar_type(),
              " and ", scale_in.scalar_type());
  TORCH_CHECK(qdata_in.size(1) % (kNvfp4BlockSize / 2) == 0,
              "dequantize_nvfp4: expected qdata cols % 8 == 0, found shape ", qdata_in.sizes());
  const int64_t rows = qdata_in.size(0), cols = qdata_in.size(1) * 2;
  TORCH_CHECK(scale_in.size(0) == rows && scale_in.size(1) * kNvfp4BlockSize == cols,
              "dequantize_nvfp4: expected scale shape [", rows, ", ", cols / kNvfp4BlockSize,
              "] for qdata ", qdata_in.sizes(), ", found ", scale_in.sizes());
  TORCH_CHECK(qdata_in.device() == scale_in.device(),
              "dequantize_nvfp4: qdata and scale must be on one device, found ", qdata_in.device(),
              " and ", scale_in.device());
  TORCH_CHECK(is_supported_float(dtype),
              "dequantize_nvfp4: expected output dtype float32, float16 or bfloat16, found ",
              dtype);
  const at::Tensor qdata = qdata_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  if (qdata.is_cuda()) {
#if Q4_WITH_CUDA
    const c10::cuda::CUDAGuard guard(qdata.device());
    at::Tensor out = at::empty({rows, cols}, qdata.options().dtype(dtype));
    cuda::check_cuda(
        cuda::launch_dequantize_nvfp4(
            qdata.data_ptr<uint8_t>(), scale.data_ptr<uint8_t>(), out.numel() / kNvfp4BlockSize,
            out.data_ptr(), cuda::dtype_of(dtype, "nvfp4"), at::cuda::getCurrentCUDAStream()),
        "dequantize_nvfp4");
    return out;
#else
    fail_no_cuda("dequantize_nvfp4");
#endif
  }
  TORCH_CHECK(qdata.device().is_cpu(), "dequantize_nvfp4: expected a CPU or CUDA tensor, found ",
              qdata.device());
  return dequantize_cpu(qdata, scale, dtype);
}

namespace {

// out_dtype: the result's dtype (nullopt: w's). On CUDA an fp16 <-> bf16 change happens in the
// kernel's store (the fake-quantized values are exact in both); otherwise a cast follows.
// `into` (optional): a contiguous tensor of w's shape and device in the result's dtype, written
// and returned instead of a fresh one.
at::Tensor fake_quant_dispatch(const at::Tensor& w_in, const std::string& name, bool check,
                               BlockRule rule,
                               std::optional<at::ScalarType> out_dtype = std::nullopt,
                               const at::Tensor& into = at::Tensor()) {
  check_input(w_in, "fake_quant_nvfp4", name);
  const at::Tensor w = w_in.contiguous();
  const at::ScalarType want = out_dtype ? *out_dtype : w.scalar_type();
  if (w.is_cuda()) {
#if Q4_WITH_CUDA
    const bool direct = want == w.scalar_type() || (w.element_size() == 2 &&
                                                   (want == at::kHalf || want == at::kBFloat16));
    const c10::cuda::CUDAGuard guard(w.device());
    at::Tensor out = direct && into.defined()
                         ? into
                         : at::empty(w.sizes(), w.options().dtype(direct ? want : w.scalar_type()));
    at::Tensor flag = check ? at::zeros({1}, w.options().dtype(at::kInt)) : at::Tensor();
    cuda::check_cuda(
        cuda::launch_fake_quant_nvfp4_cast(
            w.data_ptr(), cuda::dtype_of(w.scalar_type(), "nvfp4"), out.data_ptr(),
            cuda::dtype_of(out.scalar_type(), "nvfp4"), w.numel() / kNvfp4BlockSize,
            check ? flag.data_ptr<int32_t>() : nullptr, rule, at::cuda::getCurrentCUDAStream()),
        "fake_quant_nvfp4");
    if (check) check_flag(flag, w, "fake_quant_nvfp4", name);
    if (direct) return out;
    return into.defined() ? into.copy_(out) : out.to(want);
#else
    fail_no_cuda("fake_quant_nvfp4");
#endif
  }
  at::Tensor out = fake_quant_cpu(w, name, rule);
  if (into.defined()) return into.copy_(out);
  return out.scalar_type() == want ? out : out.to(want);
}

}  // namespace

at::Tensor fake_quant_nvfp4_forward(const at::Tensor& w, const std::string& name, BlockRule rule) {
  return fake_quant_dispatch(w, name, /*check=*/true, rule);
}

at::Tensor fake_quant_nvfp4_forward_unchecked(const at::Tensor& w,
                                              std::optional<at::ScalarType> out_dtype,
                                              const std::string& name, BlockRule rule) {
  return fake_quant_dispatch(w, name, /*check=*/false, rule, out_dtype);
}

void fake_quant_nvfp4_forward_into(const at::Tensor& w, const at::Tensor& out,
                                   const std::string& name, BlockRule rule) {
  TORCH_CHECK(out.sizes() == w.sizes() && out.device() == w.device() && out.is_contiguous() &&
                  is_supported_float(out.scalar_type()),
              "fake_quant_nvfp4_forward_into: ", name,
              ": out must be a contiguous float tensor of the input's shape and device");
  fake_quant_dispatch(w, name, /*check=*/false, rule, out.scalar_type(), out);
}

namespace {

// Straight-through estimator: forward quantizes, backward passes the gradient unchanged.
struct FakeQuantNvfp4Fn : public torch::autograd::Function<FakeQuantNvfp4Fn> {
  static at::Tensor forward(torch::autograd::AutogradContext* /*ctx*/, const at::Tensor& w,
                            bool check_finite, int64_t rule) {
    const auto r = static_cast<BlockRule>(rule);
    return check_finite ? fake_quant_nvfp4_forward(w, "weight", r)
                        : fake_quant_nvfp4_forward_unchecked(w, std::nullopt, "tensor", r);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* /*ctx*/,
                                                 torch::autograd::variable_list grad_out) {
    return {grad_out[0], at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor fake_quant_nvfp4(const at::Tensor& w, bool check_finite, BlockRule rule) {
  return FakeQuantNvfp4Fn::apply(w, check_finite, static_cast<int64_t>(rule));
}

}  // namespace q4::quant
