// GRPO's loss against a direct fp64 computation from full logits on fixed completions: the loss
// and its gradient with respect to the logits (derived by hand below, not by autograd) for each
// loss_type, with and without clipping and the KL term, and the clip ratio; group advantages for
// each scale_rewards against the formula; the completion mask, the rollout logs and the config
// keys (defaults, TRL's boolean scale_rewards, the one-line errors, the refused run).
#include "q4/trainer/objectives/grpo.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <ostream>
#include <string>
#include <vector>

#include "q4/trainer/objectives/registry.h"
#include "component_fixtures.h"
#include "q4/trainer/plan/setup.h"

using namespace q4::trainer;

namespace grpo_test {

// A fixed micro-batch: B completions of up to L tokens over a vocabulary of V.
struct Fixture {
  int64_t B = 4, L = 6, V = 7;
  double temperature = 0.7;
  std::vector<int64_t> lengths = {6, 3, 1, 4};
  at::Tensor logits;    // (B, L, V) fp64
  at::Tensor ids;       // (B, L) int64
  at::Tensor old_logp;  // (B, L) fp64
  at::Tensor ref_logp;  // (B, L) fp64
  at::Tensor adv;       // (B) fp64
  at::Tensor mask;      // (B, L) fp64

  explicit Fixture(bool clipping) {
    at::manual_seed(11);
    logits = at::randn({B, L, V}, at::kDouble) * 2;
    ids = at::randint(0, V, {B, L}, at::kLong);
    const at::Tensor lp = logp_of(logits);
    // Without clipping the sampling policy is the policy (ratio 1); with it, far enough away
    // that some ratios leave [0.8, 1.28] on both sides.
    old_logp = clipping ? lp + at::randn({B, L}, at::kDouble) * 0.6 : lp.clone();
    ref_logp = lp + at::randn({B, L}, at::kDouble) * 0.3;
    adv = at::tensor({1.3, -0.7, 0.4, -1.1}, at::kDouble);
    mask = completion_mask(lengths, std::vector<bool>(B, false), L, false).to(at::kDouble);
  }
  at::Tensor logp_of(const at::Tensor& x) const {
    return (x / temperature).log_softmax(-1).gather(2, ids.unsqueeze(2)).squeeze(2);
  }
};

struct DirectResult {
  double loss = 0, clip_ratio = 0, kl = 0;
  std::vector<double> grad;  // (B, L, V) row-major
};

// The loss written out element by element in fp64, and its gradient w.r.t. the logits:
// d per-token / d logp, times d logp / d x_v = (1[v = y] - softmax_v) / T.
DirectResult direct(const Fixture& f, const GrpoLossOptions& o) {
  const int64_t B = f.B, L = f.L, V = f.V;
  auto at2 = [](const at::Tensor& t, int64_t b, int64_t j) { return t[b][j].item<double>(); };
  std::vector<double> w(B * L, 0.0);
  double tokens = 0;
  for (int64_t b = 0; b < B; ++b) {
    double n = 0;
    for (int64_t j = 0; j < L; ++j) n += at2(f.mask, b, j);
    tokens += n;
    for (int64_t j = 0; j < L; ++j) {
      const double m = at2(f.mask, b, j);
      switch (o.loss_type) {
        case GrpoLossType::kGrpo:
          w[b * L + j] = m / std::max(n, 1.0) / static_cast<double>(B);
          break;
        case GrpoLossType::kDrGrpo:
          w[b * L + j] = m / static_cast<double>(B * o.max_completion_length);
          break;
        case GrpoLossType::kDapo:
          w[b * L + j] = m;  // divided by the token count below
          break;
      }
    }
  }
  if (o.loss_type == GrpoLossType::kDapo) {
    for (double& x : w) x /= tokens;
  }
  DirectResult r;
  r.grad.assign(B * L * V, 0.0);
  double clipped = 0, kl_sum = 0;
  for (int64_t b = 0; b < B; ++b) {
    const double a = f.adv[b].item<double>();
    for (int64_t j = 0; j < L; ++j) {
      std::vector<double> x(V);
      double mx = -1e300;
      for (int64_t v = 0; v < V; ++v) {
        x[v] = f.logits[b][j][v].item<double>() / f.temperature;
        mx = std::max(mx, x[v]);
      }
      double z = 0;
      for (double xv : x) z += std::exp(xv - mx);
      const double lse = mx + std::log(z);
      const int64_t y = f.ids[b][j].item<int64_t>();
      const double lp = x[y] - lse;
      const double ratio = std::exp(lp - at2(f.old_logp, b, j));
      const double lo = 1 - o.epsilon_low, hi = 1 + o.epsilon_high;
      const double c = std::min(std::max(ratio, lo), hi);
      const double l1 = ratio * a, l2 = c * a;
      double per = -std::min(l1, l2);
      // -min picks r A (gradient -r A) unless the clipped term is smaller, where it is constant.
      double dlp = l1 <= l2 ? -ratio * a : 0.0;
      const double m = at2(f.mask, b, j);
      if ((ratio < lo && a < 0) || (ratio > hi && a > 0)) clipped += m;
      if (o.beta != 0) {
        const double d = at2(f.ref_logp, b, j) - lp;
        const double kl = std::exp(d) - d - 1;
        per += o.beta * kl;
        dlp += o.beta * (1 - std::exp(d));
        kl_sum += kl * m;
      }
      r.loss += w[b * L + j] * per;
      for (int64_t v = 0; v < V; ++v) {
        const double p = std::exp(x[v] - lse);
        r.grad[(b * L + j) * V + v] =
            w[b * L + j] * dlp * ((v == y ? 1.0 : 0.0) - p) / f.temperature;
      }
    }
  }
  r.clip_ratio = clipped / tokens;
  r.kl = kl_sum / tokens;
  return r;
}

double logged(const GrpoLossOutput& out, const std::string& name) {
  for (const auto& [n, v] : out.logged) {
    if (n == name) return v.item<double>();
  }
  ADD_FAILURE() << "no logged value " << name;
  return 0;
}

struct Case {
  GrpoLossType type;
  bool clipping;
  double beta;
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << to_string(c.type) << (c.clipping ? " clipping" : " no clipping") << " beta " << c.beta;
}

class GrpoLossCases : public ::testing::TestWithParam<Case> {};

// fp32 loss and autograd gradients against the fp64 direct values. fp32 rounding of logits of
// size ~5 over V = 7 terms: relative errors ~1e-6; the bounds leave 10x room and stay far below
// any real difference (a dropped mask or wrong normalizer moves the loss by > 10%).
TEST_P(GrpoLossCases, LossAndLogitGradientsMatchADirectFp64Computation) {
  const Case c = GetParam();
  const Fixture f(c.clipping);
  GrpoLossOptions o;
  o.loss_type = c.type;
  o.epsilon_low = 0.2;
  o.epsilon_high = 0.28;
  o.beta = c.beta;
  o.max_completion_length = 8;  // > L: dr_grpo's normalizer is the configured length, not L
  const at::Tensor x = f.logits.to(at::kFloat).requires_grad_(true);
  GrpoTokens t;
  t.logps = (x / f.temperature).log_softmax(-1).gather(2, f.ids.unsqueeze(2)).squeeze(2);
  t.old_logps = f.old_logp.to(at::kFloat);
  if (c.beta != 0) t.ref_logps = f.ref_logp.to(at::kFloat);
  t.advantages = f.adv.to(at::kFloat);
  t.mask = f.mask.to(at::kBool);
  const GrpoLossOutput out = grpo_loss(t, o);
  const at::Tensor loss = out.loss_sum / out.units;
  loss.backward();
  const DirectResult d = direct(f, o);
  EXPECT_NEAR(loss.item<double>(), d.loss, 1e-5 * (1 + std::abs(d.loss)));
  const at::Tensor g = x.grad().to(at::kDouble).contiguous();
  double max_err = 0, max_g = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    max_err = std::max(max_err, std::abs(g.data_ptr<double>()[i] - d.grad[i]));
    max_g = std::max(max_g, std::abs(d.grad[i]));
  }
  EXPECT_LT(max_err, 1e-6 + 1e-5 * max_g) << "largest gradient " << max_g;
  EXPECT_GT(max_g, 1e-3);  // the comparison is not of zeros
  EXPECT_NEAR(logged(out, "clip_ratio"), d.clip_ratio, 1e-7);
  if (c.clipping) {
    EXPECT_GT(d.clip_ratio, 0.0);  // the case clips something
  } else {
    EXPECT_EQ(d.clip_ratio, 0.0);
  }
  if (c.beta != 0) {
    EXPECT_NEAR(logged(out, "kl"), d.kl, 1e-6 * (1 + d.kl));
  }
  EXPECT_EQ(logged(out, "tokens"), 14.0);
}

