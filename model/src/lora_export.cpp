// LoRA adapters as a PEFT adapter folder; see Qwen3Model::export_adapter.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "q4/io/atomic_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"

namespace q4::model {

namespace fs = std::filesystem;

void Qwen3Model::export_adapter(const std::string& dir, const std::string& base_model) const {
  const Impl& m = *impl_;
  TORCH_CHECK(!m.adapters.empty(), "export_adapter: the model has no LoRA adapters");
  m.fence(nullptr);
  fs::create_directories(dir);
  // PEFT's keys for a PeftModelForCausalLM around Qwen3ForCausalLM: base_model.model.<name>,
  // the adapter name ("default") left out; tensors in the masters' dtype (fp32 stays fp32).
  std::vector<SafetensorsWriter::Decl> decls;
  std::vector<at::Tensor> data;
  std::set<std::string> modules;
  std::set<int64_t> layers;
  for (const Parameter& p : m.params) {
    if (p.lora_a == nullptr) continue;
    for (const Parameter* a : {p.lora_a, p.lora_b}) {
      const at::Tensor t = a->master.detach().cpu().contiguous();
      StDtype dt = StDtype::kF32;
      if (t.scalar_type() == at::kHalf) dt = StDtype::kF16;
      if (t.scalar_type() == at::kBFloat16) dt = StDtype::kBF16;
      decls.push_back({"base_model.model." + a->name, dt, t.sizes().vec()});
      data.push_back(t);
    }
    const std::string base = p.name.substr(0, p.name.size() - 7);  // without ".weight"
    modules.insert(base.substr(base.rfind('.') + 1));
    const std::string pre = "model.layers.";
    if (p.name.rfind(pre, 0) == 0) layers.insert(std::stoll(p.name.substr(pre.size())));
  }
  {
    SafetensorsWriter w((fs::path(dir) / "adapter_model.safetensors").string(), decls,
                        {{"format", "pt"}});
    for (const at::Tensor& t : data) w.append(t);
    w.commit();
  }
  const auto& lora = m.opt.lora;
  nlohmann::json cfg = {
      {"peft_type", "LORA"},
      {"task_type", "CAUSAL_LM"},
      {"base_model_name_or_path", base_model},
      {"r", lora.rank},
      {"lora_alpha", lora.alpha},
      {"lora_dropout", 0.0},
      {"target_modules", std::vector<std::string>(modules.begin(), modules.end())},
      {"bias", "none"},
      {"fan_in_fan_out", false},
      {"inference_mode", true},
      {"init_lora_weights", true},
      {"use_rslora", false},
      {"use_dora", false},
      {"modules_to_save", nullptr},
  };
  // Adapters on only some layers: PEFT's layers_to_transform names them.
  const int64_t L = m.cfg.num_hidden_layers;
  if (!layers.empty() && static_cast<int64_t>(layers.size()) < L) {
    cfg["layers_to_transform"] = std::vector<int64_t>(layers.begin(), layers.end());
  } else {
    cfg["layers_to_transform"] = nullptr;
  }
  io::AtomicFile f((fs::path(dir) / "adapter_config.json").string());
  f.write(cfg.dump(2) + "\n");
  f.commit();
}

double Qwen3Model::merged_requantization_error() const {
  const Impl& m = *impl_;
  at::NoGradGuard no_grad;
  double err = 0.0, upd = 0.0;
  for (const Parameter& p : m.params) {
    if (p.lora_a == nullptr) continue;
    const at::Tensor merged = m.merged_weight(&p);
    const at::Tensor fq = q4::quant::fake_quant_nvfp4_forward_unchecked(merged, at::kFloat, p.name);
    err += (fq - merged).pow(2).sum().item<double>();
    const at::Tensor ba = at::mm(p.lora_b->master.to(at::kFloat), p.lora_a->master.to(at::kFloat));
    upd += ba.mul_(m.opt.lora.scale()).pow(2).sum().item<double>();
  }
  return upd > 0.0 ? std::sqrt(err / upd) : 0.0;
}

}  // namespace q4::model
