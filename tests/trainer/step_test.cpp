// The one step function: a step of grad_accum micro-batches is the token-weighted mean of one
// big batch (same loss, same update), in-backward updates give the buffered step's update, and
// an instrumented step reports its phases in order.
#include "q4/trainer/step/step.h"

#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <cmath>
#include <map>

#include "component_fixtures.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/quant/nvfp4.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace q4::test::step_test {

std::vector<at::Tensor> masters(model::Qwen3Model& m) {
  std::vector<at::Tensor> out;
  for (auto* p : m.trainable_parameters()) out.push_back(p->master.clone());
  return out;
}

void expect_close(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b, double atol) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_LE((a[i] - b[i]).abs().max().item<double>(), atol) << "tensor " << i;
  }
}

// Two batchers of the same `count` random examples of 12 tokens in batches of 2: one for each rig
// of a side-by-side comparison.
struct SameData {
  std::unique_ptr<data::Batcher> a, b;
};
SameData same_data(int64_t count, int64_t vocab) {
  return {random_batcher(count, 12, vocab, 2), random_batcher(count, 12, vocab, 2)};
}

// Three steps of `resident` and `offloaded` (optim.offload: all) with config `c`, one rig each
// on the same data: losses and gradient norms must be equal, then the masters, bit for bit.
void expect_offload_matches(const Config& c, model::Qwen3Model& resident,
                            model::Qwen3Model& offloaded, bool in_backward,
                            const std::string& what) {
  SupervisedCrossEntropy ce;
  StepRig r1(c, resident, ce, in_backward), r2(c, offloaded, ce, in_backward);
  auto [b1, b2] = same_data(8, resident.config().vocab_size);
  ASSERT_NO_FATAL_FAILURE(expect_equal_steps(r1, r2, *b1, *b2, what));
  // Offloaded masters are written by kernels in flight: read them after the device is done.
  if (torch::cuda::is_available()) torch::cuda::synchronize();
  const auto a = masters(resident), b = masters(offloaded);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i].cpu(), b[i].cpu())) << what << " tensor " << i;
  }
}

TEST(TrainStep, AccumulationEqualsOneBigBatch) {
  auto m1 = tiny_model(), m2 = tiny_model();
  SupervisedCrossEntropy ce;
  Config c1 = cpu_config("unused", /*grad_accum=*/2);
  Config c2 = cpu_config("unused", /*grad_accum=*/1);
  StepRig r1(c1, m1, ce), r2(c2, m2, ce);
  const int64_t V = m1.config().vocab_size;
  auto b1 = random_batcher(4, 12, V, /*batch_size=*/2);
  auto b2 = random_batcher(4, 12, V, /*batch_size=*/4);
  const StepOutcome s1 = r1.step->run(0, *b1);
  const StepOutcome s2 = r2.step->run(0, *b2);
  EXPECT_EQ(s1.supervised, s2.supervised);
  EXPECT_EQ(s1.real_tokens, s2.real_tokens);
  EXPECT_NEAR(s1.loss, s2.loss, 1e-5);
  EXPECT_NEAR(s1.res.grad_norm, s2.res.grad_norm, 1e-4 * s2.res.grad_norm);
  // Adam's first update is lr * g / (|g| + eps): gradients equal up to fp32 summation order give
  // equal updates, except where |g| is of the order of eps (1e-8; a few norm weights of this
  // random model), where the order moves the update by up to a tenth of lr (1e-3).
  expect_close(masters(m1), masters(m2), 1e-4);
}

// Without clipping, updates inside the backward are the buffered step's, with one micro-batch a
// step and with several (the last one's backward applies the sums).
TEST(TrainStep, InBackwardUpdatesEqualBufferedOnes) {
  SupervisedCrossEntropy ce;
  for (const int64_t accum : {3, 1}) {
    auto m1 = tiny_model(), m2 = tiny_model();
    const Config c = cpu_config("unused", accum);
    StepRig buffered(c, m1, ce), in_backward(c, m2, ce, /*in_backward=*/true);
    EXPECT_TRUE(in_backward.step->in_backward());
    auto [b1, b2] = same_data(12, m1.config().vocab_size);
    for (int64_t step = 0; step < 2; ++step) {
      const StepOutcome s1 = buffered.step->run(step, *b1);
      const StepOutcome s2 = in_backward.step->run(step, *b2);
      EXPECT_DOUBLE_EQ(s1.loss, s2.loss) << "accum " << accum << " step " << step;
      EXPECT_NEAR(s1.res.grad_norm, s2.res.grad_norm, 1e-6 * s1.res.grad_norm);
      EXPECT_TRUE(s1.res.applied && s2.res.applied);
      expect_close(masters(m1), masters(m2), 1e-6);
    }
    if (accum > 1) continue;
    in_backward.step->disable_in_backward();
    EXPECT_FALSE(in_backward.step->in_backward());
    const StepOutcome s3 = in_backward.step->run(2, *b2);
    EXPECT_TRUE(s3.res.applied);
  }
}

