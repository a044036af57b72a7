// Token sampling, batched generation and the cached decode loop (see sampling.h). Filters and
// the draw run on the logits' device (one uniform per row comes from the host generator);
// only with a repetition penalty do the rows come to the host in fp32.
#include "q4/model/sampling.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace q4::model {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

bool is_stop(const std::vector<int64_t>& stop_ids, int64_t tok) {
  return std::find(stop_ids.begin(), stop_ids.end(), tok) != stop_ids.end();
}

void check_ids(const std::vector<int64_t>& ids, int64_t V, const char* what) {
  for (int64_t id : ids) {
    TORCH_CHECK(id >= 0 && id < V, what, ": token id ", id, " is outside [0, ", V, ")");
  }
}

}  // namespace

void SamplingParams::validate(const std::string& prefix, bool cli) const {
  const auto name = [&](std::string field) {
    if (!cli) return prefix + field;
    std::replace(field.begin(), field.end(), '_', '-');
    return prefix + "--" + field;
  };
  TORCH_CHECK(std::isfinite(temperature) && temperature >= 0, name("temperature"),
              ": expected a finite value >= 0, got ", temperature);
  TORCH_CHECK(top_k >= 0, name("top_k"), ": expected >= 0 (0 = off), got ", top_k);
  TORCH_CHECK(top_p > 0 && top_p <= 1, name("top_p"), ": expected a value in (0, 1], got ", top_p);
  TORCH_CHECK(std::isfinite(repetition_penalty) && repetition_penalty > 0,
              name("repetition_penalty"), ": expected a finite value > 0 (1 = off), got ",
              repetition_penalty);
  TORCH_CHECK(max_new_tokens >= 0, name("max_new_tokens"), ": expected >= 0, got ", max_new_tokens);
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
  const at::Tensor kth = std::get<0>(logits.topk(k)).narrow(-1, k - 1, 1);  // (..., 1)
  return logits.masked_fill(logits < kth, kNegInf);
}

at::Tensor filter_top_p(const at::Tensor& logits, double top_p) {
  if (top_p >= 1.0) return logits;
  auto sorted = logits.sort(/*dim=*/-1, /*descending=*/true);
  const at::Tensor& vals = std::get<0>(sorted);  // (..., V) descending
  const at::Tensor& idx = std::get<1>(sorted);   // (..., V)
  const at::Tensor probs = vals.softmax(-1);
  const at::Tensor before = probs.cumsum(-1) - probs;  // probability mass ranked above each token
  at::Tensor remove_sorted = before >= top_p;
  remove_sorted.select(-1, 0).fill_(false);  // at least one token
  const at::Tensor remove = at::zeros_like(remove_sorted).scatter(-1, idx, remove_sorted);
  return logits.masked_fill(remove, kNegInf);
}

TokenSampler::TokenSampler(const SamplingParams& params, at::Generator generator)
    : params_(params),
      gen_(generator.defined() ? std::move(generator)
                               : at::make_generator<at::CPUGeneratorImpl>(params.seed)) {
  params_.validate();
}

TokenSampler::TokenSampler(const SamplingParams& params, std::vector<at::Generator> row_generators)
    : params_(params), row_gens_(std::move(row_generators)) {
  params_.validate();
  TORCH_CHECK(!row_gens_.empty(), "sampler: no row generators");
}

