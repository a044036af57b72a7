// The evaluator: the validation loss is one pass over the held-out batches through the run's
// objective (the same value on every call), only on rank 0, and the best value is tracked.
#include "q4/trainer/output/evaluator.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cmath>

#include "component_fixtures.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/setup.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(Evaluator, ValidationLossIsOnePassThroughTheObjective) {
  auto model = tiny_model();
  SupervisedCrossEntropy ce;
  const RunPlan plan = resolve_plan(cpu_config("unused"), RunOptions{});
  Evaluator ev(plan.eval_plan(), /*leader=*/true);
  const int64_t V = model.config().vocab_size;
  ev.attach(model, nullptr, ce, random_batcher(5, 12, V, 2));
  ASSERT_TRUE(ev.has_validation());
  EXPECT_EQ(ev.validation_examples(), 5);
  // Reference: the model's CE summed over the same three batches (2 + 2 + 1 rows).
  auto ref = random_batcher(5, 12, V, 2);
  double sum = 0;
  int64_t tokens = 0;
  {
    at::NoGradGuard no_grad;
    for (int i = 0; i < 3; ++i) {
      const data::Batch b = ref->next();
      sum += model.loss(to_inputs(b, model, at::kCPU)).loss_sum.item<double>();
      tokens += b.supervised_tokens;
    }
  }
  const auto v = ev.validation_loss(4);
  ASSERT_TRUE(v.has_value());
  EXPECT_EQ(v->tokens, tokens);
  EXPECT_NEAR(v->loss, sum / static_cast<double>(tokens), 1e-6);
  const auto again = ev.validation_loss(5);
  EXPECT_DOUBLE_EQ(again->loss, v->loss);   // every pass starts from the first batch
  EXPECT_EQ(ev.best_validation_step(), 4);  // equal is not better
  EXPECT_DOUBLE_EQ(*ev.last_validation(), v->loss);
}

TEST(Evaluator, OnlyRankZeroEvaluates) {
  auto model = tiny_model();
  SupervisedCrossEntropy ce;
  const RunPlan plan = resolve_plan(cpu_config("unused"), RunOptions{});
  Evaluator ev(plan.eval_plan(), /*leader=*/false);
  ev.attach(model, nullptr, ce, random_batcher(2, 8, model.config().vocab_size, 2));
  EXPECT_FALSE(ev.validation_loss(1).has_value());
  EXPECT_TRUE(ev.answer_prompts().empty());
  Evaluator none(plan.eval_plan(), /*leader=*/true);
  none.attach(model, nullptr, ce, nullptr);
  EXPECT_FALSE(none.has_validation());
  EXPECT_FALSE(none.validation_loss(1).has_value());
}

TEST(Evaluator, BestValidation) {
  const RunPlan plan = resolve_plan(cpu_config("unused"), RunOptions{});
  Evaluator ev(plan.eval_plan(), true);
  EXPECT_FALSE(ev.last_validation().has_value());
  ev.note_validation(2.0, 10);
  ev.note_validation(std::nan(""), 20);  // a non-finite loss is never the best
  ev.note_validation(1.5, 30);
  ev.note_validation(1.7, 40);
  EXPECT_DOUBLE_EQ(ev.best_validation(), 1.5);
  EXPECT_EQ(ev.best_validation_step(), 30);
  EXPECT_DOUBLE_EQ(*ev.last_validation(), 1.7);
}
