// The preference losses against a direct fp64 computation from the log-probabilities: each
// pair's loss, its gradient with respect to the policy's chosen and rejected log-probabilities
// (derived by hand below, not by autograd) and the rewards, for DPO's sigmoid loss (with and
// without label smoothing), IPO and SimPO, in fp32 and fp64. Then the objective on the tiny
// model against the same loss written out from each sequence's full logits (gradients by
// autograd), and through the step.
#include "q4/trainer/objectives/preference.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <csignal>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "component_fixtures.h"
#include "q4/io/dat_file.h"
#include "q4/model/dat_file.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/signals.h"

using namespace q4::trainer;

namespace {

struct Direct {
  std::vector<double> loss, d_chosen, d_rejected, r_chosen, r_rejected;
};

double log_sigmoid(double x) {
  return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x));
}
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// L = -(1 - e) log s(b z) - e log s(-b z); dL/dz = -(1 - e) b s(-b z) + e b s(b z).
void sigmoid_form(double z, double b, double e, double* l, double* dz) {
  *l = -(1 - e) * log_sigmoid(b * z) - e * log_sigmoid(-b * z);
  *dz = -(1 - e) * b * sigmoid(-b * z) + e * b * sigmoid(b * z);
}

Direct direct(const std::vector<double>& c, const std::vector<double>& r,
              const std::vector<double>& nc, const std::vector<double>& nr,
              const std::vector<double>& rc, const std::vector<double>& rr,
              const PreferenceLossOptions& o) {
  Direct d;
  const double b = o.beta;
  for (size_t i = 0; i < c.size(); ++i) {
    double l = 0, dz = 0, zc = 0, zr = 0;  // z = zc - zr (- gamma / beta); dz/dc, dz/dr below
    double dzc = 1, dzr = 1;
    switch (o.kind) {
      case PreferenceLossKind::kSigmoid:
        zc = c[i] - rc[i];
        zr = r[i] - rr[i];
        sigmoid_form(zc - zr, b, o.label_smoothing, &l, &dz);
        break;
      case PreferenceLossKind::kIpo:
        zc = (c[i] - rc[i]) / nc[i];
        zr = (r[i] - rr[i]) / nr[i];
        l = std::pow(zc - zr - 1 / (2 * b), 2);
        dz = 2 * (zc - zr - 1 / (2 * b));
        dzc = 1 / nc[i];
        dzr = 1 / nr[i];
        break;
      case PreferenceLossKind::kSimpo:
        zc = c[i] / nc[i];
        zr = r[i] / nr[i];
        sigmoid_form(zc - zr - o.simpo_gamma / b, b, o.label_smoothing, &l, &dz);
        dzc = 1 / nc[i];
        dzr = 1 / nr[i];
        break;
    }
    d.loss.push_back(l);
    d.d_chosen.push_back(dz * dzc);
    d.d_rejected.push_back(-dz * dzr);
    d.r_chosen.push_back(b * zc);
    d.r_rejected.push_back(b * zr);
  }
  return d;
}

at::Tensor as(const std::vector<double>& v, at::ScalarType dt) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble)).to(dt);
}

void expect_close(const at::Tensor& got, const std::vector<double>& want, double rtol,
                  const std::string& what) {
  const at::Tensor g = got.to(at::kDouble).cpu();
  ASSERT_EQ(g.numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const double x = g[static_cast<int64_t>(i)].item<double>();
    EXPECT_NEAR(x, want[i], rtol * (std::fabs(want[i]) + 1e-3)) << what << " pair " << i;
  }
}

}  // namespace

