// Finished-row compaction in batched generation (SamplingParams::compact_finished, sampling.h):
// on tiny random models (dense with grouped-query attention, and mixture-of-experts), a
// left-padded batch whose rows stop at very different steps gives the same tokens, finish
// reasons, log-probabilities and entropies with compaction as without it, bit for bit with a
// forward whose rows do not depend on the step's row count (the model one row at a time) and to
// rounding through the batched forward, for sampling with every filter, with the host
// repetition penalty and greedy; the sampler's
// per-row uniforms do not depend on which rows a step holds; select_cache_rows keeps the rows'
// keys, values and padding mask; and the recorded entropy equals an fp64 entropy of the full
// logits / T of each prompt + completion.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <iostream>
#include <string>

#include "q4/model/qwen3_config.h"
#include "q4/model/sampling.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace compaction_test {

Qwen3Model model_of(const std::string& config, uint64_t seed) {
  const auto cfg = Qwen3Config::from_json_file(config);
  ModelOptions opt;
  opt.trainable = TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  return Qwen3Model::random_init(cfg, opt, seed, /*std=*/0.5);
}

// 12 prompts of 1 to 7 tokens (left padding), a sixteenth of the vocabulary stops.
const std::vector<std::vector<int64_t>> kPrompts = {
    {33, 17, 42, 99, 55}, {250, 38, 61}, {7}, {300, 301, 302, 303, 304, 305, 306},
    {90, 91},             {120},         {5, 6, 7, 8}, {377, 12, 200},
    {64, 65, 66, 67, 68}, {150, 151},    {222},        {44, 45, 46, 47, 48, 49}};

SamplingParams params_with(double temperature, int64_t top_k, double top_p, double penalty) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = top_k;
  p.top_p = top_p;
  p.repetition_penalty = penalty;
  p.max_new_tokens = 24;
  p.seed = 29;
  p.want_logprobs = true;
  p.want_entropy = true;
  p.logprobs_at_temperature = temperature > 0;
  p.stop_ids.clear();
  for (int64_t id = 100; id < 124; ++id) p.stop_ids.push_back(id);
  return p;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Whether some step had at least a quarter of the rows stopped and one still running: the rule
// compacts there, so the case exercises compaction.
bool compacts(const std::vector<GenerationResult>& out, int64_t max_new_tokens) {
  std::vector<int64_t> len;
  for (const auto& r : out) len.push_back(static_cast<int64_t>(r.tokens.size()));
  std::sort(len.begin(), len.end());
  const size_t quarter = (len.size() + 3) / 4;
  return len[quarter - 1] < max_new_tokens - 1 && len.back() > len[quarter - 1] + 1;
}

// The model's forward one row at a time, on each row's slice of the batch's cache: every GEMM has
// one row, so a row's logits do not depend on which other rows the step holds (the batched
// forward's do: BLAS kernels block rows by their count).
StepLogits row_by_row(Qwen3Model& m) {
  return [&m](const ModelInputs& in, KvCache& cache) {
    const int64_t B = in.input_ids.size(0), T = in.input_ids.size(1);
    std::vector<at::Tensor> rows;
    for (int64_t r = 0; r < B; ++r) {
      KvCache one;  // views: the row's keys and values are written into the batch's cache
      for (size_t l = 0; l < cache.k.size(); ++l) {
        one.k.push_back(cache.k[l].narrow(0, r, 1));
        one.v.push_back(cache.v[l].narrow(0, r, 1));
      }
      if (cache.key_valid.defined()) one.key_valid = cache.key_valid.narrow(0, r, 1);
      one.length = cache.length;
      ModelInputs x;
      x.input_ids = in.input_ids.narrow(0, r, 1);
      if (in.position_ids.defined()) x.position_ids = in.position_ids.narrow(0, r, 1);
      rows.push_back(m.next_token_logits(x, one));
    }
    cache.length += T;
    return at::cat(rows);  // (B, V)
  };
}

struct Pair {
  std::vector<GenerationResult> off, on;
};

// One generator per row, as the GRPO rollouts sample (TokenSampler's row generators).
TokenSampler row_sampler(const SamplingParams& p) {
  std::vector<at::Generator> gens;
  for (size_t r = 0; r < kPrompts.size(); ++r) gens.push_back(at::detail::createCPUGenerator(40 + r));
  return TokenSampler(p, std::move(gens));
}

Pair both_ways(Qwen3Model& m, const SamplingParams& p, const StepLogits& step,
               bool row_generators = false) {
  SamplingParams off = p, on = p;
  off.compact_finished = false;
  on.compact_finished = true;
  Pair r;
  for (const SamplingParams* q : {&off, &on}) {
    TokenSampler own = row_generators ? row_sampler(*q) : TokenSampler(*q);
    (q == &off ? r.off : r.on) = generate(m, kPrompts, *q, &own, step);
  }
  EXPECT_EQ(r.off.size(), r.on.size());
  return r;
}

