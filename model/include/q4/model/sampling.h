// Batched generation with a KV cache and token sampling (docs/model.md#generation). Prompts of
// different lengths share one cache, left-padded: padded key slots are masked (KvCache::
// key_valid) and each row's RoPE positions start at 0 at its first real token, so a row sees what
// it would see alone. The logits processors follow HF transformers' order (repetition penalty,
// temperature, top-k, top-p) in fp32 on the logits' device (on the host only with a repetition
// penalty), and each row's draw is by inverse CDF from one uniform of a seeded CPU generator, so
// a seed reproduces a run on any device up to the logits' rounding. Temperature 0 is greedy: the
// argmax on the device, as Qwen3Model::generate() has always computed it.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "q4/model/qwen3.h"

namespace q4::model {

struct SamplingParams {
  double temperature = 0;           // 0: greedy (argmax); > 0: softmax(logits / temperature)
  int64_t top_k = 0;                // keep the k most likely tokens; 0: off
  double top_p = 1.0;               // keep the smallest set with probability >= top_p; 1: off
  double repetition_penalty = 1.0;  // > 1 discourages tokens already in the row (HF); 1: off
  int64_t max_new_tokens = 128;     // per row
  uint64_t seed = 0;                // the CPU generator's seed when none is passed (sampling only)
  std::vector<int64_t> stop_ids = {151645, 151643};  // Qwen3 <|im_end|>, <|endoftext|>
  bool want_logprobs = false;  // GenerationResult::logprobs (one log_softmax per token)
  // The logprobs under logits / temperature (temperature > 0), before top-k and top-p: GRPO's
  // policy as TRL defines it, computed op for op as Qwen3Model::token_logprobs(in, temperature)
  // computes it from the same logits. false: the unprocessed logits (temperature 1).
  bool logprobs_at_temperature = false;
  // GenerationResult::entropy: each position's entropy (nats) of softmax(logits / temperature)
  // over the full vocabulary, before top-k and top-p (TRL's entropy_from_logits; temperature 0:
  // of the unprocessed logits).
  bool want_entropy = false;
  // generate(): rows that stopped leave the decode batch (their KV cache rows and inputs are
  // dropped) once at least a quarter of the batch's rows have stopped, so later steps compute
  // only the running rows. Each row keeps its own uniforms (TokenSampler's SampledRows), so the
  // tokens, log-probabilities and entropies are the uncompacted batch's bit for bit wherever a
  // row's logits do not depend on the batch's row count. GEMMs block rows by their count
  // (OpenBLAS's sgemm rounds a row differently in its 12-, 8- and 4-row kernels), so through
  // the model's batched forward the logits move in their last bits (as a row alone differs from
  // the row in a batch), and a run stays a function of its prompts, params and seed.
  bool compact_finished = true;
  // Errors name the field as `prefix` + its name ("temperature", "top_k", "top_p",
  // "repetition_penalty", "max_new_tokens"); `cli` spells it as an option ("--top-k").
  void validate(const std::string& prefix = "", bool cli = false) const;
};

// HF RepetitionPenaltyLogitsProcessor: for every distinct id in `history`, a positive logit is
// divided by `penalty`, a negative one multiplied. logits: (V) fp32, edited in place.
void apply_repetition_penalty(at::Tensor& logits, const std::vector<int64_t>& history,
                              double penalty);
// Sets every logit outside the k largest of its row to -inf (ties at the k-th value are kept, as
// HF). k <= 0 or k >= V: unchanged. logits: (V) or (B, V) fp32.
at::Tensor filter_top_k(const at::Tensor& logits, int64_t k);
// Nucleus filter per row: keeps the most likely tokens whose cumulative probability reaches
// top_p (the token that crosses top_p is kept, at least one token always), -inf elsewhere.
// top_p >= 1: unchanged. logits: (V) or (B, V) fp32 (already divided by the temperature).
at::Tensor filter_top_p(const at::Tensor& logits, double top_p);

// The logits of a decode step that holds only some rows of a batch (generate() with
// compact_finished): logits row i is row rows[i] of a batch of `batch_rows`.
struct SampledRows {
  int64_t batch_rows = 0;
  std::vector<int64_t> rows;  // ascending, each in [0, batch_rows)
};

// Picks the next token of each row from its logits. Sampling draws from one CPU generator (the
// given one, else one seeded with params.seed): rows of a batch take consecutive draws, so a
// batch of one draws what one row alone draws. With SampledRows every step still draws
// batch_rows uniforms and row r takes the r-th: a row's draws do not depend on which other rows
// are in the step, and the generator advances as for the whole batch.
class TokenSampler {
 public:
  explicit TokenSampler(const SamplingParams& params, at::Generator generator = {});
  // One generator per row instead (rollouts): row b's draws come from row_generators[b] alone,
  // so a row samples the same tokens in any batch (another rank's share, another batch size).
  // Every next_batch() then takes row_generators.size() rows, or SampledRows of that many (a
  // row left out of a step draws nothing in it).
  TokenSampler(const SamplingParams& params, std::vector<at::Generator> row_generators);
  // logits (B, V), any float dtype and device; histories[b]: every token of row b so far (prompt
  // and output) for the repetition penalty (may be empty when the penalty is off). Returns the
  // B ids; with `logprobs`, also each id's log-probability under the unprocessed logits
  // (log_softmax in fp32: the model's own distribution, as a trainer's token_logprobs computes;
  // logits / temperature with logprobs_at_temperature); with `entropy`, each row's entropy of
  // softmax(logits / temperature) in fp32 (SamplingParams::want_entropy). `rows`: which rows of
  // a larger batch the logits hold (null: the whole batch, B rows).
  std::vector<int64_t> next_batch(const at::Tensor& logits,
                                  const std::vector<const std::vector<int64_t>*>& histories,
                                  std::vector<float>* logprobs = nullptr,
                                  std::vector<float>* entropy = nullptr,
                                  const SampledRows* rows = nullptr);
  // One row: logits (V).
  int64_t next(const at::Tensor& logits, const std::vector<int64_t>& history);
  const SamplingParams& params() const { return params_; }

