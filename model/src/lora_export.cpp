// LoRA adapters as a PEFT adapter folder; see Qwen3Model::export_adapter.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
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

// An MoE layer's expert adapters in peft's layout (docs/model.md#lora-on-experts), for
// transformers' fused Qwen3MoeExperts parameters gate_up_proj (E, 2I, H) and down_proj (E, H, I)
// targeted with target_parameters. peft nests one ParamWrapper per parameter on the experts
// module, down_proj's outside gate_up_proj's, so gate_up_proj's tensors sit under "base_layer.".
// lora_A (E·r, in): expert e's rows e·r..e·r+r-1, as q4 stores A. lora_B (out, r·E): expert e's
// rank j is column j·E + e; q4 stores B as (E·out, r) blocks, gate_up's out = [gate; up].
constexpr const char* kExperts = ".mlp.experts.";

// The module path "model.layers.N.mlp.experts" of a stacked expert tensor's name, or "".
std::string experts_module_of(const std::string& name) {
  const size_t at = name.find(kExperts);
  return at == std::string::npos ? "" : name.substr(0, at + std::strlen(kExperts) - 1);
}

// q4 B (E·out, r) blocks (or (E, out, r)) -> peft lora_B (out, r·E).
at::Tensor peft_b_of(const at::Tensor& b, int64_t E) {
  const int64_t r = b.size(-1);
  return b.reshape({E, -1, r}).permute({1, 2, 0}).reshape({-1, r * E}).contiguous();
}

// peft lora_B (out, r·E) -> q4 B (E, out, r).
at::Tensor q4_b_of(const at::Tensor& b, int64_t E) {
  return b.reshape({b.size(0), -1, E}).permute({2, 0, 1});
}