std::vector<int64_t> TokenSampler::next_batch(
    const at::Tensor& logits, const std::vector<const std::vector<int64_t>*>& histories,
    std::vector<float>* logprobs, std::vector<float>* entropy, const SampledRows* rows) {
  TORCH_CHECK(logits.dim() == 2, "sampler: expected (B, V) logits, got ", logits.sizes());
  const int64_t B = logits.size(0);
  TORCH_CHECK(rows == nullptr || static_cast<int64_t>(rows->rows.size()) == B, "sampler: ", B,
              " rows of logits but ", rows == nullptr ? 0 : rows->rows.size(), " row indices");
  const bool penalize = params_.repetition_penalty != 1.0;
  TORCH_CHECK(!penalize || static_cast<int64_t>(histories.size()) == B, "sampler: ", B,
              " rows of logits but ", histories.size(), " histories");
  at::Tensor ids;  // (B) int64
  if (params_.temperature == 0 && !penalize) {
    ids = logits.argmax(-1);  // on the device, in the logits' dtype
  } else if (!penalize) {
    ids = draw(logits.to(at::kFloat), rows);  // on the logits' device
  } else {
    at::Tensor l = logits.to(at::kCPU, at::kFloat).clone();  // (B, V)
    for (int64_t b = 0; b < B; ++b) {
      at::Tensor row = l.select(0, b);
      apply_repetition_penalty(row, *histories[b], params_.repetition_penalty);
    }
    ids = params_.temperature == 0 ? l.argmax(-1) : draw(l, rows);
  }
  if (logprobs != nullptr || entropy != nullptr) {
    std::vector<at::Tensor> host;  // (B) fp32 each: the log-probabilities, the entropies
    if (logprobs != nullptr) host.push_back(token_logprobs(logits, ids));
    if (entropy != nullptr) host.push_back(entropies(logits));
    const at::Tensor both = at::stack(host).cpu();  // (1 or 2, B): one copy to the host
    const float* p = both.data_ptr<float>();
    if (logprobs != nullptr) {
      logprobs->assign(p, p + B);
      p += B;
    }
    if (entropy != nullptr) entropy->assign(p, p + B);
  }
  const at::Tensor host = ids.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(host.data_ptr<int64_t>(), host.data_ptr<int64_t>() + B);
}

at::Tensor TokenSampler::token_logprobs(const at::Tensor& logits, const at::Tensor& ids) const {
  const int64_t B = logits.size(0);
  const at::Tensor y = ids.to(logits.device()).view({B, 1});
  if (params_.logprobs_at_temperature && params_.temperature > 0) {
    // Op for op as chunked_token_logprobs (chunked_loss.cpp) computes it in training.
    at::Tensor l = logits.to(at::kFloat);
    if (params_.temperature != 1.0) l = l / params_.temperature;
    return l.gather(1, y).squeeze(1) - at::logsumexp(l, 1);
  }
  return logits.to(at::kFloat).log_softmax(-1).gather(1, y).view({B});
}

at::Tensor TokenSampler::entropies(const at::Tensor& logits) const {
  // TRL's entropy_from_logits on logits / T: logsumexp(l) - sum(softmax(l) l), which stays
  // finite where a probability underflows to 0 (p log p would give 0 * -inf).
  at::Tensor l = logits.to(at::kFloat);
  if (params_.temperature > 0 && params_.temperature != 1.0) l = l / params_.temperature;
  return at::logsumexp(l, 1) - (l.softmax(1) * l).sum(1);
}

at::Tensor TokenSampler::draw(const at::Tensor& logits, const SampledRows* rows) {
  const int64_t B = logits.size(0);
  at::Tensor l = logits / params_.temperature;
  l = filter_top_k(l, params_.top_k);
  l = filter_top_p(l, params_.top_p);
  const at::Tensor probs = l.softmax(-1);        // (B, V) fp32
  const at::Tensor cdf = probs.cumsum(-1);       // (B, V)
  // One uniform per row from the host generator, on any device: u · total falls in the
  // interval of exactly one token of positive probability (`right`: past the flat runs of the
  // filtered ones). A part of a batch (SampledRows) draws the whole batch's uniforms and takes
  // its rows'; with row generators each row draws from its own.
  if (rows != nullptr) {
    for (const int64_t r : rows->rows) {
      TORCH_CHECK(r >= 0 && r < rows->batch_rows, "sampler: row ", r, " outside a batch of ",
                  rows->batch_rows);
    }
  }
  const int64_t batch_rows = rows == nullptr ? B : rows->batch_rows;
  at::Tensor u;
  if (row_gens_.empty()) {
    u = at::rand({batch_rows, 1}, gen_, at::kFloat);
    if (rows != nullptr) u = u.index_select(0, at::tensor(rows->rows, at::kLong));
  } else {
    TORCH_CHECK(static_cast<int64_t>(row_gens_.size()) == batch_rows, "sampler: ", batch_rows,
                " rows for ", row_gens_.size(), " row generators");
    u = at::empty({B, 1}, at::kFloat);
    float* up = u.data_ptr<float>();
    for (int64_t b = 0; b < B; ++b) {
      const int64_t r = rows == nullptr ? b : rows->rows[b];
      up[b] = at::rand({1}, row_gens_[r], at::kFloat).item<float>();
    }
  }
  const at::Tensor target = u.to(logits.device()) * cdf.narrow(1, cdf.size(1) - 1, 1);
  at::Tensor ids = at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true)
                       .clamp_max(cdf.size(1) - 1)
                       .view({B});
  // u · total may round up to the total itself: that row takes its most likely token instead.
  const at::Tensor zero = probs.gather(1, ids.view({B, 1})).view({B}).eq(0);
  return at::where(zero, probs.argmax(-1), ids);
}

