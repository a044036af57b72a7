// Token sampling and streaming decode for q4chat: temperature, top-k, top-p (nucleus) and the
// repetition penalty applied to one row of logits exactly as HF transformers' logits processors
// do (penalty, then temperature, then top-k, then top-p), a seeded CPU generator so a run is
// reproducible, and a decode loop that extends a KV cache across calls (multi-turn chat keeps
// its cache; the cache grows when a turn would overflow it). Temperature 0 is greedy (argmax),
// which reproduces Qwen3Model::generate() token for token.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "q4/model/qwen3.h"

namespace q4::chat {

struct SamplingOptions {
  double temperature = 0.7;         // 0: greedy (argmax); > 0: softmax(logits / temperature)
  int64_t top_k = 0;                // keep the k most likely tokens; 0: off
  double top_p = 1.0;               // keep the smallest set with probability >= top_p; 1: off
  double repetition_penalty = 1.0;  // > 1 discourages tokens already seen (HF semantics); 1: off
  uint64_t seed = 0;                // generator seed (sampling only)
  void validate() const;            // errors naming the option (--temperature, ...)
};

// HF RepetitionPenaltyLogitsProcessor: for every distinct id in `history`, a positive logit is
// divided by `penalty`, a negative one multiplied. logits: (V) fp32, edited in place.
void apply_repetition_penalty(at::Tensor& logits, const std::vector<int64_t>& history,
                              double penalty);
// Sets every logit outside the k largest to -inf (ties at the k-th value are kept, as HF).
// k <= 0 or k >= V: unchanged. logits: (V) fp32.
at::Tensor filter_top_k(const at::Tensor& logits, int64_t k);
// Nucleus filter: keeps the most likely tokens whose cumulative probability reaches top_p (the
// token that crosses top_p is kept, at least one token always), -inf elsewhere. top_p >= 1:
// unchanged. logits: (V) fp32 (already divided by the temperature).
at::Tensor filter_top_p(const at::Tensor& logits, double top_p);

class Sampler {
 public:
  explicit Sampler(const SamplingOptions& options);
  // Next token from one row of logits (V, any float dtype, any device); `history` is every
  // token of the conversation so far (prompt and generated) for the repetition penalty.
  int64_t next(const at::Tensor& logits, const std::vector<int64_t>& history);
  const SamplingOptions& options() const { return opt_; }

 private:
  SamplingOptions opt_;
  at::Generator gen_;
};

struct DecodeResult {
  std::vector<int64_t> tokens;  // generated ids, the stop token included when one came
  bool stopped = false;         // ended on a stop id (else: max_new_tokens or the callback)
};

// Appends `new_ids` to `cache` (prefill in one pass; the cache is reallocated larger when
// needed), then samples up to `max_new_tokens` tokens, feeding each back except the last one,
// which the caller feeds with the next turn's input. `history` gets new_ids and every sampled
// token appended. `on_token` (optional) sees each sampled id before the stop check; returning
// false ends the decode. Inference only (run under a NoGradGuard).
DecodeResult decode(model::Qwen3Model& model, model::KvCache& cache,
                    const std::vector<int64_t>& new_ids, Sampler& sampler,
                    std::vector<int64_t>& history, int64_t max_new_tokens,
                    const std::vector<int64_t>& stop_ids,
                    const std::function<bool(int64_t)>& on_token = {});

// Ensures `cache` can take `needed` tokens in total, copying the valid prefix into a larger
// cache (at least doubling) when it cannot.
void reserve_cache(const model::Qwen3Model& model, model::KvCache& cache, int64_t needed);

}  // namespace q4::chat