TEST(PreferenceLoss, EveryKindMatchesADirectFp64Computation) {
  // Six pairs: answers of 3-40 tokens, log-probabilities of about -1.5 a token, references near
  // the policy; pair 4 has the policy far ahead of the reference (a saturated sigmoid).
  const std::vector<double> nc = {12, 3, 40, 7, 25, 9}, nr = {10, 30, 5, 7, 22, 14};
  std::vector<double> c, r, rc, rr;
  for (size_t i = 0; i < nc.size(); ++i) {
    c.push_back(-1.5 * nc[i] + 0.7 * static_cast<double>(i) - 1.1);
    r.push_back(-1.6 * nr[i] - 0.4 * static_cast<double>(i) + 0.3);
    rc.push_back(c.back() + (i == 4 ? -60.0 : 0.9 - 0.35 * static_cast<double>(i)));
    rr.push_back(r.back() + 0.2 * static_cast<double>(i) - 0.5);
  }
  struct Case {
    PreferenceLossKind kind;
    double beta, smoothing;
  };
  for (const Case k :
       {Case{PreferenceLossKind::kSigmoid, 0.1, 0.0}, Case{PreferenceLossKind::kSigmoid, 0.5, 0.1},
        Case{PreferenceLossKind::kIpo, 0.1, 0.0}, Case{PreferenceLossKind::kIpo, 0.6, 0.0},
        Case{PreferenceLossKind::kSimpo, 2.0, 0.0}, Case{PreferenceLossKind::kSimpo, 2.5, 0.15}}) {
    PreferenceLossOptions o;
    o.kind = k.kind;
    o.beta = k.beta;
    o.label_smoothing = k.smoothing;
    const Direct want = direct(c, r, nc, nr, rc, rr, o);
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      const std::string what = std::string(q4::io::enum_name(k.kind)) + " beta " +
                               std::to_string(k.beta) + " smoothing " +
                               std::to_string(k.smoothing) + (dt == at::kFloat ? " fp32" : " fp64");
      PreferencePairs p;
      p.chosen_logps = as(c, dt).requires_grad_(true);
      p.rejected_logps = as(r, dt).requires_grad_(true);
      p.chosen_tokens = as(nc, at::kLong);
      p.rejected_tokens = as(nr, at::kLong);
      if (k.kind != PreferenceLossKind::kSimpo) {
        p.ref_chosen_logps = as(rc, dt);
        p.ref_rejected_logps = as(rr, dt);
      }
      const PreferenceLossOutput out = preference_loss(p, o);
      out.losses.sum().backward();
      const double rtol = dt == at::kFloat ? 2e-5 : 1e-12;
      expect_close(out.losses, want.loss, rtol, what + " loss");
      expect_close(p.chosen_logps.grad(), want.d_chosen, rtol, what + " d/d chosen");
      expect_close(p.rejected_logps.grad(), want.d_rejected, rtol, what + " d/d rejected");
      expect_close(out.chosen_rewards, want.r_chosen, rtol, what + " chosen reward");
      expect_close(out.rejected_rewards, want.r_rejected, rtol, what + " rejected reward");
      EXPECT_FALSE(out.chosen_rewards.requires_grad()) << what;
    }
  }
}

