// The logits processors and TokenSampler (sampling.h) on hand-made logits: top-k, top-p, the HF
// repetition penalty per row, greedy, option checks, seeded reproducibility and the sampled
// frequencies of a fixed distribution.
#include "q4/model/sampling.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace q4::model {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

std::vector<float> to_vec(const at::Tensor& t) {
  at::Tensor c = t.contiguous().to(at::kFloat);
  return std::vector<float>(c.data_ptr<float>(), c.data_ptr<float>() + c.numel());
}

SamplingParams sampled(double temperature, uint64_t seed) {
  SamplingParams p;
  p.temperature = temperature;
  p.seed = seed;
  return p;
}

TEST(Sampling, TopKKeepsTheKLargest) {
  const at::Tensor l = at::tensor({1.f, 5.f, 3.f, 4.f, 2.f});
  EXPECT_EQ(to_vec(filter_top_k(l, 2)), (std::vector<float>{-kInf, 5.f, -kInf, 4.f, -kInf}));
  EXPECT_EQ(to_vec(filter_top_k(l, 0)), to_vec(l));  // off
  EXPECT_EQ(to_vec(filter_top_k(l, 9)), to_vec(l));  // k >= V: off
  // Ties at the k-th value are kept (HF TopKLogitsWarper).
  const at::Tensor t = at::tensor({3.f, 1.f, 3.f, 2.f});
  EXPECT_EQ(to_vec(filter_top_k(t, 1)), (std::vector<float>{3.f, -kInf, 3.f, -kInf}));
  // Per row of a batch.
  const at::Tensor b = at::stack({l, at::tensor({5.f, 1.f, 2.f, 3.f, 4.f})});
  EXPECT_EQ(to_vec(filter_top_k(b, 2)),
            (std::vector<float>{-kInf, 5.f, -kInf, 4.f, -kInf, 5.f, -kInf, -kInf, -kInf, 4.f}));
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
  // Per row: the second row (reversed order) keeps its own two most likely tokens.
  const at::Tensor b = at::stack({l, l.flip(0)});
  const auto kb = to_vec(filter_top_p(b, 0.6));
  EXPECT_TRUE(std::isfinite(kb[4 + 0]) && std::isfinite(kb[4 + 2]));
  EXPECT_TRUE(std::isinf(kb[4 + 1]) && std::isinf(kb[4 + 3]));
}

TEST(Sampling, RepetitionPenaltyDividesPositivesMultipliesNegatives) {
  at::Tensor l = at::tensor({2.f, -2.f, 1.f, 3.f});
  apply_repetition_penalty(l, {0, 1, 1}, 2.0);  // repeated ids count once
  EXPECT_EQ(to_vec(l), (std::vector<float>{1.f, -4.f, 1.f, 3.f}));
  at::Tensor same = at::tensor({2.f, -2.f});
  apply_repetition_penalty(same, {0, 1}, 1.0);
  EXPECT_EQ(to_vec(same), (std::vector<float>{2.f, -2.f}));
}

// The penalty of each row from its own history, against a direct computation: greedy picks the
// argmax of the penalized row, which differs per history.
TEST(Sampling, RepetitionPenaltyPerRowMatchesADirectComputation) {
  const std::vector<float> raw = {2.0f, 1.9f, -0.5f, 1.5f, -3.0f};
  const std::vector<std::vector<int64_t>> hist = {{0}, {0, 1}, {}, {0, 1, 3, 3}};
  const double penalty = 1.4;
  SamplingParams p;
  p.repetition_penalty = penalty;
  TokenSampler s(p);
  const at::Tensor logits = at::tensor(raw).repeat({4, 1});  // (4, V)
  std::vector<const std::vector<int64_t>*> rows;
  for (const auto& h : hist) rows.push_back(&h);
  const std::vector<int64_t> got = s.next_batch(logits, rows);
  for (size_t b = 0; b < hist.size(); ++b) {
    std::vector<float> want = raw;
    for (int64_t id : hist[b]) {
      const float x = raw[id];  // once per distinct id (HF gathers, then scatters)
      want[id] = x < 0 ? static_cast<float>(x * penalty) : static_cast<float>(x / penalty);
    }
    const int64_t arg = std::max_element(want.begin(), want.end()) - want.begin();
    EXPECT_EQ(got[b], arg) << "row " << b;
  }
  EXPECT_EQ(got, (std::vector<int64_t>{1, 3, 0, 0}));
}