void expect_compaction_changes_nothing(Qwen3Model& m, const SamplingParams& p,
                                       const std::string& what, bool row_generators = false) {
  const Pair r = both_ways(m, p, row_by_row(m), row_generators);
  ASSERT_TRUE(compacts(r.off, p.max_new_tokens)) << what << ": the rows stop too close together";
  for (size_t i = 0; i < r.off.size(); ++i) {
    const auto &a = r.off[i], &b = r.on[i];
    EXPECT_EQ(a.tokens, b.tokens) << what << " row " << i;
    EXPECT_EQ(a.finish, b.finish) << what << " row " << i;
    EXPECT_EQ(a.logprobs.size(), a.tokens.size()) << what << " row " << i;
    EXPECT_EQ(a.entropy.size(), a.tokens.size()) << what << " row " << i;
    EXPECT_TRUE(same_bits(a.logprobs, b.logprobs)) << what << " row " << i;
    EXPECT_TRUE(same_bits(a.entropy, b.entropy)) << what << " row " << i;
  }
}

// Bit for bit with a forward whose rows do not depend on the step's row count: the sampler's
// per-row uniforms, the cache rows kept, the padding mask and the positions of the compacted
// steps are those of the uncompacted batch (grouped-query attention: 4 query heads, 2 KV heads).
TEST(Compaction, CompactedEqualsUncompactedBitForBit) {
  at::NoGradGuard no_grad;
  Qwen3Model m = model_of(kConfig, 7);
  expect_compaction_changes_nothing(m, params_with(1.0, 40, 0.95, 1.0), "sampled");
  expect_compaction_changes_nothing(m, params_with(0.7, 0, 1.0, 1.3), "penalty");
  expect_compaction_changes_nothing(m, params_with(0.0, 0, 1.0, 1.0), "greedy");
  expect_compaction_changes_nothing(m, params_with(1.0, 40, 0.95, 1.0), "row generators",
                                    /*row_generators=*/true);
}

TEST(Compaction, MixtureOfExpertsCompactedEqualsUncompacted) {
  at::NoGradGuard no_grad;
  Qwen3Model m = model_of(kFixtures + "/qwen3_moe_tiny.config.json", 8);
  expect_compaction_changes_nothing(m, params_with(1.0, 40, 0.95, 1.0), "moe sampled");
}

// Through the model's batched forward the compacted steps' GEMMs have fewer rows, which BLAS
// rounds differently in the last bits: the same tokens on this seeded case (a token can differ
// only where u · total falls within ~1e-6 of a boundary) and log-probabilities and entropies
// within 1e-4 nats (measured 7.6e-6 on the 2-core development machine: fp32 rounding of the
// large logits of this init, as rollout_test.cpp bounds the decode against the training
// forward; a wrong row or position is off by ~1).
TEST(Compaction, BatchedForwardAgreesToRounding) {
  at::NoGradGuard no_grad;
  Qwen3Model m = model_of(kConfig, 7);
  const SamplingParams p = params_with(1.0, 40, 0.95, 1.0);
  const Pair r = both_ways(m, p, {});
  ASSERT_TRUE(compacts(r.off, p.max_new_tokens));
  double d = 0;
  for (size_t i = 0; i < r.off.size(); ++i) {
    const auto &a = r.off[i], &b = r.on[i];
    ASSERT_EQ(a.tokens, b.tokens) << "row " << i;
    for (size_t j = 0; j < a.tokens.size(); ++j) {
      d = std::max<double>(d, std::abs(a.logprobs[j] - b.logprobs[j]));
      d = std::max<double>(d, std::abs(a.entropy[j] - b.entropy[j]));
    }
  }
  std::cout << "[ measured ] batched forward: max |compacted - uncompacted| " << d << "\n";
  EXPECT_LT(d, 1e-4);
}

// A step that holds rows {1, 3} of a batch of 4 draws what the whole batch's rows 1 and 3 draw,
// and leaves the generator where the whole batch leaves it.
TEST(Compaction, SampledRowsTakeTheirOwnUniforms) {
  at::manual_seed(2);
  const at::Tensor logits = at::randn({4, 50}, at::kFloat) * 2;  // (4, V)
  SamplingParams p;
  p.temperature = 0.9;
  p.seed = 5;
  TokenSampler whole(p), part(p);
  for (int step = 0; step < 20; ++step) {
    const auto all = whole.next_batch(logits, {});
    SampledRows rows;
    rows.batch_rows = 4;
    rows.rows = {1, 3};
    const auto some = part.next_batch(at::stack({logits[1], logits[3]}), {}, nullptr, nullptr,
                                      &rows);
    ASSERT_EQ(some.size(), 2u);
    EXPECT_EQ(some[0], all[1]) << "step " << step;
    EXPECT_EQ(some[1], all[3]) << "step " << step;
  }
  // With one generator per row, a row left out of a step draws nothing: row 3 draws next what
  // it would have drawn in the skipped step.
  std::vector<at::Generator> ga, gb;
  for (int r = 0; r < 4; ++r) {
    ga.push_back(at::detail::createCPUGenerator(60 + r));
    gb.push_back(at::detail::createCPUGenerator(60 + r));
  }
  TokenSampler per_row(p, std::move(ga)), per_row_part(p, std::move(gb));
  SampledRows only3;
  only3.batch_rows = 4;
  only3.rows = {3};
  for (int step = 0; step < 20; ++step) {
    const auto all = per_row.next_batch(logits, {});
    const auto some = per_row_part.next_batch(logits.narrow(0, 3, 1), {}, nullptr, nullptr, &only3);
    EXPECT_EQ(some.at(0), all[3]) << "step " << step;
  }
  SampledRows bad;
  bad.batch_rows = 2;
  bad.rows = {0, 2};
  EXPECT_THROW(part.next_batch(logits.narrow(0, 0, 2), {}, nullptr, nullptr, &bad), c10::Error);
}