int64_t TokenSampler::next(const at::Tensor& logits, const std::vector<int64_t>& history) {
  TORCH_CHECK(logits.dim() == 1, "sampler: expected (V) logits, got ", logits.sizes());
  return next_batch(logits.unsqueeze(0), {&history}).at(0);
}

const char* finish_reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

namespace {

// A batch of prompts left-padded to the longest: the prefill inputs, and the cache's valid slots
// and each row's positions when some row is shorter.
struct PaddedBatch {
  int64_t longest = 0;
  bool padded = false;
  std::vector<int64_t> lengths;
  ModelInputs prefill;  // input_ids (B, longest); position_ids when padded
};

PaddedBatch pad_left(const std::vector<std::vector<int64_t>>& prompts, const at::Device& dev) {
  PaddedBatch pb;
  const int64_t B = static_cast<int64_t>(prompts.size());
  for (const auto& p : prompts) {
    pb.lengths.push_back(static_cast<int64_t>(p.size()));
    pb.longest = std::max(pb.longest, pb.lengths.back());
  }
  std::vector<int64_t> ids(B * pb.longest, 0), pos(B * pb.longest, 0);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t pad = pb.longest - pb.lengths[b];
    pb.padded = pb.padded || pad > 0;
    for (int64_t j = 0; j < pb.lengths[b]; ++j) {
      ids[b * pb.longest + pad + j] = prompts[b][j];
      pos[b * pb.longest + pad + j] = j;
    }
  }
  pb.prefill.input_ids = at::tensor(ids, at::kLong).view({B, pb.longest}).to(dev);
  if (pb.padded) pb.prefill.position_ids = at::tensor(pos, at::kLong).view({B, pb.longest}).to(dev);
  return pb;
}

// Marks the left padding of `cache` invalid (slots [0, longest - length) of each row).
void mask_padding(KvCache& cache, const PaddedBatch& pb, const at::Device& dev) {
  const int64_t B = static_cast<int64_t>(pb.lengths.size());
  at::Tensor valid = at::ones({B, cache.capacity()}, at::kBool);
  for (int64_t b = 0; b < B; ++b) valid[b].narrow(0, 0, pb.longest - pb.lengths[b]).fill_(false);
  cache.key_valid = valid.to(dev);
}

}  // namespace