TEST(Sampling, GreedyIsArgmaxAndPenaltyChangesIt) {
  TokenSampler s(sampled(0, 0));
  const at::Tensor l = at::tensor({1.f, 3.f, 2.9f});
  EXPECT_EQ(s.next(l, {}), 1);
  SamplingParams o = sampled(0, 0);
  o.repetition_penalty = 1.5;  // 3 / 1.5 = 2 < 2.9
  TokenSampler p(o);
  EXPECT_EQ(p.next(l, {1}), 2);
}

TEST(Sampling, SeededSamplingIsReproducible) {
  const at::Tensor l = at::tensor({0.7f, 0.3f}).log();
  TokenSampler a(sampled(1.0, 42)), b(sampled(1.0, 42)), c(sampled(1.0, 43));
  std::vector<int64_t> da, db, dc;
  for (int i = 0; i < 500; ++i) {
    da.push_back(a.next(l, {}));
    db.push_back(b.next(l, {}));
    dc.push_back(c.next(l, {}));
  }
  EXPECT_EQ(da, db);
  EXPECT_NE(da, dc);
  // A given generator is used as is: two samplers on copies of one seeded state agree.
  at::Generator g1 = at::detail::createCPUGenerator(9), g2 = at::detail::createCPUGenerator(9);
  TokenSampler x(sampled(1.0, 0), g1), y(sampled(1.0, 123), g2);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(x.next(l, {}), y.next(l, {}));
}

// Each row of a batch draws from its own distribution: frequencies over many draws match the
// probabilities. Binomial(n, p) with n = 4000: std <= 32, so 160 is a 5-sigma bound.
TEST(Sampling, SampledFrequenciesFollowEachRowsDistribution) {
  const std::vector<std::vector<float>> probs = {{0.5f, 0.25f, 0.15f, 0.1f},
                                                 {0.1f, 0.2f, 0.3f, 0.4f}};
  const at::Tensor logits = at::stack({at::tensor(probs[0]), at::tensor(probs[1])}).log() * 0.5;
  TokenSampler s(sampled(0.5, 7));  // logits / 0.5 gives back log(p)
  const int n = 4000;
  std::vector<std::vector<int>> count(2, std::vector<int>(4, 0));
  for (int i = 0; i < n; ++i) {
    const auto t = s.next_batch(logits, {});
    for (int b = 0; b < 2; ++b) ++count[b][t[b]];
  }
  for (int b = 0; b < 2; ++b) {
    for (int v = 0; v < 4; ++v) {
      EXPECT_NEAR(count[b][v], n * probs[b][v], 160.0) << "row " << b << " token " << v;
    }
  }
}

TEST(Sampling, TopK1AndTinyTopPLeaveTheArgmax) {
  const at::Tensor l = at::tensor({0.2f, 0.5f, 0.3f}).log();
  SamplingParams p = sampled(1.0, 3);
  p.top_k = 1;
  TokenSampler k1(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(k1.next(l, {}), 1);
  p.top_k = 0;
  p.top_p = 1e-6;
  TokenSampler p1(p);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(p1.next(l, {}), 1);
}

TEST(Sampling, LogprobsAreTheUnprocessedDistributions) {
  const at::Tensor l = at::tensor({0.5f, 0.25f, 0.25f}).log().repeat({2, 1});
  SamplingParams p = sampled(0.3, 1);
  p.top_k = 2;
  TokenSampler s(p);
  std::vector<float> lp;
  const auto t = s.next_batch(l, {}, &lp);
  ASSERT_EQ(lp.size(), 2u);
  for (int b = 0; b < 2; ++b) {
    EXPECT_NEAR(lp[b], std::log(t[b] == 0 ? 0.5 : 0.25), 1e-6);  // fp32 log_softmax
  }
}

// The exact distribution each setting draws from, in fp64: softmax(l / T), the top k kept, then
// the smallest most-likely set whose mass (among the kept) reaches top_p, renormalized.
std::vector<double> exact_probabilities(const std::vector<double>& l, double T, int64_t k,
                                        double top_p) {
  const size_t V = l.size();
  std::vector<size_t> order(V);
  for (size_t i = 0; i < V; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return l[a] > l[b]; });
  const size_t kept_k = k > 0 && static_cast<size_t>(k) < V ? static_cast<size_t>(k) : V;
  std::vector<double> p(V, 0.0);
  double z = 0;
  for (size_t r = 0; r < kept_k; ++r) z += std::exp(l[order[r]] / T);
  double before = 0, kept_mass = 0;
  for (size_t r = 0; r < kept_k; ++r) {
    const double q = std::exp(l[order[r]] / T) / z;
    if (r > 0 && before >= top_p) break;
    p[order[r]] = q;
    kept_mass += q;
    before += q;
  }
  for (double& x : p) x /= kept_mass;
  return p;
}