INSTANTIATE_TEST_SUITE_P(
    Grpo, GrpoLossCases,
    ::testing::Values(Case{GrpoLossType::kGrpo, false, 0}, Case{GrpoLossType::kGrpo, true, 0},
                      Case{GrpoLossType::kGrpo, true, 0.04}, Case{GrpoLossType::kDapo, false, 0},
                      Case{GrpoLossType::kDapo, true, 0}, Case{GrpoLossType::kDapo, false, 0.1},
                      Case{GrpoLossType::kDapo, true, 0.1}, Case{GrpoLossType::kDrGrpo, false, 0},
                      Case{GrpoLossType::kDrGrpo, true, 0},
                      Case{GrpoLossType::kDrGrpo, true, 0.1}));

// The units add up across micro-batches to the one-batch normalizers: two halves of the batch,
// (sum of loss_sums) / (sum of units), equal the whole batch's loss for each loss_type.
TEST(Grpo, MicroBatchSumsGiveTheWholeBatchsMean) {
  const Fixture f(true);
  for (GrpoLossType type : {GrpoLossType::kGrpo, GrpoLossType::kDapo, GrpoLossType::kDrGrpo}) {
    GrpoLossOptions o;
    o.loss_type = type;
    o.max_completion_length = f.L;
    auto part = [&](int64_t b0, int64_t n) {
      GrpoTokens t;
      t.logps = f.logp_of(f.logits).narrow(0, b0, n).to(at::kFloat);
      t.old_logps = f.old_logp.narrow(0, b0, n).to(at::kFloat);
      t.advantages = f.adv.narrow(0, b0, n).to(at::kFloat);
      t.mask = f.mask.narrow(0, b0, n);
      return grpo_loss(t, o);
    };
    const auto whole = part(0, f.B), a = part(0, 2), b = part(2, 2);
    const double split =
        (a.loss_sum + b.loss_sum).item<double>() / (a.units + b.units).item<double>();
    EXPECT_NEAR(split, (whole.loss_sum / whole.units).item<double>(), 1e-6) << to_string(type);
    EXPECT_NEAR(direct(f, o).loss, split, 1e-5);
  }
}

