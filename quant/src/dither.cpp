// dither_nvfp4 (dither.h): the cells come from the quantizer's own outputs (quantize_nvfp4's
// codes and scale bytes, numerics::e2m1_threshold's thresholds) and every drawn block is checked
// with fake_quant_nvfp4_forward, so the grid is never re-derived here. Blocks are 16-element rows
// (nb, 16), processed in chunks so that the fp64 temporaries stay small on any device.
#include "q4/quant/dither.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <array>
#include <cmath>
#include <limits>

#include "q4/quant/numerics.h"
#include "q4/quant/nvfp4.h"

namespace q4::quant {
namespace {

// Blocks per chunk: about 1M elements, a few fp64 temporaries of 8 MiB each.
constexpr int64_t kChunkBlocks = int64_t{1} << 16;

// (8) fp64: the cell of E2M1 magnitude code k in units of the block scale is [lower[k],
// upper[k]) (|d| >= threshold rounds up, so a threshold belongs to the upper cell). Code 7's
// upper bound is infinite (the quantizer clamps |d| to 6); the block maximum bounds it.
at::Tensor cell_bounds(bool upper, at::Device dev) {
  std::array<double, 8> t{};
  for (int k = 0; k < 8; ++k) {
    if (upper) {
      t[k] = k == 7 ? std::numeric_limits<double>::infinity() : numerics::e2m1_threshold(k);
    } else {
      t[k] = k == 0 ? 0.0 : numerics::e2m1_threshold(k - 1);
    }
  }
  return at::from_blob(t.data(), {8}, at::kDouble).clone().to(dev);
}

// What a chunk of blocks needs for its draws, (k, 16) each.
struct Cells {
  at::Tensor x;     // fp64 values of w
  at::Tensor lo;    // fp64 lower bound of |value|
  at::Tensor span;  // fp64 width of the |value| interval, hi - lo (hi = min(cell top, block max))
  at::Tensor sign;  // fp64 +1 / -1 of a nonzero code, 0 for the zero code (sign drawn)
  at::Tensor keep;  // bool: keeps w's value (the block maximum, a zero scale, an empty interval)
  at::Tensor fq;    // fake_quant(w) in w's dtype
};

// xb (k, 16) w's dtype, codes (k, 16) uint8, s (k, 1) fp32 decoded scales, fq (k, 16).
Cells make_cells(const at::Tensor& xb, const at::Tensor& codes, const at::Tensor& s,
                 const at::Tensor& fq) {
  Cells c;
  c.x = xb.to(at::kDouble);
  const at::Tensor s64 = s.to(at::kDouble);
  const at::Tensor ax = c.x.abs();
  const at::Tensor amax = std::get<0>(ax.max(1, /*keepdim=*/true));  // (k, 1)
  const at::Tensor mag = at::bitwise_and(codes, 7).to(at::kLong);
  c.lo = at::index_select(cell_bounds(false, xb.device()), 0, mag.reshape({-1}))
             .view(mag.sizes())
             .mul_(s64);
  const at::Tensor hi = at::minimum(
      at::index_select(cell_bounds(true, xb.device()), 0, mag.reshape({-1})).view(mag.sizes()) *
          s64,
      amax);
  c.span = hi - c.lo;
  const at::Tensor negative = at::ne(at::bitwise_and(codes, 8), 0);
  c.sign = at::where(at::eq(mag, 0), at::zeros_like(c.x),
                     at::where(negative, at::full_like(c.x, -1.0), at::full_like(c.x, 1.0)));
  // The first element at the block maximum stays; others there may move below it.
  const at::Tensor at_max = at::eq(ax, amax);
  const at::Tensor first_max = at_max.logical_and(at::eq(at_max.to(at::kInt).cumsum(1), 1));
  c.keep = first_max.logical_or_(at::eq(s64, 0.0).expand_as(ax)).logical_or_(at::le(c.span, 0.0));
  c.fq = fq;
  return c;
}

// One draw for the blocks `rows` (m) of `c`: (m, 16) candidates in `dtype`.
at::Tensor draw(const Cells& c, const at::Tensor& rows, at::ScalarType dtype, at::Generator& gen) {
  const int64_t m = rows.numel();
  const at::Device dev = c.x.device();
  const auto f64 = at::TensorOptions().dtype(at::kDouble);
  const at::Tensor u = at::rand({m, kNvfp4BlockSize}, gen, f64).to(dev);
  const at::Tensor coin = at::rand({m, kNvfp4BlockSize}, gen, f64).to(dev);
  const at::Tensor sign0 = c.sign.index_select(0, rows);
  const at::Tensor coin_sign =
      at::where(at::lt(coin, 0.5), at::full_like(coin, -1.0), at::full_like(coin, 1.0));
  // The zero code's cell holds both signs.
  const at::Tensor sign = at::where(at::eq(sign0, 0.0), coin_sign, sign0);
  const at::Tensor mag = c.lo.index_select(0, rows) + u * c.span.index_select(0, rows);
  const at::Tensor x = c.x.index_select(0, rows);
  return at::where(c.keep.index_select(0, rows), x, sign * mag).to(dtype);
}

// Dithers the chunk `xb` (k, 16) in place; returns (blocks dithered, elements moved).
std::pair<int64_t, int64_t> dither_chunk(at::Tensor xb, const Cells& c, const std::string& name,
                                         BlockRule rule, at::Generator& gen) {
  const int64_t k = xb.size(0);
  at::Tensor pending = at::arange(k, at::TensorOptions().dtype(at::kLong).device(xb.device()));
  int64_t dithered = 0, moved = 0;
  for (int round = 0; round < kDitherRounds && pending.numel() > 0; ++round) {
    const at::Tensor cand = draw(c, pending, xb.scalar_type(), gen);
    const at::Tensor same =
        at::eq(fake_quant_nvfp4_forward(cand, name, rule), c.fq.index_select(0, pending)).all(1);
    const at::Tensor ok = pending.masked_select(same);
    const at::Tensor ok_cand = cand.index_select(0, at::nonzero(same).reshape({-1}));
    moved += at::ne(ok_cand, xb.index_select(0, ok)).sum().item<int64_t>();
    dithered += ok.numel();
    xb.index_copy_(0, ok, ok_cand);
    pending = pending.masked_select(same.logical_not());
  }
  return {dithered, moved};
}

// (r, c) uint8 E2M1 codes of the packed (r, c/2) qdata: element 2j low nibble, 2j+1 high.
at::Tensor unpack_codes(const at::Tensor& qdata) {
  const at::Tensor lo = at::bitwise_and(qdata, 15);
  const at::Tensor hi = at::bitwise_right_shift(qdata, 4);
  return at::stack({lo, hi}, -1).reshape({qdata.size(0), qdata.size(1) * 2});
}

}  // namespace

at::Tensor dither_nvfp4(const at::Tensor& w, uint64_t seed, const std::string& name,
                        BlockRule rule, DitherStats* stats) {
  TORCH_CHECK(w.defined() && w.dim() == 2 && w.size(1) % kNvfp4BlockSize == 0,
              "dither_nvfp4: tensor '", name, "' expected 2-D [rows, cols] with cols % 16 == 0, "
              "found shape ", w.sizes());
  // Both calls check the values (NaN/Inf is an error naming `name`) and dtype/device.
  const Nvfp4Tensor q = quantize_nvfp4(w, name, rule);
  const at::Tensor fq = fake_quant_nvfp4_forward(w, name, rule).reshape({-1, kNvfp4BlockSize});
  const at::Tensor s = e4m3_decode(q.scale).reshape({-1, 1});  // (nb, 1) fp32
  const at::Tensor codes = unpack_codes(q.qdata).reshape({-1, kNvfp4BlockSize});
  at::Tensor out = w.contiguous().clone();
  const at::Tensor blocks = out.view({-1, kNvfp4BlockSize});  // (nb, 16), aliases out
  at::Generator gen = at::detail::createCPUGenerator(seed);
  DitherStats st;
  st.blocks = blocks.size(0);
  for (int64_t b0 = 0; b0 < st.blocks; b0 += kChunkBlocks) {
    const int64_t n = std::min(kChunkBlocks, st.blocks - b0);
    at::Tensor xb = blocks.narrow(0, b0, n);
    const Cells c = make_cells(xb, codes.narrow(0, b0, n), s.narrow(0, b0, n), fq.narrow(0, b0, n));
    const auto [dithered, moved] = dither_chunk(xb, c, name, rule, gen);
    st.blocks_dithered += dithered;
    st.elements_moved += moved;
  }
  if (stats != nullptr) *stats = st;
  return out;
}

}  // namespace q4::quant
