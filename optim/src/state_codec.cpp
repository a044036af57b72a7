// Block codecs of the packed Adam moments: code tables, the vectorized CPU encode/decode used
// per chunk by the CPU step, the CUDA dispatch of the public pack/unpack functions, and the scalar
// references. Maps (sources in optim_math.h): int8 = bitsandbytes dynamic tree map (block 256,
// second moment made zero-free), 4-bit = torchao AdamW4bit m map + a linear zero-free map on
// sqrt(v) (block 128), NVFP4 = docs/design.md#nvfp4-arithmetic.
#include "q4/optim/state_codec.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <string>

#include "cpu_kernels.h"
#include "cuda_launch.h"
#include "optim_math.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace q4::optim {
namespace detail {

at::Tensor Scratch::get(int slot, at::ScalarType dtype, int64_t n) {
  TORCH_INTERNAL_ASSERT(slot >= 0 && slot < kNumSlots);
  at::Tensor& b = buf_[slot];
  const int64_t need = n * static_cast<int64_t>(c10::elementSize(dtype));
  const int64_t have = b.defined() ? b.numel() : 0;  // uint8 bytes
  if (need > have) {
    current_bytes_ -= have;
    b = at::Tensor();
    b = at::empty({need}, at::TensorOptions().dtype(at::kByte));
    current_bytes_ += need;
    peak_bytes_ = std::max(peak_bytes_, current_bytes_);
  }
  return b.narrow(0, 0, need).view(dtype);
}

void Scratch::release() {
  for (auto& b : buf_) b = at::Tensor();
  current_bytes_ = 0;
  peak_bytes_ = 0;
}

namespace {

MapId map_id(StateMode mode, Moment moment) {
  TORCH_CHECK(mode == StateMode::kInt8 || mode == StateMode::k4Bit,
              "q4::optim: no code map for state mode ", to_string(mode));
  if (mode == StateMode::kInt8) {
    return moment == Moment::kFirst ? MapId::kInt8First : MapId::kInt8Second;
  }
  return moment == Moment::kFirst ? MapId::k4BitFirst : MapId::k4BitSecond;
}

struct MapCache {
  CodeMap host[4];
  MapTensors cpu[4];
  at::Tensor e4m3;
  at::Tensor e2m1;
  at::Tensor e2m1_thresholds;
  MapCache() {
    for (int i = 0; i < 4; ++i) {
      host[i] = make_code_map(static_cast<MapId>(i));
      const int n = host[i].size;
      cpu[i].value = at::empty({n}, at::kFloat);
      cpu[i].mid = at::empty({n - 1}, at::kFloat);
      cpu[i].sr_value = at::empty({n}, at::kFloat);
      cpu[i].inv_gap = at::empty({n - 1}, at::kFloat);
      std::memcpy(cpu[i].sr_value.data_ptr<float>(), host[i].sr_value, sizeof(float) * n);
      std::memcpy(cpu[i].value.data_ptr<float>(), host[i].value, sizeof(float) * n);
      std::memcpy(cpu[i].mid.data_ptr<float>(), host[i].mid, sizeof(float) * (n - 1));
      std::memcpy(cpu[i].inv_gap.data_ptr<float>(), host[i].inv_gap, sizeof(float) * (n - 1));
    }
    e4m3 = at::empty({256}, at::kFloat);
    for (int b = 0; b < 256; ++b) e4m3.data_ptr<float>()[b] = e4m3_decode(static_cast<uint8_t>(b));
    e2m1 = at::empty({16}, at::kFloat);
    for (int c = 0; c < 16; ++c) e2m1.data_ptr<float>()[c] = e2m1_decode(static_cast<uint8_t>(c));
    // |d| >= t for each E2M1 threshold (docs/design.md#nvfp4-arithmetic): the code magnitude is the number of thresholds
    // <= |d| (count_sorted_below with right=true).
    e2m1_thresholds = at::empty({q4::numerics::kE2m1Thresholds}, at::kFloat);
    for (int i = 0; i < q4::numerics::kE2m1Thresholds; ++i) {
      e2m1_thresholds.data_ptr<float>()[i] = q4::numerics::e2m1_threshold(i);
    }
  }
};

// Khuong and Morin's branchless lower/upper bound: `base` moves by half of what is left while
// the probe is below y (right: not above it); the answer lies in [base, base + n]. Negated
// comparisons as bucketize has them, so that a NaN y counts every entry on both sides.
template <bool kRight>
int32_t count_below(const float* sorted, int64_t size, float y) {
  const float* base = sorted;
  int64_t n = size;
  while (n > 1) {
    const int64_t half = n / 2;
    const bool below = kRight ? !(y < base[half]) : !(base[half] >= y);
    base = below ? base + half : base;
    n -= half;
  }
  const bool below = kRight ? !(y < *base) : !(*base >= y);
  return static_cast<int32_t>(base - sorted) + (below ? 1 : 0);
}

const MapCache& maps() {
  static const MapCache cache;
  return cache;
}

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void count_sorted_below(const at::Tensor& y, const at::Tensor& sorted, at::Tensor& out,
                        bool right) {
  TORCH_INTERNAL_ASSERT(y.is_contiguous() && sorted.is_contiguous() && out.is_contiguous() &&
                        out.numel() == y.numel() && out.scalar_type() == at::kInt);
  const float* yp = y.data_ptr<float>();
  const float* sp = sorted.data_ptr<float>();
  int32_t* op = out.data_ptr<int32_t>();
  const int64_t size = sorted.numel();
  at::parallel_for(0, y.numel(), 1 << 14, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      op[i] = size == 0 ? 0 : right ? count_below<true>(sp, size, yp[i])
                                    : count_below<false>(sp, size, yp[i]);
    }
  });
}

