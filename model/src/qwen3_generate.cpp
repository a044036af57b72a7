// Greedy decoding with a KV cache: the prompt is prefilled in one causal pass, then one token per
// step attends to the cache. Only the last position's hidden state goes through lm_head. One
// host synchronization per generated token (the argmax decides whether to stop).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>

#include "qwen3_impl.h"

namespace q4::model {

std::vector<int64_t> Qwen3Model::generate(const std::vector<int64_t>& prompt_ids,
                                          const GenerateOptions& gen) {
  TORCH_CHECK(!prompt_ids.empty(), "generate: the prompt is empty");
  TORCH_CHECK(gen.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ",
              gen.max_new_tokens);
  const int64_t V = impl_->cfg.vocab_size;
  for (int64_t id : prompt_ids) {
    TORCH_CHECK(id >= 0 && id < V, "generate: prompt token id ", id, " is outside [0, ", V, ")");
  }
  std::vector<int64_t> out;
  if (gen.max_new_tokens == 0) return out;
  at::NoGradGuard no_grad;
  const auto dev = impl_->opt.device;
  const int64_t P = static_cast<int64_t>(prompt_ids.size());
  KvCache cache = make_cache(1, P + gen.max_new_tokens);
  at::Tensor ids = at::tensor(prompt_ids, at::kLong).view({1, P}).to(dev);
  at::Tensor lm = impl_->weight(impl_->lm_head);  // (V, H)
  for (int64_t step = 0; step < gen.max_new_tokens; ++step) {
    ModelInputs in;
    in.input_ids = ids;
    at::Tensor h = impl_->hidden_states(in, &cache);    // (1, T, H)
    at::Tensor last = h.select(1, h.size(1) - 1);       // (1, H)
    at::Tensor next = at::linear(last, lm).argmax(-1);  // (1)
    const int64_t tok = next.item<int64_t>();
    out.push_back(tok);
    if (std::find(gen.stop_ids.begin(), gen.stop_ids.end(), tok) != gen.stop_ids.end()) break;
    ids = next.view({1, 1});
  }
  return out;
}

}  // namespace q4::model
