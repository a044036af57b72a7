// Batched generation and the cached decode loop (sampling.h) on a tiny random model (fixture
// config, vocab 384): batch 1 greedy against the step loop generate() always ran, a left-padded
// batch against each prompt alone, per-row stops, top-k 1 / tiny top-p against greedy, seeded
// sampling, and decode() against generate() (cache growth, an adapted lm_head, a second turn).
// A padded batch computes other shapes than a prompt alone, so rows are compared by logits with
// a tolerance and by tokens only where the alone run's top-2 margin is large (no test relies on
// BLAS kernels giving the same bits across batch shapes).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "q4/model/qwen3_config.h"
#include "q4/model/sampling.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

Qwen3Model tiny_model() { return tiny_random_model(/*seed=*/3); }

SamplingParams greedy(int64_t n, std::vector<int64_t> stop_ids = {}) {
  SamplingParams p;
  p.temperature = 0;
  p.max_new_tokens = n;
  p.stop_ids = std::move(stop_ids);
  return p;
}

// Sampling with every filter on (temperature 1, top-k 50, top-p 0.95, repetition penalty 1.2)
// from seed 11, up to 16 tokens.
SamplingParams seeded_sampling() {
  SamplingParams p = greedy(16);
  p.temperature = 1.0;
  p.top_k = 50;
  p.top_p = 0.95;
  p.repetition_penalty = 1.2;
  p.seed = 11;
  return p;
}

// The greedy loop Qwen3Model::generate() ran before it went through the batched generate: batch
// 1, prefill, argmax of the last position's logits on the device, fed back.
std::vector<int64_t> reference_greedy(Qwen3Model& m, const std::vector<int64_t>& prompt, int64_t n,
                                      const std::vector<int64_t>& stop_ids) {
  at::NoGradGuard ng;
  const int64_t P = static_cast<int64_t>(prompt.size());
  KvCache cache = m.make_cache(1, P + n);
  at::Tensor ids = at::tensor(prompt, at::kLong).view({1, P});
  const at::Tensor lm =
      m.parameter(m.tied() ? "model.embed_tokens.weight" : "lm_head.weight").master;
  std::vector<int64_t> out;
  for (int64_t step = 0; step < n; ++step) {
    ModelInputs in;
    in.input_ids = ids;
    at::Tensor h = m.hidden_states(in, &cache);
    at::Tensor next = at::linear(h.select(1, h.size(1) - 1), lm).argmax(-1);
    out.push_back(next.item<int64_t>());
    if (std::find(stop_ids.begin(), stop_ids.end(), out.back()) != stop_ids.end()) break;
    ids = next.view({1, 1});
  }
  return out;
}

// Full-forward logits (no cache) at each generated step of `prompt` followed by `tokens`: (n, V).
at::Tensor step_logits(Qwen3Model& m, const std::vector<int64_t>& prompt,
                       const std::vector<int64_t>& tokens) {
  at::NoGradGuard ng;
  std::vector<int64_t> seq = prompt;
  seq.insert(seq.end(), tokens.begin(), tokens.end());
  ModelInputs in;
  in.input_ids = at::tensor(seq, at::kLong).unsqueeze(0);
  const int64_t P = static_cast<int64_t>(prompt.size());
  return m.forward(in)[0].narrow(0, P - 1, static_cast<int64_t>(tokens.size()));
}

// The number of leading steps whose top-2 logit margin is at least `margin`: where a batched
// row must pick the same token as the prompt alone.
size_t confident_prefix(const at::Tensor& logits, double margin) {
  const at::Tensor top2 = std::get<0>(logits.to(at::kFloat).topk(2, -1));  // (n, 2)
  const at::Tensor gap = (top2.select(1, 0) - top2.select(1, 1)).contiguous();
  size_t i = 0;
  while (i < static_cast<size_t>(gap.size(0)) && gap[i].item<double>() >= margin) ++i;
  return i;
}

const std::vector<std::vector<int64_t>> kPrompts = {
    {5, 17, 99, 200, 3, 42}, {7, 8}, {300, 1, 2, 3, 250, 12, 13, 14, 15, 90, 91}};

