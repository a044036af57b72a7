// Sampling on hand-made logits (top-k, top-p, repetition penalty, temperature 0, seeded
// reproducibility) and the cached decode loop against Qwen3Model::generate() on a tiny random
// model (fixture config, vocab 384).
#include "sampling.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "q4/model/qwen3_config.h"

namespace q4::chat {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> to_vec(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

TEST(Sampling, TopKKeepsTheKLargest) {
  const at::Tensor l = at::tensor({1.f, 5.f, 3.f, 4.f, 2.f});
  EXPECT_EQ(to_vec(filter_top_k(l, 2)), (std::vector<float>{-kInf, 5.f, -kInf, 4.f, -kInf}));
  EXPECT_EQ(to_vec(filter_top_k(l, 0)), to_vec(l));  // off
  EXPECT_EQ(to_vec(filter_top_k(l, 9)), to_vec(l));  // k >= V: off
  // Ties at the k-th value are kept (HF TopKLogitsWarper).
  const at::Tensor t = at::tensor({3.f, 1.f, 3.f, 2.f});
  EXPECT_EQ(to_vec(filter_top_k(t, 1)), (std::vector<float>{3.f, -kInf, 3.f, -kInf}));
}

TEST(Sampling, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (given as log-probabilities, in shuffled order).
  const at::Tensor l = at::tensor({0.15f, 0.5f, 0.05f, 0.3f}).log();
  // 0.6: 0.5 alone does not reach it, 0.5 + 0.3 does -> two tokens.
  EXPECT_EQ(at::isinf(filter_top_p(l, 0.6)).to(at::kInt).sum().item<int>(), 2);
  auto kept = to_vec(filter_top_p(l, 0.6));
  EXPECT_TRUE(std::isfinite(kept[1]) && std::isfinite(kept[3]));
  EXPECT_TRUE(std::isinf(kept[0]) && std::isinf(kept[2]));
  // 0.9: three tokens; 0.1: the most likely only; 1.0: unchanged.
  EXPECT_EQ(at::isinf(filter_top_p(l, 0.9)).to(at::kInt).sum().item<int>(), 1);
  kept = to_vec(filter_top_p(l, 0.1));
  EXPECT_TRUE(std::isfinite(kept[1]));
  EXPECT_EQ(at::isinf(filter_top_p(l, 0.1)).to(at::kInt).sum().item<int>(), 3);
  EXPECT_EQ(to_vec(filter_top_p(l, 1.0)), to_vec(l));
}

TEST(Sampling, RepetitionPenaltyDividesPositivesMultipliesNegatives) {
  at::Tensor l = at::tensor({2.f, -2.f, 1.f, 3.f});
  apply_repetition_penalty(l, {0, 1, 1}, 2.0);  // repeated ids count once
  EXPECT_EQ(to_vec(l), (std::vector<float>{1.f, -4.f, 1.f, 3.f}));
  at::Tensor same = at::tensor({2.f, -2.f});
  apply_repetition_penalty(same, {0, 1}, 1.0);
  EXPECT_EQ(to_vec(same), (std::vector<float>{2.f, -2.f}));
}

TEST(Sampling, GreedyIsArgmaxAndPenaltyChangesIt) {
  SamplingOptions o;
  o.temperature = 0;
  Sampler s(o);
  const at::Tensor l = at::tensor({1.f, 3.f, 2.9f});
  EXPECT_EQ(s.next(l, {}), 1);
  o.repetition_penalty = 1.5;  // 3 / 1.5 = 2 < 2.9
  Sampler p(o);
  EXPECT_EQ(p.next(l, {1}), 2);
}

TEST(Sampling, SeededSamplingIsReproducibleAndFollowsTheDistribution) {
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_p = 1.0;
  o.seed = 42;
  const at::Tensor l = at::tensor({0.7f, 0.3f}).log();
  Sampler a(o), b(o);
  std::vector<int64_t> da, db;
  for (int i = 0; i < 2000; ++i) {
    da.push_back(a.next(l, {}));
    db.push_back(b.next(l, {}));
  }
  EXPECT_EQ(da, db);
  o.seed = 43;
  Sampler c(o);
  std::vector<int64_t> dc;
  for (int i = 0; i < 2000; ++i) dc.push_back(c.next(l, {}));
  EXPECT_NE(da, dc);
  // Binomial(2000, 0.7): std 20.5, so +-100 is ~5 sigma.
  int64_t zeros = 0;
  for (int64_t t : da) zeros += t == 0;
  EXPECT_NEAR(static_cast<double>(zeros), 1400.0, 100.0);
  // top_k = 1 or a tiny top_p leave only the argmax.
  o.top_k = 1;
  Sampler k1(o);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(k1.next(l, {}), 0);
  o.top_k = 0;
  o.top_p = 0.05;
  Sampler p1(o);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(p1.next(l, {}), 0);
}

TEST(Sampling, OptionsAreValidated) {
  SamplingOptions o;
  o.top_p = 0;
  EXPECT_THROW(Sampler{o}, c10::Error);
  o = {};
  o.temperature = -1;
  EXPECT_THROW(Sampler{o}, c10::Error);
  o = {};
  o.repetition_penalty = 0;
  EXPECT_THROW(Sampler{o}, c10::Error);
}

model::Qwen3Model tiny_model() {
  const auto cfg = model::Qwen3Config::from_json_file(Q4_FIXTURES_DIR "/qwen3_tiny.config.json");
  model::ModelOptions opt;
  opt.trainable = model::TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  return model::Qwen3Model::random_init(cfg, opt, /*seed=*/3, /*std=*/0.5);
}

TEST(Decode, GreedyEqualsGenerateAndTheCacheGrows) {
  auto m = tiny_model();
  const std::vector<int64_t> prompt = {5, 17, 99, 200, 3, 42};
  model::GenerateOptions g;
  g.max_new_tokens = 20;
  g.stop_ids = {7};
  const auto ref = m.generate(prompt, g);
  ASSERT_FALSE(ref.empty());
  SamplingOptions o;
  o.temperature = 0;
  for (int64_t capacity : {64, 2}) {  // 2: the cache is reallocated before the prefill
    Sampler s(o);
    model::KvCache cache = m.make_cache(1, capacity);
    std::vector<int64_t> history;
    std::vector<int64_t> streamed;
    const auto r =
        decode(m, cache, prompt, s, history, g.max_new_tokens, g.stop_ids, [&](int64_t t) {
          streamed.push_back(t);
          return true;
        });
    EXPECT_EQ(r.tokens, ref) << "capacity " << capacity;
    EXPECT_EQ(streamed, ref);
    EXPECT_EQ(r.stopped, !ref.empty() && ref.back() == 7);
    EXPECT_EQ(history.size(), prompt.size() + ref.size());
    // Every token but the last sampled one is in the cache.
    EXPECT_EQ(cache.length, static_cast<int64_t>(prompt.size() + ref.size()) - 1);
  }
}

// An adapter on lm_head (as q4chat --adapter loads one: plain, no master, the weight built from
// the codes and A, B): the decode goes through forward() and equals generate().
TEST(Decode, AdaptedLmHeadEqualsGenerate) {
  const auto cfg = model::Qwen3Config::from_json_file(Q4_FIXTURES_DIR "/qwen3_tiny.config.json");
  model::ModelOptions opt;
  opt.trainable = model::TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  opt.master_dtype = at::kFloat;
  opt.lora.rank = 4;
  opt.lora.targets = {"q_proj", "lm_head"};
  opt.lora.merge_aware = false;
  auto m = model::Qwen3Model::random_init(cfg, opt, /*seed=*/3, /*std=*/0.5);
  at::Generator gen = at::detail::createCPUGenerator(11);
  for (auto& p : m.adapters()) p.master.copy_(at::randn(p.master.sizes(), gen) * 0.5);
  const std::vector<int64_t> prompt = {5, 17, 99, 200, 3, 42};
  model::GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_ids = {};
  SamplingOptions o;
  o.temperature = 0;
  Sampler s(o);
  model::KvCache cache = m.make_cache(1, 64);
  std::vector<int64_t> history;
  EXPECT_EQ(decode(m, cache, prompt, s, history, g.max_new_tokens, {}).tokens,
            m.generate(prompt, g));
}

TEST(Decode, ExtendingTheCacheEqualsAFreshPrefill) {
  auto m = tiny_model();
  SamplingOptions o;
  o.temperature = 0;
  Sampler s(o);
  model::KvCache cache = m.make_cache(1, 8);
  std::vector<int64_t> history;
  const auto first = decode(m, cache, {1, 2, 3, 4}, s, history, 5, {});
  ASSERT_EQ(first.tokens.size(), 5u);
  // Second turn: the unfed last token plus new input, on the same cache.
  const std::vector<int64_t> more = {first.tokens.back(), 9, 10, 11};
  history.pop_back();
  const auto second = decode(m, cache, more, s, history, 6, {});
  std::vector<int64_t> all = {1, 2, 3, 4};
  all.insert(all.end(), first.tokens.begin(), first.tokens.end() - 1);
  all.insert(all.end(), more.begin(), more.end());
  model::GenerateOptions g;
  g.max_new_tokens = 6;
  g.stop_ids = {};
  EXPECT_EQ(second.tokens, m.generate(all, g));
}

TEST(Decode, SeededSamplingDecodeIsReproducible) {
  auto m = tiny_model();
  SamplingOptions o;
  o.temperature = 1.0;
  o.top_k = 50;
  o.top_p = 0.95;
  o.repetition_penalty = 1.2;
  o.seed = 11;
  std::vector<std::vector<int64_t>> runs;
  for (int i = 0; i < 2; ++i) {
    Sampler s(o);
    model::KvCache cache = m.make_cache(1, 32);
    std::vector<int64_t> history;
    runs.push_back(decode(m, cache, {1, 2, 3}, s, history, 16, {}).tokens);
  }
  EXPECT_EQ(runs[0], runs[1]);
  EXPECT_EQ(runs[0].size(), 16u);
}

}  // namespace
}  // namespace q4::chat