namespace {

// The rows of a decode step: active.rows[i] is the prompt (and result) index of decode row i.
// Without compaction every row stays; with it the stopped ones leave
// (SamplingParams::compact_finished).
struct DecodeRows {
  SampledRows active;      // rows in the decode batch, ascending; batch_rows = every prompt
  std::vector<bool> done;  // per prompt: stopped
  bool all() const { return static_cast<int64_t>(active.rows.size()) == active.batch_rows; }
};

// Whether to drop the stopped rows from the decode batch now: when at least a quarter of its
// rows have stopped. A compaction copies the running rows' valid cache slots (about what one
// decode step reads of them). Each compaction keeps at most 3/4 of the rows before it, so the
// rows copied over a generation sum to at most 3x the batch (3 whole-cache copies), while no
// step computes more than 4/3 of its running rows (docs/model.md#generation).
bool should_compact(const DecodeRows& r) {
  int64_t stopped = 0;
  for (const int64_t b : r.active.rows) stopped += r.done[b] ? 1 : 0;
  return stopped > 0 && 4 * stopped >= static_cast<int64_t>(r.active.rows.size());
}

// Drops the stopped rows of the decode batch from `cache` and `r`; `toks` (decode-row order)
// keeps the running rows' tokens.
void compact(DecodeRows& r, KvCache& cache, std::vector<int64_t>& toks) {
  std::vector<int64_t> keep, rows, kept_toks;
  for (size_t i = 0; i < r.active.rows.size(); ++i) {
    if (r.done[r.active.rows[i]]) continue;
    keep.push_back(static_cast<int64_t>(i));
    rows.push_back(r.active.rows[i]);
    kept_toks.push_back(toks[i]);
  }
  select_cache_rows(cache, keep);
  r.active.rows = std::move(rows);
  toks = std::move(kept_toks);
}

}  // namespace

std::vector<GenerationResult> generate(Qwen3Model& model,
                                       const std::vector<std::vector<int64_t>>& prompts,
                                       const SamplingParams& params, TokenSampler* sampler,
                                       const StepLogits& step_logits) {
  TORCH_CHECK(!prompts.empty(), "generate: no prompts");
  TORCH_CHECK(params.max_new_tokens >= 0, "generate: max_new_tokens must be >= 0, got ",
              params.max_new_tokens);
  const int64_t V = model.config().vocab_size;
  for (const auto& p : prompts) {
    TORCH_CHECK(!p.empty(), "generate: the prompt is empty");
    check_ids(p, V, "generate: prompt");
  }
  const int64_t B = static_cast<int64_t>(prompts.size());
  std::vector<GenerationResult> out(B);
  if (params.max_new_tokens == 0) return out;
  TokenSampler own(params);
  TokenSampler& s = sampler != nullptr ? *sampler : own;
  at::NoGradGuard no_grad;
  const auto dev = model.options().device;
  PaddedBatch pb = pad_left(prompts, dev);
  KvCache cache = model.make_cache(B, pb.longest + params.max_new_tokens);
  if (pb.padded) mask_padding(cache, pb, dev);
  std::vector<std::vector<int64_t>> history(prompts);
  DecodeRows r;
  r.active.batch_rows = B;
  for (int64_t b = 0; b < B; ++b) r.active.rows.push_back(b);
  r.done.assign(B, false);
  std::vector<float> lp, ent;
  ModelInputs in = pb.prefill;
  for (int64_t step = 0; step < params.max_new_tokens; ++step) {
    std::vector<const std::vector<int64_t>*> hist;
    for (const int64_t b : r.active.rows) hist.push_back(&history[b]);
    const at::Tensor logits =
        step_logits ? step_logits(in, cache) : model.next_token_logits(in, cache);  // (B', V)
    std::vector<int64_t> toks = s.next_batch(
        logits, hist, params.want_logprobs ? &lp : nullptr,
        params.want_entropy ? &ent : nullptr, r.all() ? nullptr : &r.active);
    int64_t running = 0;
    for (size_t i = 0; i < r.active.rows.size(); ++i) {
      const int64_t b = r.active.rows[i];
      if (r.done[b]) continue;
      out[b].tokens.push_back(toks[i]);
      if (params.want_logprobs) out[b].logprobs.push_back(lp[i]);
      if (params.want_entropy) out[b].entropy.push_back(ent[i]);
      history[b].push_back(toks[i]);
      if (is_stop(params.stop_ids, toks[i])) {
        out[b].finish = FinishReason::kStop;
        r.done[b] = true;
      }
      running += r.done[b] ? 0 : 1;
    }
    if (running == 0 || step + 1 == params.max_new_tokens) break;
    // Without compaction stopped rows are fed too (the batch keeps its shape); nothing of theirs
    // is kept.
    if (params.compact_finished && should_compact(r)) compact(r, cache, toks);
    const auto n = static_cast<int64_t>(r.active.rows.size());
    in = ModelInputs();
    in.input_ids = at::tensor(toks, at::kLong).view({n, 1}).to(dev);
    if (pb.padded) {
      std::vector<int64_t> pos;
      for (const int64_t b : r.active.rows) pos.push_back(pb.lengths[b] + step);
      in.position_ids = at::tensor(pos, at::kLong).view({n, 1}).to(dev);
    }
  }
  return out;
}

