// model.forward_weights: a trained NVFP4 linear's forward weight fake-quantized by every forward
// (sweep), dequantized from device codes (codes) or kept as it is (kept), the two latter
// refreshed right after each update. All three train bit-identically: the same losses, norms
// and masters over steps with several micro-batches, recompute, buffered and in-backward
// updates, dense and mixture-of-experts layers; a refresh that came late (or never) would leave
// a step computing with the previous step's weights.
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <string>
#include <vector>

#include "component_fixtures.h"
#include "q4/quant/nvfp4.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;
using model::ForwardWeights;

namespace {

std::vector<at::Tensor> masters(model::Qwen3Model& m) {
  std::vector<at::Tensor> out;
  for (auto* p : m.trainable_parameters()) out.push_back(p->master.clone().cpu());
  return out;
}

// The tiny dense or mixture-of-experts model with `o`, then the forward weights of `mode`.
model::Qwen3Model tiny(const model::ModelOptions& o, bool moe, ForwardWeights mode) {
  const auto cfg = model::Qwen3Config::from_json_file(
      std::string(Q4_FIXTURES_DIR) +
      (moe ? "/qwen3_moe_tiny.config.json" : "/qwen3_tiny.config.json"));
  auto m = model::Qwen3Model::random_init(cfg, o, /*seed=*/11, 0.02);
  m.set_forward_weights(mode);
  return m;
}

// Every trained NVFP4 linear of `m` holds what `mode` keeps, equal to its master's quantization.
void expect_kept_current(model::Qwen3Model& m, ForwardWeights mode, const std::string& what) {
  int64_t checked = 0;
  for (auto* p : m.trainable_parameters()) {
    if (!p->quantized) continue;
    ++checked;
    EXPECT_EQ(p->qdata.defined(), mode == ForwardWeights::kCodes) << what << " " << p->name;
    EXPECT_EQ(p->kept_weight.defined(), mode == ForwardWeights::kKept) << what << " " << p->name;
    if (p->qdata.defined()) {
      const auto q = quant::quantize_nvfp4(p->master, p->name);
      EXPECT_TRUE(at::equal(q.qdata, p->qdata) && at::equal(q.scale, p->scale))
          << what << " " << p->name;
    }
    if (p->kept_weight.defined()) {
      const at::Tensor want =
          quant::fake_quant_nvfp4_forward(p->master, p->name).to(m.options().compute_dtype);
      EXPECT_TRUE(at::equal(want, p->kept_weight)) << what << " " << p->name;
    }
  }
  EXPECT_GT(checked, 0) << what;
}

// Three steps of config `c` with the sweep and with `mode`, one rig each on the same data:
// losses, norms and masters bit for bit.
void expect_mode_matches(const Config& c, const model::ModelOptions& o, bool moe, bool in_backward,
                         ForwardWeights mode, const std::string& what) {
  auto sweep = tiny(o, moe, ForwardWeights::kSweep), kept = tiny(o, moe, mode);
  expect_kept_current(kept, mode, what + " at start");
  SupervisedCrossEntropy ce;
  StepRig r1(c, sweep, ce, in_backward), r2(c, kept, ce, in_backward);
  const int64_t V = sweep.config().vocab_size;
  auto b1 = random_batcher(12, 12, V, 2), b2 = random_batcher(12, 12, V, 2);
  ASSERT_NO_FATAL_FAILURE(expect_equal_steps(r1, r2, *b1, *b2, what));
  if (torch::cuda::is_available()) torch::cuda::synchronize();
  const auto a = masters(sweep), b = masters(kept);
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::equal(a[i], b[i])) << what << " tensor " << i;
  }
  expect_kept_current(kept, mode, what + " after 3 steps");
}

std::string describe(ForwardWeights mode, bool moe, int64_t accum, bool in_backward) {
  return std::string(io::enum_name(mode)) + (moe ? " moe" : " dense") + " accum " +
         std::to_string(accum) + (in_backward ? " in-backward" : " buffered");
}

}  // namespace

// CPU, fp32: recompute on (the layers' weights read again inside the backward), 2 micro-batches a
// step and 1, buffered and in-backward updates, dense and MoE layers; the dense model also with
// the recomputed MLP over row chunks (its weights resolved once, their gradients delivered once).
TEST(ForwardWeights, ModesTrainBitIdenticallyToTheSweep) {
  for (const bool moe : {false, true}) {
    for (const int64_t chunk : {int64_t{0}, int64_t{8}}) {
      if (moe && chunk > 0) continue;
      model::ModelOptions o = tiny_fp32_options();
      o.gradient_checkpointing = true;
      o.mlp_chunk_tokens = chunk;
      for (const ForwardWeights mode : {ForwardWeights::kCodes, ForwardWeights::kKept}) {
        for (const int64_t accum : {2, 1}) {
          for (const bool in_backward : {false, true}) {
            const std::string what =
                describe(mode, moe, accum, in_backward) + (chunk > 0 ? " mlp chunks" : "");
            expect_mode_matches(cpu_config("unused", accum), o, moe, in_backward, mode, what);
          }
        }
      }
    }
  }
}

