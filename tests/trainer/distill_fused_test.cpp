// The chunked loss's use of a LossTerm's fused form (LossTerm::fused), on the CPU with an ATen
// stand-in for the CUDA kernel: where it answers, its per-row values and mixed gradient replace
// the term's chunk and the CE's own path, and the loss, its parts and the gradients (scaled by the
// upstream gradient) equal the generic path's; where it declines, the generic path runs
// unchanged. The kernel itself: tests/trainer/cuda/distill_fused_cuda_test.cpp.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "component_fixtures.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/objectives/distill.h"

using namespace q4;
using namespace q4::trainer;

// In a namespace of its own: the test binaries are unity builds.
namespace q4::test::distill_fused_test {

namespace {

double max_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a.to(at::kDouble) - b.to(at::kDouble)).abs().max().item<double>();
}

struct LossRun {
  at::Tensor loss, ce, term, grad_h, grad_w;
};

LossRun run(const at::Tensor& h0, const at::Tensor& w0, const at::Tensor& labels,
            const model::LossTerm& term) {
  at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
  LossRun r;
  r.loss = model::chunked_loss_with_term(h, w, labels, 3, term, &r.ce, &r.term);
  r.loss.mul(2.5).backward();  // the upstream gradient scales both
  r.grad_h = h.grad();
  r.grad_w = w.grad();
  return r;
}

TEST(ChunkedLossWithTerm, FusedFormTakesThePlaceOfTheChunk) {
  const trainer::testing::LossProblem p(21);
  const at::Tensor &h0 = p.h0, &w0 = p.w0, &teacher = p.teacher, &labels = p.labels;
  labels[4] = -100;
  const double alpha = 0.3;
  const DivergenceOptions opt{Divergence::kReverseKl, 2.0};
  int chunks = 0, fused_calls = 0;
  model::LossTerm term;
  term.weight = alpha;
  term.chunk = [&](at::Tensor& z, const at::Tensor& v, int64_t row_begin, bool want_grad) {
    ++chunks;
    return divergence_chunk(z, teacher.narrow(0, row_begin, z.size(0)), v, opt, want_grad);
  };
  const LossRun generic = run(h0, w0, labels, term);
  EXPECT_EQ(chunks, 4);
  // Declining: the generic path, bit for bit.
  term.fused = [&](at::Tensor&, const at::Tensor&, int64_t, bool) {
    ++fused_calls;
    return model::LossRows{};
  };
  chunks = 0;
  const LossRun declined = run(h0, w0, labels, term);
  EXPECT_EQ(fused_calls, 4);
  EXPECT_EQ(chunks, 4);
  EXPECT_TRUE(declined.loss.equal(generic.loss));
  EXPECT_TRUE(declined.grad_h.equal(generic.grad_h) && declined.grad_w.equal(generic.grad_w));
  // Answering: CE rows, the term's value (its sum, as one row) and the mixed gradient in place.
  term.fused = [&](at::Tensor& x, const at::Tensor& y, int64_t row_begin, bool want_grad) {
    ++fused_calls;
    const at::Tensor valid = y.ne(-100);
    at::Tensor z = x.clone();
    model::LossRows r;
    r.term = at::zeros({x.size(0)}, x.options());
    r.term[0] = divergence_chunk(z, teacher.narrow(0, row_begin, x.size(0)), valid, opt, want_grad);
    const at::Tensor lsm = at::log_softmax(x, 1);
    r.ce = -lsm.gather(1, y.clamp_min(0).unsqueeze(1)).squeeze(1) * valid.to(at::kFloat);
    if (want_grad) {
      at::Tensor g = lsm.exp().scatter_add(1, y.clamp_min(0).unsqueeze(1),
                                           at::full({x.size(0), 1}, -1.0, x.options()));
      g.mul_(valid.to(at::kFloat).unsqueeze(1));
      x.copy_(g.mul_(1.0 - alpha).add_(z, alpha));
    }
    return r;
  };
  chunks = fused_calls = 0;
  const LossRun fused = run(h0, w0, labels, term);
  EXPECT_EQ(fused_calls, 4);
  EXPECT_EQ(chunks, 0) << "the term's chunk ran beside its fused form";
  EXPECT_NEAR(fused.loss.item<double>(), generic.loss.item<double>(),
              1e-6 * generic.loss.item<double>());
  EXPECT_NEAR(fused.ce.item<double>(), generic.ce.item<double>(), 1e-6 * generic.ce.item<double>());
  EXPECT_NEAR(fused.term.item<double>(), generic.term.item<double>(),
              1e-6 * generic.term.item<double>());
  EXPECT_LE(max_diff(fused.grad_h, generic.grad_h), 1e-5);
  EXPECT_LE(max_diff(fused.grad_w, generic.grad_w), 1e-5);
  EXPECT_GT(generic.grad_w.abs().max().item<double>(), 0.1);  // not vacuous
}

}  // namespace

}  // namespace q4::test::distill_fused_test
