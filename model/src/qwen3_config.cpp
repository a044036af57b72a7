// Qwen3 config.json reader. Every key is checked for presence and JSON type before use, so a
// malformed config yields one c10::Error naming the file and key instead of an nlohmann
// exception or a silently defaulted value (a hard-coded rope_theta of 1e6 would be wrong for
// the 4B config's 5e6: rope_theta is therefore required).
#include "q4/model/qwen3_config.h"

#include <c10/util/Exception.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/io/bounded_read.h"

namespace q4::model {
namespace {

// Bounds that keep every parameter count below 2^63 (7 linears of at most 2^24 x 2^24 per
// layer, at most 2^12 layers) while being far above any real model.
constexpr int64_t kMaxDim = int64_t{1} << 24;
constexpr int64_t kMaxLayers = int64_t{1} << 12;
// Experts per MoE layer: far above any release (128 in Qwen3-30B-A3B and 235B-A22B).
constexpr int64_t kMaxExperts = int64_t{1} << 12;

std::string dump_short(const nlohmann::json& v) {
  std::string s = v.dump();
  if (s.size() > 80) s = s.substr(0, 77) + "...";
  return s;
}

class Fields {
 public:
  Fields(const nlohmann::json& j, const std::string& src) : j_(j), src_(src) {}

  const nlohmann::json* get(const char* key) const {
    auto it = j_.find(key);
    return it == j_.end() ? nullptr : &*it;
  }

  int64_t required_int(const char* key, int64_t lo, int64_t hi) const {
    const nlohmann::json* v = get(key);
    TORCH_CHECK(v != nullptr && !v->is_null(), src_, ": missing required key '", key,
                "' (expected an integer)");
    return to_int(key, *v, lo, hi);
  }

  int64_t to_int(const char* key, const nlohmann::json& v, int64_t lo, int64_t hi) const {
    TORCH_CHECK(v.is_number_integer(), src_, ": key '", key, "': expected an integer, found ",
                dump_short(v));
    if (v.is_number_unsigned()) {
      TORCH_CHECK(v.get<uint64_t>() <= static_cast<uint64_t>(hi), src_, ": key '", key,
                  "': expected an integer in [", lo, ", ", hi, "], found ", dump_short(v));
    }
    const int64_t x = v.get<int64_t>();
    TORCH_CHECK(x >= lo && x <= hi, src_, ": key '", key, "': expected an integer in [", lo, ", ",
                hi, "], found ", x);
    return x;
  }

  double to_positive_double(const char* key, const nlohmann::json& v) const {
    TORCH_CHECK(v.is_number(), src_, ": key '", key, "': expected a number, found ", dump_short(v));
    const double x = v.get<double>();
    TORCH_CHECK(std::isfinite(x) && x > 0.0, src_, ": key '", key,
                "': expected a finite positive number, found ", dump_short(v));
    return x;
  }

  double required_positive_double(const char* key) const {
    const nlohmann::json* v = get(key);
    TORCH_CHECK(v != nullptr && !v->is_null(), src_, ": missing required key '", key,
                "' (expected a positive number)");
    return to_positive_double(key, *v);
  }

