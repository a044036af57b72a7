// Export verification without a second model: for every parameter of an exported .dat, the
// weight a model loaded from it would use in its forward (load()'s rules for a frozen model: a
// quantized entry is dequantized, a raw one cast to the compute dtype) is compared bit for bit
// with the weight this model's forward uses. Equal weights give equal logits and greedy answers,
// so this is the reload check at the cost of one tensor on the device at a time. Raw tensors
// are compared at the precision of their stored element type. A trained NVFP4 weight reloads as
// dequantize(quantize(master)), which is fake_quant(master), its forward weight, exactly.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <unordered_map>

#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"

namespace q4::model {

// Rows are compared `chunk_elems` elements at a time (16M by default), so the check's device
// temporaries stay ~100 MB whatever the tensor (the embedding and lm_head are 389M elements
// each). NVFP4 scales are per 16 elements of a row, so a row range quantizes exactly as it does
// inside the whole tensor.
std::vector<std::string> Qwen3Model::compare_forward_weights(const DatReader& exported,
                                                             int64_t chunk_elems) const {
  TORCH_CHECK(chunk_elems > 0, "compare_forward_weights: chunk_elems must be > 0");
  Impl& m = *impl_;
  m.fence(nullptr);  // every master current before any is read
  const at::Device dev = m.opt.device;
  const at::ScalarType cd = m.opt.compute_dtype;
  c10::NoGradGuard no_grad;
  // What this model's forward multiplies by, for a row range of the master; for an NVFP4 linear
  // of a plain-precision model (no fake quantization), what the export quantizer makes of it:
  // the NVFP4 export of such a model is its post-training quantization.
  auto forward_weight = [&](const Parameter& p, const at::Tensor& master) {
    if (p.quantized && (p.trainable || p.lora_a != nullptr || !m.opt.fake_quant)) {
      return q4::quant::fake_quant_nvfp4_forward_unchecked(master, cd, p.name, m.opt.block_rule);
    }
    if (!p.trainable) return master;
    return master.to(cd);
  };
  std::vector<std::string> differ;
  std::unordered_map<std::string, bool> seen;
  for (const DatEntry& e : exported.entries()) {
    const KeyRef ref = classify_key(e.key);
    const Parameter* p = m.find(ref.name);
    if (p == nullptr || seen.count(ref.name)) continue;
    seen[ref.name] = true;
    at::Tensor raw, qdata, scale;  // host copies of the exported entry
    if (ref.part == KeyRef::Part::kRaw) {
      raw = exported.load(e);
    } else {
      const DatEntry* q = exported.find(ref.name + ".qdata");
      const DatEntry* s = exported.find(ref.name + ".scale");
      TORCH_CHECK(q != nullptr && s != nullptr, exported.path(), ": ", ref.name,
                  " has only one half of its NVFP4 pair");
      qdata = exported.load(*q);
      scale = exported.load(*s);
    }
    // An adapted linear computes with fake_quant of its merged weight.
    const at::Tensor master = p->lora_a != nullptr ? m.merged_weight(p) : m.device_master(p);
    const int64_t rows = master.dim() >= 1 ? master.size(0) : 1;
    const int64_t row_elems = master.numel() / std::max<int64_t>(rows, 1);
    const bool shape_ok = raw.defined() ? raw.sizes() == master.sizes()
                                        : qdata.dim() == 2 && qdata.size(0) == rows &&
                                              qdata.size(1) * 2 == row_elems && master.dim() == 2;
    if (!shape_ok) {
      differ.push_back(ref.name + " (shape)");
      continue;
    }
    const int64_t step = master.dim() >= 2 ? std::max<int64_t>(1, chunk_elems / row_elems) : rows;
    int64_t mismatched = 0;
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t n = std::min(step, rows - r0);
      auto part = [&](const at::Tensor& t) { return master.dim() >= 1 ? t.narrow(0, r0, n) : t; };
      at::Tensor w;
      at::ScalarType stored = cd;  // a raw entry's element type: the export's precision
      if (raw.defined()) {
        stored = raw.scalar_type();
        w = part(raw).to(dev).to(cd);
      } else {
        // Dequantized values are exact in every float dtype, so dequantizing straight to the
        // compute dtype equals load()'s path.
        w = q4::quant::dequantize_nvfp4(part(qdata).to(dev), part(scale).to(dev), cd);
      }
      // A raw tensor is stored in its source element type (fp16 in the shipped layout): compare
      // with this model's weight rounded to that type, the most the file can hold (an fp32 master
      // exported to fp16 is rounded by design, not a defect of the export). A dense master is
      // rounded to the file's type first and then cast as load() casts it: rounding it to the
      // compute dtype first (bf16) and then to fp16 would round twice.
      // (A raw entry of an NVFP4 linear of a plain-precision model is its dense export.)
      const bool dense = raw.defined() && !(p->quantized && m.opt.fake_quant);
      const at::Tensor mine = dense
                                  ? part(master).to(stored).to(cd)
                                  : forward_weight(*p, part(master)).to(stored).to(w.scalar_type());
      if (!at::equal(w, mine)) mismatched += w.ne(mine).sum().item<int64_t>();
    }
    if (mismatched > 0) {
      differ.push_back(ref.name + " (" + std::to_string(mismatched) + " of " +
                       std::to_string(master.numel()) + " elements)");
    }
  }
  for (const auto& p : m.params) {
    if (!seen.count(p.name)) differ.push_back(p.name + " (missing)");
  }
  return differ;
}

}  // namespace q4::model