TEST(Generate, GreedyBatchOneIsTheOldGreedyLoop) {
  auto m = tiny_model();
  for (const auto& prompt : kPrompts) {
    const auto ref = reference_greedy(m, prompt, 20, {});
    const auto got = generate(m, {prompt}, greedy(20));
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].tokens, ref);  // same shapes and kernels: the same bits
    EXPECT_EQ(got[0].finish, FinishReason::kLength);
    EXPECT_EQ(m.generate(prompt, {20, {}}), ref);
  }
  // With a stop id: the output ends with it, as before.
  const auto ref = reference_greedy(m, kPrompts[0], 20, {});
  const int64_t stop = ref[3];
  const auto cut = reference_greedy(m, kPrompts[0], 20, {stop});
  const auto got = generate(m, {kPrompts[0]}, greedy(20, {stop}));
  EXPECT_EQ(got[0].tokens, cut);
  EXPECT_EQ(got[0].finish, FinishReason::kStop);
}

// The padded prefill gives each row the logits of its prompt alone (tolerance: fp32 CPU sums in
// another order, ~1e-6 relative; 1e-4 also catches a padded key that leaks in, ~1e-1).
TEST(Generate, LeftPaddedPrefillMatchesEachPromptAlone) {
  auto m = tiny_model();
  at::NoGradGuard ng;
  const int64_t B = static_cast<int64_t>(kPrompts.size()), L = 11;
  std::vector<int64_t> ids(B * L, 0), pos(B * L, 0);
  at::Tensor valid = at::ones({B, L + 1}, at::kBool);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t P = static_cast<int64_t>(kPrompts[b].size()), pad = L - P;
    for (int64_t j = 0; j < P; ++j) {
      ids[b * L + pad + j] = kPrompts[b][j];
      pos[b * L + pad + j] = j;
    }
    valid[b].narrow(0, 0, pad).fill_(false);
  }
  KvCache cache = m.make_cache(B, L + 1);
  cache.key_valid = valid;
  ModelInputs in;
  in.input_ids = at::tensor(ids, at::kLong).view({B, L});
  in.position_ids = at::tensor(pos, at::kLong).view({B, L});
  const at::Tensor batched = m.next_token_logits(in, cache);  // (B, V)
  for (int64_t b = 0; b < B; ++b) {
    const at::Tensor alone = step_logits(m, kPrompts[b], {0})[0];
    EXPECT_LT(rel_err(batched[b], alone), 1e-4) << "row " << b;
  }
  // Without key_valid the padding is attended: the short rows' logits move.
  KvCache plain = m.make_cache(B, L + 1);
  const at::Tensor leaky = m.next_token_logits(in, plain);
  EXPECT_GT(rel_err(leaky[1], step_logits(m, kPrompts[1], {0})[0]), 1e-3);
}

TEST(Generate, BatchOfDifferentLengthsMatchesEachPromptAlone) {
  auto m = tiny_model();
  SamplingParams p = greedy(16);
  p.want_logprobs = true;
  const auto batched = generate(m, kPrompts, p);
  ASSERT_EQ(batched.size(), kPrompts.size());
  for (size_t b = 0; b < kPrompts.size(); ++b) {
    const auto alone = generate(m, {kPrompts[b]}, p)[0];
    ASSERT_EQ(alone.tokens.size(), 16u);
    const at::Tensor logits = step_logits(m, kPrompts[b], alone.tokens);
    const size_t n = confident_prefix(logits, 1e-3);
    ASSERT_GE(n, 8u) << "row " << b << ": the fixture's margins are too small to compare";
    const auto& got = batched[b];
    EXPECT_EQ(std::vector<int64_t>(got.tokens.begin(), got.tokens.begin() + n),
              std::vector<int64_t>(alone.tokens.begin(), alone.tokens.begin() + n))
        << "row " << b;
    ASSERT_EQ(got.logprobs.size(), got.tokens.size());
    const at::Tensor lsm = logits.log_softmax(-1);
    for (size_t i = 0; i < n; ++i) {
      EXPECT_NEAR(got.logprobs[i], lsm[i][alone.tokens[i]].item<float>(), 1e-4) << b << " " << i;
    }
  }
}

