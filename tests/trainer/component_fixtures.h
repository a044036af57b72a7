// Shared fixtures of the trainer component tests: a per-test temporary directory, the tiny
// Qwen3 model of tests/fixtures with random weights (fp32 on the CPU, everything trainable), a
// batcher of random-token examples, and the wiring of the one step (optimizer, schedule,
// gradient sync) the way set-up builds it, without files.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/io/remove_tree.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/run_plan.h"
#include "q4/trainer/step/step.h"

namespace q4::trainer::testing {

struct ComponentTempDir {
  std::filesystem::path path;
  ComponentTempDir() {
    path = std::filesystem::temp_directory_path() /
           ("q4_component_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    q4::io::remove_tree(path);
    std::filesystem::create_directories(path);
  }
  ~ComponentTempDir() { q4::io::remove_tree(path); }
};

// The tiny Qwen3 with random weights of standard deviation `init_std` under the options `o`.
inline model::Qwen3Model tiny_model_with(const model::ModelOptions& o, uint64_t seed,
                                         double init_std) {
  const auto cfg =
      model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.config.json");
  return model::Qwen3Model::random_init(cfg, o, seed, init_std);
}

// fp32 masters, compute and gradients, everything trainable, no checkpointing.
inline model::ModelOptions tiny_fp32_options() {
  model::ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.grad_dtype = at::kFloat;
  o.trainable = model::TrainableSpec::everything();
  o.gradient_checkpointing = false;
  return o;
}

inline model::Qwen3Model tiny_model(uint64_t seed = 7, bool offload_masters = false) {
  model::ModelOptions o = tiny_fp32_options();
  o.offload_masters = offload_masters;
  return tiny_model_with(o, seed, 0.02);
}

// A chunked-loss problem (the distillation tests'): hidden states (10, 8), an lm_head (37, 8) at
// scale 0.5, teacher logits (10, 37) at scale 2 and labels in [0, 37), each drawn from its own
// seed: seed, seed + 1, seed + 2, seed + 3.
struct LossProblem {
  static constexpr int64_t N = 10, H = 8, V = 37;
  at::Tensor h0, w0, teacher, labels;
  explicit LossProblem(uint64_t seed)
      : h0(at::randn({N, H}, at::detail::createCPUGenerator(seed), at::kFloat)),
        w0(at::randn({V, H}, at::detail::createCPUGenerator(seed + 1), at::kFloat) * 0.5),
        teacher(at::randn({N, V}, at::detail::createCPUGenerator(seed + 2), at::kFloat) * 2),
        labels(at::randint(0, V, {N}, at::detail::createCPUGenerator(seed + 3), at::kLong)) {}
};

// `count` examples of `len` random tokens below `vocab`; the second half of each is supervised.
inline std::vector<data::Example> random_examples(int64_t count, int64_t len, int64_t vocab,
                                                  uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const at::Tensor ids = at::randint(0, vocab, {count, len}, gen, at::kLong);
  std::vector<data::Example> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    auto& e = out[static_cast<size_t>(i)];
    for (int64_t t = 0; t < len; ++t) {
      const auto id = static_cast<data::TokenId>(ids[i][t].item<int64_t>());
      e.input_ids.push_back(id);
      e.labels.push_back(t >= len / 2 ? id : data::kIgnoreIndex);
    }
    e.source_line = i + 1;
  }
  return out;
}

inline std::unique_ptr<data::Batcher> random_batcher(int64_t count, int64_t len, int64_t vocab,
                                                     int64_t batch_size, uint64_t seed = 1) {
  data::BatcherOptions bo;
  bo.batch_size = batch_size;
  bo.max_seq_len = len;
  bo.shuffle = false;
  return std::make_unique<data::Batcher>(random_examples(count, len, vocab, seed), bo);
}

// The CUDA tests' model options: fp16 masters, bf16 compute, everything trainable, every layer
// recomputed.
inline model::ModelOptions cuda_recompute_options() {
  model::ModelOptions o;
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.device = at::Device(at::kCUDA, 0);
  o.trainable = model::TrainableSpec::everything();
  o.gradient_checkpointing = true;
  return o;
}

// A run's config on the CPU for the component tests.
inline Config cpu_config(const std::string& dir, int64_t grad_accum = 1) {
  Config c;
  c.model.device = "cpu";
  c.train.steps = 10;
  c.train.grad_accum = grad_accum;
  c.train.batch_size = 2;
  c.train.max_grad_norm = 0;
  c.output.dir = dir;
  return c;
}

// The optimizer, schedule, gradient sync and step of one process (or, with `comm`, of one rank)
// over `model`, as set-up wires them.
struct StepRig {
  RunPlan plan;
  optim::PackedAdamW optimizer;
  optim::LrSchedule schedule;
  GradSync sync;
  std::unordered_map<const model::Parameter*, int64_t> index;
  std::unique_ptr<TrainStep> step;

  StepRig(const Config& c, model::Qwen3Model& model, Objective& objective, bool in_backward = false,
          DistComm* comm = nullptr)
      : plan(resolve_plan(c, RunOptions{})),
        optimizer(optim::AdamWOptions{}),
        schedule([] {
          optim::LrScheduleOptions s;
          s.kind = optim::LrScheduleKind::kConstant;
          s.peak_lr = 1e-3;
          s.total_steps = 10;
          return s;
        }()),
        sync(comm, model, model.trainable_parameters()) {
    index = sync.add_owned_params(optimizer);
    step = std::make_unique<TrainStep>(plan, model, optimizer, schedule, objective, sync, comm,
                                       in_backward, index);
  }
};

// Three steps of two rigs, each on its own copy of the same data: every step applied, with
// bit-identical losses and gradient norms (`what` names the case in failures).
inline void expect_equal_steps(StepRig& r1, StepRig& r2, data::Batcher& b1, data::Batcher& b2,
                               const std::string& what) {
  for (int64_t step = 0; step < 3; ++step) {
    const StepOutcome s1 = r1.step->run(step, b1);
    const StepOutcome s2 = r2.step->run(step, b2);
    ASSERT_TRUE(s1.res.applied && s2.res.applied) << what;
    EXPECT_EQ(s1.loss, s2.loss) << what << " step " << step;
    EXPECT_EQ(s1.res.grad_norm, s2.res.grad_norm) << what << " step " << step;
  }
}

}  // namespace q4::trainer::testing