const MapTensors& cpu_map(StateMode mode, Moment moment) {
  return maps().cpu[static_cast<int>(map_id(mode, moment))];
}
const CodeMap& host_map(StateMode mode, Moment moment) {
  return maps().host[static_cast<int>(map_id(mode, moment))];
}
at::Tensor e4m3_decode_table_cpu() { return maps().e4m3; }
at::Tensor e2m1_decode_table_cpu() { return maps().e2m1; }

void decode_chunk_cpu(const at::Tensor& codes, const at::Tensor& scales, StateMode mode,
                      Moment moment, int64_t start, int64_t n, const at::Tensor& x, Scratch& s) {
  const int64_t block = moment_block_size(mode);
  const int64_t nb = ceil_div(n, block);
  const int64_t npad = nb * block;
  TORCH_INTERNAL_ASSERT(start % block == 0 && x.numel() == npad);
  at::Tensor ci = s.get(kSlotI32, at::kInt, npad);  // (npad) code of each element
  if (mode == StateMode::kInt8) {
    ci.narrow(0, 0, n).copy_(codes.narrow(0, start, n));
    if (npad > n) ci.narrow(0, n, npad - n).zero_();
  } else {
    const int64_t nbytes = ceil_div(n, 2);
    const at::Tensor bytes = codes.narrow(0, start / 2, nbytes);
    at::Tensor pairs = ci.view({npad / 2, 2});  // (npad/2, 2): low nibble, high nibble
    at::Tensor lo = pairs.select(1, 0).narrow(0, 0, nbytes);
    at::Tensor hi = pairs.select(1, 1).narrow(0, 0, nbytes);
    at::bitwise_and_out(lo, bytes, 15);
    at::bitwise_right_shift_out(hi, bytes, 4);
    if (npad / 2 > nbytes) pairs.narrow(0, nbytes, npad / 2 - nbytes).zero_();
  }
  at::Tensor xb = x.view({nb, block});
  if (mode == StateMode::kNvfp4) {
    at::Tensor xo = x;
    at::index_select_out(xo, maps().e2m1, 0, ci);
    at::Tensor sb = s.get(kSlotBlockI, at::kInt, nb);
    sb.copy_(scales.narrow(0, start / block, nb));
    at::Tensor sf = s.get(kSlotBlockF, at::kFloat, nb);
    at::index_select_out(sf, maps().e4m3, 0, sb);
    xb.mul_(sf.view({nb, 1}));
  } else {
    at::Tensor xo = x;
    at::index_select_out(xo, cpu_map(mode, moment).value, 0, ci);
    xb.mul_(scales.narrow(0, start / block, nb).view({nb, 1}));
  }
  if (npad > n) x.narrow(0, n, npad - n).zero_();
}