// TRL: advantage = (r - group mean) / (std + 1e-4), std unbiased, of the group (group) or of the
// whole batch (batch); none leaves r - group mean.
TEST(Grpo, GroupAdvantagesFollowScaleRewards) {
  const std::vector<double> r = {1, 0, 0, 1, 0.5, 0.5, 0.5, 0.5, 2, -1, 3, 0};
  const int64_t G = 4;
  auto stats = [](const std::vector<double>& v, size_t b, size_t n, double* mean, double* std) {
    double m = 0, s = 0;
    for (size_t i = b; i < b + n; ++i) m += v[i];
    m /= static_cast<double>(n);
    for (size_t i = b; i < b + n; ++i) s += (v[i] - m) * (v[i] - m);
    *mean = m;
    *std = std::sqrt(s / static_cast<double>(n - 1));
  };
  double batch_mean = 0, batch_std = 0;
  stats(r, 0, r.size(), &batch_mean, &batch_std);
  for (ScaleRewards scale : {ScaleRewards::kGroup, ScaleRewards::kBatch, ScaleRewards::kNone}) {
    const GroupAdvantages a = group_advantages(at::tensor(r, at::kDouble), G, scale);
    for (size_t i = 0; i < r.size(); ++i) {
      double mean = 0, std = 0;
      stats(r, i / G * G, G, &mean, &std);
      const double s = scale == ScaleRewards::kBatch ? batch_std : std;
      const double want = scale == ScaleRewards::kNone ? r[i] - mean : (r[i] - mean) / (s + 1e-4);
      EXPECT_NEAR(a.advantages[i].item<double>(), want, 1e-5) << to_string(scale) << " " << i;
      EXPECT_NEAR(a.std[i].item<double>(), s, 1e-6);
    }
  }
  // A group whose rewards are all equal has advantage 0, not 0 / 0.
  const GroupAdvantages same = group_advantages(at::full({4}, 0.5), 4, ScaleRewards::kGroup);
  EXPECT_EQ(same.advantages.abs().max().item<float>(), 0.0f);
  // A group of one is refused, naming the key.
  try {
    group_advantages(at::ones({3}), 1, ScaleRewards::kGroup);
    ADD_FAILURE() << "no error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("grpo.num_generations"),
              std::string::npos);
  }
}

