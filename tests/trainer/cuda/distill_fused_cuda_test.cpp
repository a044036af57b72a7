// The fused distillation loss kernels (q4/model/fused_divergence.h) against an fp64 direct
// computation of the same rows and against the unfused path they replace (the ATen divergences
// of distill.h, the CE, mixed in fp32), in fp32 and bf16 logits: forward and reverse KL and the
// top-K form, temperatures 1 and 2.5, rows of large logits, -inf masks, an unlabelled row, rows
// of a length that is no multiple of the vector width; then the chunked loss on CUDA with the
// fused form against the same loss without it. Skips without a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <limits>
#include <string>

#include "q4/model/fused_divergence.h"
#include "q4/trainer/objectives/distill.h"

using namespace q4;
using namespace q4::trainer;

// In a namespace of its own: the test binaries are unity builds.
namespace q4::test::distill_fused_cuda_test {

namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

constexpr double kInf = std::numeric_limits<double>::infinity();

at::Generator gen(uint64_t seed) { return at::detail::createCPUGenerator(seed); }

// An fp32 copy that never aliases `x` (Tensor::to returns an fp32 tensor itself).
at::Tensor fp32_copy(const at::Tensor& x) {
  return x.to(at::kFloat, /*non_blocking=*/false, /*copy=*/true);
}

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.cpu().to(at::kDouble) - b.cpu().to(at::kDouble)).abs().max().item<double>();
}

// The tolerance of a gradient written in `dtype` against fp32 or fp64 values `ref`: fp32, `extra`
// (the arithmetic); bf16, half a bf16 step of the largest entry (2^-8 of it) more.
double grad_tol(at::ScalarType dtype, const at::Tensor& ref, double extra) {
  const double round = dtype == at::kFloat ? 0.0 : std::ldexp(ref.abs().max().item<double>(), -8);
  return round + extra;
}

// The fp32 arithmetic's part of a gradient's error against fp64: reverse KL's gradient holds
// log p_s - log p_t, whose fp32 offsets (x - max) round at the logits' magnitude.
double arith_tol(bool reverse, const at::Tensor& z, const at::Tensor& t) {
  const auto finite_max = [](const at::Tensor& x) {
    const at::Tensor d = x.to(at::kDouble);
    return at::where(at::isfinite(d), d.abs(), at::zeros_like(d)).max().item<double>();
  };
  return 2e-6 + (reverse ? 1e-7 * (finite_max(z) + finite_max(t)) : 0.0);
}

// Student and teacher logits (n, V): random rows, a row of large logits (scale 300), a row whose
// student is the teacher plus a constant, and label -100 on row 2.
struct Rows {
  at::Tensor z, t, labels;
};

Rows make_rows(int64_t V, uint64_t seed) {
  const int64_t n = 6;
  Rows r;
  r.z = at::randn({n, V}, gen(seed), at::kDouble) * 3;
  r.t = at::randn({n, V}, gen(seed + 1), at::kDouble) * 3;
  r.z[3] = r.z[3] * 100;
  r.t[3] = r.t[3] * 100;
  r.z[4] = r.t[4] + 7.0;
  r.labels = at::randint(0, V, {n}, gen(seed + 2), at::kLong);
  r.labels[2] = -100;
  return r;
}

// fp64: per-row CE, T^2 * KL and the gradient of sum((1 - w) CE + w T^2 KL) over labelled rows,
// from the logits as the kernel reads them (`x`, `y` already rounded to the tested dtype).
// A probability of 0 contributes 0 to a KL.
struct Ref {
  at::Tensor ce, term, grad;
};