void encode_chunk_cpu(const at::Tensor& x, StateMode mode, Moment moment, int64_t start, int64_t n,
                      const at::Tensor& codes, const at::Tensor& scales, uint32_t sr_key,
                      Scratch& s) {
  const int64_t block = moment_block_size(mode);
  const int64_t nb = ceil_div(n, block);
  const int64_t npad = nb * block;
  TORCH_INTERNAL_ASSERT(start % block == 0 && x.numel() == npad);
  const at::Tensor xb = x.view({nb, block});
  at::Tensor y = s.get(kSlotTmp2, at::kFloat, npad);  // (npad) normalized values
  at::Tensor yb = y.view({nb, block});
  at::Tensor ci = s.get(kSlotI32, at::kInt, npad);  // (npad) codes
  at::Tensor amax = s.get(kSlotBlockF, at::kFloat, nb);
  if (moment == Moment::kSecond && mode != StateMode::kNvfp4) {
    at::amax_out(amax, xb, {1}, false);  // v >= 0
  } else {
    at::abs_out(y, x);
    at::amax_out(amax, yb, {1}, false);
  }
  if (mode == StateMode::kNvfp4) {
    // s = e4m3_rne(clamp(amax / 6, 2^-16, 448)) per block with the shared scalar codec (one
    // value per 16 elements), then its decoded value.
    at::Tensor bits = s.get(kSlotBlockI2, at::kInt, nb);
    const float* ap = amax.data_ptr<float>();
    int32_t* bp = bits.data_ptr<int32_t>();
    for (int64_t b = 0; b < nb; ++b) bp[b] = e4m3_encode(nvfp4_scale_input(ap[b]));
    scales.narrow(0, start / block, nb).copy_(bits);
    at::Tensor sf = amax;  // decoded scale + 1e-12
    at::index_select_out(sf, maps().e4m3, 0, bits);
    sf.add_(1e-12f);
    at::div_out(yb, xb, sf.view({nb, 1}));
    y.clamp_(-kE2m1Max, kE2m1Max);
    at::Tensor neg = s.get(kSlotMask, at::kBool, npad);
    at::lt_out(neg, y, 0);
    y.abs_();
    count_sorted_below(y, maps().e2m1_thresholds, ci, /*right=*/true);
    ci.add_(neg, 8);
  } else {
    scales.narrow(0, start / block, nb).copy_(amax);
    const CodeMap& hm = host_map(mode, moment);
    // Per-block factors of block_norm() (optim_math.h): y = (x * f) * inv, or for the
    // sqrt-domain map t = (sqrt(x) * fs) * rs.
    at::Tensor fac = s.get(kSlotBlockF2, at::kFloat, 2 * nb);  // (2, nb)
    const float* ap = amax.data_ptr<float>();
    float* f1 = fac.data_ptr<float>();
    float* f2 = f1 + nb;
    for (int64_t b = 0; b < nb; ++b) {
      const BlockNorm bn = block_norm(ap[b]);
      f1[b] = hm.sqrt_domain ? bn.fs : bn.f;
      f2[b] = hm.sqrt_domain ? bn.rs : bn.inv;
    }
    if (hm.sqrt_domain) {
      at::sqrt_out(y, x);
      yb.mul_(fac.narrow(0, 0, nb).view({nb, 1}));
    } else {
      at::mul_out(yb, xb, fac.narrow(0, 0, nb).view({nb, 1}));
    }
    yb.mul_(fac.narrow(0, nb, nb).view({nb, 1}));
    const MapTensors& mt = cpu_map(mode, moment);
    if (hm.stochastic) {
      // sr_pick(): t (= y, or the sqrt-domain value above), l = #{sr_value <= t} - 1 clamped,
      // p = (t - sr_value[l]) * inv_gap[l], code l + 1 if u < p.
      const int64_t size = mt.value.numel();
      count_sorted_below(y, mt.sr_value, ci, /*right=*/true);
      ci.sub_(1).clamp_(0, size - 2);
      at::Tensor prob = s.get(kSlotTmp, at::kFloat, npad);
      at::index_select_out(prob, mt.sr_value, 0, ci);
      at::sub_out(prob, y, prob);
      at::Tensor u = s.get(kSlotGrad, at::kFloat, npad);
      at::index_select_out(u, mt.inv_gap, 0, ci);
      prob.mul_(u);
      moment_uniform_cpu(sr_key, start, npad, moment == Moment::kFirst ? 0 : 1, u, s);
      at::Tensor up = s.get(kSlotMask, at::kBool, npad);
      at::lt_out(up, u, prob);
      ci.add_(up);
    } else {
      count_sorted_below(y, mt.mid, ci, /*right=*/false);
    }
  }
  if (mode == StateMode::kInt8) {
    codes.narrow(0, start, n).copy_(ci.narrow(0, 0, n));
  } else {
    const int64_t nbytes = ceil_div(n, 2);
    const at::Tensor pairs = ci.view({npad / 2, 2});
    at::Tensor packed = s.get(kSlotI32b, at::kInt, npad / 2);
    packed.copy_(pairs.select(1, 1)).mul_(16).add_(pairs.select(1, 0));
    codes.narrow(0, start / 2, nbytes).copy_(packed.narrow(0, 0, nbytes));
  }
}

}  // namespace detail

