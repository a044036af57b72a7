// GRPO rollouts (sampling.h) on a tiny random fake-quantized model (fixture config): the
// log-probabilities recorded while sampling with the KV cache against the training forward's
// (completion_logprobs: prompt + completion in one right-padded pass) and against an fp64
// log softmax of the full logits / T; the chunked token log-probabilities' temperature gradient
// against autograd in fp64; the prompt-major layout of the groups.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <iostream>

#include "q4/model/qwen3_config.h"
#include "q4/model/sampling.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace rollout_test {

Qwen3Model rollout_model() { return tiny_random_model(/*seed=*/5); }

SamplingParams rollout_params(double temperature) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_k = 40;
  p.top_p = 0.95;
  p.max_new_tokens = 10;
  // A twelfth of the vocabulary (384) stops: some completions of 10 tokens end early, others not.
  p.stop_ids.clear();
  for (int64_t id = 0; id < 32; ++id) p.stop_ids.push_back(id);
  p.seed = 23;
  return p;
}

struct Rollouts {
  std::vector<std::vector<int64_t>> prompts, completions;  // per completion
  std::vector<GenerationResult> results;
};

Rollouts roll(Qwen3Model& m, double temperature) {
  const std::vector<std::vector<int64_t>> prompts = {{33, 17, 42, 99, 55}, {250, 38, 61}};
  Rollouts r;
  r.results = sample_completions(m, prompts, /*num_generations=*/3, rollout_params(temperature));
  for (size_t i = 0; i < r.results.size(); ++i) {
    r.prompts.push_back(prompts[i / 3]);
    r.completions.push_back(r.results[i].tokens);
  }
  return r;
}

// The largest |rollout - training| over every completion token.
double max_difference(const Rollouts& r, const at::Tensor& train) {
  double d = 0;
  for (size_t i = 0; i < r.results.size(); ++i) {
    const auto& lp = r.results[i].logprobs;
    EXPECT_EQ(lp.size(), r.completions[i].size());
    for (size_t j = 0; j < lp.size(); ++j) {
      d = std::max(
          d, std::abs(static_cast<double>(lp[j]) -
                      train[static_cast<int64_t>(i)][static_cast<int64_t>(j)].item<double>()));
    }
  }
  return d;
}

// CPU fp32: the cached decode (a left-padded batch, one token per step, attention over the cache)
// and the training forward (whole rows, right-padded) compute each completion token's hidden
// state with other shapes, so their fp32 sums round differently (not bit for bit); the lm_head,
// the temperature and the log-softmax are the same ops. Measured on the 2-core development
// machine: 8.6e-6 (T 1) and 1.1e-5 (T 0.7) at most, in nats, on this random model (init std
// 0.5: large activations and logits, so fp32 rounding is large in absolute terms). The bound,
// 1e-4 (a ratio within 1 +- 1e-4), is far below what clipping at 0.2 acts on, and far below a
// wrong position (another token's log-probability, off by ~1) or a missing temperature.
TEST(Rollout, SampledLogprobsEqualTheTrainingForward) {
  at::NoGradGuard no_grad;
  Qwen3Model m = rollout_model();
  for (double temperature : {1.0, 0.7}) {
    const Rollouts r = roll(m, temperature);
    ASSERT_EQ(r.results.size(), 6u);
    const at::Tensor train = completion_logprobs(m, r.prompts, r.completions, temperature);
    const double d = max_difference(r, train);
    std::cout << "[ measured ] temperature " << temperature
              << ": max |rollout - training forward| log-probability " << d << "\n";
    EXPECT_LT(d, 1e-4) << "temperature " << temperature;
    // Past each completion's end the training tensor holds 0.
    for (size_t i = 0; i < r.results.size(); ++i) {
      for (int64_t j = static_cast<int64_t>(r.completions[i].size()); j < train.size(1); ++j) {
        EXPECT_EQ(train[static_cast<int64_t>(i)][j].item<float>(), 0.0f);
      }
    }
  }
}

