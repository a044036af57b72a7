// Distillation against direct fp64 computations: the chunk divergences (forward and reverse KL,
// top-K) and their gradients against autograd on the dense formulas, the chunked loss with a
// term against the dense loss, and the objective through the real step against the full
// logits of both models.
#include "q4/trainer/objectives/distill.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "component_fixtures.h"
#include "q4/io/dat_file.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/setup.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace {

at::Generator gen(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// fp64 dense reference of one chunk's divergence (T^2 scaled, summed over valid rows), its
// value and its gradient with respect to the student's logits by autograd.
std::pair<double, at::Tensor> dense_divergence(const at::Tensor& z32, const at::Tensor& t32,
                                               const at::Tensor& valid, Divergence kind, double t) {
  at::Tensor z = z32.to(at::kDouble).detach().requires_grad_(true);
  const at::Tensor ls = at::log_softmax(z / t, 1);
  const at::Tensor lt = at::log_softmax(t32.to(at::kDouble) / t, 1);
  const at::Tensor rows = kind == Divergence::kForwardKl ? (lt.exp() * (lt - ls)).sum(1)
                                                         : (ls.exp() * (ls - lt)).sum(1);
  const at::Tensor total = (rows * valid.to(at::kDouble)).sum() * (t * t);
  total.backward();
  return {total.item<double>(), z.grad()};
}

void expect_close(const at::Tensor& a, const at::Tensor& b, double atol, const char* what) {
  const double d = (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
  EXPECT_LE(d, atol) << what;
}

TEST(DivergenceChunk, MatchesFp64AndAutograd) {
  const at::Tensor z0 = at::randn({6, 37}, gen(1), at::kFloat) * 3;
  const at::Tensor t0 = at::randn({6, 37}, gen(2), at::kFloat) * 3;
  const at::Tensor valid = at::tensor({1, 1, 0, 1, 1, 1}).ne(0);
  for (Divergence kind : {Divergence::kForwardKl, Divergence::kReverseKl}) {
    for (double t : {1.0, 2.5}) {
      SCOPED_TRACE(to_string(kind) + " T=" + std::to_string(t));
      const auto [ref, ref_grad] = dense_divergence(z0, t0, valid, kind, t);
      at::Tensor z = z0.clone();
      const double got =
          divergence_chunk(z, t0, valid, {kind, t}, /*want_grad=*/true).item<double>();
      EXPECT_NEAR(got, ref, 1e-5 * std::abs(ref) + 1e-6);
      expect_close(z, ref_grad, 5e-6, "gradient");  // fp32 exp/log of logits up to ~10
      EXPECT_TRUE(z[2].abs().max().item<double>() == 0.0) << "an invalid row has a gradient";
      // Without a gradient the value is the same.
      at::Tensor z2 = z0.clone();
      EXPECT_EQ(divergence_chunk(z2, t0, valid, {kind, t}, false).item<double>(), got);
    }
  }
  // Equal distributions: no divergence, no gradient.
  at::Tensor z = z0.clone();
  EXPECT_NEAR(divergence_chunk(z, z0, valid, {}, true).item<double>(), 0.0, 1e-5);
  EXPECT_LE(z.abs().max().item<double>(), 1e-6);
}

TEST(TopkDivergence, WithEveryTokenIsTheForwardKl) {
  const at::Tensor z0 = at::randn({5, 29}, gen(3), at::kFloat) * 2;
  const at::Tensor t0 = at::randn({5, 29}, gen(4), at::kFloat) * 2;
  const at::Tensor valid = at::tensor({1, 0, 1, 1, 1}).ne(0);
  // The teacher's whole distribution as "top 29", in a shuffled order.
  const at::Tensor ids = at::argsort(at::randn({5, 29}, gen(5)), /*dim=*/1, /*descending=*/false);
  for (double t : {1.0, 0.7}) {
    const at::Tensor lp = at::log_softmax(t0 / t, 1).gather(1, ids);
    at::Tensor a = z0.clone(), b = z0.clone();
    const double full =
        divergence_chunk(a, t0, valid, {Divergence::kForwardKl, t}, true).item<double>();
    const double topk = topk_divergence_chunk(b, ids, lp, valid, t, true).item<double>();
    EXPECT_NEAR(topk, full, 1e-5 * std::abs(full));
    expect_close(b, a, 1e-6, "gradient");
  }
}

TEST(TopkDivergence, MatchesFp64AndAutograd) {
  const at::Tensor z0 = at::randn({5, 31}, gen(6), at::kFloat) * 2;
  const at::Tensor t0 = at::randn({5, 31}, gen(7), at::kFloat) * 2;
  const at::Tensor valid = at::tensor({1, 1, 1, 0, 1}).ne(0);
  const int64_t K = 4;
  const double t = 1.5;
  const at::Tensor lp_full = at::log_softmax(t0.to(at::kDouble) / t, 1);
  const auto [lp, ids] = lp_full.topk(K, 1);
  // KL over the K tokens and "any other token": the teacher's q_k and remaining mass q_r
  // against the student's p_s[ids_k] and remaining mass s_r, at T.
  at::Tensor z = z0.to(at::kDouble).requires_grad_(true);
  const at::Tensor q = lp.exp();
  const at::Tensor qr = 1 - q.sum(1);
  const at::Tensor ls = at::log_softmax(z / t, 1).gather(1, ids);
  const at::Tensor sr = 1 - ls.exp().sum(1);
  const at::Tensor rows = (q * (lp - ls)).sum(1) + qr * (qr.log() - sr.log());
  const at::Tensor ref = (rows * valid.to(at::kDouble)).sum() * (t * t);
  ref.backward();
  at::Tensor got_grad = z0.clone();
  const double got =
      topk_divergence_chunk(got_grad, ids, lp.to(at::kFloat), valid, t, true).item<double>();
  EXPECT_NEAR(got, ref.item<double>(), 1e-5 * std::abs(ref.item<double>()));
  expect_close(got_grad, z.grad(), 1e-6, "gradient");
}

// The chunked loss with a divergence term equals the dense (1 - a) CE + a KL over fp64 logits,
// with its gradients with respect to hidden states and weight, across chunk boundaries.
TEST(ChunkedLossWithTerm, MatchesTheDenseLossAndItsGradients) {
  const LossProblem p(8);
  const at::Tensor &h0 = p.h0, &w0 = p.w0, &teacher = p.teacher, &labels = p.labels;
  labels[3] = -100;
  labels[7] = -100;
  const double alpha = 0.3, t = 2.0;
  for (Divergence kind : {Divergence::kForwardKl, Divergence::kReverseKl}) {
    SCOPED_TRACE(to_string(kind));
    // Dense fp64.
    at::Tensor hd = h0.to(at::kDouble).requires_grad_(true);
    at::Tensor wd = w0.to(at::kDouble).requires_grad_(true);
    const at::Tensor logits = at::matmul(hd, wd.t());
    const at::Tensor valid = labels.ne(-100);
    const at::Tensor ce =
        at::nll_loss(at::log_softmax(logits, 1), labels, {}, at::Reduction::Sum, -100);
    const at::Tensor ls = at::log_softmax(logits / t, 1);
    const at::Tensor lt = at::log_softmax(teacher.to(at::kDouble) / t, 1);
    const at::Tensor kl = kind == Divergence::kForwardKl ? (lt.exp() * (lt - ls)).sum(1)
                                                         : (ls.exp() * (ls - lt)).sum(1);
    const at::Tensor div = (kl * valid.to(at::kDouble)).sum() * (t * t);
    const at::Tensor total = ce * (1 - alpha) + div * alpha;
    total.backward();
    // Chunked, chunks of 3 rows.
    at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
    model::LossTerm term;
    term.weight = alpha;
    term.chunk = [&](at::Tensor& z, const at::Tensor& v, int64_t row_begin, bool want_grad) {
      return divergence_chunk(z, teacher.narrow(0, row_begin, z.size(0)), v, {kind, t}, want_grad);
    };
    at::Tensor ce_sum, term_sum;
    const at::Tensor got = model::chunked_loss_with_term(h, w, labels, 3, term, &ce_sum, &term_sum);
    got.backward();
    EXPECT_NEAR(got.item<double>(), total.item<double>(), 1e-5 * total.item<double>());
    EXPECT_NEAR(ce_sum.item<double>(), ce.item<double>(), 1e-5 * ce.item<double>());
    EXPECT_NEAR(term_sum.item<double>(), div.item<double>(), 1e-5 * div.item<double>() + 1e-6);
    expect_close(h.grad(), hd.grad(), 1e-5, "hidden gradient");
    expect_close(w.grad(), wd.grad(), 1e-5, "weight gradient");
  }
}

model::Qwen3Model frozen_tiny(uint64_t seed) {
  model::ModelOptions o = tiny_fp32_options();
  o.grad_dtype.reset();
  o.trainable = model::TrainableSpec::nothing();
  return tiny_model_with(o, seed, 0.05);
}

struct Fp64Parts {
  double ce = 0, kl = 0;
  int64_t tokens = 0;
};

// The batch's summed CE and T^2-scaled forward KL from the full logits of both models, in fp64.
Fp64Parts fp64_parts(model::Qwen3Model& student, model::Qwen3Model& teacher, const data::Batch& b,
                     double t) {
  at::NoGradGuard no_grad;
  const auto shifted = [](const at::Tensor& x) { return x.narrow(1, 0, x.size(1) - 1); };
  const at::Tensor zs = shifted(student.forward(to_inputs(b, student, at::kCPU))).to(at::kDouble);
  const at::Tensor zt = shifted(teacher.forward(to_inputs(b, teacher, at::kCPU))).to(at::kDouble);
  const at::Tensor y = b.labels.narrow(1, 1, b.labels.size(1) - 1);
  const at::Tensor valid = y.ne(data::kIgnoreIndex).to(at::kDouble);
  const at::Tensor lp = zs.log_softmax(-1);
  Fp64Parts p;
  p.ce = -(lp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1) * valid).sum().item<double>();
  const at::Tensor ls = (zs / t).log_softmax(-1), lt = (zt / t).log_softmax(-1);
  p.kl = ((lt.exp() * (lt - ls)).sum(-1) * valid).sum().item<double>() * t * t;
  p.tokens = b.supervised_tokens;
  return p;
}

TEST(Distillation, ThroughTheStepMatchesFp64) {
  auto student = tiny_model();
  auto teacher_ref = frozen_tiny(11);
  DistillConfig dc;
  dc.alpha = 0.7;
  dc.temperature = 1.5;
  Distillation distill(dc, std::make_unique<model::Qwen3Model>(frozen_tiny(11)));
  StepRig rig(cpu_config("unused", /*grad_accum=*/2), student, distill);
  const int64_t V = student.config().vocab_size;
  auto ref_batcher = random_batcher(4, 12, V, 2);
  Fp64Parts sum;
  for (int i = 0; i < 2; ++i) {
    const Fp64Parts p = fp64_parts(student, teacher_ref, ref_batcher->next(), dc.temperature);
    sum.ce += p.ce;
    sum.kl += p.kl;
    sum.tokens += p.tokens;
  }
  ASSERT_GT(sum.kl, 0.05 * sum.tokens);  // the two models really differ
  auto batcher = random_batcher(4, 12, V, 2);
  const StepOutcome so = rig.step->run(0, *batcher);
  const double n = static_cast<double>(sum.tokens);
  EXPECT_EQ(so.units, sum.tokens);
  EXPECT_NEAR(so.loss, (0.3 * sum.ce + 0.7 * sum.kl) / n, 1e-5);
  ASSERT_EQ(so.logged.size(), 2u);
  EXPECT_EQ(so.logged[0].first, "distill_ce");
  EXPECT_NEAR(so.logged[0].second.item<double>(), sum.ce / n, 1e-5);
  EXPECT_EQ(so.logged[1].first, "distill_divergence");
  EXPECT_NEAR(so.logged[1].second.item<double>(), sum.kl / n, 1e-5);
  EXPECT_TRUE(so.res.applied);
  // The held-out loss is the student's cross-entropy.
  auto eval_batcher = random_batcher(4, 12, V, 2, /*seed=*/5);
  const data::Batch b = eval_batcher->next();
  MicroBatch mb;
  mb.inputs = to_inputs(b, student, at::kCPU);
  mb.batch = &b;
  at::NoGradGuard no_grad;
  const double ev = distill.evaluate(student, mb).loss_sum.item<double>();
  EXPECT_NEAR(ev, fp64_parts(student, teacher_ref, b, 1.0).ce, 1e-4);
}

// alpha 0 is supervised fine-tuning: the same update as the cross-entropy objective.
TEST(Distillation, AlphaZeroTrainsLikeCrossEntropy) {
  auto a = tiny_model(), b = tiny_model();
  DistillConfig dc;
  dc.alpha = 0.0;
  Distillation distill(dc, std::make_unique<model::Qwen3Model>(frozen_tiny(11)));
  SupervisedCrossEntropy ce;
  StepRig ra(cpu_config("unused"), a, distill), rb(cpu_config("unused"), b, ce);
  const int64_t V = a.config().vocab_size;
  auto ba = random_batcher(4, 12, V, 2), bb = random_batcher(4, 12, V, 2);
  const StepOutcome sa = ra.step->run(0, *ba), sb = rb.step->run(0, *bb);
  EXPECT_NEAR(sa.loss, sb.loss, 1e-6);
  const auto pa = a.trainable_parameters(), pb = b.trainable_parameters();
  for (size_t i = 0; i < pa.size(); ++i) {
    expect_close(pa[i]->master, pb[i]->master, 1e-6, pa[i]->name.c_str());
  }
}

// The top-K file of `teacher` over `examples` with K = V, written here from each example's full
// logits (one sequence at a time, not packed): the reference layout of distill.h.
void write_full_topk(model::Qwen3Model& teacher, const std::vector<data::Example>& examples,
                     double temperature, const std::string& path) {
  at::NoGradGuard no_grad;
  const int64_t V = teacher.config().vocab_size;
  std::vector<at::Tensor> ids, lps;
  std::vector<int64_t> offsets{0}, hashes;
  for (const auto& e : examples) {
    model::ModelInputs in;
    in.input_ids =
        at::tensor(std::vector<int64_t>(e.input_ids.begin(), e.input_ids.end()), at::kLong)
            .unsqueeze(0);
    const at::Tensor lp =
        at::log_softmax(teacher.forward(in)[0].to(at::kFloat) / temperature, -1);  // (L, V)
    int64_t n = 0;
    for (size_t j = 0; j + 1 < e.labels.size(); ++j) {
      if (e.labels[j + 1] == data::kIgnoreIndex) continue;
      const auto [v, k] = lp[static_cast<int64_t>(j)].topk(V);
      ids.push_back(k.to(at::kInt));
      lps.push_back(v);
      ++n;
    }
    offsets.push_back(offsets.back() + n);
    hashes.push_back(example_hash(e));
  }
  io::DatWriter w(path, 6);
  w.add("topk.ids", at::stack(ids));
  w.add("topk.logprobs", at::stack(lps));
  w.add("topk.example_offsets", at::tensor(offsets, at::kLong));
  w.add("topk.example_hashes", at::tensor(hashes, at::kLong));
  w.add("topk.vocab_size", at::tensor({V}, at::kLong));
  w.add("topk.temperature", at::tensor({temperature}, at::kDouble));
  w.commit();
}

// Offline distillation from a file holding the teacher's whole distribution (K = V) trains
// exactly as online distillation: same loss, same logged values, same update. The rows of packed
// micro-batches are found through their examples.
TEST(OfflineDistillation, WithEveryTokenEqualsOnline) {
  ComponentTempDir tmp;
  auto online_student = tiny_model(), offline_student = tiny_model();
  auto teacher = frozen_tiny(11);
  const int64_t V = teacher.config().vocab_size;
  data::BatcherOptions bo;
  bo.batch_size = 2;
  bo.max_seq_len = 24;
  bo.pack = true;
  bo.shuffle = false;
  data::Batcher a(random_examples(8, 11, V, 3), bo), b(random_examples(8, 11, V, 3), bo);
  const std::string path = (tmp.path / "topk.dat").string();
  DistillConfig dc;
  dc.alpha = 0.6;
  dc.temperature = 1.3;
  write_full_topk(teacher, a.examples(), dc.temperature, path);
  Distillation online(dc, std::make_unique<model::Qwen3Model>(frozen_tiny(11)));
  OfflineDistillation offline(
      dc, std::make_unique<TopkTeacher>(path, b.examples(), V, dc.temperature), b);
  StepRig ra(cpu_config("unused"), online_student, online);
  StepRig rb(cpu_config("unused"), offline_student, offline);
  for (int step = 0; step < 2; ++step) {
    const StepOutcome sa = ra.step->run(step, a), sb = rb.step->run(step, b);
    EXPECT_NEAR(sb.loss, sa.loss, 2e-5 * sa.loss);
    ASSERT_EQ(sb.logged.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_NEAR(sb.logged[i].second.item<double>(), sa.logged[i].second.item<double>(), 2e-5)
          << sa.logged[i].first;
    }
  }
  const auto pa = online_student.trainable_parameters();
  const auto pb = offline_student.trainable_parameters();
  // Adam divides by the gradient's RMS: fp32 differences of the two teachers' logits (packed vs
  // one sequence) move an element by up to ~1% of lr (1e-3) where its gradient is near zero.
  for (size_t i = 0; i < pa.size(); ++i) {
    expect_close(pb[i]->master, pa[i]->master, 1e-5, pa[i]->name.c_str());
  }
  // A file made for other examples is refused, naming the key.
  try {
    TopkTeacher other(path, random_examples(8, 11, V, 4), V, dc.temperature);
    ADD_FAILURE() << "a file for other data was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("distill.topk_file"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("other training data"), std::string::npos) << e.what();
  }
}

// A top-K file of K = 4 out of V for `examples`: each supervised position a random distribution's
// top 4 log-probabilities, then `edit` applied to the (rows, 4) log-probabilities.
void write_random_topk(const std::vector<data::Example>& examples, int64_t V,
                       const std::function<void(at::Tensor&)>& edit, const std::string& path) {
  std::vector<int64_t> offsets{0}, hashes;
  for (const auto& e : examples) {
    int64_t n = 0;
    for (size_t j = 1; j < e.labels.size(); ++j) n += e.labels[j] != data::kIgnoreIndex;
    offsets.push_back(offsets.back() + n);
    hashes.push_back(example_hash(e));
  }
  const at::Tensor lp_full = at::log_softmax(at::randn({offsets.back(), V}, gen(5)), 1);
  auto [lp, ids] = lp_full.topk(4, 1);
  lp = lp.contiguous();
  edit(lp);
  io::DatWriter w(path, 6);
  w.add("topk.ids", ids.to(at::kInt));
  w.add("topk.logprobs", lp);
  w.add("topk.example_offsets", at::tensor(offsets, at::kLong));
  w.add("topk.example_hashes", at::tensor(hashes, at::kLong));
  w.add("topk.vocab_size", at::tensor({V}, at::kLong));
  w.add("topk.temperature", at::tensor({1.0}, at::kDouble));
  w.commit();
}

// The file's log-probabilities are checked on load: a NaN, a value above 0 or a row whose
// probabilities sum past 1 is an input error naming the file and the row (a NaN used to skip
// every step, a +5 to train).
TEST(OfflineDistillation, BadLogprobsAreRefusedOnLoad) {
  ComponentTempDir tmp;
  const int64_t V = 64;
  const auto examples = random_examples(4, 9, V, 3);
  const std::string path = (tmp.path / "topk.dat").string();
  write_random_topk(
      examples, V, [](at::Tensor&) {}, path);
  EXPECT_NO_THROW(TopkTeacher(path, examples, V, 1.0));
  struct Case {
    const char* what;
    std::function<void(at::Tensor&)> edit;
    const char* expected;
  };
  const std::vector<Case> cases = {
      {"NaN", [](at::Tensor& lp) { lp[5][2] = std::nanf(""); }, "row 5 "},
      {"every NaN", [](at::Tensor& lp) { lp.fill_(std::nanf("")); }, "row 0 "},
      {"+5", [](at::Tensor& lp) { lp[7][0] = 5.0f; }, "above 0"},
      {"mass", [](at::Tensor& lp) { lp[3].fill_(std::log(0.3f)); }, "sum to 1.2"},
  };
  for (const Case& k : cases) {
    write_random_topk(examples, V, k.edit, path);
    try {
      TopkTeacher t(path, examples, V, 1.0);
      ADD_FAILURE() << k.what << ": accepted";
    } catch (const ConfigError& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("distill.topk_file: " + path), std::string::npos) << k.what << ": " << m;
      EXPECT_NE(m.find(k.expected), std::string::npos) << k.what << ": " << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  }
}

TEST(DistillConfig, MistakesNameTheKey) {
  const auto message = [](const Config& c) -> std::string {
    try {
      validate_config(c);
      validate_objective_config(c);
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  Config c = cpu_config("runs/x");
  c.model.weights = "w.dat";
  c.model.config = "config.json";
  c.model.tokenizer = "tokenizer.json";
  c.train.objective = ObjectiveKind::kDistill;
  EXPECT_NE(message(c).find("distill.teacher"), std::string::npos) << message(c);
  c.distill.topk_file = "t.dat";
  c.distill.divergence = Divergence::kReverseKl;
  EXPECT_NE(message(c).find("distill.divergence"), std::string::npos) << message(c);
  c.distill.divergence = Divergence::kForwardKl;
  EXPECT_EQ(message(c), "");
  c.train.objective = ObjectiveKind::kCrossEntropy;
  EXPECT_NE(message(c).find("distill.topk_file: set, but train.objective"), std::string::npos)
      << message(c);
}

}  // namespace
