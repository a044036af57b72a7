// In-backward updates (begin_step / step_param / end_step) against the buffered step():
// without clipping they give the same bits (same constants, same rounding streams) in every
// moment mode and in any parameter order; clipping uses the previous step's norm (the first step,
// which has none, is applied unclipped and its moments are then scaled to the clipped gradient's);
// a parameter with a NaN/Inf gradient keeps its master and moments while the others move, and
// the step counts as non-finite.
#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <vector>

#include "optim_test_util.h"
#include "q4/optim/adamw.h"

namespace q4::optim {
namespace {

using test::bit_equal;

struct Problem {
  std::vector<at::Tensor> masters;
  std::vector<std::vector<at::Tensor>> grads;  // [step][param]
};

Problem make_problem(uint64_t seed, int steps) {
  at::Generator g = test::gen(seed);
  Problem p;
  for (auto shape : {std::vector<int64_t>{64, 96}, {4096}, {33, 256}, {8}}) {
    p.masters.push_back(at::randn(shape, g).mul(0.1).to(at::kHalf));
  }
  for (int s = 0; s < steps; ++s) {
    std::vector<at::Tensor> gs;
    for (const auto& m : p.masters) gs.push_back(at::randn(m.sizes(), g).mul(0.01 * (s + 1)));
    p.grads.push_back(gs);
  }
  return p;
}

PackedAdamW make_opt(const std::vector<at::Tensor>& masters, StateMode mode) {
  AdamWOptions o;
  o.lr = 1e-3;
  o.weight_decay = 0.01;
  o.state_mode = mode;
  o.small_tensor_threshold = 16;
  PackedAdamW opt(o);
  for (size_t i = 0; i < masters.size(); ++i) {
    opt.add_param("p" + std::to_string(i), masters[i], masters[i].dim() >= 2);
  }
  return opt;
}

std::vector<at::Tensor> clone_all(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.clone());
  return out;
}

TEST(InBackward, MatchesBufferedStepBitExactWithoutClipping) {
  for (StateMode mode : {StateMode::kFp32, StateMode::kInt8, StateMode::k4Bit}) {
    const Problem pr = make_problem(3, 4);
    auto ma = clone_all(pr.masters), mb = clone_all(pr.masters);
    PackedAdamW a = make_opt(ma, mode), b = make_opt(mb, mode);
    for (const auto& gs : pr.grads) {
      a.step(gs);
      b.begin_step();
      for (int64_t i = static_cast<int64_t>(gs.size()) - 1; i >= 0; --i) b.step_param(i, gs[i]);
      const StepResult r = b.end_step();
      EXPECT_TRUE(r.applied);
    }
    for (size_t i = 0; i < ma.size(); ++i) {
      EXPECT_TRUE(bit_equal(ma[i], mb[i])) << to_string(mode) << " param " << i;
      EXPECT_TRUE(bit_equal(a.decoded_exp_avg(i), b.decoded_exp_avg(i))) << to_string(mode);
      EXPECT_TRUE(bit_equal(a.decoded_exp_avg_sq(i), b.decoded_exp_avg_sq(i))) << to_string(mode);
    }
    EXPECT_EQ(a.step_count(), b.step_count());
  }
}

TEST(InBackward, ClipsWithThePreviousStepsNorm) {
  const Problem pr = make_problem(5, 2);
  auto ma = clone_all(pr.masters), mb = clone_all(pr.masters);
  PackedAdamW a = make_opt(ma, StateMode::kFp32), b = make_opt(mb, StateMode::kFp32);
  StepArgs args;
  args.max_grad_norm = 1e-3;  // far below the gradients' norms: always clips
  b.begin_step(args);
  for (size_t i = 0; i < pr.grads[0].size(); ++i) b.step_param(i, pr.grads[0][i]);
  const StepResult r1 = b.end_step();
  // The first step has no previous norm: applied unclipped, then its moments are scaled by the
  // coefficient the buffered step would have used, which it reports.
  EXPECT_NEAR(r1.clip_coef, args.max_grad_norm / (r1.grad_norm + 1e-6), 1e-15);
  EXPECT_NEAR(b.previous_grad_norm(), r1.grad_norm, 0.0);
  b.begin_step(args);
  for (size_t i = 0; i < pr.grads[1].size(); ++i) b.step_param(i, pr.grads[1][i]);
  const StepResult r2 = b.end_step();
  EXPECT_NEAR(r2.clip_coef, args.max_grad_norm / (r1.grad_norm + 1e-6), 1e-12);
  // Same as the buffered steps: the first clipped by its own norm (the masters differ only where
  // eps matters: Adam's first update is sign(g) up to eps), the second fed the gradients
  // pre-scaled by the previous norm's coefficient.
  const StepResult a1 = a.step(pr.grads[0], args);
  // A buffered step leaves its norm for an in-backward step after it, as an in-backward one does.
  EXPECT_NEAR(a.previous_grad_norm(), a1.grad_norm, 0.0);
  std::vector<at::Tensor> scaled;
  for (const auto& g : pr.grads[1]) scaled.push_back(g * r2.clip_coef);
  StepArgs plain;
  a.step(scaled, plain);
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_LT((ma[i].to(at::kFloat) - mb[i].to(at::kFloat)).abs().max().item<double>(), 1e-3);
  }
}