Ref fp64_reference(const at::Tensor& x0, const at::Tensor& y, const at::Tensor& labels,
                   bool reverse, double t, double w) {
  at::Tensor x = x0.cpu().to(at::kDouble).requires_grad_(true);
  const at::Tensor yd = y.cpu().to(at::kDouble);
  const at::Tensor valid = labels.ge(0).to(at::kDouble);
  const at::Tensor ls = at::log_softmax(x / t, 1), lt = at::log_softmax(yd / t, 1);
  const at::Tensor lp = reverse ? ls : lt, lq = reverse ? lt : ls;
  const at::Tensor p = lp.exp();
  // Where p = 0 both log-probabilities are replaced by 0 before the product, so that neither the
  // value nor autograd meets 0 * inf.
  const at::Tensor keep = p.gt(0), zero = at::zeros_like(p);
  const at::Tensor kl =
      (p * (at::where(keep, lp, zero) - at::where(keep, lq, zero))).sum(1) * (t * t) * valid;
  const at::Tensor ce =
      -at::log_softmax(x, 1).gather(1, labels.clamp_min(0).unsqueeze(1)).squeeze(1) * valid;
  (ce * (1 - w) + kl * w).sum().backward();
  return {ce.detach(), kl.detach(), x.grad()};
}

struct Case {
  at::ScalarType dtype;
  bool reverse;
  double t;
  int64_t V;
};

std::string name(const Case& c) {
  return std::string(c.dtype == at::kFloat ? "fp32" : "bf16") +
         (c.reverse ? " reverse" : " forward") + " T=" + std::to_string(c.t) +
         " V=" + std::to_string(c.V);
}

TEST(DistillFusedCuda, MatchesFp64AndTheUnfusedPath) {
  SKIP_WITHOUT_CUDA();
  const double w = 0.4;
  for (const Case& c : {Case{at::kFloat, false, 1.0, 1024}, Case{at::kFloat, true, 2.5, 1024},
                        Case{at::kBFloat16, false, 2.5, 1024}, Case{at::kBFloat16, true, 1.0, 1024},
                        Case{at::kFloat, false, 2.5, 1003}, Case{at::kBFloat16, true, 2.5, 1003}}) {
    SCOPED_TRACE(name(c));
    const Rows r = make_rows(c.V, 40);
    const auto dev = at::TensorOptions().device(at::kCUDA).dtype(c.dtype);
    const at::Tensor z = r.z.to(dev), t = r.t.to(dev), y = r.labels.cuda();
    at::Tensor g = z.clone();
    ASSERT_TRUE(model::fused_distill_applies(g, y));
    const model::LossRows got = model::fused_distill_xent_(g, y, t, c.reverse, c.t, w, true);
    const Ref ref = fp64_reference(z, t, r.labels, c.reverse, c.t, w);
    const double scale = ref.term.abs().max().item<double>();
    EXPECT_LE(max_diff(got.ce, ref.ce), 2e-5 * ref.ce.abs().max().item<double>() + 1e-4);
    EXPECT_LE(max_diff(got.term, ref.term), 2e-5 * scale + 1e-4);
    EXPECT_LE(max_diff(g, ref.grad), grad_tol(c.dtype, ref.grad, arith_tol(c.reverse, z, t)))
        << "gradient";
    EXPECT_EQ(g[2].abs().max().item<double>(), 0.0) << "an unlabelled row has a gradient";
    // Without a gradient: the same values, the logits untouched.
    at::Tensor g2 = z.clone();
    const model::LossRows vals = model::fused_distill_xent_(g2, y, t, c.reverse, c.t, w, false);
    EXPECT_LE(max_diff(vals.term, got.term), 1e-6 * scale + 1e-6);
    EXPECT_TRUE(g2.equal(z));
    // The unfused path: the ATen divergence on an fp32 copy and the CE's gradient, mixed. A copy
    // always (an fp32 z would otherwise be returned as itself and overwritten by the gradient).
    at::Tensor zt = fp32_copy(z);
    const double unfused =
        divergence_chunk(zt, t, y.ne(-100),
                         {c.reverse ? Divergence::kReverseKl : Divergence::kForwardKl, c.t}, true)
            .item<double>();
    EXPECT_NEAR(got.term.sum().item<double>(), unfused, 2e-5 * std::abs(unfused) + 1e-4);
    const at::Tensor valid = y.ne(-100).to(at::kFloat).unsqueeze(1);
    const at::Tensor zf = z.to(at::kFloat);
    const at::Tensor gce =
        (zf.softmax(1) - at::one_hot(y.clamp_min(0), c.V).to(at::kFloat)) * valid;
    // The ATen path's log-softmax loses ulps of the large row's log-sum-exp (~300 / T).
    const at::Tensor unfused_grad = gce * (1 - w) + zt * w;
    EXPECT_LE(max_diff(g, unfused_grad),
              grad_tol(c.dtype, unfused_grad, 1e-4 + arith_tol(c.reverse, z, t)))
        << "gradient vs unfused";
  }
}