  std::optional<bool> optional_bool(const char* key) const {
    const nlohmann::json* v = get(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    TORCH_CHECK(v->is_boolean(), src_, ": key '", key, "': expected true or false, found ",
                dump_short(*v));
    return v->get<bool>();
  }

  std::optional<std::string> optional_string(const char* key) const {
    const nlohmann::json* v = get(key);
    if (v == nullptr || v->is_null()) return std::nullopt;
    TORCH_CHECK(v->is_string(), src_, ": key '", key, "': expected a string, found ",
                dump_short(*v));
    return v->get<std::string>();
  }

  // Token ids: null/absent, an integer, or a list of integers.
  std::vector<int64_t> token_ids(const char* key) const {
    std::vector<int64_t> ids;
    const nlohmann::json* v = get(key);
    if (v == nullptr || v->is_null()) return ids;
    if (v->is_array()) {
      for (const auto& e : *v) ids.push_back(to_int(key, e, 0, INT64_MAX));
    } else {
      ids.push_back(to_int(key, *v, 0, INT64_MAX));
    }
    return ids;
  }

 private:
  const nlohmann::json& j_;
  const std::string& src_;
};

// Architecture identity (present keys must say Qwen3), then the features this implementation
// does not have: each is an error naming its key.
void check_supported(const Fields& f, const std::string& src) {
  // Architecture identity: present keys must say Qwen3.
  if (const nlohmann::json* a = f.get("architectures"); a != nullptr && !a->is_null()) {
    TORCH_CHECK(a->is_array() && !a->empty(), src,
                ": key 'architectures': expected [\"Qwen3ForCausalLM\"] or "
                "[\"Qwen3MoeForCausalLM\"], found ",
                dump_short(*a));
    for (const auto& e : *a) {
      const bool known = e.is_string() && (e.get<std::string>() == "Qwen3ForCausalLM" ||
                                           e.get<std::string>() == "Qwen3MoeForCausalLM");
      TORCH_CHECK(known, src,
                  ": key 'architectures': only Qwen3ForCausalLM and Qwen3MoeForCausalLM are "
                  "supported, found ",
                  dump_short(*a));
    }
  }
  if (auto mt = f.optional_string("model_type")) {
    TORCH_CHECK(*mt == "qwen3" || *mt == "qwen3_moe", src,
                ": key 'model_type': expected \"qwen3\" or \"qwen3_moe\", found \"", *mt, "\"");
  }

  // Features this implementation does not have.
  if (const nlohmann::json* rs = f.get("rope_scaling"); rs != nullptr) {
    TORCH_CHECK(rs->is_null(), src,
                ": key 'rope_scaling': RoPE scaling is not supported (expected null), found ",
                dump_short(*rs));
  }
  const bool sliding = f.optional_bool("use_sliding_window").value_or(false);
  TORCH_CHECK(!sliding, src,
              ": key 'use_sliding_window': sliding-window attention is not supported (expected "
              "false), found true");
  // 'sliding_window' alone is inert in HF Qwen3 (only read when use_sliding_window is true);
  // it still has to be null or an integer.
  if (const nlohmann::json* sw = f.get("sliding_window"); sw != nullptr && !sw->is_null()) {
    f.to_int("sliding_window", *sw, 0, INT64_MAX);
  }
  if (const nlohmann::json* lt = f.get("layer_types"); lt != nullptr && !lt->is_null()) {
    TORCH_CHECK(lt->is_array(), src, ": key 'layer_types': expected a list, found ",
                dump_short(*lt));
    for (size_t i = 0; i < lt->size(); ++i) {
      const auto& e = (*lt)[i];
      TORCH_CHECK(e.is_string() && e.get<std::string>() == "full_attention", src,
                  ": key 'layer_types[", i,
                  "]': only \"full_attention\" layers are supported, found ", dump_short(e));
    }
  }
  TORCH_CHECK(!f.optional_bool("attention_bias").value_or(false), src,
              ": key 'attention_bias': biased q/k/v/o projections are not supported (expected "
              "false), found true");
  if (auto act = f.optional_string("hidden_act")) {
    TORCH_CHECK(*act == "silu", src, ": key 'hidden_act': expected \"silu\", found \"", *act, "\"");
  }
}

// RoPE base: top-level rope_theta (transformers 4.x) or rope_parameters (transformers 5.x).
double read_rope_theta(const Fields& f, const std::string& src) {
  double theta = 0.0;
  const nlohmann::json* top_theta = f.get("rope_theta");
  if (top_theta != nullptr && top_theta->is_null()) top_theta = nullptr;
  const nlohmann::json* rp = f.get("rope_parameters");
  if (rp != nullptr && !rp->is_null()) {
    TORCH_CHECK(rp->is_object(), src, ": key 'rope_parameters': expected an object, found ",
                dump_short(*rp));
    auto rt = rp->find("rope_type");
    TORCH_CHECK(rt == rp->end() || rt->is_null() || (rt->is_string() && *rt == "default"), src,
                ": key 'rope_parameters.rope_type': only \"default\" RoPE is supported, found ",
                rt == rp->end() ? std::string("?") : dump_short(*rt));
    for (const auto& item : rp->items()) {
      TORCH_CHECK(item.key() == "rope_type" || item.key() == "rope_theta", src,
                  ": key 'rope_parameters.", item.key(),
                  "': RoPE scaling parameters are not supported");
    }
    auto th = rp->find("rope_theta");
    TORCH_CHECK(th != rp->end() || top_theta != nullptr, src,
                ": missing required key 'rope_theta' (or 'rope_parameters.rope_theta')");
    if (th != rp->end()) {
      theta = f.to_positive_double("rope_parameters.rope_theta", *th);
      if (top_theta != nullptr) {
        const double t = f.to_positive_double("rope_theta", *top_theta);
        TORCH_CHECK(t == theta, src, ": keys 'rope_theta' (", t,
                    ") and 'rope_parameters.rope_theta' (", theta, ") disagree");
      }
    } else {
      theta = f.to_positive_double("rope_theta", *top_theta);
    }
  } else {
    theta = f.required_positive_double("rope_theta");
  }
  return theta;
}

// Whether the config describes Qwen3MoeForCausalLM (its model_type or architectures say so).
bool says_moe(const Fields& f) {
  if (auto mt = f.optional_string("model_type")) return *mt == "qwen3_moe";
  const nlohmann::json* a = f.get("architectures");
  return a != nullptr && a->is_array() && !a->empty() && (*a)[0] == "Qwen3MoeForCausalLM";
}

// The mixture-of-experts keys (HF Qwen3MoeConfig's defaults where absent), and the routings of
// other MoE generations this FFN does not implement, each refused naming its key.
MoeConfig read_moe(const Fields& f, const std::string& src, int64_t num_layers) {
  for (const char* key : {"shared_expert_intermediate_size", "n_shared_experts",
                          "num_shared_experts", "moe_shared_expert_intermediate_size"}) {
    if (const nlohmann::json* v = f.get(key); v != nullptr && !v->is_null()) {
      TORCH_CHECK(v->is_number() && v->get<double>() == 0.0, src, ": key '", key,
                  "': shared experts are not supported (Qwen3-MoE routes every token to its "
                  "top-k experts only), found ",
                  dump_short(*v));
    }
  }
  if (auto sf = f.optional_string("scoring_func")) {
    TORCH_CHECK(*sf == "softmax", src,
                ": key 'scoring_func': only softmax routing is supported, "
                "found \"",
                *sf, "\"");
  }
  if (auto tm = f.optional_string("topk_method")) {
    TORCH_CHECK(*tm == "greedy", src,
                ": key 'topk_method': only plain top-k routing is supported, "
                "found \"",
                *tm, "\"");
  }
  MoeConfig m;
  const auto opt_int = [&](const char* key, int64_t dflt, int64_t lo, int64_t hi) {
    const nlohmann::json* v = f.get(key);
    return v == nullptr || v->is_null() ? dflt : f.to_int(key, *v, lo, hi);
  };
  // transformers 5 saves the expert count as num_local_experts (num_experts is its alias).
  m.num_experts =
      opt_int("num_experts", opt_int("num_local_experts", 128, 1, kMaxExperts), 1, kMaxExperts);
  if (const nlohmann::json* v = f.get("num_local_experts"); v != nullptr && !v->is_null()) {
    TORCH_CHECK(f.to_int("num_local_experts", *v, 1, kMaxExperts) == m.num_experts, src,
                ": keys 'num_experts' (", m.num_experts, ") and 'num_local_experts' (",
                dump_short(*v), ") disagree; they name the same count");
  }
  m.num_experts_per_tok = opt_int("num_experts_per_tok", 8, 1, kMaxExperts);
  m.moe_intermediate_size = opt_int("moe_intermediate_size", 768, 1, kMaxDim);
  m.decoder_sparse_step = opt_int("decoder_sparse_step", 1, 1, kMaxLayers);
  m.norm_topk_prob = f.optional_bool("norm_topk_prob").value_or(false);
  m.output_router_logits = f.optional_bool("output_router_logits").value_or(false);
  if (const nlohmann::json* v = f.get("router_aux_loss_coef"); v != nullptr && !v->is_null()) {
    TORCH_CHECK(v->is_number() && std::isfinite(v->get<double>()) && v->get<double>() >= 0.0, src,
                ": key 'router_aux_loss_coef': expected a finite number >= 0, found ",
                dump_short(*v));
    m.router_aux_loss_coef = v->get<double>();
  }
  if (const nlohmann::json* v = f.get("mlp_only_layers"); v != nullptr && !v->is_null()) {
    TORCH_CHECK(v->is_array(), src,
                ": key 'mlp_only_layers': expected a list of layer indices, "
                "found ",
                dump_short(*v));
    for (const auto& e : *v)
      m.mlp_only_layers.push_back(f.to_int("mlp_only_layers", e, 0, num_layers - 1));
  }
  return m;
}

}  // namespace

Qwen3Config Qwen3Config::from_json_file(const std::string& path) {
  // A config.json is a few KiB: 16 MiB bounds a mistaken /dev/zero or huge file, and a FIFO or a
  // directory is refused before any read.
  constexpr size_t kMaxConfigJsonBytes = size_t{16} << 20;
  const std::string text = io::read_regular_file(path, kMaxConfigJsonBytes, "Qwen3 config.json");
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  TORCH_CHECK(!j.is_discarded(), path, ": not valid JSON");
  return from_json(j, path);
}

Qwen3Config Qwen3Config::from_json(const nlohmann::json& j, const std::string& source_name) {
  const std::string& src = source_name;
  TORCH_CHECK(j.is_object(), src, ": expected a JSON object at the top level, found ",
              j.type_name());
  Fields f(j, src);
  Qwen3Config c;
  c.source = src;

  check_supported(f, src);

  c.vocab_size = f.required_int("vocab_size", 1, kMaxDim);
  c.hidden_size = f.required_int("hidden_size", 1, kMaxDim);
  c.intermediate_size = f.required_int("intermediate_size", 1, kMaxDim);
  c.num_hidden_layers = f.required_int("num_hidden_layers", 1, kMaxLayers);
  c.num_attention_heads = f.required_int("num_attention_heads", 1, kMaxDim);
  c.num_key_value_heads = f.required_int("num_key_value_heads", 1, kMaxDim);
  if (const nlohmann::json* hd = f.get("head_dim"); hd != nullptr && !hd->is_null()) {
    c.head_dim = f.to_int("head_dim", *hd, 1, kMaxDim);
  } else {
    TORCH_CHECK(c.hidden_size % c.num_attention_heads == 0, src,
                ": key 'head_dim' is absent and hidden_size ", c.hidden_size,
                " is not divisible by num_attention_heads ", c.num_attention_heads,
                "; set 'head_dim' explicitly");
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.rms_norm_eps = f.required_positive_double("rms_norm_eps");
  c.max_position_embeddings = f.required_int("max_position_embeddings", 1, INT64_MAX);
  c.tie_word_embeddings = f.optional_bool("tie_word_embeddings").value_or(false);

  c.rope_theta = read_rope_theta(f, src);

  std::vector<int64_t> bos = f.token_ids("bos_token_id");
  TORCH_CHECK(bos.size() <= 1, src, ": key 'bos_token_id': expected one id or null, found ",
              bos.size(), " ids");
  if (!bos.empty()) c.bos_token_id = bos[0];
  c.eos_token_ids = f.token_ids("eos_token_id");
  if (!c.eos_token_ids.empty()) c.eos_token_id = c.eos_token_ids[0];
  if (says_moe(f)) c.moe = read_moe(f, src, c.num_hidden_layers);

  c.validate();
  return c;
}

void Qwen3Config::validate() const {
  const std::string& src = source;
  auto in_range = [&](const char* key, int64_t v, int64_t hi) {
    TORCH_CHECK(v >= 1 && v <= hi, src, ": key '", key, "': expected an integer in [1, ", hi,
                "], found ", v);
  };
  in_range("vocab_size", vocab_size, kMaxDim);
  in_range("hidden_size", hidden_size, kMaxDim);
  in_range("intermediate_size", intermediate_size, kMaxDim);
  in_range("num_hidden_layers", num_hidden_layers, kMaxLayers);
  in_range("num_attention_heads", num_attention_heads, kMaxDim);
  in_range("num_key_value_heads", num_key_value_heads, kMaxDim);
  in_range("head_dim", head_dim, kMaxDim);
  in_range("max_position_embeddings", max_position_embeddings, INT64_MAX);
  TORCH_CHECK(num_attention_heads % num_key_value_heads == 0, src,
              ": key 'num_key_value_heads': must divide num_attention_heads (", num_attention_heads,
              "), found ", num_key_value_heads);
  TORCH_CHECK(head_dim % 2 == 0, src, ": key 'head_dim': RoPE needs an even head_dim, found ",
              head_dim);
  TORCH_CHECK(q_dim() <= kMaxDim, src, ": keys 'num_attention_heads' x 'head_dim' = ", q_dim(),
              " exceeds ", kMaxDim);
  TORCH_CHECK(std::isfinite(rms_norm_eps) && rms_norm_eps > 0.0, src,
              ": key 'rms_norm_eps': expected a finite positive number, found ", rms_norm_eps);
  TORCH_CHECK(std::isfinite(rope_theta) && rope_theta > 0.0, src,
              ": key 'rope_theta': expected a finite positive number, found ", rope_theta);
  if (is_moe()) {
    in_range("num_experts", moe.num_experts, kMaxExperts);
    in_range("moe_intermediate_size", moe.moe_intermediate_size, kMaxDim);
    in_range("decoder_sparse_step", moe.decoder_sparse_step, kMaxLayers);
    TORCH_CHECK(moe.num_experts_per_tok >= 1 && moe.num_experts_per_tok <= moe.num_experts, src,
                ": key 'num_experts_per_tok': expected an integer in [1, num_experts = ",
                moe.num_experts, "], found ", moe.num_experts_per_tok);
    TORCH_CHECK(moe.num_experts * moe.moe_intermediate_size <= kMaxDim * 64, src,
                ": keys 'num_experts' x 'moe_intermediate_size' = ",
                moe.num_experts * moe.moe_intermediate_size, " exceeds ", kMaxDim * 64);
    for (int64_t l : moe.mlp_only_layers) {
      TORCH_CHECK(l >= 0 && l < num_hidden_layers, src,
                  ": key 'mlp_only_layers': expected layer indices in [0, ", num_hidden_layers,
                  "), found ", l);
    }
    TORCH_CHECK(std::isfinite(moe.router_aux_loss_coef) && moe.router_aux_loss_coef >= 0.0, src,
                ": key 'router_aux_loss_coef': expected a finite number >= 0, found ",
                moe.router_aux_loss_coef);
  }
  for (int64_t id : eos_token_ids) {
    TORCH_CHECK(id >= 0, src, ": key 'eos_token_id': expected non-negative ids, found ", id);
  }
  if (eos_token_id) {
    TORCH_CHECK(*eos_token_id >= 0, src, ": key 'eos_token_id': expected a non-negative id, found ",
                *eos_token_id);
  }
}

bool Qwen3Config::is_moe_layer(int64_t layer) const {
  if (!is_moe()) return false;
  for (int64_t l : moe.mlp_only_layers) {
    if (l == layer) return false;
  }
  return (layer + 1) % moe.decoder_sparse_step == 0;
}

nlohmann::json Qwen3Config::to_json() const {
  nlohmann::json j;
  j["architectures"] =
      nlohmann::json::array({is_moe() ? "Qwen3MoeForCausalLM" : "Qwen3ForCausalLM"});
  j["model_type"] = is_moe() ? "qwen3_moe" : "qwen3";
  if (is_moe()) {
    j["num_experts"] = moe.num_experts;
    j["num_experts_per_tok"] = moe.num_experts_per_tok;
    j["moe_intermediate_size"] = moe.moe_intermediate_size;
    j["norm_topk_prob"] = moe.norm_topk_prob;
    j["decoder_sparse_step"] = moe.decoder_sparse_step;
    j["mlp_only_layers"] = moe.mlp_only_layers;
    j["router_aux_loss_coef"] = moe.router_aux_loss_coef;
    j["output_router_logits"] = moe.output_router_logits;
  }
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  j["max_position_embeddings"] = max_position_embeddings;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["rope_scaling"] = nullptr;
  j["use_sliding_window"] = false;
  j["bos_token_id"] = bos_token_id ? nlohmann::json(*bos_token_id) : nlohmann::json(nullptr);
  if (eos_token_ids.size() > 1) {
    j["eos_token_id"] = eos_token_ids;
  } else {
    j["eos_token_id"] = eos_token_id ? nlohmann::json(*eos_token_id) : nlohmann::json(nullptr);
  }
  return j;
}

}  // namespace q4::model