TEST(Generate, EachRowStopsOnItsOwn) {
  auto m = tiny_model();
  std::vector<std::vector<int64_t>> alone;
  for (const auto& prompt : kPrompts) alone.push_back(generate(m, {prompt}, greedy(12))[0].tokens);
  const int64_t stop = alone[0][2];  // row 0 stops at step 2 at the latest
  const auto got = generate(m, kPrompts, greedy(12, {stop}));
  for (size_t b = 0; b < kPrompts.size(); ++b) {
    const auto at = std::find(alone[b].begin(), alone[b].end(), stop);
    const bool stops = at != alone[b].end();
    const std::vector<int64_t> want(alone[b].begin(), stops ? at + 1 : alone[b].end());
    const at::Tensor logits = step_logits(m, kPrompts[b], alone[b]);
    ASSERT_GE(confident_prefix(logits, 1e-3), want.size()) << "row " << b;
    EXPECT_EQ(got[b].tokens, want) << "row " << b;
    EXPECT_EQ(got[b].finish, stops ? FinishReason::kStop : FinishReason::kLength) << "row " << b;
  }
  EXPECT_EQ(got[0].finish, FinishReason::kStop);
  EXPECT_LE(got[0].tokens.size(), 3u);
}

TEST(Generate, TopK1AndTinyTopPEqualGreedy) {
  auto m = tiny_model();
  const auto ref = generate(m, kPrompts, greedy(10));
  SamplingParams p = greedy(10);
  p.temperature = 1.3;
  p.seed = 5;
  p.top_k = 1;
  const auto k1 = generate(m, kPrompts, p);
  p.top_k = 0;
  p.top_p = 1e-6;
  const auto tiny_p = generate(m, kPrompts, p);
  for (size_t b = 0; b < kPrompts.size(); ++b) {
    EXPECT_EQ(k1[b].tokens, ref[b].tokens) << "row " << b;
    EXPECT_EQ(tiny_p[b].tokens, ref[b].tokens) << "row " << b;
  }
}

TEST(Generate, SeededSamplingIsReproducible) {
  auto m = tiny_model();
  SamplingParams p = seeded_sampling();
  const auto a = generate(m, kPrompts, p);
  const auto b = generate(m, kPrompts, p);
  p.seed = 12;
  const auto c = generate(m, kPrompts, p);
  bool differs = false;
  for (size_t r = 0; r < kPrompts.size(); ++r) {
    EXPECT_EQ(a[r].tokens, b[r].tokens);
    EXPECT_EQ(a[r].tokens.size(), 16u);
    differs = differs || a[r].tokens != c[r].tokens;
  }
  EXPECT_TRUE(differs);
}

TEST(Generate, BadInputIsRefused) {
  auto m = tiny_model();
  EXPECT_THROW(generate(m, {}, greedy(4)), c10::Error);
  EXPECT_THROW(generate(m, {{1, 2}, {}}, greedy(4)), c10::Error);
  EXPECT_THROW(generate(m, {{1, 384}}, greedy(4)), c10::Error);
  EXPECT_THROW(generate(m, {{1, 2}}, greedy(-1)), c10::Error);
  EXPECT_TRUE(generate(m, {{1, 2}}, greedy(0))[0].tokens.empty());
}

TEST(Decode, GreedyEqualsGenerateAndTheCacheGrows) {
  auto m = tiny_model();
  const std::vector<int64_t> prompt = kPrompts[0];
  const auto ref = m.generate(prompt, {20, {7}});
  ASSERT_FALSE(ref.empty());
  for (int64_t capacity : {64, 2}) {  // 2: the cache is reallocated before the prefill
    TokenSampler s(greedy(0));
    KvCache cache = m.make_cache(1, capacity);
    std::vector<int64_t> history;
    std::vector<int64_t> streamed;
    const auto r = decode(m, cache, prompt, s, history, 20, {7}, [&](int64_t t) {
      streamed.push_back(t);
      return true;
    });
    EXPECT_EQ(r.tokens, ref) << "capacity " << capacity;
    EXPECT_EQ(streamed, ref);
    EXPECT_EQ(r.finish == FinishReason::kStop, ref.back() == 7);
    EXPECT_EQ(history.size(), prompt.size() + ref.size());
    // Every token but the last sampled one is in the cache.
    EXPECT_EQ(cache.length, static_cast<int64_t>(prompt.size() + ref.size()) - 1);
  }
  TokenSampler s(greedy(0));
  KvCache cache = m.make_cache(1, 64);
  std::vector<int64_t> history;
  const auto cut = decode(m, cache, prompt, s, history, 20, {}, [](int64_t) { return false; });
  EXPECT_EQ(cut.tokens.size(), 1u);
  EXPECT_EQ(cut.finish, FinishReason::kCancelled);
}