// -inf logits are masks: a teacher's (forward KL) or a student's (reverse KL) -inf columns carry
// no mass and no gradient; the values stay finite.
TEST(DistillFusedCuda, InfiniteMasks) {
  SKIP_WITHOUT_CUDA();
  const int64_t V = 512;
  for (const bool reverse : {false, true}) {
    for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
      SCOPED_TRACE(std::string(reverse ? "reverse" : "forward") +
                   (dt == at::kFloat ? " fp32" : " bf16"));
      Rows r = make_rows(V, 50);
      at::Tensor& masked = reverse ? r.z : r.t;
      masked.narrow(1, V - 100, 100).fill_(-kInf);  // a padded vocabulary's tail
      r.z.narrow(1, V - 100, 100).fill_(-kInf);     // both models mask it (forward KL finite)
      r.labels.clamp_max_(V - 101);
      const auto dev = at::TensorOptions().device(at::kCUDA).dtype(dt);
      const at::Tensor z = r.z.to(dev), t = r.t.to(dev), y = r.labels.cuda();
      at::Tensor g = z.clone();
      const model::LossRows got = model::fused_distill_xent_(g, y, t, reverse, 2.0, 0.5, true);
      const Ref ref = fp64_reference(z, t, r.labels, reverse, 2.0, 0.5);
      EXPECT_TRUE(at::isfinite(got.term).all().item<bool>() && at::isfinite(g).all().item<bool>());
      EXPECT_LE(max_diff(got.term, ref.term), 2e-5 * ref.term.abs().max().item<double>() + 1e-4);
      EXPECT_LE(max_diff(g, ref.grad), grad_tol(dt, ref.grad, arith_tol(reverse, z, t)));
      EXPECT_EQ(g.narrow(1, V - 100, 100).abs().max().item<double>(), 0.0);
    }
  }
}

// The top-K form against topk_divergence_chunk and the CE (the unfused path), K = 16 and K = V.
TEST(DistillFusedCuda, TopkMatchesTheUnfusedPath) {
  SKIP_WITHOUT_CUDA();
  const double w = 0.7;
  for (const at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (const int64_t V : {1024, 1003}) {
      for (const int64_t K : {int64_t{16}, V}) {
        for (const double temp : {1.0, 2.5}) {
          SCOPED_TRACE((dt == at::kFloat ? "fp32 V=" : "bf16 V=") + std::to_string(V) +
                       " K=" + std::to_string(K) + " T=" + std::to_string(temp));
          const Rows r = make_rows(V, 60);
          const auto dev = at::TensorOptions().device(at::kCUDA).dtype(dt);
          const at::Tensor z = r.z.to(dev), y = r.labels.cuda();
          const auto [lp, ids] = at::log_softmax(r.t / temp, 1).topk(K, 1);
          const at::Tensor ids_d = ids.cuda(), lp_d = lp.to(at::kFloat).cuda();
          at::Tensor g = z.clone();
          ASSERT_TRUE(model::fused_topk_distill_applies(g, y, ids_d));
          const model::LossRows got =
              model::fused_topk_distill_xent_(g, y, ids_d, lp_d, temp, w, true);
          at::Tensor zt = fp32_copy(z);  // the unfused divergence writes its gradient over it
          const double unfused =
              topk_divergence_chunk(zt, ids_d, lp_d, y.ne(-100), temp, true).item<double>();
          EXPECT_NEAR(got.term.sum().item<double>(), unfused, 2e-5 * std::abs(unfused) + 1e-4);
          const at::Tensor zf = z.to(at::kFloat);
          const at::Tensor lsm = zf.log_softmax(1);
          const at::Tensor valid = y.ne(-100).to(at::kFloat);
          const double ce =
              (-lsm.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1) * valid).sum().item<double>();
          EXPECT_NEAR(got.ce.sum().item<double>(), ce, 2e-5 * ce);
          const at::Tensor gce =
              (lsm.exp() - at::one_hot(y.clamp_min(0), V).to(at::kFloat)) * valid.unsqueeze(1);
          const at::Tensor unfused_grad = gce * (1 - w) + zt * w;
          EXPECT_LE(max_diff(g, unfused_grad), grad_tol(dt, unfused_grad, 2e-4));
          EXPECT_EQ(g[2].abs().max().item<double>(), 0.0);
        }
      }
    }
  }
}