// Frequencies of 24,000 draws (48 rows x 500 calls) against the exact probabilities for
// temperature, top-k, top-p and all three together: each within 5 binomial sigmas (at most
// 5 sqrt(n p (1 - p)) <= 5 * 77), and a token the filters remove never drawn.
TEST(Sampling, TemperatureTopKTopPDrawFromTheExactDistribution) {
  const std::vector<double> l = {2.0, 1.5, 1.2, 0.3, -0.4, 0.9, -1.0, 0.0};
  struct Setting {
    double T;
    int64_t k;
    double top_p;
  };
  for (const Setting& st : {Setting{0.7, 0, 1.0}, Setting{1.6, 0, 1.0}, Setting{1.0, 3, 1.0},
                            Setting{1.0, 0, 0.6}, Setting{1.3, 5, 0.75}}) {
    SamplingParams p = sampled(st.T, 17);
    p.top_k = st.k;
    p.top_p = st.top_p;
    TokenSampler s(p);
    std::vector<float> lf(l.begin(), l.end());
    const at::Tensor logits = at::tensor(lf).repeat({48, 1});
    const std::vector<double> want = exact_probabilities(l, st.T, st.k, st.top_p);
    std::vector<double> count(l.size(), 0.0);
    const int calls = 500;
    for (int i = 0; i < calls; ++i) {
      for (int64_t t : s.next_batch(logits, {})) count[t] += 1;
    }
    const double n = 48.0 * calls;
    for (size_t v = 0; v < l.size(); ++v) {
      const std::string where = "T " + std::to_string(st.T) + " k " + std::to_string(st.k) +
                                " top_p " + std::to_string(st.top_p) + " token " +
                                std::to_string(v);
      if (want[v] == 0) {
        EXPECT_EQ(count[v], 0.0) << where;
      } else {
        EXPECT_NEAR(count[v], n * want[v], 5 * std::sqrt(n * want[v] * (1 - want[v])) + 1) << where;
      }
    }
  }
}

// logprobs_at_temperature: log softmax(logits / T) before top-k / top-p (TRL's GRPO policy), in
// fp64 from the same logits.
TEST(Sampling, LogprobsAtTemperatureAreTheScaledDistribution) {
  const std::vector<double> l = {1.0, 0.2, -0.5, 2.2};
  std::vector<float> lf(l.begin(), l.end());
  SamplingParams p = sampled(0.6, 5);
  p.top_k = 2;
  p.logprobs_at_temperature = true;
  TokenSampler s(p);
  std::vector<float> lp;
  const auto t = s.next_batch(at::tensor(lf).repeat({3, 1}), {}, &lp);
  double z = 0;
  for (double x : l) z += std::exp(x / 0.6);
  for (int b = 0; b < 3; ++b) {
    EXPECT_TRUE(t[b] == 0 || t[b] == 3);  // top-k 2 still filters the draw
    EXPECT_NEAR(lp[b], l[t[b]] / 0.6 - std::log(z), 1e-6);
  }
}

TEST(Sampling, ParamsAreValidatedWithTheNamesGiven) {
  auto message = [](SamplingParams p, const std::string& prefix, bool cli) {
    try {
      p.validate(prefix, cli);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string();
  };
  SamplingParams p;
  p.top_p = 0;
  EXPECT_NE(message(p, "", true).find("--top-p: expected a value in (0, 1], got 0"),
            std::string::npos);
  p = {};
  p.top_k = -1;
  EXPECT_NE(message(p, "eval.", false).find("eval.top_k: expected >= 0"), std::string::npos);
  p = {};
  p.temperature = -1;
  EXPECT_THROW(TokenSampler{p}, c10::Error);
  p = {};
  p.repetition_penalty = 0;
  EXPECT_NE(message(p, "", true).find("--repetition-penalty"), std::string::npos);
  p = {};
  p.max_new_tokens = -1;
  EXPECT_NE(message(p, "", false).find("max_new_tokens: expected >= 0"), std::string::npos);
  EXPECT_EQ(message(SamplingParams{}, "", false), "");
}

}  // namespace
}  // namespace q4::model