TEST(PreferenceLoss, MistakesNameTheField) {
  auto message = [](const PreferencePairs& p, const PreferenceLossOptions& o) {
    try {
      preference_loss(p, o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  PreferencePairs p;
  p.chosen_logps = at::zeros({3});
  p.rejected_logps = at::zeros({3});
  p.chosen_tokens = at::ones({3});
  p.rejected_tokens = at::ones({3});
  PreferenceLossOptions o;
  EXPECT_NE(message(p, o).find("ref_chosen_logps must be (3)"), std::string::npos);
  o.kind = PreferenceLossKind::kSimpo;  // reference-free
  EXPECT_EQ(message(p, o), "no error");
  o.beta = 0;
  EXPECT_NE(message(p, o).find("preference.beta"), std::string::npos);
  o.beta = 1;
  o.label_smoothing = 0.5;
  EXPECT_NE(message(p, o).find("preference.label_smoothing"), std::string::npos);
  o.label_smoothing = 0;
  p.rejected_tokens = at::ones({2});
  EXPECT_NE(message(p, o).find("rejected_tokens must be (3)"), std::string::npos);
}

// ---------------------------------------------------------------- the objective

namespace {

using q4::trainer::testing::cpu_config;
using q4::trainer::testing::random_examples;
using q4::trainer::testing::StepRig;
using q4::trainer::testing::tiny_model;

// 8 pairs laid out chosen, rejected, ...: chosen answers 12 tokens (6 supervised), rejected 9 (4).
std::vector<q4::data::Example> pair_examples(int64_t vocab) {
  auto chosen = random_examples(8, 12, vocab, 3), rejected = random_examples(8, 9, vocab, 4);
  std::vector<q4::data::Example> out;
  for (size_t i = 0; i < chosen.size(); ++i) {
    out.push_back(chosen[i]);
    out.push_back(rejected[i]);
  }
  return out;
}

q4::data::BatcherOptions pair_batches(int64_t rows) {
  q4::data::BatcherOptions bo;
  bo.batch_size = rows;
  bo.max_seq_len = 12;
  bo.shuffle = false;
  bo.group = 2;
  return bo;
}

// An example's summed log-probability of its supervised labels from the model's full logits,
// one sequence alone, in fp64 (differentiable through the model's forward).
at::Tensor direct_logprob(q4::model::Qwen3Model& m, const q4::data::Example& e) {
  q4::model::ModelInputs in;
  in.input_ids = at::tensor(std::vector<int64_t>(e.input_ids.begin(), e.input_ids.end()), at::kLong)
                     .unsqueeze(0);
  const at::Tensor lp = at::log_softmax(m.forward(in)[0].to(at::kDouble), -1);  // (L, V)
  at::Tensor sum = at::zeros({}, at::kDouble);
  for (size_t j = 0; j + 1 < e.labels.size(); ++j) {
    if (e.labels[j + 1] != q4::data::kIgnoreIndex)
      sum = sum + lp[static_cast<int64_t>(j)][e.labels[j + 1]];
  }
  return sum;
}

int64_t supervised(const q4::data::Example& e) {
  int64_t n = 0;
  for (size_t j = 1; j < e.labels.size(); ++j) n += e.labels[j] != q4::data::kIgnoreIndex;
  return n;
}

// The pairs' summed loss, written out in fp64 from the log-probabilities (docs/trainer.md).
struct DirectPairs {
  at::Tensor loss;  // () fp64, differentiable
  double chosen_rewards = 0, rejected_rewards = 0, wins = 0, chosen_logps = 0, nll = 0;
  // Pairs whose rewards are within rounding of a tie: |chosen - rejected| < beta x 1e-3, four
  // times the 2e-4 by which an fp32 sum of log-probabilities may differ from this fp64 one.
  int near_ties = 0;
};
DirectPairs direct_pairs(q4::model::Qwen3Model& m, const std::vector<q4::data::Example>& ex,
                         const std::vector<double>& ref, const PreferenceConfig& c) {
  DirectPairs d;
  d.loss = at::zeros({}, at::kDouble);
  const double b = c.beta, e = c.label_smoothing;
  auto sigmoid_loss = [&](const at::Tensor& z) {
    return -(1 - e) * at::log_sigmoid(z * b) - e * at::log_sigmoid(z * -b);
  };
  for (size_t i = 0; i + 1 < ex.size(); i += 2) {
    const at::Tensor pc = direct_logprob(m, ex[i]), pr = direct_logprob(m, ex[i + 1]);
    const double nc = static_cast<double>(supervised(ex[i]));
    const double nr = static_cast<double>(supervised(ex[i + 1]));
    at::Tensor l, rc, rr;
    switch (c.loss) {
      case PreferenceLossKind::kSigmoid:
        rc = (pc - ref[i]) * b;
        rr = (pr - ref[i + 1]) * b;
        l = sigmoid_loss((pc - ref[i]) - (pr - ref[i + 1]));
        break;
      case PreferenceLossKind::kIpo:
        rc = (pc - ref[i]) / nc * b;
        rr = (pr - ref[i + 1]) / nr * b;
        l = ((pc - ref[i]) / nc - (pr - ref[i + 1]) / nr - 1 / (2 * b)).pow(2);
        break;
      case PreferenceLossKind::kSimpo:
        rc = pc / nc * b;
        rr = pr / nr * b;
        l = sigmoid_loss(pc / nc - pr / nr - c.simpo_gamma / b);
        break;
    }
    l = l + c.sft_weight * (-pc / nc);
    d.loss = d.loss + l;
    d.chosen_rewards += rc.item<double>();
    d.rejected_rewards += rr.item<double>();
    d.wins += rc.item<double>() > rr.item<double>()    ? 1.0
              : rc.item<double>() == rr.item<double>() ? 0.5
                                                       : 0.0;
    d.near_ties += std::fabs(rc.item<double>() - rr.item<double>()) < b * 1e-3;
    d.chosen_logps += pc.item<double>();
    d.nll += (-pc / nc).item<double>();
  }
  return d;
}

std::vector<at::Tensor> grads_of(q4::model::Qwen3Model& m) {
  std::vector<at::Tensor> g;
  for (auto* p : m.trainable_parameters()) {
    g.push_back(p->grad.defined() ? p->grad.to(at::kDouble).clone()
                                  : at::zeros_like(p->master, at::kDouble));
  }
  m.zero_grad();
  return g;
}

double logged(const q4::trainer::ObjectiveOutput& o, const std::string& name) {
  for (const auto& [k, v] : o.logged) {
    if (k == name) return v.item<double>();
  }
  ADD_FAILURE() << "not logged: " << name;
  return 0;
}

// The CPU run config of the preference objective in fp32 on the HF fixture model's shapes.
Config preference_fixture_config(const std::string& dir) {
  Config c = cpu_config(dir);
  c.model.config = std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.config.json";
  c.model.compute_dtype = DtypeOrAuto::kFp32;
  c.train.objective = ObjectiveKind::kPreference;
  return c;
}

// `other` written to `path` as a .dat (lm_head not quantized); returns the path.
std::string write_reference(const q4::model::Qwen3Model& other, const std::filesystem::path& path) {
  q4::model::write_dat(other, path.string(), /*quantize_lm_head=*/false);
  return path.string();
}

// The tests of preference.reference: the policy (seed 7), another model (seed 11) written to
// <tmp>/reference.dat, the preference pairs in batches of 4 and the fixture's config.
struct SeparateReference {
  q4::trainer::testing::ComponentTempDir tmp;
  q4::model::Qwen3Model policy = tiny_model(7);
  std::string ref_path = write_reference(tiny_model(11), tmp.path / "reference.dat");
  q4::data::Batcher train{pair_examples(policy.config().vocab_size), pair_batches(4)};
  Config c = preference_fixture_config(tmp.path.string());
};

}  // namespace

// The objective on one micro-batch of 4 pairs against the loss written out in fp64 from each
// sequence's full logits: the reference pass, the loss, its gradients (autograd through the
// model, for every parameter) and the logged values, for every loss, with label smoothing and
// with the SFT term.
TEST(PreferenceObjective, LossAndGradientsMatchFp64FromFullLogits) {
  auto policy = tiny_model(7), reference = tiny_model(11);
  const int64_t V = policy.config().vocab_size;
  q4::data::Batcher all(pair_examples(V), pair_batches(16));
  const auto& ex = all.examples();
  std::ostringstream sink;
  // The reference pass (in batches of 2 pairs) against each sequence scored alone in fp64.
  const std::vector<double> ref = sequence_logprobs_of(reference, ex, pair_batches(4), sink, "t");
  {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < ex.size(); ++i) {
      EXPECT_NEAR(ref[i], direct_logprob(reference, ex[i]).item<double>(), 2e-4) << "example " << i;
    }
  }
  const q4::data::Batch b = all.next();
  q4::trainer::MicroBatch mb;
  mb.inputs = to_inputs(b, policy, at::kCPU);
  mb.batch = &b;
  std::vector<PreferenceConfig> cases(5);
  cases[1].label_smoothing = 0.2;
  cases[2].loss = PreferenceLossKind::kIpo;
  cases[3].loss = PreferenceLossKind::kSimpo;
  cases[3].beta = 2.0;
  cases[4].sft_weight = 0.5;
  cases[4].beta = 0.5;
  for (const auto& pc : cases) {
    SCOPED_TRACE(to_string(pc.loss) + " smoothing " + std::to_string(pc.label_smoothing) + " sft " +
                 std::to_string(pc.sft_weight));
    ReferenceLogprobs r;
    r.train = ref;
    PreferenceObjective objective(pc, r);
    EXPECT_EQ(objective.units(b), 8);
    const q4::trainer::ObjectiveOutput o = objective.compute(policy, mb);
    (o.loss_sum / 8.0).backward();
    const auto got = grads_of(policy);
    const DirectPairs d = direct_pairs(policy, ex, ref, pc);
    (d.loss / 8.0).backward();
    const auto want = grads_of(policy);
    EXPECT_NEAR(o.loss_sum.item<double>(), d.loss.item<double>(),
                1e-4 * (d.loss.abs().item<double>() + 1));
    EXPECT_NEAR(logged(o, "rewards/chosen"), d.chosen_rewards,
                1e-4 * (std::fabs(d.chosen_rewards) + 1));
    EXPECT_NEAR(logged(o, "rewards/rejected"), d.rejected_rewards,
                1e-4 * (std::fabs(d.rejected_rewards) + 1));
    EXPECT_NEAR(logged(o, "rewards/margins"), d.chosen_rewards - d.rejected_rewards,
                2e-4 * (std::fabs(d.chosen_rewards) + 1));
    // The count of wins agrees on every pair far from a tie; a pair within rounding of one (IPO
    // here: per-token rewards 5e-6 apart) may count 0, 1/2 or 1 on any kernel.
    EXPECT_LE(std::fabs(logged(o, "rewards/accuracies") - d.wins), d.near_ties) << d.near_ties;
    EXPECT_NEAR(logged(o, "logps/chosen"), d.chosen_logps, 1e-4 * std::fabs(d.chosen_logps));
    if (pc.sft_weight > 0) EXPECT_NEAR(logged(o, "nll_loss"), d.nll, 1e-4 * d.nll);
    double worst = 0, scale = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      worst = std::max(worst, (got[i] - want[i]).abs().max().item<double>());
      scale = std::max(scale, want[i].abs().max().item<double>());
    }
    EXPECT_GT(scale, 1e-4);  // a gradient that is really there
    EXPECT_LE(worst, 1e-4 * scale);
  }
}

// Through the real step with grad_accum 2 (one pair of 2 micro-batches each): the step's loss is
// the mean over the step's pairs, and the policy before its first update scores the reference's
// own log-probabilities. Bit for bit only when the reference pass batches the answers as the step
// does (the same rows, so the same shapes and kernels): then rewards are exactly 0, every pair a
// tie (accuracy 1/2) and the DPO loss log 2. A reference pass in other shapes (16 rows a batch)
// rounds differently (BLAS kernels block other shapes otherwise): the loss and rewards agree to
// rounding, but which answer of a pair "wins" is rounding noise, so its accuracy is not a value
// any kernel guarantees and is not checked.
TEST(PreferenceObjective, ThroughTheStepTheFirstLossIsLog2) {
  for (const int64_t reference_rows : {4, 16}) {
    SCOPED_TRACE("reference pass of " + std::to_string(reference_rows) + " rows a batch");
    const bool same_shapes = reference_rows == 4;
    auto policy = tiny_model(7);
    const int64_t V = policy.config().vocab_size;
    q4::data::Batcher batcher(pair_examples(V), pair_batches(4));
    std::ostringstream sink;
    ReferenceLogprobs r;
    r.train =
        sequence_logprobs_of(policy, batcher.examples(), pair_batches(reference_rows), sink, "t");
    PreferenceObjective objective(PreferenceConfig{}, r);
    StepRig rig(cpu_config("unused", /*grad_accum=*/2), policy, objective);
    const StepOutcome so = rig.step->run(0, batcher);
    EXPECT_EQ(so.units, 4);
    EXPECT_NEAR(so.loss, std::log(2.0), same_shapes ? 1e-7 : 1e-5);
    ASSERT_FALSE(so.logged.empty());
    for (const auto& [name, v] : so.logged) {
      if (name.rfind("rewards/", 0) != 0) continue;
      if (name == "rewards/accuracies") {
        if (same_shapes) EXPECT_EQ(v.item<double>(), 0.5) << name;
        if (!same_shapes) std::cout << "accuracy, rounding's ties: " << v.item<double>() << "\n";
      } else if (same_shapes) {
        EXPECT_EQ(v.item<double>(), 0.0) << name;
      } else {
        EXPECT_NEAR(v.item<double>(), 0.0, 1e-5) << name;  // beta x rounding of the sums
      }
    }
    EXPECT_TRUE(so.res.applied);
    // The update moved the policy: the next step's pairs have rewards.
    const StepOutcome next = rig.step->run(1, batcher);
    EXPECT_LT(next.loss, std::log(2.0));
  }
}

// preference.reference: another model (a .dat) scores the answers once, through the frozen load
// (its NVFP4 linears dequantized, the values a fake-quantized forward of its masters uses), the
// scores go to output.dir, and a second call reads them back instead of loading the model again.
TEST(PreferenceObjective, ASeparateReferenceModelScoresOnceAndIsReadBack) {
  SeparateReference f;
  f.c.preference.reference = f.ref_path;
  std::ostringstream out;
  const ReferenceLogprobs r =
      reference_logprobs(objective_plan(f.c), f.policy, f.train, nullptr, true, out);
  EXPECT_NE(out.str().find("reference " + f.ref_path), std::string::npos) << out.str();
  // The same file loaded frozen here scores the same sums bit for bit.
  q4::model::ModelOptions o;
  o.master_dtype = o.compute_dtype = at::kFloat;
  o.trainable = q4::model::TrainableSpec::nothing();
  q4::model::DatReader reader(f.ref_path);
  auto loaded = q4::model::Qwen3Model::load(f.policy.config(), reader, o);
  std::ostringstream sink;
  const auto want = sequence_logprobs_of(loaded, f.train.examples(), pair_batches(4), sink, "t");
  const auto mine = sequence_logprobs_of(f.policy, f.train.examples(), pair_batches(4), sink, "t");
  EXPECT_EQ(r.train, want);
  double far = 0;
  for (size_t i = 0; i < want.size(); ++i) far = std::max(far, std::fabs(r.train[i] - mine[i]));
  EXPECT_GT(far, 0.1) << "the reference scored like the policy";
  EXPECT_TRUE(r.validation.empty());
  // Read back, not recomputed (the reference file is gone: loading it would fail).
  std::filesystem::remove(f.ref_path);
  std::ostringstream again;
  const ReferenceLogprobs r2 =
      reference_logprobs(objective_plan(f.c), f.policy, f.train, nullptr, true, again);
  EXPECT_NE(again.str().find("read from"), std::string::npos) << again.str();
  EXPECT_EQ(r2.train, r.train);
}

// reference_logprobs.dat records which model scored it and a checksum: a resume that names
// another preference.reference is refused (it used to read the stale scores while logging the
// new model), a damaged file is refused naming it, a file without a checksum is scored again.
TEST(PreferenceObjective, TheReferenceFileIsCheckedOnRead) {
  SeparateReference f;
  std::ostringstream out;
  const ReferenceLogprobs by_policy =
      reference_logprobs(objective_plan(f.c), f.policy, f.train, nullptr, true, out);
  const std::string file = (f.tmp.path / kReferenceFile).string();
  auto error_of = [&](const Config& cc) -> std::string {
    std::ostringstream sink;
    try {
      reference_logprobs(objective_plan(cc), f.policy, f.train, nullptr, true, sink);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "no error: " + sink.str();
  };
  // Another reference on resume: refused, naming the key, both models and the file.
  Config changed = f.c;
  changed.preference.reference = f.ref_path;
  const std::string m = error_of(changed);
  EXPECT_NE(m.find("config key preference.reference: " + f.ref_path), std::string::npos) << m;
  EXPECT_NE(m.find("the starting model"), std::string::npos) << m;
  EXPECT_NE(m.find(file), std::string::npos) << m;
  // The same reference reads back.
  EXPECT_EQ(error_of(f.c).rfind("no error", 0), 0u);

  // Rewrites the file's entries with `edit` applied to reference.train; `keep_checksum` false
  // leaves out the checksum (and model) entries, as an older q4train wrote the file.
  auto rewrite = [&](const std::function<void(at::Tensor&)>& edit, bool keep_checksum) {
    std::map<std::string, at::Tensor> all = q4::io::DatReader(file).load_all();
    edit(all.at("reference.train"));
    if (!keep_checksum) {
      all.erase("reference.crc32c");
      all.erase("reference.model");
    }
    q4::io::DatWriter w(file, static_cast<int64_t>(all.size()));
    for (const auto& [k, t] : all) w.add(k, t);
    w.commit();
  };
  rewrite([](at::Tensor& t) { t.fill_(std::nan("")); }, /*keep_checksum=*/true);
  const std::string d = error_of(f.c);
  EXPECT_NE(d.find(file + " is damaged (checksum mismatch)"), std::string::npos) << d;
  // Without a checksum (all NaN, as in an older file): computed again, finite, written anew.
  rewrite([](at::Tensor& t) { t.fill_(std::nan("")); }, /*keep_checksum=*/false);
  std::ostringstream again;
  const ReferenceLogprobs r =
      reference_logprobs(objective_plan(f.c), f.policy, f.train, nullptr, true, again);
  EXPECT_NE(again.str().find("has no checksum"), std::string::npos) << again.str();
  EXPECT_EQ(r.train, by_policy.train);
  EXPECT_EQ(error_of(f.c).rfind("no error", 0), 0u);
}

// A stop signal during the reference pass ends it at the next batch and writes nothing (it used
// to run the whole pass first).
TEST(PreferenceObjective, AStopSignalEndsTheReferencePass) {
  q4::trainer::testing::ComponentTempDir tmp;
  auto policy = tiny_model(7);
  const int64_t V = policy.config().vocab_size;
  q4::data::Batcher train(pair_examples(V), pair_batches(4));
  Config c = cpu_config(tmp.path.string());
  c.train.objective = ObjectiveKind::kPreference;
  request_stop(SIGINT);
  std::ostringstream out;
  const ReferenceLogprobs r =
      reference_logprobs(objective_plan(c), policy, train, nullptr, true, out);
  clear_stop_request();
  EXPECT_NE(out.str().find("stopped by signal 2; nothing written"), std::string::npos) << out.str();
  EXPECT_FALSE(std::filesystem::exists(tmp.path / kReferenceFile));
  ASSERT_FALSE(r.train.empty());
  EXPECT_TRUE(std::isnan(r.train.front())) << "a sequence was scored after the signal";
}

// The bounds of beta and simpo_gamma: the extremes that made non-finite steps are refused,
// naming the key and its range.
TEST(PreferenceLoss, ExtremeSettingsAreRefused) {
  for (double beta : {1e-40, 1e30}) {
    Config c;
    c.preference.beta = beta;
    try {
      validate_config(c);
      ADD_FAILURE() << "beta " << beta << " accepted";
    } catch (const ConfigError& e) {
      EXPECT_NE(std::string(e.what()).find("preference.beta"), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("[0.001, 1e3]"), std::string::npos) << e.what();
    }
  }
  Config c;
  c.preference.simpo_gamma = 1e300;
  try {
    validate_config(c);
    ADD_FAILURE() << "simpo_gamma 1e300 accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("preference.simpo_gamma"), std::string::npos) << e.what();
  }
  PreferenceLossOptions o;
  o.beta = 1e-40;
  EXPECT_THROW(o.validate(), c10::Error);
}

// The preference step with checkpointed layers and updates inside the backward is the plain
// buffered step: the same losses, rewards and masters over two steps.
TEST(PreferenceObjective, CheckpointingAndInBackwardUpdatesTrainAsTheBufferedStep) {
  auto plain = tiny_model(7), other = tiny_model(7);
  other.set_recompute(/*gradient_checkpointing=*/true, /*recompute_layers=*/-1);
  const int64_t V = plain.config().vocab_size;
  q4::data::Batcher a(pair_examples(V), pair_batches(4)), b(pair_examples(V), pair_batches(4));
  std::ostringstream sink;
  ReferenceLogprobs r;
  r.train = sequence_logprobs_of(plain, a.examples(), pair_batches(4), sink, "t");
  PreferenceObjective oa(PreferenceConfig{}, r), ob(PreferenceConfig{}, r);
  StepRig ra(cpu_config("unused"), plain, oa),
      rb(cpu_config("unused"), other, ob, /*in_backward=*/true);
  ASSERT_TRUE(rb.step->in_backward());
  for (int step = 0; step < 2; ++step) {
    const StepOutcome sa = ra.step->run(step, a), sb = rb.step->run(step, b);
    EXPECT_NEAR(sb.loss, sa.loss, 1e-6) << "step " << step;
    ASSERT_EQ(sa.logged.size(), sb.logged.size());
    for (size_t i = 0; i < sa.logged.size(); ++i) {
      EXPECT_NEAR(sb.logged[i].second.item<double>(), sa.logged[i].second.item<double>(), 1e-5)
          << sa.logged[i].first;
    }
  }
  const auto pa = plain.trainable_parameters(), pb = other.trainable_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_LE((pa[i]->master - pb[i]->master).abs().max().item<double>(), 1e-6) << pa[i]->name;
  }
}
