// q4dat diff: compares two .dat files entry by entry, in A's order, reading payloads in 8 MiB
// chunks (memory stays flat for multi-GB files). Per entry: identical bytes, max abs difference
// (numeric types, computed in fp64), differing type/shape, or present in one file only. Equal
// means same keys in the same order, same types and shapes, and values within --atol. An NVFP4
// pair present in both files is compared by its dequantized values when its bytes differ (so
// code 8 (-0) vs code 0 counts as equal); other e2m1/e4m3 entries and bools must match exactly.
#include <ATen/ATen.h>
#include <fmt/core.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>

#include "common.h"
#include "q4/quant/nvfp4.h"
#include "q4dat.h"

namespace q4::tools {

using q4::io::DatEntry;
using q4::io::DatReader;
using q4::io::ElemType;

namespace {

constexpr uint64_t kChunkBytes = uint64_t{8} << 20;

bool numeric(ElemType t) {
  return t != ElemType::kE2M1Packed && t != ElemType::kE4M3Scale && t != ElemType::kBool;
}

struct Compared {
  bool identical = true;
  uint64_t bytes_differ = 0;
  double max_abs = 0.0;  // numeric types only; +inf when NaN positions differ
};

double max_abs_of(const at::Tensor& ta, const at::Tensor& tb) {
  const at::Tensor nan_a = at::isnan(ta), nan_b = at::isnan(tb);
  if (!at::equal(nan_a, nan_b)) return std::numeric_limits<double>::infinity();
  at::Tensor d = (ta - tb).abs();
  d = at::where(ta == tb, at::zeros_like(d), d);  // equal infinities
  d = at::where(nan_a, at::zeros_like(d), d);
  return d.numel() ? d.max().item<double>() : 0.0;
}

// Same type and shape assumed. Walks both payloads chunk by chunk.
Compared compare(const DatReader& ra, const DatEntry& a, const DatReader& rb, const DatEntry& b) {
  Compared c;
  const uint64_t esize = q4::io::elem_size_bytes(a.type);
  const uint64_t chunk = std::max<uint64_t>(esize, kChunkBytes / esize * esize);
  std::vector<uint8_t> ba, bb;
  for (uint64_t off = 0; off < a.nbytes; off += chunk) {
    const uint64_t n = std::min(chunk, a.nbytes - off);
    ba.resize(n);
    bb.resize(n);
    ra.read_range(a.offset + off, n, ba.data());
    rb.read_range(b.offset + off, n, bb.data());
    if (std::equal(ba.begin(), ba.end(), bb.begin())) continue;
    c.identical = false;
    for (uint64_t i = 0; i < n; ++i) c.bytes_differ += ba[i] != bb[i];
    if (!numeric(a.type)) continue;
    const auto dtype = q4::io::elem_scalar_type(a.type);
    const int64_t count = static_cast<int64_t>(n / esize);
    const at::Tensor ta = at::from_blob(ba.data(), {count}, dtype).to(at::kDouble);
    const at::Tensor tb = at::from_blob(bb.data(), {count}, dtype).to(at::kDouble);
    c.max_abs = std::max(c.max_abs, max_abs_of(ta, tb));
  }
  return c;
}

// Rows [r0, r0 + n) of an NVFP4 pair, dequantized to fp32: (n, cols).
at::Tensor dequant_rows(const DatReader& r, const Nvfp4Pair& p, int64_t r0, int64_t n) {
  const DatEntry& q = r.entries()[p.qdata_index];
  const DatEntry& s = r.entries()[p.scale_index];
  at::Tensor qd = at::empty({n, p.cols / 2}, at::TensorOptions().dtype(at::kByte));
  at::Tensor sc = at::empty({n, p.cols / 16}, at::TensorOptions().dtype(at::kByte));
  r.read_range(q.offset + static_cast<uint64_t>(r0 * p.cols / 2), qd.nbytes(), qd.data_ptr());
  r.read_range(s.offset + static_cast<uint64_t>(r0 * p.cols / 16), sc.nbytes(), sc.data_ptr());
  return q4::quant::dequantize_nvfp4(qd, sc, at::kFloat);
}

// Max abs difference between the dequantized values of two same-shape pairs, in row chunks.
double compare_pair_values(const DatReader& ra, const Nvfp4Pair& pa, const DatReader& rb,
                           const Nvfp4Pair& pb) {
  const int64_t step = std::max<int64_t>(1, (int64_t{1} << 21) / pa.cols);
  double m = 0.0;
  for (int64_t r0 = 0; r0 < pa.rows; r0 += step) {
    const int64_t n = std::min(step, pa.rows - r0);
    m = std::max(m, max_abs_of(dequant_rows(ra, pa, r0, n), dequant_rows(rb, pb, r0, n)));
  }
  return m;
}

}  // namespace

int run_diff(const DiffOptions& o) {
  const auto ra = as_input([&] { return std::make_unique<DatReader>(o.a); });
  const auto rb = as_input([&] { return std::make_unique<DatReader>(o.b); });
  uint64_t identical = 0, within = 0, different = 0, only_a = 0, only_b = 0;
  std::vector<std::string> common_a, common_b;
  // NVFP4 pairs by member key, for value comparison of pairs whose bytes differ.
  const std::vector<Nvfp4Pair> pairs_a = find_nvfp4_pairs(*ra, false);
  const std::vector<Nvfp4Pair> pairs_b = find_nvfp4_pairs(*rb, false);
  std::map<std::string, const Nvfp4Pair*> member_a, by_name_b;
  for (const Nvfp4Pair& p : pairs_a) {
    member_a[ra->entries()[p.qdata_index].key] = &p;
    member_a[ra->entries()[p.scale_index].key] = &p;
  }
  for (const Nvfp4Pair& p : pairs_b) by_name_b[p.name] = &p;
  std::map<std::string, double> pair_diff;  // cache: pair name -> max abs value difference
  for (const DatEntry& a : ra->entries()) {
    const DatEntry* b = rb->find(a.key);
    if (b == nullptr) {
      ++only_a;
      fmt::print("only-A    {}\n", a.key);
      continue;
    }
    common_a.push_back(a.key);
    if (a.type != b->type || a.shape != b->shape) {
      ++different;
      fmt::print("differs   {}  {} {} vs {} {}\n", a.key, q4::io::elem_type_name(a.type),
                 shape_str(a.shape), q4::io::elem_type_name(b->type), shape_str(b->shape));
      continue;
    }
    const Compared c = compare(*ra, a, *rb, *b);
    const Nvfp4Pair* pa = member_a.count(a.key) ? member_a[a.key] : nullptr;
    const Nvfp4Pair* pb = pa && by_name_b.count(pa->name) ? by_name_b[pa->name] : nullptr;
    if (!c.identical && pa && pb && pa->rows == pb->rows && pa->cols == pb->cols) {
      if (!pair_diff.count(pa->name)) {
        pair_diff[pa->name] = compare_pair_values(*ra, *pa, *rb, *pb);
      }
      const double m = pair_diff[pa->name];
      const bool ok = m <= o.atol;
      ok ? ++within : ++different;
      if (!ok || !o.quiet) {
        fmt::print("{:<10}{}  {} of {} bytes differ; NVFP4 values max_abs_diff={:.6g}\n",
                   ok ? "within" : "differs", a.key, c.bytes_differ, a.nbytes, m);
      }
    } else if (c.identical) {
      ++identical;
      if (!o.quiet) fmt::print("identical {}\n", a.key);
    } else if (numeric(a.type) && c.max_abs <= o.atol) {
      ++within;
      if (!o.quiet) fmt::print("within    {}  max_abs_diff={:.6g}\n", a.key, c.max_abs);
    } else if (numeric(a.type)) {
      ++different;
      fmt::print("differs   {}  max_abs_diff={:.6g}\n", a.key, c.max_abs);
    } else {
      ++different;
      fmt::print("differs   {}  {} of {} bytes differ ({})\n", a.key, c.bytes_differ, a.nbytes,
                 q4::io::elem_type_name(a.type));
    }
  }
  for (const DatEntry& b : rb->entries()) {
    if (ra->find(b.key) == nullptr) {
      ++only_b;
      fmt::print("only-B    {}\n", b.key);
    } else {
      common_b.push_back(b.key);
    }
  }
  const bool same_order = common_a == common_b;
  if (!same_order) fmt::print("order     the common entries appear in a different order\n");
  const bool equal = different == 0 && only_a == 0 && only_b == 0 && same_order;
  fmt::print(
      "diff: {} identical, {} within atol {:g}, {} different, {} only in A, {} only in "
      "B: {}\n",
      identical, within, o.atol, different, only_a, only_b, equal ? "equal" : "DIFFERENT");
  return equal ? 0 : 1;
}

}  // namespace q4::tools
