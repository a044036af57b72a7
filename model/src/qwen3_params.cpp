// The Qwen3 parameter table (qwen3_params.h) and the parameter counts of Qwen3Config, which are
// sums over that table.
#include "q4/model/qwen3_params.h"

#include "ffn.h"
#include "q4/model/qwen3.h"

namespace q4::model {

int64_t ParamSpec::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

bool is_expert_stack(const ParamSpec& p) {
  return p.group == ParamGroup::kProjection && p.layer >= 0 &&
         p.name.find(".mlp.experts.") != std::string::npos;
}

int64_t active_elements(const ParamSpec& p, const Qwen3Config& cfg) {
  if (!is_expert_stack(p)) return p.numel();
  return p.numel() / cfg.moe.num_experts * cfg.moe.num_experts_per_tok;
}

std::vector<ParamSpec> qwen3_parameters(const Qwen3Config& c, bool include_lm_head) {
  const int64_t H = c.hidden_size, D = c.head_dim;
  const int64_t V = c.vocab_size, L = c.num_hidden_layers;
  using K = ParamKind;
  using G = ParamGroup;
  std::vector<ParamSpec> out;
  out.reserve(static_cast<size_t>(2 + 12 * L + 1));
  out.push_back({"model.embed_tokens.weight", {V, H}, K::kEmbedding, G::kEmbedding, -1});
  for (int64_t l = 0; l < L; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    const auto lin = [&](const char* n, int64_t rows, int64_t cols) {
      out.push_back({p + n, {rows, cols}, K::kQuantizedLinear, G::kProjection, l});
    };
    const auto norm = [&](const char* n, int64_t size) {
      out.push_back({p + n, {size}, K::kRaw, G::kNorm, l});
    };
    lin("self_attn.q_proj.weight", c.q_dim(), H);   // (heads*D, H)
    lin("self_attn.k_proj.weight", c.kv_dim(), H);  // (kv*D, H)
    lin("self_attn.v_proj.weight", c.kv_dim(), H);  // (kv*D, H)
    lin("self_attn.o_proj.weight", H, c.q_dim());   // (H, heads*D)
    norm("self_attn.q_norm.weight", D);
    norm("self_attn.k_norm.weight", D);
    for (const FfnParamSpec& f : ffn_for(c, l).param_specs(c)) {  // the FFN slot's tensors
      out.push_back({p + f.suffix, f.shape, f.kind, f.group, l});
    }
    norm("input_layernorm.weight", H);
    norm("post_attention_layernorm.weight", H);
  }
  out.push_back({"model.norm.weight", {H}, K::kRaw, G::kNorm, -1});
  if (include_lm_head) {
    out.push_back({"lm_head.weight", {V, H}, K::kQuantizedLinear, G::kLmHead, -1});
  }
  return out;
}

bool TrainableSpec::trains(const ParamSpec& p, int64_t num_layers, bool tied) const {
  switch (p.group) {
    case ParamGroup::kEmbedding:
      return embeddings || (tied && lm_head);
    case ParamGroup::kLmHead:
      return lm_head;
    case ParamGroup::kProjection:
      return projections && layer_selected(p.layer, num_layers);
    case ParamGroup::kRouter:
      return router && layer_selected(p.layer, num_layers);
    case ParamGroup::kNorm:
      return norms && (p.layer < 0 || layer_selected(p.layer, num_layers));
  }
  return false;
}

int64_t Qwen3Config::layer_num_parameters(int64_t layer) const {
  int64_t n = 0;
  for (const ParamSpec& p : qwen3_parameters(*this, false)) n += p.layer == layer ? p.numel() : 0;
  return n;
}

int64_t Qwen3Config::num_parameters(bool include_lm_head) const {
  int64_t n = 0;
  for (const ParamSpec& p : qwen3_parameters(*this, include_lm_head)) n += p.numel();
  return n;
}

int64_t Qwen3Config::num_linear_parameters(bool include_lm_head) const {
  int64_t n = 0;
  for (const ParamSpec& p : qwen3_parameters(*this, include_lm_head)) {
    if (p.kind == ParamKind::kQuantizedLinear) n += p.numel();
  }
  return n;
}

int64_t Qwen3Config::num_active_parameters(bool include_lm_head) const {
  int64_t n = 0;
  for (const ParamSpec& p : qwen3_parameters(*this, include_lm_head))
    n += active_elements(p, *this);
  return n;
}

int64_t Qwen3Config::layer_active_linear_parameters(int64_t layer) const {
  int64_t n = 0;
  for (const ParamSpec& p : qwen3_parameters(*this, false)) {
    const bool matmul = p.kind == ParamKind::kQuantizedLinear || p.group == ParamGroup::kRouter;
    if (p.layer == layer && matmul) n += active_elements(p, *this);
  }
  return n;
}

}  // namespace q4::model