void reserve_cache(const Qwen3Model& model, KvCache& cache, int64_t needed) {
  if (needed <= cache.capacity()) return;
  const int64_t batch = cache.k.empty() ? 1 : cache.k[0].size(0);
  KvCache bigger = model.make_cache(batch, std::max(needed, 2 * cache.capacity()));
  for (size_t l = 0; l < cache.k.size() && cache.length > 0; ++l) {
    bigger.k[l].narrow(2, 0, cache.length).copy_(cache.k[l].narrow(2, 0, cache.length));
    bigger.v[l].narrow(2, 0, cache.length).copy_(cache.v[l].narrow(2, 0, cache.length));
  }
  if (cache.key_valid.defined()) {
    bigger.key_valid = at::ones({batch, bigger.capacity()}, cache.key_valid.options());
    bigger.key_valid.narrow(1, 0, cache.capacity()).copy_(cache.key_valid);
  }
  bigger.length = cache.length;
  cache = std::move(bigger);
}

void select_cache_rows(KvCache& cache, const std::vector<int64_t>& rows) {
  TORCH_CHECK(!rows.empty(), "select_cache_rows: no rows to keep");
  if (cache.k.empty()) return;
  const int64_t batch = cache.k[0].size(0);
  for (const int64_t r : rows) {
    TORCH_CHECK(r >= 0 && r < batch, "select_cache_rows: row ", r, " outside a batch of ", batch);
  }
  const at::Tensor index = at::tensor(rows, at::kLong).to(cache.k[0].device());
  const auto R = static_cast<int64_t>(rows.size());
  // Layer by layer, so that the old and the new cache coexist for one layer only.
  const auto select = [&](at::Tensor& t) {
    at::Tensor kept = at::empty({R, t.size(1), t.size(2), t.size(3)}, t.options());
    if (cache.length > 0) {
      kept.narrow(2, 0, cache.length)
          .copy_(t.narrow(2, 0, cache.length).index_select(0, index));
    }
    t = kept;
  };
  for (size_t l = 0; l < cache.k.size(); ++l) {
    select(cache.k[l]);
    select(cache.v[l]);
  }
  if (cache.key_valid.defined()) cache.key_valid = cache.key_valid.index_select(0, index);
}

GenerationResult decode(Qwen3Model& model, KvCache& cache, const std::vector<int64_t>& new_ids,
                        TokenSampler& sampler, std::vector<int64_t>& history,
                        int64_t max_new_tokens, const std::vector<int64_t>& stop_ids,
                        const std::function<bool(int64_t)>& on_token) {
  TORCH_CHECK(!new_ids.empty(), "decode: no input tokens");
  TORCH_CHECK(max_new_tokens >= 0, "decode: max_new_tokens must be >= 0, got ", max_new_tokens);
  check_ids(new_ids, model.config().vocab_size, "decode");
  GenerationResult r;
  at::NoGradGuard no_grad;
  const auto dev = model.options().device;
  const int64_t n = static_cast<int64_t>(new_ids.size());
  reserve_cache(model, cache, cache.length + n + max_new_tokens);
  history.insert(history.end(), new_ids.begin(), new_ids.end());
  ModelInputs in;
  in.input_ids = at::tensor(new_ids, at::kLong).view({1, n}).to(dev);
  if (max_new_tokens == 0) {  // prefill only: the cache holds every input token
    model.hidden_states(in, &cache);
    return r;
  }
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    const int64_t tok = sampler.next_batch(model.next_token_logits(in, cache), {&history}).at(0);
    r.tokens.push_back(tok);
    history.push_back(tok);
    const bool go_on = !on_token || on_token(tok);
    if (is_stop(stop_ids, tok)) {
      r.finish = FinishReason::kStop;
      break;
    }
    if (!go_on) {
      r.finish = FinishReason::kCancelled;
      break;
    }
    in.input_ids = at::tensor(std::vector<int64_t>{tok}, at::kLong).view({1, 1}).to(dev);
  }
  return r;
}