namespace detail {

namespace {

// hash32 on int64 tensors holding 32-bit values (optim_math.h), t a same-sized temporary.
void hash32_cpu(const at::Tensor& v, const at::Tensor& t) {
  at::bitwise_right_shift_out(const_cast<at::Tensor&>(t), v, 16);
  v.bitwise_xor_(t).mul_(static_cast<int64_t>(kHashMul1)).bitwise_and_(int64_t{0xffffffff});
  at::bitwise_right_shift_out(const_cast<at::Tensor&>(t), v, 15);
  v.bitwise_xor_(t).mul_(kHashMul2Signed).bitwise_and_(int64_t{0xffffffff});
  at::bitwise_right_shift_out(const_cast<at::Tensor&>(t), v, 16);
  v.bitwise_xor_(t);
}

// h[i] = sr_bits(key, first_index + i) as int64 in kSlotI64 (returned); temporary kSlotI64b.
// sr_bits = hash32(lo(i) ^ hash32(key ^ hi(i))); the range is cut where hi(i) = i >> 32
// changes so that the inner hash is a scalar in each piece.
at::Tensor sr_bits_cpu(uint32_t key, int64_t first_index, int64_t n, Scratch& s) {
  at::Tensor h = s.get(kSlotI64, at::kLong, n);
  at::Tensor t = s.get(kSlotI64b, at::kLong, n);
  for (int64_t done = 0; done < n;) {
    const int64_t first = first_index + done;
    const int64_t hi = first >> 32;
    const int64_t len = std::min(n - done, ((hi + 1) << 32) - first);
    at::Tensor hp = h.narrow(0, done, len);
    at::Tensor tp = t.narrow(0, done, len);
    at::arange_out(hp, at::Scalar(first), at::Scalar(first + len), at::Scalar(int64_t{1}));
    hp.bitwise_and_(int64_t{0xffffffff}).bitwise_xor_(int64_t{sr_range_key(key, first)});
    hash32_cpu(hp, tp);
    done += len;
  }
  return h;
}

}  // namespace

void moment_uniform_cpu(uint32_t key, int64_t first_index, int64_t n, int moment,
                        const at::Tensor& u, Scratch& s) {
  at::Tensor h = sr_bits_cpu(key, first_index, n, s);
  at::Tensor t = s.get(kSlotI64b, at::kLong, n);
  // moment_uniform(): high 16 bits of h (first moment) or of h * kMomentMul mod 2^32 (second;
  // the signed multiplier keeps the int64 product in range).
  if (moment != 0) h.mul_(kMomentMulSigned).bitwise_and_(int64_t{0xffffffff});
  at::bitwise_right_shift_out(t, h, 16);
  u.narrow(0, 0, n).copy_(t).mul_(1.52587890625e-05);
}

void stochastic_round_cpu(const at::Tensor& p, const at::Tensor& out, uint32_t key,
                          int64_t first_index, Scratch& s) {
  const int64_t n = p.numel();
  const at::ScalarType dt = out.scalar_type();
  const bool half = dt == at::kHalf;
  // Saturate at the largest finite value (docs/optim.md); then sr_round_fp16/bf16
  // (optim_math.h) element-wise: add h mod 2^k to the fp32 bits, clear the k low bits.
  at::Tensor x = p;
  x.clamp_(half ? -65504.0 : -3.3895313892515355e38, half ? 65504.0 : 3.3895313892515355e38);
  at::Tensor h = sr_bits_cpu(key, first_index, n, s);
  at::Tensor r = s.get(kSlotI32, at::kInt, n);
  r.copy_(h.bitwise_and_(half ? int64_t{0x1fff} : int64_t{0xffff}));
  at::Tensor c;
  if (half) {
    // c = copysign(2^-14, x) where |x| < 2^-14, else 0; x + c (fp32, round to nearest).
    at::Tensor small = s.get(kSlotMask, at::kBool, n);
    at::Tensor neg = s.get(kSlotHalf, at::kBool, n);
    c = s.get(kSlotTmp, at::kFloat, n);
    at::abs_out(c, x);
    at::lt_out(small, c, 6.103515625e-05);
    at::signbit_out(neg, x);
    c.copy_(neg).mul_(-2.0 * 6.103515625e-05).add_(6.103515625e-05).mul_(small);
    x.add_(c);
  }
  at::Tensor bits = x.view(at::kInt);
  bits.add_(r).bitwise_and_(half ? int64_t{-8192} : int64_t{-65536});  // ~(2^k - 1) as int32
  if (half) x.sub_(c);  // exact
  out.copy_(x);         // exact in the target
}

}  // namespace detail