TEST(Compaction, SelectCacheRowsKeepsTheRows) {
  at::NoGradGuard no_grad;
  Qwen3Model m = model_of(kConfig, 7);
  KvCache c = m.make_cache(3, 8);
  for (size_t l = 0; l < c.k.size(); ++l) {
    c.k[l].copy_(at::randn_like(c.k[l]));
    c.v[l].copy_(at::randn_like(c.v[l]));
  }
  c.key_valid = at::rand({3, 8}) > 0.5;
  c.length = 5;
  const KvCache before = [&] {
    KvCache b = c;
    for (auto& t : b.k) t = t.clone();
    for (auto& t : b.v) t = t.clone();
    return b;
  }();
  select_cache_rows(c, {2, 0});
  EXPECT_EQ(c.length, 5);
  EXPECT_EQ(c.capacity(), 8);
  for (size_t l = 0; l < c.k.size(); ++l) {
    ASSERT_EQ(c.k[l].size(0), 2);
    EXPECT_TRUE(c.k[l][0].narrow(1, 0, 5).equal(before.k[l][2].narrow(1, 0, 5)));
    EXPECT_TRUE(c.k[l][1].narrow(1, 0, 5).equal(before.k[l][0].narrow(1, 0, 5)));
    EXPECT_TRUE(c.v[l][0].narrow(1, 0, 5).equal(before.v[l][2].narrow(1, 0, 5)));
    EXPECT_TRUE(c.v[l][1].narrow(1, 0, 5).equal(before.v[l][0].narrow(1, 0, 5)));
  }
  EXPECT_TRUE(c.key_valid[0].equal(before.key_valid[2]));
  EXPECT_TRUE(c.key_valid[1].equal(before.key_valid[0]));
  EXPECT_THROW(select_cache_rows(c, {2}), c10::Error);  // the batch is 2 rows now
  EXPECT_THROW(select_cache_rows(c, {}), c10::Error);
}

// Against the definition: -sum p log p of softmax(logits / T) in fp64 over the full vocabulary,
// from the model's logits of each prompt + completion alone. The rollout's logits come from the
// cached, batched decode (other shapes than one whole row: fp32 rounding, ~1e-5 in the
// log-probabilities on this model, rollout_test.cpp); the entropy's terms carry the same
// relative rounding, so 1e-4 nats bounds it while a wrong temperature (T 0.7 against 1) or a
// top-k-filtered distribution moves it by ~0.1 or more.
TEST(Compaction, RecordedEntropyIsTheSamplingDistributionsInFp64) {
  at::NoGradGuard no_grad;
  Qwen3Model m = model_of(kConfig, 7);
  const double T = 0.7;
  const SamplingParams p = params_with(T, 40, 0.95, 1.0);
  const std::vector<std::vector<int64_t>> prompts = {kPrompts[0], kPrompts[1]};
  const auto out = sample_completions(m, prompts, /*num_generations=*/3, p);
  double worst = 0, spread = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    const auto& prompt = prompts[i / 3];
    std::vector<int64_t> row = prompt;
    row.insert(row.end(), out[i].tokens.begin(), out[i].tokens.end());
    ModelInputs in;
    in.input_ids = at::tensor(row, at::kLong).view({1, -1});
    const at::Tensor logits = m.forward(in).to(at::kDouble)[0];  // (P + C, V)
    ASSERT_EQ(out[i].entropy.size(), out[i].tokens.size());
    const auto P = static_cast<int64_t>(prompt.size());
    for (size_t j = 0; j < out[i].tokens.size(); ++j) {
      const at::Tensor lp = (logits[P - 1 + static_cast<int64_t>(j)] / T).log_softmax(0);
      const double want = -(lp.exp() * lp).sum().item<double>();
      const double at_t1 =
          -(logits[P - 1 + static_cast<int64_t>(j)].softmax(0) *
            logits[P - 1 + static_cast<int64_t>(j)].log_softmax(0))
               .sum()
               .item<double>();
      worst = std::max(worst, std::abs(out[i].entropy[j] - want));
      spread = std::max(spread, std::abs(at_t1 - want));
    }
  }
  EXPECT_LT(worst, 1e-4);
  EXPECT_GT(spread, 0.1);  // the temperature matters on this model: the check can fail
}

}  // namespace compaction_test
}  // namespace q4::model