std::vector<GenerationResult> sample_completions(Qwen3Model& model,
                                                 const std::vector<std::vector<int64_t>>& prompts,
                                                 int64_t num_generations,
                                                 const SamplingParams& params,
                                                 TokenSampler* sampler) {
  TORCH_CHECK(num_generations >= 2, "grpo.num_generations: expected >= 2 (a group), got ",
              num_generations);
  TORCH_CHECK(params.temperature > 0, "grpo.temperature: rollouts sample, expected > 0, got ",
              params.temperature);
  std::vector<std::vector<int64_t>> rows;
  rows.reserve(prompts.size() * num_generations);
  for (const auto& p : prompts) {
    for (int64_t g = 0; g < num_generations; ++g) rows.push_back(p);
  }
  SamplingParams p = params;
  p.want_logprobs = true;
  p.logprobs_at_temperature = true;
  p.want_entropy = true;
  if (sampler == nullptr) return generate(model, rows, p);
  TORCH_CHECK(sampler->params().logprobs_at_temperature &&
                  sampler->params().temperature == params.temperature,
              "sample_completions: the sampler's params must have logprobs_at_temperature and "
              "the rollout's temperature");
  return generate(model, rows, p, sampler);
}

at::Tensor completion_logprobs(Qwen3Model& model, const std::vector<std::vector<int64_t>>& prompts,
                               const std::vector<std::vector<int64_t>>& completions,
                               double temperature, int64_t max_len) {
  TORCH_CHECK(prompts.size() == completions.size() && !prompts.empty(),
              "completion_logprobs: ", prompts.size(), " prompts for ", completions.size(),
              " completions");
  const int64_t B = static_cast<int64_t>(prompts.size());
  int64_t T = 1, L = max_len;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(!prompts[b].empty(), "completion_logprobs: completion ", b, "'s prompt is empty");
    T = std::max<int64_t>(T, prompts[b].size() + completions[b].size());
    L = std::max<int64_t>(L, completions[b].size());
  }
  // Right-padded rows, the completion's tokens labelled (HF shift: position t predicts t + 1).
  std::vector<int64_t> ids(B * T, 0), labels(B * T, -100), mask(B * T, 0), dest;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t P = static_cast<int64_t>(prompts[b].size());
    const int64_t C = static_cast<int64_t>(completions[b].size());
    for (int64_t t = 0; t < P + C; ++t) {
      ids[b * T + t] = t < P ? prompts[b][t] : completions[b][t - P];
      mask[b * T + t] = 1;
      if (t >= P) labels[b * T + t] = ids[b * T + t];
    }
    for (int64_t j = 0; j < C; ++j) dest.push_back(b * L + j);  // in ascending position order
  }
  check_ids(ids, model.config().vocab_size, "completion_logprobs");
  ModelInputs in;
  in.input_ids = at::tensor(ids, at::kLong).view({B, T});
  in.labels = at::tensor(labels, at::kLong).view({B, T});
  in.attention_mask = at::tensor(mask, at::kLong).view({B, T});
  const Qwen3Model::TokenLogprobs tl = model.token_logprobs(in, temperature);
  const at::Tensor lp = tl.logprobs;  // (N) in (row, position) order
  TORCH_INTERNAL_ASSERT(lp.size(0) == static_cast<int64_t>(dest.size()));
  const at::Tensor index = at::tensor(dest, at::kLong).to(lp.device());
  return at::zeros({B * L}, lp.options()).index_add(0, index, lp).view({B, L});
}

}  // namespace q4::model