TEST(Grpo, CompletionMaskAndRolloutStats) {
  const at::Tensor m = completion_mask({3, 5, 2}, {false, true, false}, 5, true);
  EXPECT_TRUE(m.equal(
      at::tensor({1.f, 1.f, 1.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 1.f, 1.f, 0.f, 0.f, 0.f})
          .view({3, 5})));
  EXPECT_EQ(completion_mask({3, 5, 2}, {false, true, false}, 5, false).sum().item<float>(), 10.0f);
  const at::Tensor rewards = at::tensor({1.0, 0.0, 1.0, 1.0});
  const GroupAdvantages a = group_advantages(rewards, 2, ScaleRewards::kGroup);
  const at::Tensor per_fn = at::tensor({1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 0.5, 0.5}).view({4, 2});
  const auto s = grpo_rollout_stats({3, 5, 2, 4}, {false, true, false, false}, rewards, a, 2,
                                    per_fn, {"acc", "fmt"});
  auto get = [&](const std::string& k) {
    for (const auto& [n, v] : s) {
      if (n == k) return v;
    }
    ADD_FAILURE() << k;
    return -1.0;
  };
  EXPECT_DOUBLE_EQ(get("completions/mean_length"), 3.5);
  EXPECT_DOUBLE_EQ(get("completions/clipped_ratio"), 0.25);
  EXPECT_DOUBLE_EQ(get("completions/mean_terminated_length"), 3.0);
  EXPECT_DOUBLE_EQ(get("reward"), 0.75);
  EXPECT_NEAR(get("reward_std"), std::sqrt(0.5) / 2, 1e-7);  // groups' stds 0.707, 0
  EXPECT_DOUBLE_EQ(get("frac_reward_zero_std"), 0.5);
  EXPECT_DOUBLE_EQ(get("rewards/acc/mean"), 0.5);
  EXPECT_DOUBLE_EQ(get("rewards/fmt/mean"), 0.5);
}

