// Export verification without a second model: for every parameter of an exported .dat, the
// weight a model loaded from it would use in its forward (load()'s rules: a quantized entry is
// dequantized and fake-quantized, a raw one cast to the compute dtype) is compared bit for bit
// with the weight this model's forward uses. Equal weights give equal logits and greedy answers,
// so this is the reload check at the cost of one tensor on the device at a time. Raw tensors
// are compared at the precision of their stored element type. A trained
// NVFP4 weight reloads as fake_quant(dequantize(quantize(master))), and fake-quantization is not
// idempotent in rare blocks (quantize(dequantize(q)) != q for ~0.5% of random blocks), so a
// few elements of a trained tensor can differ; the message counts them.
#include <ATen/ATen.h>

#include <unordered_map>

#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"

namespace q4::model {

std::vector<std::string> Qwen3Model::compare_forward_weights(const DatReader& exported) const {
  Impl& m = *impl_;
  const at::Device dev = m.opt.device;
  const at::ScalarType cd = m.opt.compute_dtype;
  c10::NoGradGuard no_grad;
  auto forward_weight = [&](const Parameter& p) {  // what this model's forward multiplies by
    if (!p.trainable) return p.master;
    if (p.quantized) return q4::quant::fake_quant_nvfp4_forward_unchecked(p.master, cd);
    return p.master.to(cd);
  };
  std::vector<std::string> differ;
  std::unordered_map<std::string, bool> seen;
  for (const DatEntry& e : exported.entries()) {
    const KeyRef ref = classify_key(e.key);
    const Parameter* p = m.find(ref.name);
    if (p == nullptr || seen.count(ref.name)) continue;
    at::Tensor w;
    at::ScalarType stored = cd;  // a raw entry's element type: the export's precision
    if (ref.part == KeyRef::Part::kRaw) {
      const at::Tensor raw = exported.load(e);
      stored = raw.scalar_type();
      w = raw.to(dev).to(cd);
    } else {
      const DatEntry* q = exported.find(ref.name + ".qdata");
      const DatEntry* s = exported.find(ref.name + ".scale");
      TORCH_CHECK(q != nullptr && s != nullptr, exported.path(), ": ", ref.name,
                  " has only one half of its NVFP4 pair");
      // Dequantized values are exact in every float dtype, so dequantizing straight to the
      // compute dtype equals load()'s path.
      w = q4::quant::dequantize_nvfp4(exported.load(*q).to(dev), exported.load(*s).to(dev), cd);
      w = q4::quant::fake_quant_nvfp4_forward_unchecked(w, cd);
    }
    seen[ref.name] = true;
    // A raw tensor is stored in its source element type (fp16 in the shipped layout): compare
    // with this model's weight rounded to that type, the most the file can hold (an fp32 master
    // exported to fp16 is rounded by design, not a defect of the export).
    const at::Tensor mine = forward_weight(*p).to(stored).to(cd);
    if (w.sizes() != mine.sizes()) {
      differ.push_back(ref.name + " (shape)");
    } else if (!at::equal(w, mine.to(w.scalar_type()))) {
      const int64_t n = w.ne(mine.to(w.scalar_type())).sum().item<int64_t>();
      differ.push_back(ref.name + " (" + std::to_string(n) + " of " + std::to_string(w.numel()) +
                       " elements)");
    }
  }
  for (const auto& p : m.params) {
    if (!seen.count(p.name)) differ.push_back(p.name + " (missing)");
  }
  return differ;
}

}  // namespace q4::model
