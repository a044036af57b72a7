// Sampling and the cached decode loop (see sampling.h). Logits are brought to the host in fp32
// once per token (one (V) copy, which the stop check needs anyway); filters work on that row.
#include "sampling.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

namespace q4::chat {

void SamplingOptions::validate() const {
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0,
              "--temperature: expected a finite value >= 0, got ", temperature);
  TORCH_CHECK(top_k >= 0, "--top-k: expected >= 0 (0 = off), got ", top_k);
  TORCH_CHECK(top_p > 0 && top_p <= 1, "--top-p: expected a value in (0, 1], got ", top_p);
  TORCH_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0,
              "--repetition-penalty: expected a finite value > 0 (1 = off), got ",
              repetition_penalty);
}

void apply_repetition_penalty(at::Tensor& logits, const std::vector<int64_t>& history,
                              double penalty) {
  if (penalty == 1.0 || history.empty()) return;
  TORCH_CHECK(logits.dim() == 1, "repetition penalty: expected (V) logits, got ", logits.sizes());
  std::vector<int64_t> ids(history);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  const int64_t V = logits.size(0);
  ids.erase(std::remove_if(ids.begin(), ids.end(), [V](int64_t i) { return i < 0 || i >= V; }),
            ids.end());
  if (ids.empty()) return;
  at::Tensor idx = at::tensor(ids, at::kLong).to(logits.device());
  at::Tensor s = logits.index_select(0, idx);
  s = at::where(s < 0, s * penalty, s / penalty);
  logits.index_copy_(0, idx, s);
}

at::Tensor filter_top_k(const at::Tensor& logits, int64_t k) {
  const int64_t V = logits.size(-1);
  if (k <= 0 || k >= V) return logits;
  const at::Tensor kth = std::get<0>(logits.topk(k)).select(-1, k - 1);
  return logits.masked_fill(logits < kth, -std::numeric_limits<float>::infinity());
}

at::Tensor filter_top_p(const at::Tensor& logits, double top_p) {
  if (top_p >= 1.0) return logits;
  auto sorted = logits.sort(/*dim=*/-1, /*descending=*/true);
  const at::Tensor& vals = std::get<0>(sorted);  // (V) descending
  const at::Tensor& idx = std::get<1>(sorted);   // (V)
  const at::Tensor probs = vals.softmax(-1);
  const at::Tensor before = probs.cumsum(-1) - probs;  // probability mass ranked above each token
  at::Tensor remove_sorted = before >= top_p;
  remove_sorted.select(0, 0).fill_(false);  // at least one token
  const at::Tensor remove = at::zeros_like(remove_sorted).scatter(-1, idx, remove_sorted);
  return logits.masked_fill(remove, -std::numeric_limits<float>::infinity());
}

Sampler::Sampler(const SamplingOptions& options)
    : opt_(options), gen_(at::make_generator<at::CPUGeneratorImpl>(options.seed)) {
  opt_.validate();
}

int64_t Sampler::next(const at::Tensor& logits, const std::vector<int64_t>& history) {
  TORCH_CHECK(logits.dim() == 1, "sampler: expected (V) logits, got ", logits.sizes());
  at::Tensor l = logits.to(at::kCPU, at::kFloat).clone();
  apply_repetition_penalty(l, history, opt_.repetition_penalty);
  if (opt_.temperature == 0) return l.argmax().item<int64_t>();
  l = l / opt_.temperature;
  l = filter_top_k(l, opt_.top_k);
  l = filter_top_p(l, opt_.top_p);
  const at::Tensor probs = l.softmax(-1);
  return at::multinomial(probs, 1, /*replacement=*/false, gen_).item<int64_t>();
}

void reserve_cache(const model::Qwen3Model& model, model::KvCache& cache, int64_t needed) {
  if (needed <= cache.capacity()) return;
  const int64_t batch = cache.k.empty() ? 1 : cache.k[0].size(0);
  model::KvCache bigger = model.make_cache(batch, std::max(needed, 2 * cache.capacity()));
  for (size_t l = 0; l < cache.k.size() && cache.length > 0; ++l) {
    bigger.k[l].narrow(2, 0, cache.length).copy_(cache.k[l].narrow(2, 0, cache.length));
    bigger.v[l].narrow(2, 0, cache.length).copy_(cache.v[l].narrow(2, 0, cache.length));
  }
  bigger.length = cache.length;
  cache = std::move(bigger);
}

namespace {

// Logits (V) of the last position after appending `ids` (1, T) to the cache.
at::Tensor last_logits(model::Qwen3Model& model, model::KvCache& cache, const at::Tensor& ids) {
  model::ModelInputs in;
  in.input_ids = ids;
  const std::string lm_name = model.tied() ? "model.embed_tokens.weight" : "lm_head.weight";
  const model::Parameter& lm = model.parameter(lm_name);
  // A trained master or an adapted lm_head (no master: the file's codes and A, B) is not the
  // forward weight: let forward() build it.
  if (lm.trainable || lm.lora_a != nullptr) {
    at::Tensor logits = model.forward(in, &cache);  // (1, T, V)
    return logits.select(0, 0).select(0, logits.size(1) - 1);
  }
  // As Qwen3Model::generate does (same shapes, same kernels, same argmax).
  at::Tensor h = model.hidden_states(in, &cache);   // (1, T, H)
  at::Tensor last = h.select(1, h.size(1) - 1);     // (1, H)
  return at::linear(last, lm.master).select(0, 0);  // (V)
}

}  // namespace

DecodeResult decode(model::Qwen3Model& model, model::KvCache& cache,
                    const std::vector<int64_t>& new_ids, Sampler& sampler,
                    std::vector<int64_t>& history, int64_t max_new_tokens,
                    const std::vector<int64_t>& stop_ids,
                    const std::function<bool(int64_t)>& on_token) {
  TORCH_CHECK(!new_ids.empty(), "decode: no input tokens");
  TORCH_CHECK(max_new_tokens >= 0, "decode: max_new_tokens must be >= 0, got ", max_new_tokens);
  const int64_t V = model.config().vocab_size;
  for (int64_t id : new_ids) {
    TORCH_CHECK(id >= 0 && id < V, "decode: token id ", id, " is outside [0, ", V, ")");
  }
  DecodeResult r;
  at::NoGradGuard no_grad;
  const auto dev = model.options().device;
  const int64_t n = static_cast<int64_t>(new_ids.size());
  reserve_cache(model, cache, cache.length + n + max_new_tokens);
  history.insert(history.end(), new_ids.begin(), new_ids.end());
  if (max_new_tokens == 0) {  // prefill only: the cache holds every input token
    model::ModelInputs in;
    in.input_ids = at::tensor(new_ids, at::kLong).view({1, n}).to(dev);
    model.hidden_states(in, &cache);
    return r;
  }
  at::Tensor ids = at::tensor(new_ids, at::kLong).view({1, n}).to(dev);
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t tok = sampler.next(last_logits(model, cache, ids), history);
    r.tokens.push_back(tok);
    history.push_back(tok);
    const bool go_on = !on_token || on_token(tok);
    if (std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end()) {
      r.stopped = true;
      break;
    }
    if (!go_on) break;
    ids = at::tensor(std::vector<int64_t>{tok}, at::kLong).view({1, 1}).to(dev);
  }
  return r;
}

}  // namespace q4::chat