// fp16 masters and no recompute: the kept weight is the fp32 compute weight of fp16 values.
TEST(ForwardWeights, KeptWeightOfHalfMastersTrainsAsTheSweep) {
  model::ModelOptions o = tiny_fp32_options();
  o.master_dtype = at::kHalf;
  o.grad_dtype.reset();
  expect_mode_matches(cpu_config("unused", 2), o, false, true, ForwardWeights::kKept, "fp16");
}

// A restore writes the masters from elsewhere; refresh_forward_weights() (the trainer calls it
// after every restore) makes the forward compute with them again.
TEST(ForwardWeights, RefreshFollowsMastersWrittenFromElsewhere) {
  for (const ForwardWeights mode : {ForwardWeights::kCodes, ForwardWeights::kKept}) {
    const model::ModelOptions o = tiny_fp32_options();
    auto restored = tiny(o, false, mode);
    auto source = model::Qwen3Model::random_init(restored.config(), o, /*seed=*/99, 0.02);
    const auto ps = restored.trainable_parameters(), qs = source.trainable_parameters();
    for (size_t i = 0; i < ps.size(); ++i) ps[i]->master.copy_(qs[i]->master);
    restored.refresh_forward_weights();
    expect_kept_current(restored, mode, io::enum_name(mode));
    auto batcher = random_batcher(2, 12, restored.config().vocab_size, 2);
    const data::Batch b = batcher->next();
    at::NoGradGuard no_grad;
    const at::Tensor want = source.loss(to_inputs(b, source, at::kCPU)).loss;
    const at::Tensor got = restored.loss(to_inputs(b, restored, at::kCPU)).loss;
    EXPECT_TRUE(at::equal(want, got)) << io::enum_name(mode);
  }
}

// A kept weight rewritten while a graph still saves it (what an update before the parameter's
// last use would do) fails that graph's backward instead of using the new values.
TEST(ForwardWeights, ARefreshUnderALiveGraphFailsItsBackward) {
  auto m = tiny(tiny_fp32_options(), false, ForwardWeights::kKept);
  auto batcher = random_batcher(2, 12, m.config().vocab_size, 2);
  const data::Batch b = batcher->next();
  m.begin_grad_step();
  const model::LossOutput out = m.loss(to_inputs(b, m, at::kCPU));
  m.refresh_forward_weights();
  EXPECT_THROW(out.loss_sum.backward(), c10::Error);
}

// Adapters: the adapted linears keep the file's codes whatever the mode; the linears that train
// beside them keep their forward weight.
TEST(ForwardWeights, AdaptedLinearsKeepTheirCodes) {
  model::ModelOptions o = tiny_fp32_options();
  o.lora.rank = 4;
  o.lora.alpha = 8;
  o.lora.targets = {"q_proj", "v_proj"};
  auto m = tiny(o, false, ForwardWeights::kKept);
  int64_t adapted = 0, kept = 0;
  for (const auto& p : m.parameters()) {
    if (p.lora_a != nullptr) {
      ++adapted;
      EXPECT_TRUE(p.qdata.defined() && !p.kept_weight.defined()) << p.name;
    } else if (p.trainable && p.quantized) {
      ++kept;
      EXPECT_TRUE(p.kept_weight.defined() && !p.qdata.defined()) << p.name;
    }
  }
  EXPECT_GT(adapted, 0);
  EXPECT_GT(kept, 0);
}