 private:
  // Temperature, top-k, top-p, then one draw per row by inverse CDF (fp32 (B, V) logits on any
  // device): the B sampled ids on that device. `rows` as in next_batch.
  at::Tensor draw(const at::Tensor& logits, const SampledRows* rows);
  // (B) fp32 on the logits' device: the log-probability of ids (B) under the logits (B, V), and
  // each row's entropy (next_batch).
  at::Tensor token_logprobs(const at::Tensor& logits, const at::Tensor& ids) const;
  at::Tensor entropies(const at::Tensor& logits) const;

  SamplingParams params_;
  at::Generator gen_;
  std::vector<at::Generator> row_gens_;  // per row, when given
};

// kStop: a stop id came; kLength: max_new_tokens reached; kCancelled: decode()'s on_token ended it.
enum class FinishReason { kStop, kLength, kCancelled };
const char* finish_reason_name(FinishReason r);  // "stop", "length", "cancelled"

struct GenerationResult {
  std::vector<int64_t> tokens;  // generated ids, the stop id included when one came
  FinishReason finish = FinishReason::kLength;
  std::vector<float> logprobs;  // per token (SamplingParams::want_logprobs), else empty
  std::vector<float> entropy;   // per token (SamplingParams::want_entropy), else empty
};

// A step's logits: (B, V) of the last position of `in` (B rows), which goes through `cache` (and
// extends it by its T tokens). generate() computes them with Qwen3Model::next_token_logits.
using StepLogits = std::function<at::Tensor(const ModelInputs& in, KvCache& cache)>;

// Generates after each prompt (non-empty, ids in [0, vocab)) in one batch: one prefill, then one
// forward of B tokens per step, until every row has stopped or reached max_new_tokens. A row
// that stops (a stop id) gets no more tokens, and with SamplingParams::compact_finished leaves
// the decode batch (select_cache_rows). `sampler` (optional) brings its generator and
// params' sampling fields; without one a TokenSampler(params) is made. `step_logits` (optional)
// replaces model.next_token_logits (a test's forward whose rows do not depend on the batch's
// row count). Inference only.
std::vector<GenerationResult> generate(Qwen3Model& model,
                                       const std::vector<std::vector<int64_t>>& prompts,
                                       const SamplingParams& params,
                                       TokenSampler* sampler = nullptr,
                                       const StepLogits& step_logits = {});

// Continues one sequence on `cache` (multi-turn chat keeps its cache): appends `new_ids` (prefill
// in one pass; the cache grows when needed), then samples up to `max_new_tokens` tokens, feeding
// each back except the last one, which the caller feeds with its next input. `history` gets
// new_ids and every sampled token appended. `on_token` (optional) sees each sampled id before
// the stop check; returning false ends the decode.
GenerationResult decode(Qwen3Model& model, KvCache& cache, const std::vector<int64_t>& new_ids,
                        TokenSampler& sampler, std::vector<int64_t>& history,
                        int64_t max_new_tokens, const std::vector<int64_t>& stop_ids,
                        const std::function<bool(int64_t)>& on_token = {});

// Ensures `cache` can take `needed` tokens in total, copying the valid prefix into a larger
// cache (at least doubling) when it cannot.
void reserve_cache(const Qwen3Model& model, KvCache& cache, int64_t needed);

// Keeps rows `rows` of `cache` (indices into its batch, in the order given) in every layer's
// keys and values and in key_valid: the cache then serves a batch of rows.size() sequences.
// Only the `length` valid slots are copied; the capacity stays.
void select_cache_rows(KvCache& cache, const std::vector<int64_t>& rows);

// ---------------------------------------------------------------- rollouts (GRPO)
//
// `num_generations` completions of each prompt, sampled in one batch with the KV cache through
// the model's own forward (the weights training computes with), prompt-major: completion g of
// prompt p is at p * num_generations + g. Each token's log-probability is recorded under
// logits / params.temperature before top-k / top-p (logprobs_at_temperature): the old policy's
// log-probability of GRPO's ratio, and each position's entropy of softmax(logits / temperature)
// (want_entropy: TRL's `entropy` log). params.temperature must be > 0; params.max_new_tokens is
// the completion's length limit; a completion without a stop id is truncated
// (FinishReason::kLength).
std::vector<GenerationResult> sample_completions(Qwen3Model& model,
                                                 const std::vector<std::vector<int64_t>>& prompts,
                                                 int64_t num_generations,
                                                 const SamplingParams& params,
                                                 TokenSampler* sampler = nullptr);

// The same log-probabilities from the training forward: one row per completion, its prompt then
// its tokens (right-padded, attention-masked), through Qwen3Model::token_logprobs(in,
// temperature). prompts[i] is completion i's prompt. Returns (B, L) fp32 on the model's device,
// L the longest completion (or `max_len` when larger), 0 past each completion's end;
// differentiable when grad mode is on (the trainer's policy log-probabilities).
at::Tensor completion_logprobs(Qwen3Model& model, const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<std::vector<int64_t>>& completions,
                               double temperature, int64_t max_len = 0);

}  // namespace q4::model