std::string config_error(const std::string& yaml) {
  try {
    parse_config(yaml, "grpo.yaml", "/tmp", {}, validate_objective_config);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

constexpr const char* kModel =
    "model: {config: /x/config.json, tokenizer: /x/tokenizer.json, init: random}\n";

TEST(Grpo, ConfigKeysDefaultsAndErrors) {
  const Config d = parse_config(
      std::string(kModel) + "train: {objective: grpo, seq_len: 1024, batch_size: 8}\n",
      "grpo.yaml", "/tmp", {}, validate_objective_config);
  EXPECT_EQ(d.grpo.num_generations, 8);
  EXPECT_EQ(d.grpo.max_completion_length, 256);
  EXPECT_EQ(d.grpo.loss_type, GrpoLossType::kDapo);
  EXPECT_EQ(d.grpo.scale_rewards, ScaleRewards::kGroup);
  EXPECT_EQ(d.grpo.top_k, 0);
  EXPECT_EQ(grpo_loss_options(d.grpo).epsilon_high, 0.2);  // 0 means epsilon
  // TRL's booleans for scale_rewards, printed back as the names.
  for (const auto& [text, want] :
       {std::pair<const char*, ScaleRewards>{"true", ScaleRewards::kGroup},
        {"false", ScaleRewards::kNone},
        {"batch", ScaleRewards::kBatch}}) {
    const Config c = parse_config(std::string(kModel) + "grpo: {scale_rewards: " + text + "}\n",
                                  "grpo.yaml", "/tmp");
    EXPECT_EQ(c.grpo.scale_rewards, want) << text;
    const Config back = parse_config(config_to_yaml(c), "saved.yaml", "/tmp");
    EXPECT_EQ(back.grpo.scale_rewards, want) << text;
  }
  const std::string one =
      config_error(std::string(kModel) +
                   "train: {objective: grpo, seq_len: 1024}\ngrpo: {num_generations: 1}\n");
  EXPECT_NE(one.find("config key grpo.num_generations"), std::string::npos) << one;
  EXPECT_EQ(one.find('\n'), std::string::npos) << one;
  const std::string longer =
      config_error(std::string(kModel) +
                   "train: {objective: grpo, seq_len: 128}\ngrpo: {max_completion_length: 128}\n");
  EXPECT_NE(longer.find("grpo.max_completion_length"), std::string::npos) << longer;
  EXPECT_NE(longer.find("train.seq_len"), std::string::npos) << longer;
  // grpo.* under another objective is named by the ignored-settings warning.
  Config sft = d;
  sft.train.objective = ObjectiveKind::kCrossEntropy;
  sft.grpo.beta = 0.1;
  EXPECT_NE(ignored_settings_warning(sft, objective_needs(sft)).find("grpo.beta"),
            std::string::npos);
  // The objective's sections: its own and the rewards'.
  const auto sections = objective_needs(d).sections;
  EXPECT_NE(std::find(sections.begin(), sections.end(), "reward"), sections.end());
  // A prompt too long for its completion: one line naming the keys and the place.
  try {
    check_grpo_prompt_length(800, d.grpo.max_completion_length, d.train.seq_len,
                             "prompts.jsonl:3");
    ADD_FAILURE() << "no error";
  } catch (const ConfigError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("prompts.jsonl:3"), std::string::npos) << m;
    EXPECT_NE(m.find("grpo.max_completion_length"), std::string::npos) << m;
  }
}

TEST(Grpo, ARunResolvesWholeGroupsPerStepInOneProcess) {
  const std::string model = kModel;
  Config c = parse_config(model + "train: {objective: grpo, seq_len: 1024, batch_size: 8}\n",
                          "grpo.yaml", "/tmp");
  EXPECT_NO_THROW(resolve_plan(c, RunOptions{}));
  EXPECT_NO_THROW(resolve_plan(c, RunOptions{}, false, /*dry_run=*/true));
  EXPECT_NE(objective_summary(objective_plan(c)).find("grpo: 8 completions"), std::string::npos);
  auto refused = [](const Config& cfg, const RunOptions& o, bool probe, const char* want) {
    try {
      resolve_plan(cfg, o, probe);
      ADD_FAILURE() << "no error for " << want;
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  Config odd = parse_config(
      model + "train: {objective: grpo, seq_len: 1024, batch_size: 6, grad_accum: 2}\n",
      "grpo.yaml", "/tmp");
  refused(odd, RunOptions{}, false, "train.batch_size, train.grad_accum: 6 x 2 = 12 rows");
  refused(c, RunOptions{}, /*probe=*/true, "--probe");
  // Data parallel: each rank samples and scores its share of the generation batch's prompts.
  RunOptions dp;
  dp.world.world_size = 2;
  EXPECT_NO_THROW(resolve_plan(c, dp));
}

TEST(Grpo, CompletionRowsScatterTokensInCompletionOrder) {
  const at::Tensor v = at::tensor({1.0f, 2.0f, 3.0f, 4.0f, 5.0f});
  const at::Tensor rows = completion_rows(v, {2, 0, 3}, 4);
  const at::Tensor want = at::tensor({1.0f, 2.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 3.0f, 4.0f,
                                      5.0f, 0.0f})
                              .view({3, 4});
  EXPECT_TRUE(at::equal(rows, want)) << rows;
  EXPECT_THROW(completion_rows(v, {2, 2}, 4), c10::Error);  // 5 values for 4 tokens
}

// TRL's `entropy` log: the masked mean over the trained tokens of the per-token entropies given,
// here of softmax(logits / T) in fp64 (a truncated row masked out), absent when none are given.
TEST(Grpo, EntropyIsLoggedAsTheMaskedMean) {
  const Fixture f(false);
  const at::Tensor lp = (f.logits / f.temperature).log_softmax(-1);
  const at::Tensor h = -(lp.exp() * lp).sum(-1);  // (B, L) fp64
  std::vector<bool> truncated(f.B, false);
  truncated[1] = true;
  const at::Tensor mask = completion_mask(f.lengths, truncated, f.L, /*mask_truncated=*/true);
  double sum = 0, n = 0;
  for (int64_t b = 0; b < f.B; ++b) {
    if (truncated[b]) continue;
    for (int64_t j = 0; j < f.lengths[b]; ++j) sum += h[b][j].item<double>(), n += 1;
  }
  GrpoTokens t;
  t.logps = f.logp_of(f.logits).to(at::kFloat);
  t.advantages = f.adv.to(at::kFloat);
  t.mask = mask;
  GrpoLossOptions o;
  const auto names = [](const GrpoLossOutput& out) {
    std::vector<std::string> v;
    for (const auto& [name, value] : out.logged) v.push_back(name);
    return v;
  };
  const auto none = names(grpo_loss(t, o));
  EXPECT_EQ(std::count(none.begin(), none.end(), "entropy"), 0);
  t.entropy = h.to(at::kFloat);
  const GrpoLossOutput out = grpo_loss(t, o);
  EXPECT_NEAR(logged(out, "entropy"), sum / n, 1e-6);  // fp32 mean of ~1-nat values
  EXPECT_GT(std::abs(logged(out, "entropy") - h.mean().item<double>()), 1e-3);  // masked
}

// GrpoObjective feeds the rollout rows' entropies (RolloutRows::entropy) to the loss: its
// logged `entropy` is their masked mean times the micro-batch's units (the step divides by the
// units), and nothing is logged without them.
TEST(Grpo, ObjectiveLogsTheRolloutsEntropy) {
  q4::model::Qwen3Model m = q4::trainer::testing::tiny_model();
  // Two rows: prompt {5, 6, 7} + completion {8, 9}; prompt {10} + completion {11, 12, 13} + pad.
  const at::Tensor ids = at::tensor({5, 6, 7, 8, 9, 10, 11, 12, 13, 0}, at::kLong).view({2, 5});
  const at::Tensor labels =
      at::tensor({-100, -100, -100, 8, 9, -100, 11, 12, 13, -100}, at::kLong).view({2, 5});
  q4::data::Batch b;
  b.input_ids = ids;
  b.labels = labels;
  b.attention_mask = at::tensor({1, 1, 1, 1, 1, 1, 1, 1, 1, 0}, at::kLong).view({2, 5});
  auto rr = std::make_shared<q4::data::RolloutRows>();
  rr->completion_lengths = {2, 3};
  rr->advantages = at::tensor({0.5f, -0.5f});
  rr->mask = completion_mask(rr->completion_lengths, {false, false}, 3, false);
  rr->entropy = at::tensor({1.0f, 2.0f, 0.0f, 3.0f, 4.0f, 5.0f}).view({2, 3});
  b.rollout = rr;
  MicroBatch micro;
  micro.inputs.input_ids = ids;
  micro.inputs.labels = labels;
  micro.inputs.attention_mask = b.attention_mask;
  micro.batch = &b;
  GrpoConfig g;  // dapo: the units are the 5 completion tokens
  GrpoObjective objective(g, nullptr);
  ASSERT_EQ(objective.units(b), 5);
  const auto value = [](const ObjectiveOutput& out, const std::string& name) {
    for (const auto& [n, v] : out.logged) {
      if (n == name) return v.item<double>();
    }
    return std::nan("");
  };
  EXPECT_NEAR(value(objective.compute(m, micro), "entropy"), 15.0, 1e-5);  // 5 x mean 3
  auto without = std::make_shared<q4::data::RolloutRows>(*rr);
  without->entropy = at::Tensor();
  b.rollout = without;
  EXPECT_TRUE(std::isnan(value(objective.compute(m, micro), "entropy")));
}

}  // namespace grpo_test