int64_t moment_block_size(StateMode mode) {
  switch (mode) {
    case StateMode::kInt8:
      return detail::kInt8Block;
    case StateMode::k4Bit:
      return detail::k4BitBlock;
    case StateMode::kNvfp4:
      return detail::kNvfp4Block;
    case StateMode::kFp32:
      break;
  }
  TORCH_CHECK(false, "q4::optim: state mode fp32 has no blocks");
}

std::vector<float> moment_code_map(StateMode mode, Moment moment) {
  if (mode == StateMode::kNvfp4) {
    std::vector<float> v(16);
    for (int c = 0; c < 16; ++c) v[c] = detail::e2m1_decode(static_cast<uint8_t>(c));
    return v;
  }
  const detail::CodeMap& m = detail::host_map(mode, moment);
  return std::vector<float>(m.value, m.value + m.size);
}

int64_t packed_moment_bytes(StateMode mode, int64_t numel) {
  if (mode == StateMode::kFp32) return numel * 4;
  const int64_t nb = detail::ceil_div(numel, moment_block_size(mode));
  switch (mode) {
    case StateMode::kInt8:
      return numel + nb * 4;
    case StateMode::k4Bit:
      return detail::ceil_div(numel, 2) + nb * 4;
    default:
      return detail::ceil_div(numel, 2) + nb;
  }
}

namespace {

void check_packed_mode(StateMode mode) {
  TORCH_CHECK(mode != StateMode::kFp32,
              "q4::optim: pack_moment: state mode fp32 is not packed (expected int8, 4bit or "
              "nvfp4)");
}

PackedMoment empty_packed(StateMode mode, int64_t n, const at::TensorOptions& opts) {
  PackedMoment p;
  p.numel = n;
  const int64_t nb = detail::ceil_div(n, moment_block_size(mode));
  p.codes =
      at::zeros({mode == StateMode::kInt8 ? n : detail::ceil_div(n, 2)}, opts.dtype(at::kByte));
  p.scales = at::zeros({nb}, opts.dtype(mode == StateMode::kNvfp4 ? at::kByte : at::kFloat));
  return p;
}

void check_x(const at::Tensor& x, const char* fn) {
  TORCH_CHECK(x.defined() && x.dim() == 1 && x.scalar_type() == at::kFloat, "q4::optim: ", fn,
              ": expected a 1-D fp32 tensor, got ",
              x.defined() ? std::string(x.toString()) + " of dim " + std::to_string(x.dim())
                          : std::string("an undefined tensor"));
}

void check_packed(const PackedMoment& p, StateMode mode, const char* fn) {
  check_packed_mode(mode);
  const int64_t nb = detail::ceil_div(p.numel, moment_block_size(mode));
  const int64_t ncodes = mode == StateMode::kInt8 ? p.numel : detail::ceil_div(p.numel, 2);
  TORCH_CHECK(p.codes.defined() && p.codes.scalar_type() == at::kByte && p.codes.dim() == 1 &&
                  p.codes.numel() == ncodes && p.codes.is_contiguous(),
              "q4::optim: ", fn, ": codes must be contiguous uint8 of ", ncodes,
              " elements for numel ", p.numel);
  const at::ScalarType sdt = mode == StateMode::kNvfp4 ? at::kByte : at::kFloat;
  TORCH_CHECK(p.scales.defined() && p.scales.scalar_type() == sdt && p.scales.numel() == nb &&
                  p.scales.is_contiguous() && p.scales.device() == p.codes.device(),
              "q4::optim: ", fn, ": scales must be contiguous ", c10::toString(sdt), " of ", nb,
              " elements on the codes' device");
}

}  // namespace

