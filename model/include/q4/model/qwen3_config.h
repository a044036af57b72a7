// Qwen3 architecture hyper-parameters, read from a Hugging Face config.json: Qwen3ForCausalLM
// (dense) or Qwen3MoeForCausalLM (mixture of experts, docs/model.md#mixture-of-experts). Reading
// validates once: anything this code cannot honour (other architectures, RoPE scaling,
// sliding-window attention, attention biases, activations other than SiLU, shared experts or
// routings other than softmax top-k, missing or ill-typed fields) is rejected with a c10::Error
// that names the file and the key. Unknown extra keys are ignored.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace q4::model {

// The mixture-of-experts FFN of Qwen3MoeForCausalLM (HF Qwen3MoeConfig's keys and defaults).
// A layer is sparse when num_experts > 0, it is not in mlp_only_layers and
// (layer + 1) % decoder_sparse_step == 0; the other layers have the dense SwiGLU MLP of
// intermediate_size. Routing: softmax over the router's logits, the top num_experts_per_tok
// experts (renormalised when norm_topk_prob), every token kept (no capacity).
struct MoeConfig {
  int64_t num_experts = 0;              // E; 0: a dense model
  int64_t num_experts_per_tok = 8;      // k, routed experts per token
  int64_t moe_intermediate_size = 768;  // each expert's SwiGLU width
  bool norm_topk_prob = false;          // renormalise the k routing weights to sum to 1
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;  // layers with the dense MLP
  double router_aux_loss_coef = 0.001;   // the load-balancing loss's weight in HF's loss
  bool output_router_logits = false;     // HF adds the aux loss only when set (kept for export)
};

struct Qwen3Config {
  int64_t vocab_size = 0;               // V: rows of embed_tokens and lm_head
  int64_t hidden_size = 0;              // H: residual stream width
  int64_t intermediate_size = 0;        // I: SwiGLU MLP width
  int64_t num_hidden_layers = 0;        // L: decoder layers
  int64_t num_attention_heads = 0;      // query heads
  int64_t num_key_value_heads = 0;      // KV heads (GQA); divides num_attention_heads
  int64_t head_dim = 0;                 // per-head width; derived as H / heads when absent
  double rms_norm_eps = 1e-6;           // RMSNorm epsilon (all norms)
  double rope_theta = 0.0;              // RoPE base; required, never defaulted
  int64_t max_position_embeddings = 0;  // longest supported sequence
  bool tie_word_embeddings = false;     // lm_head shares embed_tokens (HF default false)
  std::optional<int64_t> bos_token_id;  // null/absent -> nullopt
  std::optional<int64_t> eos_token_id;  // first eos id (config may hold a list)
  std::vector<int64_t> eos_token_ids;   // all eos ids
  MoeConfig moe;                        // num_experts 0: dense (Qwen3ForCausalLM)
  std::string source = "<json>";        // file name (or label) the values came from

  // Parses and validates config.json; errors name `path` and the offending key.
  static Qwen3Config from_json_file(const std::string& path);
  // Same from an already parsed object; `source_name` appears in error messages.
  static Qwen3Config from_json(const nlohmann::json& j, const std::string& source_name);

  // HF-style config.json content (architectures, model_type and the fixed-feature keys
  // included); from_json(to_json()) reproduces this config.
  nlohmann::json to_json() const;

  // Cross-field checks (positive sizes, heads % kv_heads == 0, even head_dim). from_json calls
  // it; call it again after editing fields by hand.
  void validate() const;

  int64_t q_dim() const { return num_attention_heads * head_dim; }   // q_proj out, o_proj in
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }  // k_proj / v_proj out
  bool is_moe() const { return moe.num_experts > 0; }
  // Whether decoder layer `layer` has the mixture-of-experts FFN (HF Qwen3MoeDecoderLayer).
  bool is_moe_layer(int64_t layer) const;
  // Parameters of decoder layer `layer` (4 attention linears, q_norm, k_norm, 2 RMSNorms, and its
  // FFN: 3 MLP linears, or the router and every expert's 3 linears).
  int64_t layer_num_parameters(int64_t layer = 0) const;
  // Parameters of the whole model: embed_tokens + layers + final norm, plus a separate
  // vocab x hidden lm_head when `include_lm_head` is true (pass !tie_word_embeddings to count
  // the model as HF instantiates it, true to count the shipped file, which stores lm_head).
  int64_t num_parameters(bool include_lm_head) const;
  // Parameters held in the 7 linears of every layer (what the NVFP4 file quantizes), plus
  // lm_head when `include_lm_head`.
  int64_t num_linear_parameters(bool include_lm_head) const;
  // Parameters one token's forward uses (active_elements summed): num_parameters with each
  // mixture-of-experts layer's experts counted k of E (Qwen3-30B-A3B: 3.3e9 of 30.5e9).
  int64_t num_active_parameters(bool include_lm_head) const;
  // The weights of the matrix products one token runs in decoder layer `layer`: the attention
  // projections and the FFN's (dense: gate/up/down; mixture of experts: the router's E x H and
  // k experts' three projections). Multiply-accumulates per token of the layer's linears.
  int64_t layer_active_linear_parameters(int64_t layer) const;
};

}  // namespace q4::model