// The chunked loss on CUDA (bf16 hidden and weight, chunks of 5 rows) with the trainer's fused
// form against the same term without it: loss, parts and gradients.
TEST(DistillFusedCuda, ChunkedLossWithTheFusedForm) {
  SKIP_WITHOUT_CUDA();
  const int64_t N = 13, H = 64, V = 1000;
  const auto bf = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor h0 = at::randn({N, H}, gen(70)).to(bf);
  const at::Tensor w0 = (at::randn({V, H}, gen(71)) * 0.3).to(bf);
  const at::Tensor teacher = (at::randn({N, V}, gen(72)) * 3).to(bf);
  at::Tensor labels = at::randint(0, V, {N}, gen(73), at::kLong);
  labels[6] = -100;
  labels = labels.cuda();
  for (const bool reverse : {false, true}) {
    SCOPED_TRACE(reverse ? "reverse" : "forward");
    const DivergenceOptions opt{reverse ? Divergence::kReverseKl : Divergence::kForwardKl, 2.0};
    model::LossTerm term;
    term.weight = 0.6;
    term.chunk = [&](at::Tensor& z, const at::Tensor& v, int64_t row_begin, bool want_grad) {
      return divergence_chunk(z, teacher.narrow(0, row_begin, z.size(0)), v, opt, want_grad);
    };
    const auto run = [&](const model::LossTerm& tm, at::Tensor* parts) {
      at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
      const at::Tensor loss =
          model::chunked_loss_with_term(h, w, labels, 5, tm, &parts[0], &parts[1]);
      loss.mul(1.5).backward();
      parts[2] = h.grad();
      parts[3] = w.grad();
      return loss;
    };
    at::Tensor a[4], b[4];
    const at::Tensor generic = run(term, a);
    int calls = 0;
    term.fused = [&](at::Tensor& z, const at::Tensor& y, int64_t row_begin, bool want_grad) {
      ++calls;
      return model::fused_distill_xent_(z, y, teacher.narrow(0, row_begin, z.size(0)), reverse, 2.0,
                                        0.6, want_grad);
    };
    const at::Tensor fused = run(term, b);
    EXPECT_EQ(calls, 3);
    EXPECT_NEAR(fused.item<double>(), generic.item<double>(), 1e-4 * generic.item<double>());
    for (int i = 0; i < 2; ++i) {
      EXPECT_NEAR(b[i].item<double>(), a[i].item<double>(), 1e-4 * a[i].item<double>() + 1e-4);
    }
    // bf16 gradients (the unfused path rounds the CE's gradient once more before mixing).
    for (int i = 2; i < 4; ++i) {
      const double tol = 2e-2 * a[i].abs().max().item<double>();
      EXPECT_LE(max_diff(b[i], a[i]), tol) << (i == 2 ? "hidden" : "weight") << " gradient";
    }
  }
}

}  // namespace

}  // namespace q4::test::distill_fused_cuda_test