// optim.offload: all keeps each trained NVFP4 linear's codes for the forward and re-derives them
// after every update (on the CPU the masters stay put; the same forward and refreshes): the
// losses and masters of a few steps equal those of fake-quantizing the masters, bit for bit, in
// buffered, in-backward and accumulated steps. A missed refresh would leave step 2 computing
// with step 1's weights.
TEST(TrainStep, OffloadedMastersTrainAsResidentOnes) {
  for (const int64_t accum : {1, 2}) {
    for (const bool in_backward : {false, true}) {
      auto resident = tiny_model(), offloaded = tiny_model(7, /*offload_masters=*/true);
      int64_t with_codes = 0;
      for (auto* p : offloaded.trainable_parameters()) with_codes += p->qdata.defined() ? 1 : 0;
      ASSERT_GT(with_codes, 0);
      for (auto* p : resident.trainable_parameters()) ASSERT_FALSE(p->qdata.defined());
      const std::string what =
          "accum " + std::to_string(accum) + (in_backward ? " in-backward" : "");
      expect_offload_matches(cpu_config("unused", accum), resident, offloaded, in_backward, what);
      for (auto* p : offloaded.trainable_parameters()) {
        if (!p->qdata.defined()) continue;
        const auto q = quant::quantize_nvfp4(p->master, p->name);
        EXPECT_TRUE(at::equal(q.qdata, p->qdata) && at::equal(q.scale, p->scale)) << p->name;
      }
    }
  }
}

// The same on the GPU, where offloaded masters live in pinned host memory and are updated there
// over PCIe, and accumulated gradients of several micro-batches add up there too (staged through
// the device by DMA, their norm parts taken on the way): fp16 masters, bf16 compute, losses and
// masters bit for bit equal to the resident run's.
TEST(TrainStepCuda, OffloadedMastersTrainAsResidentOnes) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  const auto cuda_model = [](bool offload) {
    const auto cfg = model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) +
                                                        "/qwen3_tiny.config.json");
    model::ModelOptions o = cuda_recompute_options();
    o.offload_masters = offload;
    return model::Qwen3Model::random_init(cfg, o, 11, 0.02);
  };
  // accum 3: a first (copied out), a middle (added) and a last micro-batch (added, norm parts).
  for (const int64_t accum : {1, 2, 3}) {
    for (const bool in_backward : {false, true}) {
      const std::string what =
          "accum " + std::to_string(accum) + (in_backward ? " in-backward" : "");
      auto resident = cuda_model(false), offloaded = cuda_model(true);
      for (auto* p : offloaded.trainable_parameters()) {
        if (p->quantized) {
          EXPECT_TRUE(p->master.is_cpu() && p->master.is_pinned()) << p->name;
        }
      }
      Config c = cpu_config("unused", accum);
      c.model.device = "cuda";
      expect_offload_matches(c, resident, offloaded, in_backward, what);
    }
  }
}

TEST(TrainStep, PhasesInOrder) {
  auto model = tiny_model();
  SupervisedCrossEntropy ce;
  StepRig rig(cpu_config("unused", /*grad_accum=*/2), model, ce);
  auto batcher = random_batcher(4, 12, model.config().vocab_size, 2);
  std::vector<std::string> phases;
  const StepOutcome so = rig.step->run(0, *batcher, [&](const char* p) { phases.push_back(p); });
  EXPECT_EQ(phases,
            (std::vector<std::string>{"batch_ready", "forward_done", "backward_done",
                                      "forward_done", "backward_done", "optimizer_step_done"}));
  EXPECT_FALSE(so.stop);
  EXPECT_FALSE(so.checkpoint_due);
  EXPECT_EQ(so.slots, 4 * 12);
}

