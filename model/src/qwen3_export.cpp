// Export of a (trained) model back to the .dat of its source: same entries, same order, same
// element types. A trainable parameter is rewritten only when its master differs from what
// load() would produce from the source entry (requantized with the NVFP4 rules, or cast back to
// the source's raw type); everything else is copied byte-exactly. DatWriter makes it atomic.
// write_dat() writes a model without a source file (a random init) in the same layout.
#include <ATen/ATen.h>

#include <optional>
#include <unordered_map>

#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"

namespace q4::model {

namespace {

// The NVFP4 pair export_to writes for the quantized parameter `p` (source entry `name`), on the
// host: nullopt when the source's pair is kept (copied byte-exactly), else the new packed data.
// An adapted linear: its merged weight W + s·B·A, quantized (what a merge-aware forward computes
// with, bit for bit). Otherwise the source is kept where it decodes to the forward's weight; a
// changed one is the model's packed data, or its master quantized.
std::optional<q4::quant::Nvfp4Tensor> exported_pair(const Qwen3Model::Impl& m, const Parameter& p,
                                                    const DatReader& source,
                                                    const std::string& name,
                                                    const std::string& where) {
  auto on_host = [](const q4::quant::Nvfp4Tensor& t) {
    return q4::quant::Nvfp4Tensor{t.qdata.cpu().contiguous(), t.scale.cpu().contiguous()};
  };
  if (p.lora_a != nullptr) {
    return on_host(q4::quant::quantize_nvfp4(m.merged_weight(&p), p.name, m.opt.block_rule));
  }
  bool unchanged = false;
  {
    // The source's dequantized weight lives only for the comparison (the export runs next to
    // the masters and moments, so its temporaries count toward the run's peak).
    const q4::quant::Nvfp4Tensor src = source.load_nvfp4(*source.find_nvfp4(name));
    const at::Device dev = m.opt.device;
    const at::Tensor deq =
        q4::quant::dequantize_nvfp4(src.qdata.to(dev), src.scale.to(dev), p.master.scalar_type());
    TORCH_CHECK(deq.sizes() == p.master.sizes(), where, ": dequantized shape ", deq.sizes(),
                " differs from the model's ", p.master.sizes());
    // Under 4-over-6 a file's max6 codes need not be what the rule makes of their own values:
    // the source is kept only where it decodes to the forward's weight.
    const at::Tensor master = m.device_master(&p);
    unchanged =
        m.opt.block_rule == q4::quant::BlockRule::kMax6
            ? at::equal(deq, master)
            : at::equal(deq, q4::quant::fake_quant_nvfp4_forward(master, p.name, m.opt.block_rule));
  }
  if (unchanged) return std::nullopt;
  if (p.qdata.defined()) return on_host({p.qdata, p.scale});
  return on_host(q4::quant::quantize_nvfp4(p.master, p.name, m.opt.block_rule));
}

}  // namespace

void Qwen3Model::export_to(const DatReader& source, const std::string& path,
                           bool dense_linears) const {
  Impl& m = *impl_;
  m.fence(nullptr);  // every master current before any is read
  TORCH_CHECK(path != source.path(), "export: output path ", path,
              " must differ from the source file");
  TORCH_CHECK(!dense_linears || !m.opt.fake_quant,
              "export: dense linears are the export of a plain-precision model (fake_quant off)");
  // A trained NVFP4 pair written dense: one fp16 entry (the pair's name without .qdata) at the
  // qdata's position, no scale entry.
  auto written_dense = [&](const Parameter* p) {
    return dense_linears && p->trainable && p->quantized;
  };
  uint64_t count = source.entries().size();
  for (const DatEntry& e : source.entries()) {
    const KeyRef ref = classify_key(e.key);
    const Parameter* p = m.find(ref.name);
    count -= p != nullptr && written_dense(p) && ref.part == KeyRef::Part::kScale ? 1 : 0;
  }
  DatWriter out(path, count);
  // Per quantized parameter: nullopt = unchanged (copy both halves), else the new packed data.
  std::unordered_map<std::string, std::optional<q4::quant::Nvfp4Tensor>> decided;

  for (size_t i = 0; i < source.entries().size(); ++i) {
    const DatEntry& e = source.entries()[i];
    KeyRef ref = classify_key(e.key);
    Parameter* p = m.find(ref.name);
    const std::string where = source.path() + ": entry " + std::to_string(i) + " '" + e.key + "'";
    if (p == nullptr || (!p->trainable && p->lora_a == nullptr)) {
      out.copy_from(source, e);
      continue;
    }
    TORCH_CHECK(ref.part == KeyRef::Part::kRaw || p->quantized, where, ": ", p->name,
                " is raw in this model but quantized in the export source");
    TORCH_CHECK(ref.part != KeyRef::Part::kRaw || !p->quantized, where, ": ", p->name,
                " is quantized in this model but raw in the export source");
    if (written_dense(p)) {
      if (ref.part == KeyRef::Part::kQData) {
        out.add(p->name, p->master.to(at::kCPU, at::kHalf).contiguous(), ElemType::kFloat16);
      }
      continue;
    }
    if (ref.part == KeyRef::Part::kRaw) {
      TORCH_CHECK(e.shape == p->master.sizes().vec(), where, ": shape differs from the model's ",
                  p->master.sizes());
      at::Tensor src = source.load(e);
      at::Tensor as_loaded = src.to(p->master.device()).to(p->master.scalar_type());
      if (at::equal(as_loaded, p->master)) {
        out.copy_from(source, e);
      } else {
        out.add(e.key, p->master.to(src.scalar_type()).cpu().contiguous(), e.type);
      }
      continue;
    }
    auto it = decided.find(ref.name);
    if (it == decided.end()) {
      it = decided.emplace(ref.name, exported_pair(m, *p, source, ref.name, where)).first;
    }
    if (!it->second) {
      out.copy_from(source, e);
    } else if (ref.part == KeyRef::Part::kQData) {
      TORCH_CHECK(e.shape == it->second->qdata.sizes().vec(), where, ": shape differs");
      out.add(e.key, it->second->qdata, e.type);
    } else {
      TORCH_CHECK(e.shape == it->second->scale.sizes().vec(), where, ": shape differs");
      out.add(e.key, it->second->scale, e.type);
    }
  }
  out.commit();
}

void write_dat(const Qwen3Model& model, const std::string& path, bool quantize_lm_head,
               bool quantize_linears) {
  const auto& params = model.parameters();
  auto quantized = [&](const Parameter& p) {
    if (p.lora_a != nullptr) return true;  // its merge, quantized (as export_to writes it)
    if (p.name == "lm_head.weight") return quantize_lm_head;
    return quantize_linears && p.quantized;
  };
  uint64_t count = 0;
  for (const auto& p : params) count += quantized(p) ? 2 : 1;
  DatWriter w(path, count);
  for (const auto& p : params) {
    if (quantized(p)) {
      const auto q = q4::quant::quantize_nvfp4(
          p.lora_a != nullptr ? model.merged_weight(p) : p.master.to(at::kFloat), p.name,
          model.options().block_rule);
      w.add_nvfp4(p.name, {q.qdata.cpu(), q.scale.cpu()}, ElemType::kE2M1Packed);
    } else {
      w.add(p.name, p.master.to(at::kCPU, at::kHalf).contiguous(), ElemType::kFloat16);
    }
  }
  w.commit();
}

}  // namespace q4::model
