// The model side of generation: the last position's logits after a cached forward (only that
// position goes through lm_head), the attention mask of a left-padded cache, the KV cache, the
// forward weights kept for a rollout (InferenceWeights), and greedy generate() of one prompt,
// which the batched generate (sampling.cpp) now runs.
#include <ATen/ATen.h>

#include <algorithm>

#include "q4/model/sampling.h"
#include "qwen3_impl.h"

namespace q4::model {

AttnMask cached_attention_mask(const ModelInputs& in, const KvCache& cache, int64_t past,
                               int64_t T) {
  TORCH_CHECK(!in.attention_mask.defined() && !in.segment_ids.defined(),
              "attention_mask/segment_ids are not supported together with a KV cache that has "
              "key_valid");
  const int64_t S = past + T;
  const at::Tensor& kv = cache.key_valid;  // (B, capacity)
  const auto bopt = at::TensorOptions().dtype(at::kBool).device(kv.device());
  // Query i sits at slot past + i: it sees slots <= past + i that hold real tokens, and itself.
  const at::Tensor causal = at::ones({T, S}, bopt).tril(past).view({1, 1, T, S});
  const at::Tensor own = at::eye(T, S, bopt).roll(past, 1).view({1, 1, T, S});
  const at::Tensor valid = kv.narrow(1, 0, S).view({-1, 1, 1, S});
  AttnMask m;
  m.kind = AttnMask::Kind::kExplicit;
  m.allowed = causal.logical_and(valid).logical_or(own).contiguous();  // (B, 1, T, S)
  return m;
}

at::Tensor Qwen3Model::next_token_logits(const ModelInputs& in, KvCache& cache) {
  at::Tensor h = impl_->hidden_states(in, &cache);         // (B, T, H)
  at::Tensor last = h.select(1, h.size(1) - 1);            // (B, H)
  return at::linear(last, impl_->weight(impl_->lm_head));  // (B, V)
}

std::vector<int64_t> Qwen3Model::generate(const std::vector<int64_t>& prompt_ids,
                                          const GenerateOptions& gen) {
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = gen.max_new_tokens;
  p.stop_ids = gen.stop_ids;
  return q4::model::generate(*this, {prompt_ids}, p).at(0).tokens;
}

Qwen3Model::InferenceWeights::InferenceWeights(Qwen3Model& model, int64_t max_bytes)
    : model_(model) {
  Impl& m = *model_.impl_;
  TORCH_CHECK(!m.inference_weights, "InferenceWeights: a scope is already active");
  m.inference_weights = true;
  m.inference_budget = std::max<int64_t>(max_bytes, 0);
  m.inference_bytes = 0;
}

Qwen3Model::InferenceWeights::~InferenceWeights() {
  Impl& m = *model_.impl_;
  for (Parameter& p : m.params) p.inference_weight = at::Tensor();
  for (Parameter& p : m.adapters) p.inference_weight = at::Tensor();
  m.inference_weights = false;
  m.inference_bytes = 0;
}

int64_t Qwen3Model::InferenceWeights::bytes() const { return model_.impl_->inference_bytes; }

KvCache Qwen3Model::make_cache(int64_t batch, int64_t capacity) const {
  TORCH_CHECK(batch > 0 && capacity > 0, "KV cache: batch and capacity must be positive, got ",
              batch, " and ", capacity);
  const auto& c = impl_->cfg;
  KvCache kv;
  auto o = at::TensorOptions().dtype(impl_->opt.compute_dtype).device(impl_->opt.device);
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    kv.k.push_back(at::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, o));
    kv.v.push_back(at::zeros({batch, c.num_key_value_heads, capacity, c.head_dim}, o));
  }
  return kv;
}

}  // namespace q4::model
