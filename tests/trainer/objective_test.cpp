// The objective interface: supervised cross-entropy through the real step equals an fp64
// reference of the token-weighted mean CE, and a second objective (a toy with its own units and
// a logged value) plugs into the same step without any change to it.
#include "q4/trainer/objectives/objective.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include "component_fixtures.h"
#include "q4/trainer/plan/setup.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace {

// The mean over real tokens of the squared final hidden state (its mean over the width), plus
// the mean hidden RMS as a logged value: nothing the model's chunked loss computes.
class HiddenEnergy final : public Objective {
 public:
  std::string name() const override { return "hidden_energy"; }
  ObjectiveNeeds needs() const override {
    ObjectiveNeeds n;
    n.labels = false;
    return n;
  }
  int64_t units(const data::Batch& batch) const override { return batch.real_tokens; }
  ObjectiveOutput compute(model::Qwen3Model& model, const MicroBatch& micro) override {
    ++calls;
    const at::Tensor ms = model.hidden_states(micro.inputs).pow(2).mean(-1);  // (B, T)
    ObjectiveOutput out;
    out.loss_sum = ms.sum();
    out.logged.emplace_back("hidden_rms", ms.sqrt().sum());
    return out;
  }
  int calls = 0;
};

// fp64 reference of the summed next-token CE of one batch (HF shift) from the full logits.
double ce_sum_fp64(model::Qwen3Model& model, const data::Batch& b) {
  at::NoGradGuard no_grad;
  const at::Tensor logits = model.forward(to_inputs(b, model, at::kCPU)).to(at::kDouble);  // (B, T, V)
  const at::Tensor lp = logits.narrow(1, 0, logits.size(1) - 1).log_softmax(-1);
  const at::Tensor y = b.labels.narrow(1, 1, b.labels.size(1) - 1);
  const at::Tensor valid = y.ne(data::kIgnoreIndex);
  const at::Tensor picked = lp.gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1);
  return -(picked * valid.to(at::kDouble)).sum().item<double>();
}

}  // namespace

TEST(Objective, SupervisedCrossEntropyThroughTheStepMatchesFp64) {
  auto model = tiny_model();
  SupervisedCrossEntropy ce;
  EXPECT_TRUE(ce.needs().labels);
  StepRig rig(cpu_config("unused", /*grad_accum=*/2), model, ce);
  const int64_t V = model.config().vocab_size;
  // The reference sees the same two micro-batches before the step changes the weights.
  auto ref_batcher = random_batcher(4, 12, V, 2);
  double sum = 0;
  int64_t tokens = 0;
  for (int i = 0; i < 2; ++i) {
    const data::Batch b = ref_batcher->next();
    sum += ce_sum_fp64(model, b);
    tokens += b.supervised_tokens;
  }
  auto batcher = random_batcher(4, 12, V, 2);
  const StepOutcome so = rig.step->run(0, *batcher);
  EXPECT_EQ(so.units, tokens);
  EXPECT_EQ(so.supervised, tokens);
  // fp32 logits and sums against fp64: a few ulp of log(V) ~ 6 per token.
  EXPECT_NEAR(so.loss, sum / static_cast<double>(tokens), 1e-5);
  EXPECT_TRUE(so.res.applied);
}

TEST(Objective, ASecondObjectivePlugsIntoTheStep) {
  auto model = tiny_model();
  HiddenEnergy toy;
  StepRig rig(cpu_config("unused", /*grad_accum=*/2), model, toy);
  const int64_t V = model.config().vocab_size;
  auto ref_batcher = random_batcher(4, 12, V, 2);
  double sum = 0, rms = 0;
  int64_t units = 0;
  std::vector<at::Tensor> before;
  for (auto* p : model.trainable_parameters()) before.push_back(p->master.clone());
  for (int i = 0; i < 2; ++i) {
    const data::Batch b = ref_batcher->next();
    at::NoGradGuard no_grad;
    const at::Tensor ms = model.hidden_states(to_inputs(b, model, at::kCPU)).to(at::kDouble).pow(2).mean(-1);
    sum += ms.sum().item<double>();
    rms += ms.sqrt().sum().item<double>();
    units += b.real_tokens;
  }
  auto batcher = random_batcher(4, 12, V, 2);
  const StepOutcome so = rig.step->run(0, *batcher);
  EXPECT_EQ(toy.calls, 2);  // one forward per micro-batch, through the objective
  EXPECT_EQ(so.units, units);
  // fp32 hidden states (64 wide, ~1e-7 relative per element) against fp64.
  EXPECT_NEAR(so.loss, sum / static_cast<double>(units), 1e-5 * std::abs(so.loss) + 1e-7);
  ASSERT_EQ(so.logged.size(), 1u);
  EXPECT_EQ(so.logged[0].first, "hidden_rms");
  EXPECT_NEAR(so.logged[0].second.item<double>(), rms / static_cast<double>(units), 1e-5);
  // Its gradient reached the masters: the step changed them.
  ASSERT_TRUE(so.res.applied);
  bool changed = false;
  const auto params = model.trainable_parameters();
  for (size_t i = 0; i < params.size(); ++i) changed |= !params[i]->master.equal(before[i]);
  EXPECT_TRUE(changed);
}
