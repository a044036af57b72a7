// The model side of generation: the last position's logits after a cached forward (only that
// position goes through lm_head), the attention mask of a left-padded cache, and greedy
// generate() of one prompt, which the batched generate (sampling.cpp) now runs.
#include <ATen/ATen.h>

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

}  // namespace q4::model