// Against the definition: log softmax(logits / T) in fp64 from the model's full logits of each
// prompt + completion row alone (the forward's own fp32 logits, so only the log-softmax's
// rounding and the batch shapes differ).
TEST(Rollout, LogprobsAreTheTemperatureScaledPolicy) {
  at::NoGradGuard no_grad;
  Qwen3Model m = rollout_model();
  const double T = 0.7;
  const Rollouts r = roll(m, T);
  int64_t stopped = 0;
  for (size_t i = 0; i < r.results.size(); ++i) {
    stopped += r.results[i].finish == FinishReason::kStop;
    std::vector<int64_t> row = r.prompts[i];
    row.insert(row.end(), r.completions[i].begin(), r.completions[i].end());
    ModelInputs in;
    in.input_ids = at::tensor(row, at::kLong).view({1, -1});
    const at::Tensor logits = m.forward(in).to(at::kDouble)[0];  // (T, V)
    const int64_t P = static_cast<int64_t>(r.prompts[i].size());
    for (size_t j = 0; j < r.completions[i].size(); ++j) {
      const at::Tensor lp = (logits[P - 1 + static_cast<int64_t>(j)] / T).log_softmax(0);
      EXPECT_NEAR(r.results[i].logprobs[j], lp[r.completions[i][j]].item<double>(), 1e-4)
          << "completion " << i << " token " << j;
    }
  }
  // The fixture's stop ids are drawn: some completions end early, some reach the limit.
  EXPECT_GT(stopped, 0);
  EXPECT_LT(stopped, 6);
}

// A group's completions come from one prompt and differ (they are sampled, not copied).
TEST(Rollout, GroupsArePromptMajorAndSampled) {
  at::NoGradGuard no_grad;
  Qwen3Model m = rollout_model();
  const std::vector<std::vector<int64_t>> prompts = {{33, 17, 42}, {250, 38, 61}};
  SamplingParams p = rollout_params(1.0);
  p.stop_ids = {};
  const auto out = sample_completions(m, prompts, 4, p);
  ASSERT_EQ(out.size(), 8u);
  int distinct = 0;
  for (int g = 1; g < 4; ++g) distinct += out[g].tokens != out[0].tokens;
  EXPECT_GT(distinct, 0);
  // Row p * 4 + g continues prompt p: its first log-probability is the one the training
  // forward gives that token after prompt p.
  const at::Tensor train =
      completion_logprobs(m, {prompts[0], prompts[0], prompts[1], prompts[1]},
                          {out[0].tokens, out[3].tokens, out[4].tokens, out[7].tokens}, 1.0);
  EXPECT_NEAR(train[1][0].item<double>(), out[3].logprobs[0], 1e-4);
  EXPECT_NEAR(train[2][0].item<double>(), out[4].logprobs[0], 1e-4);
  EXPECT_THROW(sample_completions(m, prompts, 1, p), c10::Error);  // a group of one
}

// chunked_token_logprobs at a temperature: values and gradients (hidden, weight) against
// autograd through log_softmax(h W^T / T) in fp64, with chunks smaller than the rows.
TEST(Rollout, ChunkedTokenLogprobsAtATemperatureMatchAutogradInFp64) {
  at::manual_seed(4);
  const at::Tensor h = at::randn({9, 6}, at::kDouble).requires_grad_(true);
  const at::Tensor w = at::randn({13, 6}, at::kDouble).requires_grad_(true);
  const at::Tensor y = at::randint(0, 13, {9}, at::kLong);
  const at::Tensor up = at::randn({9}, at::kDouble);
  const double T = 0.6;
  const at::Tensor got = chunked_token_logprobs(h, w, y, /*chunk_tokens=*/4, T);
  (got.to(at::kDouble) * up).sum().backward();
  const at::Tensor gh = h.grad().clone(), gw = w.grad().clone();
  h.grad().zero_();
  w.grad().zero_();
  const at::Tensor want =
      (at::matmul(h, w.t()) / T).log_softmax(1).gather(1, y.unsqueeze(1)).squeeze(1);
  (want * up).sum().backward();
  // The forward's fp32 logits bound the agreement: ~1e-6 relative.
  EXPECT_LT(rel_err(got, want), 1e-5);
  EXPECT_LT(rel_err(gh, h.grad()), 1e-5);
  EXPECT_LT(rel_err(gw, w.grad()), 1e-5);
  EXPECT_GT(w.grad().abs().max().item<double>(), 1e-3);
}

}  // namespace rollout_test
}  // namespace q4::model
