// LoRA adapters as a PEFT adapter folder; see Qwen3Model::export_adapter.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
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

AdapterConfig read_adapter_config(const std::string& dir) {
  const std::string path = (fs::path(dir) / "adapter_config.json").string();
  TORCH_CHECK(fs::is_regular_file(path), "adapter ", dir, ": no adapter_config.json");
  std::ifstream in(path);
  const auto j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(j.is_object(), path, ": not a JSON object");
  const auto need = [&](const char* key) -> const nlohmann::json& {
    TORCH_CHECK(j.contains(key), path, ": no \"", key, "\"");
    return j.at(key);
  };
  TORCH_CHECK(need("peft_type") == "LORA", path, ": peft_type is ", j.at("peft_type").dump(),
              ", only LORA adapters load");
  for (const char* flag : {"use_dora", "use_rslora", "fan_in_fan_out"}) {
    TORCH_CHECK(!j.contains(flag) || j.at(flag).is_null() || j.at(flag) == false, path, ": \"",
                flag, "\" is set, which q4 does not support");
  }
  TORCH_CHECK(!j.contains("bias") || j.at("bias") == "none", path, ": bias ", j.value("bias", ""),
              " is not supported (only \"none\")");
  TORCH_CHECK(!j.contains("modules_to_save") || j.at("modules_to_save").is_null() ||
                  j.at("modules_to_save").empty(),
              path, ": modules_to_save is not supported");
  AdapterConfig a;
  TORCH_CHECK(need("r").is_number_integer() && j.at("r").get<int64_t>() > 0, path,
              ": \"r\" must be a positive integer");
  a.lora.rank = j.at("r").get<int64_t>();
  TORCH_CHECK(need("lora_alpha").is_number(), path, ": \"lora_alpha\" must be a number");
  a.lora.alpha = j.at("lora_alpha").get<double>();
  const auto& t = need("target_modules");
  TORCH_CHECK(t.is_array() && !t.empty(), path, ": \"target_modules\" must be a list of names");
  for (const auto& m : t) {
    TORCH_CHECK(m.is_string(), path, ": \"target_modules\" holds ", m.dump());
    a.lora.targets.push_back(m.get<std::string>());
  }
  a.lora.merge_aware = false;
  if (j.contains("layers_to_transform") && !j.at("layers_to_transform").is_null()) {
    const auto& l = j.at("layers_to_transform");
    if (l.is_number_integer()) {
      a.layers.push_back(l.get<int64_t>());
    } else {
      TORCH_CHECK(l.is_array(), path, ": \"layers_to_transform\" must be a list of layers");
      for (const auto& x : l) {
        TORCH_CHECK(x.is_number_integer(), path, ": \"layers_to_transform\" holds ", x.dump());
        a.layers.push_back(x.get<int64_t>());
      }
    }
  }
  try {
    a.lora.validate();
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, path, ": ", e.what_without_backtrace());
  }
  return a;
}

ModelOptions with_adapter(ModelOptions opt, const AdapterConfig& adapter) {
  opt.lora = adapter.lora;
  opt.master_dtype = at::kFloat;  // A and B hold the file's values exactly (fp16/bf16/fp32)
  opt.trainable.layers = adapter.layers;
  opt.trainable.last_n_layers = -1;
  return opt;
}

void Qwen3Model::load_adapter(const std::string& dir) {
  Impl& m = *impl_;
  TORCH_CHECK(!m.adapters.empty(), "load_adapter: the model was built without LoRA adapters");
  const std::string path = (fs::path(dir) / "adapter_model.safetensors").string();
  TORCH_CHECK(fs::is_regular_file(path), "adapter ", dir, ": no adapter_model.safetensors");
  const SafetensorsFile f(path);
  at::NoGradGuard no_grad;
  for (Parameter& a : m.adapters) {
    const std::string key = "base_model.model." + a.name;
    const std::string named = key.substr(0, key.size() - 7) + ".default.weight";
    const StTensor* t = f.find(key) != nullptr ? f.find(key) : f.find(named);
    TORCH_CHECK(t != nullptr, path, ": no tensor ", key);
    TORCH_CHECK(t->shape == a.master.sizes().vec(), path, ": ", t->name, " has shape ",
                at::IntArrayRef(t->shape), ", the model's adapter is ", a.master.sizes());
    at::Tensor v = f.load(*t);
    TORCH_CHECK(v.is_floating_point(), path, ": ", t->name, " is not a float tensor");
    a.master.copy_(v.to(a.master.scalar_type()));
  }
}

at::Tensor Qwen3Model::merged_weight(const Parameter& adapted) const {
  return impl_->merged_weight(&adapted);
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