bool moment_codes_stochastic(StateMode mode, Moment moment) {
  return (mode == StateMode::kInt8 || mode == StateMode::k4Bit) &&
         detail::host_map(mode, moment).stochastic;
}

PackedMoment pack_moment(const at::Tensor& x, StateMode mode, Moment moment, uint32_t sr_key) {
  check_packed_mode(mode);
  check_x(x, "pack_moment");
  const at::Tensor xc = x.contiguous();
  const int64_t n = xc.numel();
  PackedMoment p = empty_packed(mode, n, xc.options());
  if (n == 0) return p;
  if (xc.is_cuda()) {
#if Q4_WITH_CUDA
    cuda::launch_pack_moment(xc.data_ptr<float>(), n, static_cast<int>(mode),
                             static_cast<int>(moment), sr_key, p.codes.data_ptr<uint8_t>(),
                             p.scales.data_ptr(), at::cuda::getCurrentCUDAStream());
    return p;
#else
    TORCH_CHECK(false,
                "q4::optim: pack_moment: CUDA tensor given but q4_optim was built "
                "without CUDA kernels (configure with -DQ4_ENABLE_CUDA=ON)");
#endif
  }
  TORCH_CHECK(xc.is_cpu(), "q4::optim: pack_moment: unsupported device ", xc.device());
  const int64_t block = moment_block_size(mode);
  const int64_t npad = detail::ceil_div(n, block) * block;
  detail::Scratch s;
  at::Tensor buf = s.get(detail::kSlotM, at::kFloat, npad);
  buf.narrow(0, 0, n).copy_(xc);
  if (npad > n) buf.narrow(0, n, npad - n).zero_();
  detail::encode_chunk_cpu(buf, mode, moment, 0, n, p.codes, p.scales, sr_key, s);
  return p;
}

at::Tensor unpack_moment(const PackedMoment& packed, StateMode mode, Moment moment) {
  check_packed(packed, mode, "unpack_moment");
  const int64_t n = packed.numel;
  at::Tensor x = at::empty({n}, packed.codes.options().dtype(at::kFloat));
  if (n == 0) return x;
  if (packed.codes.is_cuda()) {
#if Q4_WITH_CUDA
    cuda::launch_unpack_moment(packed.codes.data_ptr<uint8_t>(), packed.scales.data_ptr(), n,
                               static_cast<int>(mode), static_cast<int>(moment),
                               x.data_ptr<float>(), at::cuda::getCurrentCUDAStream());
    return x;
#else
    TORCH_CHECK(false,
                "q4::optim: unpack_moment: CUDA tensor given but q4_optim was built "
                "without CUDA kernels");
#endif
  }
  const int64_t block = moment_block_size(mode);
  const int64_t npad = detail::ceil_div(n, block) * block;
  detail::Scratch s;
  at::Tensor buf = s.get(detail::kSlotM, at::kFloat, npad);
  detail::decode_chunk_cpu(packed.codes, packed.scales, mode, moment, 0, n, buf, s);
  x.copy_(buf.narrow(0, 0, n));
  return x;
}

// ---- scalar references ----