// The peft key (without base_model.model.) of adapter `a` of `m`.
std::string peft_adapter_key(const std::string& a) {
  const std::string module = experts_module_of(a);
  if (module.empty()) return a;
  const bool down = a.find(".down_proj.") != std::string::npos;
  const char* part = a.find(".lora_A.") != std::string::npos ? "lora_A" : "lora_B";
  return module + (down ? "." : ".base_layer.") + part + ".weight";
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
  std::vector<std::string> saved;       // modules_to_save, HF order
  std::vector<std::string> parameters;  // target_parameters, HF order
  const int64_t E = m.cfg.moe.num_experts;
  const auto cpu = [](const Parameter* a) { return a->master.detach().cpu().contiguous(); };
  for (size_t i = 0; i < m.params.size(); ++i) {
    const Parameter& p = m.params[i];
    if (p.lora_a == nullptr) continue;
    const std::string pre = "model.layers.";
    if (p.name.rfind(pre, 0) == 0) layers.insert(std::stoll(p.name.substr(pre.size())));
    const std::string experts = experts_module_of(p.name);
    if (experts.empty()) {
      for (const Parameter* a : {p.lora_a, p.lora_b}) add(a->name, cpu(a));
      const std::string base = peft_module_of(p.name);
      modules.insert(base.substr(base.rfind('.') + 1));
    } else if (name_ends_with(p.name, ".gate_proj.weight")) {
      // gate and up (the next parameter) share A; their Bs stack as gate_up_proj's rows.
      const Parameter& up = m.params[i + 1];
      TORCH_INTERNAL_ASSERT(up.lora_a == p.lora_a);
      const int64_t r = p.lora_b->master.size(1);
      const at::Tensor b = at::cat({cpu(p.lora_b).view({E, -1, r}), cpu(up.lora_b).view({E, -1, r})}, 1);
      add(experts + ".base_layer.lora_A.weight", cpu(p.lora_a));
      add(experts + ".base_layer.lora_B.weight", peft_b_of(b, E));
      parameters.push_back(experts + ".gate_up_proj");
    } else if (name_ends_with(p.name, ".down_proj.weight")) {
      add(experts + ".lora_A.weight", cpu(p.lora_a));
      add(experts + ".lora_B.weight", peft_b_of(cpu(p.lora_b), E));
      parameters.push_back(experts + ".down_proj");
    }
  }
  // Every other trained tensor, as the forward computes with it (docs/trainer.md#lora-adapters):
  // without them the adapter on its base is not the trained model.
  for (const Parameter& p : m.params) {
    if (!p.trainable) continue;
    at::NoGradGuard no_grad;
    at::Tensor w = p.master.detach();
    if (p.quantized && m.opt.fake_quant) {
      w = q4::quant::fake_quant_nvfp4_forward(w, p.name, m.opt.block_rule);
    }
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
  // Expert adapters: full parameter paths (peft matches them exactly, whatever the layers).
  if (!parameters.empty()) cfg["target_parameters"] = parameters;
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

namespace {

// peft's target_parameters: q4 applies the fused experts' pair, gate_up_proj and down_proj
// (each entry the parameter's path or its end), as the target "experts"; the layers are
// layers_to_transform's, and load_adapter names any expert tensor missing or left over.
void read_target_parameters(const nlohmann::json& j, const std::string& path,
                            std::vector<std::string>* targets) {
  if (!j.contains("target_parameters") || j.at("target_parameters").is_null()) return;
  const auto& tp = j.at("target_parameters");
  TORCH_CHECK(tp.is_array(), path, ": \"target_parameters\" must be a list of parameter names");
  bool gate_up = false, down = false;
  for (const auto& x : tp) {
    const std::string v = x.is_string() ? x.get<std::string>() : "";
    const bool g = v == "mlp.experts.gate_up_proj" || name_ends_with(v, ".mlp.experts.gate_up_proj");
    const bool d = v == "mlp.experts.down_proj" || name_ends_with(v, ".mlp.experts.down_proj");
    TORCH_CHECK(g || d, path, ": \"target_parameters\" holds ", x.dump(),
                ", which q4 does not apply (only mlp.experts.gate_up_proj and "
                "mlp.experts.down_proj)");
    gate_up = gate_up || g;
    down = down || d;
  }
  if (tp.empty()) return;
  TORCH_CHECK(gate_up && down, path,
              ": \"target_parameters\" must name both mlp.experts.gate_up_proj and "
              "mlp.experts.down_proj (q4 adapts an expert's three projections together)");
  targets->push_back("experts");
}

}  // namespace

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
                          "trainable_token_indices"}) {
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
  TORCH_CHECK(t.is_array(), path, ": \"target_modules\" must be a list of names");
  for (const auto& m : t) {
    TORCH_CHECK(m.is_string(), path, ": \"target_modules\" holds ", m.dump());
    a.lora.targets.push_back(m.get<std::string>());
  }
  read_target_parameters(j, path, &a.lora.targets);
  TORCH_CHECK(!a.lora.targets.empty(), path,
              ": \"target_modules\" and \"target_parameters\" name nothing to adapt");
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

// Tensor `t` (`name` without the PEFT prefix) of an MoE layer's expert adapters, in peft's
// layout, into q4's A and B (experts_module_of's note).
void load_expert_tensor(const SafetensorsFile& f, const std::string& path, const StTensor& t,
                        const std::string& name, int64_t E,
                        const std::map<std::string, Parameter*>& adapters,
                        std::set<const Parameter*>* applied) {
  const std::string module = experts_module_of(name);
  std::string rest = name.substr(module.size() + 1);
  const bool gate_up = rest.rfind("base_layer.", 0) == 0;
  if (gate_up) rest = rest.substr(std::strlen("base_layer."));
  const bool is_a = rest.rfind("lora_A.", 0) == 0;
  TORCH_CHECK((is_a || rest.rfind("lora_B.", 0) == 0) &&
                  (rest.substr(7) == "weight" || rest.substr(7) == "default.weight"),
              path, ": tensor ", t.name, " is not a LoRA A or B weight of the experts");
  const std::string proj = module + (gate_up ? ".gate_up_proj" : ".down_proj");
  const auto get = [&](const std::string& adapter) {
    const auto it = adapters.find(adapter);
    TORCH_CHECK(it != adapters.end(), path, ": tensor ", t.name, " is not applied: ", module,
                " has no expert adapters (not an MoE layer, or outside layers_to_transform)");
    TORCH_CHECK(applied->insert(it->second).second, path, ": ", t.name, " is stored twice");
    return it->second;
  };
  if (is_a) {
    Parameter* a = get(proj + ".lora_A.weight");
    a->master.copy_(load_checked(f, path, t, a->master.sizes().vec()).to(a->master.scalar_type()));
    return;
  }
  const std::vector<std::string> bs =
      gate_up ? std::vector<std::string>{module + ".gate_proj.lora_B.weight",
                                         module + ".up_proj.lora_B.weight"}
              : std::vector<std::string>{module + ".down_proj.lora_B.weight"};
  std::vector<Parameter*> ps;
  for (const auto& b : bs) ps.push_back(get(b));
  const int64_t out = ps[0]->master.size(0) / E, r = ps[0]->master.size(1);
  const at::Tensor v = q4_b_of(
      load_checked(f, path, t, {out * static_cast<int64_t>(ps.size()), r * E}), E);  // (E, o, r)
  for (size_t i = 0; i < ps.size(); ++i) {
    ps[i]->master.copy_(v.narrow(1, static_cast<int64_t>(i) * out, out)
                            .reshape({E * out, r})
                            .to(ps[i]->master.device(), ps[i]->master.scalar_type()));
  }
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
    if (!experts_module_of(name).empty() && name.find("lora_") != std::string::npos) {
      load_expert_tensor(f, path, t, name, m.cfg.moe.num_experts, adapters, &applied);
      continue;
    }
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
    const std::string key = kPeftPrefix + peft_adapter_key(a.name);
    TORCH_CHECK(applied.count(&a) != 0, path, ": no tensor ", key);
  }
  if (tied_head != nullptr) {
    // A tied lm_head is the embedding: peft keeps both only when both were saved alike.
    const StTensor* e = f.find(std::string(kPeftPrefix) + "model.embed_tokens.weight");
    TORCH_CHECK(e != nullptr && at::equal(f.load(*e), f.load(*tied_head)), path, ": tensor ",
                tied_head->name, " differs from ", kPeftPrefix,
                "model.embed_tokens.weight, but the model ties lm_head to the embedding");
  }
  for (const Parameter& p : m.params) r.lora_pairs += p.lora_a != nullptr ? 1 : 0;
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
    const at::Tensor fq =
        q4::quant::fake_quant_nvfp4_forward_unchecked(merged, at::kFloat, p.name, m.opt.block_rule);
    err += (fq - merged).pow(2).sum().item<double>();
    const at::Tensor ba =
        lora_delta(p.lora_b->master.to(at::kFloat), p.lora_a->master.to(at::kFloat));
    upd += ba.mul_(m.opt.lora.scale()).pow(2).sum().item<double>();
  }
  return upd > 0.0 ? std::sqrt(err / upd) : 0.0;
}

}  // namespace q4::model