TEST(InBackward, FirstStepMomentsAreThoseOfTheClippedGradient) {
  // Unclipped, the first step's v would be (norm / max_norm)^2 times the clipped one and shrink
  // the following updates for ~1 / (1 - beta2) steps. end_step() scales the moments the step
  // wrote (from zero: linear in g and g^2); they must equal the buffered clipped step's up to
  // fp32 rounding (fp32 moments) or a rare code decided differently by that rounding (packed).
  for (StateMode mode : {StateMode::kFp32, StateMode::kInt8, StateMode::k4Bit,
                         StateMode::kNvfp4}) {
    const Problem pr = make_problem(11, 1);
    auto ma = clone_all(pr.masters), mb = clone_all(pr.masters);
    PackedAdamW a = make_opt(ma, mode), b = make_opt(mb, mode);
    StepArgs args;
    args.max_grad_norm = 0.05;  // the gradients' norm is ~1.6: clip coefficient ~0.03
    const StepResult ra = a.step(pr.grads[0], args);
    b.begin_step(args);
    for (size_t i = 0; i < pr.grads[0].size(); ++i) b.step_param(i, pr.grads[0][i]);
    const StepResult rb = b.end_step();
    ASSERT_LT(ra.clip_coef, 0.1);
    // The norms are summed in a different order (per parameter vs over all): ~1e-8 apart.
    EXPECT_NEAR(rb.clip_coef, ra.clip_coef, 1e-6 * ra.clip_coef) << to_string(mode);
    // NVFP4 (not a training format: its scale floor decodes these v to 0) only runs the
    // re-encode path here; its masters are compared below.
    const double tol = mode == StateMode::kFp32 ? 1e-6 : 0.02;
    for (size_t i = 0; i < ma.size(); ++i) {
      for (bool second : {false, true}) {
        if (mode == StateMode::kNvfp4 && pr.masters[i].numel() >= 16) continue;
        const at::Tensor x = second ? a.decoded_exp_avg_sq(i) : a.decoded_exp_avg(i);
        const at::Tensor y = second ? b.decoded_exp_avg_sq(i) : b.decoded_exp_avg(i);
        const double rel = ((x - y).norm() / x.norm()).item<double>();
        EXPECT_LE(rel, tol) << to_string(mode) << " param " << i << (second ? " v" : " m");
      }
      EXPECT_LT((ma[i].to(at::kFloat) - mb[i].to(at::kFloat)).abs().max().item<double>(), 1e-3);
    }
  }
}

TEST(InBackward, NonFiniteGradientLeavesThatParameterUntouched) {
  const Problem pr = make_problem(7, 1);
  auto m = clone_all(pr.masters);
  const auto before = clone_all(m);
  PackedAdamW opt = make_opt(m, StateMode::kInt8);
  auto gs = pr.grads[0];
  gs[2] = gs[2].clone();
  gs[2].view(-1)[5] = std::numeric_limits<float>::quiet_NaN();
  opt.begin_step();
  for (size_t i = 0; i < gs.size(); ++i) opt.step_param(i, gs[i]);
  const StepResult r = opt.end_step();
  EXPECT_FALSE(r.applied);
  EXPECT_FALSE(std::isfinite(r.grad_norm));
  EXPECT_EQ(r.consecutive_nonfinite, 1);
  EXPECT_TRUE(bit_equal(m[2], before[2]));
  EXPECT_TRUE(at::equal(opt.decoded_exp_avg(2), at::zeros_like(opt.decoded_exp_avg(2))));
  EXPECT_FALSE(bit_equal(m[0], before[0]));  // the finite ones moved
  EXPECT_TRUE(at::isfinite(m[2].to(at::kFloat)).all().item<bool>());
}

TEST(InBackward, MisuseIsAnError) {
  const Problem pr = make_problem(9, 1);
  auto m = clone_all(pr.masters);
  PackedAdamW opt = make_opt(m, StateMode::kFp32);
  EXPECT_NE(test::error_of([&] { opt.step_param(0, pr.grads[0][0]); }), "");
  EXPECT_NE(test::error_of([&] { opt.end_step(); }), "");
  opt.begin_step();
  opt.step_param(0, pr.grads[0][0]);
  EXPECT_NE(test::error_of([&] { opt.step_param(0, pr.grads[0][0]); }).find("already updated"),
            std::string::npos);
  EXPECT_NE(test::error_of([&] { opt.begin_step(); }), "");
  const StepResult r = opt.end_step();  // the rest get zero gradients
  EXPECT_TRUE(r.applied);
}

}  // namespace
}  // namespace q4::optim