// The estimate counts what each mode keeps: codes 0.5625 B and kept 2 B (bf16) a trained NVFP4
// element for the run; kept weights replace the tap copies the graphs save, so without
// recompute (every layer's graph holds its weights until its backward) kept costs less at the
// peak than it keeps.
TEST(ForwardWeights, EstimateCountsTheKeptBytes) {
  const auto mc =
      model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_4b.config.json");
  model::ModelOptions o;
  o.device = at::Device(at::kCUDA, 0);
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.trainable = model::TrainableSpec::everything();
  int64_t nvfp4 = 0;
  for (const auto& p : model::qwen3_parameters(mc, true)) {
    if (p.kind == model::ParamKind::kQuantizedLinear) nvfp4 += p.numel();
  }
  model::GradientLifetime life;
  life.applied_in_backward = true;
  for (const bool recompute : {true, false}) {
    o.gradient_checkpointing = recompute;
    const auto at = [&](ForwardWeights mode) {
      model::ModelOptions m = o;
      m.forward_weights = mode;
      return model::estimate_memory(mc, m, 4, 1024, true, life);
    };
    const auto sweep = at(ForwardWeights::kSweep), codes = at(ForwardWeights::kCodes),
               kept = at(ForwardWeights::kKept);
    EXPECT_EQ(sweep.forward_weight_bytes, 0);
    EXPECT_EQ(codes.forward_weight_bytes, nvfp4 / 2 + nvfp4 / 16);
    EXPECT_EQ(kept.forward_weight_bytes, nvfp4 * 2);
    EXPECT_EQ(codes.total_bytes() - sweep.total_bytes(), codes.forward_weight_bytes);
    const int64_t extra = kept.total_bytes() - sweep.total_bytes();
    EXPECT_LT(extra, kept.forward_weight_bytes) << "recompute " << recompute;
    if (!recompute) EXPECT_LT(extra, kept.forward_weight_bytes / 4);
  }
}

// auto: kept when it fits the budget, codes when only that does, else the sweep; the CPU and
// optim.offload all decide nothing here; the saved config keeps auto.
TEST(ForwardWeights, AutoTakesTheFastestThatFits) {
  const auto mc =
      model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_4b.config.json");
  Config c = cpu_config("runs/x");
  c.train.batch_size = 4;
  c.train.seq_len = 1024;
  c.train.gradient_checkpointing = Recompute::kTrue;
  c.train.trainable.lm_head = true;
  std::string line;
  const RunPlan cpu = resolve_plan(c, RunOptions{}).with_forward_weights(mc, true, 0, &line);
  EXPECT_EQ(line, "");
  EXPECT_EQ(model_options(cpu.config()).forward_weights, ForwardWeights::kSweep);
  c.model.device = "cuda";  // resolution is a CUDA matter; nothing runs here
  const RunPlan configured = resolve_plan(c, RunOptions{});
  const auto bytes = [&](ForwardWeightsOrAuto mode) {
    Config t = c;
    t.model.forward_weights = mode;
    return estimate_budget(mc, t, true).total_bytes();
  };
  const auto budget_for = [](int64_t estimate) {
    return static_cast<int64_t>(static_cast<double>(estimate) * kAllocatorMargin) +
           kCudaContextReserveBytes + (int64_t{1} << 20);
  };
  const struct {
    int64_t free_bytes;
    ForwardWeights want;
  } cases[] = {{budget_for(bytes(ForwardWeightsOrAuto::kKept)), ForwardWeights::kKept},
               {budget_for(bytes(ForwardWeightsOrAuto::kCodes)), ForwardWeights::kCodes},
               {budget_for(bytes(ForwardWeightsOrAuto::kSweep)), ForwardWeights::kSweep},
               {int64_t{1} << 30, ForwardWeights::kSweep}};
  for (const auto& k : cases) {
    const RunPlan p = configured.with_forward_weights(mc, true, k.free_bytes, &line);
    EXPECT_EQ(model_options(p.config()).forward_weights, k.want) << line;
    EXPECT_NE(line.find(std::string("auto: ") + io::enum_name(k.want)), std::string::npos) << line;
    EXPECT_EQ(p.config_to_save().model.forward_weights, ForwardWeightsOrAuto::kAuto);
  }
  c.optim.offload = Offload::kAll;
  const RunPlan offload =
      resolve_plan(c, RunOptions{}).with_forward_weights(mc, true, int64_t{1} << 40, &line);
  EXPECT_EQ(line, "");
  EXPECT_EQ(model_options(offload.config()).forward_weights, ForwardWeights::kCodes);
}

// On the GPU: fp16 masters, bf16 compute, every layer recomputed, 1 and 2 micro-batches,
// buffered (the refresh on the update's side stream) and in-backward updates: bit for bit.
TEST(ForwardWeightsCuda, ModesTrainBitIdenticallyToTheSweep) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  model::ModelOptions o = cuda_recompute_options();
  Config c0 = cpu_config("unused");
  c0.model.device = "cuda";
  for (const bool moe : {false, true}) {
    for (const ForwardWeights mode : {ForwardWeights::kCodes, ForwardWeights::kKept}) {
      for (const int64_t accum : {1, 2}) {
        for (const bool in_backward : {false, true}) {
          Config c = c0;
          c.train.grad_accum = accum;
          expect_mode_matches(c, o, moe, in_backward, mode,
                              describe(mode, moe, accum, in_backward));
        }
      }
    }
  }
}
