// q4dat quantize / dequantize. Both validate everything before the writer opens (so a bad
// target writes nothing), keep entry order (a converted entry takes the position of its source),
// hold one tensor at a time, and copy every other entry byte-exactly from the input.
#include <fmt/core.h>

#include <regex>
#include <unordered_set>

#include "common.h"
#include "q4/io/dat_file.h"
#include "q4/quant/nvfp4.h"
#include "q4dat.h"

namespace q4::tools {

using q4::io::DatEntry;
using q4::io::DatReader;
using q4::io::DatWriter;
using q4::io::ElemType;

namespace {

bool is_float(ElemType t) {
  return t == ElemType::kFloat32 || t == ElemType::kFloat16 || t == ElemType::kBFloat16;
}

}  // namespace

int run_quantize(const QuantizeOptions& o) {
  std::regex re;
  try {
    re = std::regex(o.match, std::regex::ECMAScript);
  } catch (const std::regex_error& e) {
    throw InputError("--match '" + o.match + "': invalid regular expression: " + e.what());
  }
  if (o.qdata_elem != 0 && o.qdata_elem != 100) {
    throw InputError(fmt::format("--qdata-elem: expected 0 or 100, found {}", o.qdata_elem));
  }
  check_output_file(o.out, {o.in}, o.overwrite);
  const auto r = as_input([&] { return std::make_unique<DatReader>(o.in); });
  const auto& es = r->entries();

  // Validate every match before writing anything.
  std::vector<bool> selected(es.size(), false);
  std::unordered_set<std::string> new_keys;
  size_t n_sel = 0;
  for (size_t i = 0; i < es.size(); ++i) {
    const DatEntry& e = es[i];
    if (!std::regex_search(e.key, re)) continue;
    if (!is_float(e.type) || e.shape.size() != 2 || e.shape[1] % q4::quant::kNvfp4BlockSize != 0) {
      throw InputError(fmt::format(
          "{}: entry {} '{}' matches --match '{}' but is {} {}; quantize needs a 2-D fp32/fp16/"
          "bf16 matrix whose column count is a multiple of {}",
          o.in, i, e.key, o.match, q4::io::elem_type_name(e.type), shape_str(e.shape),
          q4::quant::kNvfp4BlockSize));
    }
    for (const std::string& k : {e.key + ".qdata", e.key + ".scale"}) {
      if (r->find(k) != nullptr || !new_keys.insert(k).second) {
        throw InputError(
            fmt::format("{}: quantizing entry {} '{}' would create '{}', which "
                        "already exists",
                        o.in, i, e.key, k));
      }
    }
    selected[i] = true;
    ++n_sel;
  }
  if (n_sel == 0) {
    throw InputError(fmt::format("{}: --match '{}' matches no entry", o.in, o.match));
  }

  DatWriter w(o.out, es.size() + n_sel);
  const auto qtype = static_cast<ElemType>(o.qdata_elem);
  for (size_t i = 0; i < es.size(); ++i) {
    const DatEntry& e = es[i];
    if (!selected[i]) {
      w.copy_from(*r, e);
      continue;
    }
    const at::Tensor x = r->load(e);  // (r, c) float
    // NaN/Inf weights are bad input, reported with the entry's key.
    const q4::quant::Nvfp4Tensor q = as_input([&] { return q4::quant::quantize_nvfp4(x, e.key); });
    w.add_nvfp4(e.key, q, qtype);  // key.qdata (r, c/2), key.scale (r, c/16)
  }
  w.commit();
  fmt::print("{}: {} entries quantized, {} copied\n", o.out, n_sel, es.size() - n_sel);
  return 0;
}

int run_dequantize(const DequantizeOptions& o) {
  at::ScalarType dtype = at::kFloat;
  if (o.dtype == "fp16") {
    dtype = at::kHalf;
  } else if (o.dtype == "bf16") {
    dtype = at::kBFloat16;
  } else if (o.dtype != "fp32") {
    throw InputError("--dtype: expected fp32, fp16 or bf16, found " + o.dtype);
  }
  check_output_file(o.out, {o.in}, o.overwrite);
  const auto r = as_input([&] { return std::make_unique<DatReader>(o.in); });
  const auto& es = r->entries();
  const std::vector<Nvfp4Pair> pairs = find_nvfp4_pairs(*r, /*strict=*/true);
  if (pairs.empty()) throw InputError(o.in + ": no NVFP4 pairs (X.qdata + X.scale) to dequantize");

  std::vector<const Nvfp4Pair*> at_qdata(es.size(), nullptr);
  std::vector<bool> is_scale(es.size(), false);
  for (const Nvfp4Pair& p : pairs) {
    at_qdata[p.qdata_index] = &p;
    is_scale[p.scale_index] = true;
    if (r->find(p.name) != nullptr) {
      throw InputError(fmt::format("{}: dequantizing '{}' would create '{}', which already exists",
                                   o.in, p.name + ".qdata", p.name));
    }
  }

  DatWriter w(o.out, es.size() - pairs.size());
  for (size_t i = 0; i < es.size(); ++i) {
    if (is_scale[i]) continue;
    if (const Nvfp4Pair* p = at_qdata[i]) {
      const q4::quant::Nvfp4Tensor q = r->load_nvfp4(*p);
      w.add(p->name, q4::quant::dequantize_nvfp4(q.qdata, q.scale, dtype));  // (r, c)
    } else {
      w.copy_from(*r, es[i]);
    }
  }
  w.commit();
  fmt::print("{}: {} pairs dequantized to {}, {} entries copied\n", o.out, pairs.size(), o.dtype,
             es.size() - 2 * pairs.size());
  return 0;
}

}  // namespace q4::tools