// A gradient path that records what the step asks of it and updates nothing.
class RecordingPath final : public GradientPath {
 public:
  explicit RecordingPath(model::Qwen3Model& model) : GradientPath(model) {}
  void begin_step(const optim::StepArgs& args, int64_t micro_batches) override {
    calls.push_back("begin_step " + std::to_string(micro_batches));
    lr = args.lr;
    install_hook();
  }
  void begin_micro_batch(int64_t i, bool last) override {
    calls.push_back("begin_micro_batch " + std::to_string(i) + (last ? " last" : ""));
  }
  void on_gradient(model::Parameter& p) override {
    ASSERT_TRUE(p.grad.defined()) << p.name;
    ++gradients[p.name];
  }
  void end_micro_batch() override { calls.push_back("end_micro_batch"); }
  void finish_backward() override {
    GradientPath::finish_backward();
    calls.push_back("finish_backward");
  }
  optim::StepResult finish_step(optim::StepArgs /*args*/) override {
    calls.push_back("finish_step");
    model_.zero_grad();
    optim::StepResult r;
    r.applied = true;
    r.grad_norm = 42.0;
    return r;
  }

  std::vector<std::string> calls;
  std::map<std::string, int> gradients;
  double lr = 0.0;
};

// Batches handed out from a list, counted.
class ListSource final : public BatchSource {
 public:
  explicit ListSource(std::vector<data::Batch> batches) : batches_(std::move(batches)) {}
  data::Batch next() override { return batches_.at(taken++); }
  size_t taken = 0;

 private:
  std::vector<data::Batch> batches_;
};

// TrainStep reaches the gradients and the update only through its gradient path: a path that
// updates nothing leaves the masters as they were, sees every trainable parameter's gradient once
// per micro-batch from the hook it installed, and its result is the step's.
TEST(TrainStep, UsesOnlyItsGradientPath) {
  auto model = tiny_model();
  SupervisedCrossEntropy ce;
  const Config c = cpu_config("unused", /*grad_accum=*/2);
  const RunPlan plan = resolve_plan(c, RunOptions{});
  optim::LrScheduleOptions so;
  so.kind = optim::LrScheduleKind::kConstant;
  so.peak_lr = 1e-3;
  so.total_steps = 10;
  const optim::LrSchedule schedule(so);
  RecordingPath* path = nullptr;
  TrainStep step(plan, model, schedule, ce, /*comm=*/nullptr, /*in_backward=*/false, [&](bool) {
    auto p = std::make_unique<RecordingPath>(model);
    path = p.get();
    return p;
  });
  const auto before = masters(model);
  auto batcher = random_batcher(4, 12, model.config().vocab_size, 2);
  const StepOutcome o = step.run(0, *batcher);
  ASSERT_NE(path, nullptr);
  EXPECT_EQ(path->calls,
            (std::vector<std::string>{"begin_step 2", "begin_micro_batch 0", "end_micro_batch",
                                      "begin_micro_batch 1 last", "end_micro_batch",
                                      "finish_backward", "finish_step"}));
  EXPECT_DOUBLE_EQ(path->lr, 1e-3);
  EXPECT_EQ(o.res.grad_norm, 42.0);
  EXPECT_TRUE(std::isfinite(o.loss));
  for (auto* p : model.trainable_parameters()) EXPECT_EQ(path->gradients[p->name], 2) << p->name;
  const auto after = masters(model);
  for (size_t i = 0; i < before.size(); ++i) EXPECT_TRUE(at::equal(before[i], after[i])) << i;
}

// A step draws its micro-batches from any batch source: the batcher's batches handed out from a
// list give the batcher's step, bit for bit, and exactly grad_accum of them are drawn.
TEST(TrainStep, DrawsFromAnyBatchSource) {
  auto m1 = tiny_model(), m2 = tiny_model();
  SupervisedCrossEntropy ce;
  const Config c = cpu_config("unused", /*grad_accum=*/2);
  StepRig r1(c, m1, ce), r2(c, m2, ce);
  auto [b1, b2] = same_data(8, m1.config().vocab_size);
  std::vector<data::Batch> list;
  for (int i = 0; i < 4; ++i) list.push_back(b2->next());
  ListSource source(std::move(list));
  for (int64_t s = 0; s < 2; ++s) {
    const StepOutcome a = r1.step->run(s, *b1);
    const StepOutcome b = r2.step->run(s, source);
    EXPECT_EQ(a.loss, b.loss) << "step " << s;
    EXPECT_EQ(a.res.grad_norm, b.res.grad_norm) << "step " << s;
    EXPECT_EQ(source.taken, static_cast<size_t>(2 * (s + 1)));
  }
  const auto x = masters(m1), y = masters(m2);
  for (size_t i = 0; i < x.size(); ++i) EXPECT_TRUE(at::equal(x[i], y[i])) << i;
}

}  // namespace q4::test::step_test