namespace {

// Per-element loops written independently of optim_math.h's search helpers.
// y: the normalized value x / amax as block_norm() computes it (norm_value, or norm_sqrt for a
// sqrt-domain map: then y is already in the sqrt domain).
uint8_t ref_code(const detail::CodeMap& map, float y, uint32_t sr_key, int moment_index,
                 int64_t i) {
  if (map.stochastic) {
    const float t = y;
    int l = -1;
    for (int j = 0; j < map.size; ++j) l += map.sr_value[j] <= t ? 1 : 0;
    l = std::min(std::max(l, 0), map.size - 2);
    const float p = (t - map.sr_value[l]) * map.inv_gap[l];
    const float u = detail::moment_uniform(detail::sr_bits(sr_key, i), moment_index);
    return static_cast<uint8_t>(u < p ? l + 1 : l);
  }
  int c = 0;
  while (c < map.size - 1 && map.mid[c] < y) ++c;
  return static_cast<uint8_t>(c);
}

}  // namespace

PackedMoment pack_moment_ref(const at::Tensor& x, StateMode mode, Moment moment, uint32_t sr_key) {
  check_packed_mode(mode);
  check_x(x, "pack_moment_ref");
  const at::Tensor xc = x.contiguous().cpu();
  const int64_t n = xc.numel();
  PackedMoment p = empty_packed(mode, n, xc.options());
  const float* xp = xc.data_ptr<float>();
  uint8_t* codes = p.codes.data_ptr<uint8_t>();
  const int64_t block = moment_block_size(mode);
  const int64_t nb = detail::ceil_div(n, block);
  auto put = [&](int64_t i, uint8_t c) {
    if (mode == StateMode::kInt8) {
      if (i < n) codes[i] = c;
    } else if (i / 2 < p.codes.numel()) {
      codes[i / 2] = static_cast<uint8_t>((i % 2 == 0) ? ((codes[i / 2] & 0xf0) | c)
                                                       : ((codes[i / 2] & 0x0f) | (c << 4)));
    }
  };
  for (int64_t b = 0; b < nb; ++b) {
    float amax = 0.0f;
    for (int64_t i = b * block; i < std::min(n, (b + 1) * block); ++i) {
      amax = std::max(amax, std::fabs(xp[i]));
    }
    if (mode == StateMode::kNvfp4) {
      const uint8_t sbits = detail::e4m3_encode(detail::nvfp4_scale_input(amax));
      p.scales.data_ptr<uint8_t>()[b] = sbits;
      const float den = detail::e4m3_decode(sbits) + 1e-12f;
      for (int64_t i = b * block; i < (b + 1) * block; ++i) {
        const float v = i < n ? xp[i] : 0.0f;
        const float d = std::min(std::max(v / den, -detail::kE2m1Max), detail::kE2m1Max);
        put(i, detail::e2m1_encode(d));
      }
    } else {
      const detail::CodeMap& map = detail::host_map(mode, moment);
      p.scales.data_ptr<float>()[b] = amax;
      const detail::BlockNorm bn = detail::block_norm(amax);
      for (int64_t i = b * block; i < (b + 1) * block; ++i) {
        const float v = i < n ? xp[i] : 0.0f;
        const float y = map.sqrt_domain ? detail::norm_sqrt(std::sqrt(v), bn)
                                        : detail::norm_value(v, bn);
        put(i, ref_code(map, y, sr_key, moment == Moment::kFirst ? 0 : 1, i));
      }
    }
  }
  return p;
}

at::Tensor unpack_moment_ref(const PackedMoment& packed, StateMode mode, Moment moment) {
  check_packed(packed, mode, "unpack_moment_ref");
  const int64_t n = packed.numel;
  const at::Tensor codes = packed.codes.cpu();
  const at::Tensor scales = packed.scales.cpu();
  at::Tensor x = at::empty({n}, at::kFloat);
  const int64_t block = moment_block_size(mode);
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t byte = codes.data_ptr<uint8_t>()[mode == StateMode::kInt8 ? i : i / 2];
    const uint8_t c = mode == StateMode::kInt8 ? byte : ((i % 2 == 0) ? (byte & 0xf) : (byte >> 4));
    if (mode == StateMode::kNvfp4) {
      x.data_ptr<float>()[i] =
          detail::e2m1_decode(c) * detail::e4m3_decode(scales.data_ptr<uint8_t>()[i / block]);
    } else {
      x.data_ptr<float>()[i] =
          detail::host_map(mode, moment).value[c] * scales.data_ptr<float>()[i / block];
    }
  }
  return x;
}

}  // namespace q4::optim