// An adapter on lm_head (as q4chat --adapter loads one: plain, no master, the weight built from
// the codes and A, B): decode equals generate.
TEST(Decode, AdaptedLmHeadEqualsGenerate) {
  ModelOptions opt = inference_options();
  opt.master_dtype = at::kFloat;
  opt.lora.rank = 4;
  opt.lora.targets = {"q_proj", "lm_head"};
  opt.lora.merge_aware = false;
  auto m = tiny_random_model(/*seed=*/3, opt);
  at::Generator gen = at::detail::createCPUGenerator(11);
  for (auto& p : m.adapters()) p.master.copy_(at::randn(p.master.sizes(), gen) * 0.5);
  const std::vector<int64_t> prompt = kPrompts[0];
  TokenSampler s(greedy(0));
  KvCache cache = m.make_cache(1, 64);
  std::vector<int64_t> history;
  EXPECT_EQ(decode(m, cache, prompt, s, history, 12, {}).tokens, m.generate(prompt, {12, {}}));
}

TEST(Decode, ExtendingTheCacheEqualsAFreshPrefill) {
  auto m = tiny_model();
  TokenSampler s(greedy(0));
  KvCache cache = m.make_cache(1, 8);
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
  EXPECT_EQ(second.tokens, m.generate(all, {6, {}}));
}

// decode() and a batch of one draw the same tokens from the same seed.
TEST(Decode, SeededDecodeEqualsGenerateOfOne) {
  auto m = tiny_model();
  SamplingParams p = seeded_sampling();
  TokenSampler s(p);
  KvCache cache = m.make_cache(1, 32);
  std::vector<int64_t> history;
  const auto r = decode(m, cache, {1, 2, 3}, s, history, 16, {});
  EXPECT_EQ(r.tokens.size(), 16u);
  EXPECT_EQ(r.tokens, generate(m, {{1, 2, 3}}, p)[0].tokens);
}

// A trainable (fake-quantized) model generates the same tokens and log-probabilities inside an
// InferenceWeights scope, which keeps each linear's forward weight (up to its budget) and drops
// them when it ends; a budget of 0 keeps nothing.
TEST(Generate, InferenceWeightsKeepTheForwardWeightsAndChangeNothing) {
  ModelOptions opt = inference_options();
  opt.trainable = TrainableSpec::everything();
  Qwen3Model m = tiny_random_model(/*seed=*/3, opt);
  SamplingParams p = seeded_sampling();
  p.want_logprobs = true;
  const std::vector<std::vector<int64_t>> prompts = {{5, 9, 2}, {7}};
  const auto plain = generate(m, prompts, p);
  int64_t all = 0;
  {
    Qwen3Model::InferenceWeights kept(m, int64_t{1} << 40);
    const auto cached = generate(m, prompts, p);
    for (size_t b = 0; b < prompts.size(); ++b) {
      EXPECT_EQ(cached[b].tokens, plain[b].tokens);
      EXPECT_EQ(cached[b].logprobs, plain[b].logprobs);
    }
    all = kept.bytes();
    EXPECT_GT(all, 0);
    EXPECT_TRUE(m.parameter("model.layers.0.self_attn.q_proj.weight").inference_weight.defined());
  }
  EXPECT_FALSE(m.parameter("model.layers.0.self_attn.q_proj.weight").inference_weight.defined());
  {
    Qwen3Model::InferenceWeights some(m, all / 2);
    const auto cached = generate(m, prompts, p);
    EXPECT_EQ(cached[0].tokens, plain[0].tokens);
    EXPECT_GT(some.bytes(), 0);
    EXPECT_LE(some.bytes(), all / 2);
  }
  {
    Qwen3Model::InferenceWeights none(m, 0);
    generate(m, prompts, p);
    EXPECT_EQ(none.bytes(), 0);
  }
}

}  // namespace
}  // namespace q4::model
