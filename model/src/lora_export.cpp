// LoRA adapters as a PEFT adapter folder; see Qwen3Model::export_adapter.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
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

namespace {

constexpr const char* kPeftPrefix = "base_model.model.";

bool name_ends_with(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

StDtype st_dtype_of(const at::Tensor& t) {
  if (t.scalar_type() == at::kHalf) return StDtype::kF16;
  if (t.scalar_type() == at::kBFloat16) return StDtype::kBF16;
  return StDtype::kF32;
}

// The module path of a weight ("model.norm.weight" -> "model.norm").
std::string peft_module_of(const std::string& weight) {
  return weight.substr(0, weight.size() - std::string(".weight").size());
}

}  // namespace

void Qwen3Model::export_adapter(const std::string& dir, const std::string& base_model) const {
  const Impl& m = *impl_;
  TORCH_CHECK(!m.adapters.empty(), "export_adapter: the model has no LoRA adapters");
  m.fence(nullptr);
  fs::create_directories(dir);
  // PEFT's keys for a PeftModelForCausalLM around Qwen3ForCausalLM: base_model.model.<name>,
  // the adapter name ("default") left out; tensors in the masters' dtype (fp32 stays fp32).
  std::vector<SafetensorsWriter::Decl> decls;
  std::vector<at::Tensor> data;
  const auto add = [&](const std::string& name, const at::Tensor& t) {
    decls.push_back({kPeftPrefix + name, st_dtype_of(t), t.sizes().vec()});
    data.push_back(t);
  };
  std::set<std::string> modules;
  std::set<int64_t> layers;
  std::vector<std::string> saved;  // modules_to_save, HF order
  for (const Parameter& p : m.params) {
    if (p.lora_a == nullptr) continue;
    for (const Parameter* a : {p.lora_a, p.lora_b})
      add(a->name, a->master.detach().cpu().contiguous());
    const std::string base = peft_module_of(p.name);
    modules.insert(base.substr(base.rfind('.') + 1));
    const std::string pre = "model.layers.";
    if (p.name.rfind(pre, 0) == 0) layers.insert(std::stoll(p.name.substr(pre.size())));
  }
  // Every other trained tensor, as the forward computes with it (docs/trainer.md#lora-adapters):
  // without them the adapter on its base is not the trained model.
  for (const Parameter& p : m.params) {
    if (!p.trainable) continue;
    at::NoGradGuard no_grad;
    at::Tensor w = p.master.detach();
    if (p.quantized && m.opt.fake_quant) w = q4::quant::fake_quant_nvfp4_forward(w, p.name);
    w = w.cpu().contiguous();
    add(p.name, w);
    saved.push_back(peft_module_of(p.name));
    if (&p == m.embed && m.tied) {
      add("lm_head.weight", w);
      saved.push_back("lm_head");
    }
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
  };
  // Full module paths: peft matches an entry against the end of a module's path, so a short
  // name ("norm") would also take modules that did not train.
  cfg["modules_to_save"] = saved.empty() ? nlohmann::json(nullptr) : nlohmann::json(saved);
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
  // Keys that change what the adapter computes, which q4 does not apply: refused when set
  // rather than dropped.
  for (const char* key : {"rank_pattern", "alpha_pattern", "exclude_modules", "layer_replication",
                          "trainable_token_indices", "target_parameters"}) {
    if (!j.contains(key)) continue;
    const auto& v = j.at(key);
    TORCH_CHECK(v.is_null() || ((v.is_object() || v.is_array() || v.is_string()) && v.empty()),
                path, ": \"", key, "\" is ", v.dump(),
                ", which q4 does not apply (only empty or null)");
  }
  for (const char* flag : {"lora_bias", "use_qalora"}) {
    TORCH_CHECK(!j.contains(flag) || j.at(flag).is_null() || j.at(flag) == false, path, ": \"",
                flag, "\" is set, which q4 does not support");
  }
  AdapterConfig a;
  if (j.contains("modules_to_save") && !j.at("modules_to_save").is_null()) {
    const auto& ms = j.at("modules_to_save");
    TORCH_CHECK(ms.is_array(), path, ": \"modules_to_save\" must be a list of module names");
    for (const auto& x : ms) {
      TORCH_CHECK(x.is_string() && !x.get<std::string>().empty(), path,
                  ": \"modules_to_save\" holds ", x.dump());
      a.modules_to_save.push_back(x.get<std::string>());
    }
  }
  if (j.contains("base_model_name_or_path") && j.at("base_model_name_or_path").is_string()) {
    a.base_model = j.at("base_model_name_or_path").get<std::string>();
  }
  TORCH_CHECK(need("r").is_number_integer() && j.at("r").get<int64_t>() > 0, path,
              ": \"r\" must be a positive integer");
  a.lora.rank = j.at("r").get<int64_t>();
  TORCH_CHECK(need("lora_alpha").is_number(), path, ": \"lora_alpha\" must be a number");
  a.lora.alpha = j.at("lora_alpha").get<double>();
  // The update is scaled by lora_alpha / r in fp32 GEMMs.
  TORCH_CHECK(a.lora.alpha > 0 && std::isfinite(static_cast<float>(a.lora.scale())), path,
              ": \"lora_alpha\" ", j.at("lora_alpha").dump(), " / \"r\" ", a.lora.rank,
              " must be a positive finite fp32 number");
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

namespace {

// Why a LoRA tensor of linear `linear` has no adapter in model `m`.
std::string why_not_adapted(Qwen3Model::Impl& m, const std::string& linear) {
  const int64_t L = m.cfg.num_hidden_layers;
  const std::string pre = "model.layers.";
  if (linear.rfind(pre, 0) == 0) {
    const int64_t layer = std::atoll(linear.c_str() + pre.size());
    if (layer >= L) {
      return "layer " + std::to_string(layer) + ", but the model has " + std::to_string(L) +
             " decoder layers";
    }
  }
  if (m.find(linear) == nullptr) return "no linear of the model is " + linear;
  const std::string s = linear_short_name(linear);
  const auto& t = m.opt.lora.targets;
  if (s.empty() || std::find(t.begin(), t.end(), s) == t.end()) {
    return "its module is not in target_modules";
  }
  return "its layer is not in layers_to_transform";
}

// Every modules_to_save entry is the end of some module of `m` (PEFT's matching).
void check_modules_to_save(const Qwen3Model::Impl& m, const AdapterConfig& ac,
                           const std::string& dir) {
  for (const auto& e : ac.modules_to_save) {
    bool any = false;
    for (const Parameter& p : m.params) any = any || name_ends_with(peft_module_of(p.name), e);
    any = any || (m.tied && name_ends_with("lm_head", e));
    TORCH_CHECK(any, dir, "/adapter_config.json: modules_to_save names \"", e,
                "\", which is the end of no module of the model");
  }
}

// The values of tensor `t` of the adapter file `f` (at `path`), checked: a float tensor of
// `shape`, every element finite.
at::Tensor load_checked(const SafetensorsFile& f, const std::string& path, const StTensor& t,
                        const std::vector<int64_t>& shape) {
  TORCH_CHECK(t.shape == shape, path, ": ", t.name, " has shape ", at::IntArrayRef(t.shape),
              ", the model's is ", at::IntArrayRef(shape));
  at::Tensor v = f.load(t);
  TORCH_CHECK(v.is_floating_point(), path, ": ", t.name, " is not a float tensor");
  TORCH_CHECK(at::isfinite(v).all().item<bool>(), path, ": ", t.name,
              " holds non-finite values (NaN or Inf)");
  return v;
}

}  // namespace

AdapterLoad Qwen3Model::load_adapter(const std::string& dir) {
  Impl& m = *impl_;
  TORCH_CHECK(!m.adapters.empty(), "load_adapter: the model was built without LoRA adapters");
  const AdapterConfig ac = read_adapter_config(dir);
  const std::string path = (fs::path(dir) / "adapter_model.safetensors").string();
  TORCH_CHECK(fs::is_regular_file(path), "adapter ", dir, ": no adapter_model.safetensors");
  const SafetensorsFile f(path);
  at::NoGradGuard no_grad;
  std::map<std::string, Parameter*> adapters;
  for (Parameter& a : m.adapters) adapters[a.name] = &a;
  check_modules_to_save(m, ac, dir);
  const auto in_modules_to_save = [&](const std::string& module) {
    for (const auto& e : ac.modules_to_save) {
      if (name_ends_with(module, e)) return true;
    }
    return false;
  };
  AdapterLoad r;
  std::set<const Parameter*> applied;
  const StTensor* tied_head = nullptr;
  const auto load = [&](const StTensor& t, const std::vector<int64_t>& shape) {
    return load_checked(f, path, t, shape);
  };
  for (const StTensor& t : f.tensors()) {
    TORCH_CHECK(t.name.rfind(kPeftPrefix, 0) == 0, path, ": tensor ", t.name,
                " is not a PEFT key (base_model.model.<name>)");
    std::string name = t.name.substr(std::string(kPeftPrefix).size());
    for (const char* part : {".lora_A.", ".lora_B."}) {
      const size_t at = name.find(part);
      if (at == std::string::npos) continue;
      // "<linear>.lora_A[.default].weight" -> the adapter "<linear>.lora_A.weight".
      const std::string linear = name.substr(0, at) + ".weight";
      const std::string tail = name.substr(at + std::strlen(part));
      TORCH_CHECK(tail == "weight" || tail == "default.weight", path, ": tensor ", t.name,
                  " is not a LoRA A or B weight");
      name = lora_param_name(linear, part[6] == 'A' ? "lora_A" : "lora_B");
      const auto it = adapters.find(name);
      TORCH_CHECK(it != adapters.end(), path, ": tensor ", t.name,
                  " is not applied: ", why_not_adapted(m, linear));
      TORCH_CHECK(applied.insert(it->second).second, path, ": ", t.name, " is stored twice");
      Parameter& a = *it->second;
      a.master.copy_(load(t, a.master.sizes().vec()).to(a.master.scalar_type()));
    }
    if (name.find(".lora_") != std::string::npos || name.find("lora_") == 0) {
      if (adapters.count(name) != 0) continue;  // applied above
      TORCH_CHECK(false, path, ": tensor ", t.name, " is not a LoRA A or B weight q4 applies");
    }
    // A weight replaced whole: its module must be in modules_to_save.
    TORCH_CHECK(name_ends_with(name, ".weight") && in_modules_to_save(peft_module_of(name)), path,
                ": tensor ", t.name,
                " is neither a LoRA A/B weight nor the weight of a module in modules_to_save");
    if (name == "lm_head.weight" && m.tied) {
      tied_head = &t;  // checked against the embedding below
      continue;
    }
    Parameter* p = m.find(name);
    TORCH_CHECK(p != nullptr, path, ": tensor ", t.name, " names no weight of the model");
    TORCH_CHECK(p->lora_a == nullptr, path, ": tensor ", t.name,
                " replaces a linear the adapter also adapts with LoRA");
    TORCH_CHECK(applied.insert(p).second, path, ": ", t.name, " is stored twice");
    m.fence(p);
    p->master.copy_(load(t, m.shape_of(p)).to(p->master.device(), p->master.scalar_type()));
    ++r.full_tensors;
  }
  for (const Parameter& a : m.adapters) {
    const std::string key = kPeftPrefix + a.name;
    TORCH_CHECK(applied.count(&a) != 0, path, ": no tensor ", key);
  }
  if (tied_head != nullptr) {
    // A tied lm_head is the embedding: peft keeps both only when both were saved alike.
    const StTensor* e = f.find(std::string(kPeftPrefix) + "model.embed_tokens.weight");
    TORCH_CHECK(e != nullptr && at::equal(f.load(*e), f.load(*tied_head)), path, ": tensor ",
                tied_head->name, " differs from ", kPeftPrefix,
                "model.embed_tokens.weight, but the model ties lm_head to the embedding");
  }
  r.lora_pairs = static_cast<int64_t>(m.adapters.size() / 2);
  return r;
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
