// CUDA only: the Qwen3 training configuration (fp16 masters, bf16 compute and grads) against the
// HF fixture, offloaded layer inputs, and the checkpointing memory claim (peak grows with one
// layer input per layer). Every test skips without a GPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <map>
#include <string>

#include "../qwen3_check.h"
#include "../tiny_fixture.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

#if Q4_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace q4::model {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// fp32_all (everything trainable, checkpointing) on the GPU in the given dtypes.
ModelOptions cuda_options(at::ScalarType master, at::ScalarType compute, at::ScalarType grad) {
  ModelOptions o = fp32_all();
  o.device = at::Device(at::kCUDA, 0);
  o.master_dtype = master;
  o.compute_dtype = compute;
  o.grad_dtype = grad;
  return o;
}

struct RunResult {
  at::Tensor logits, loss;
  std::map<std::string, at::Tensor> grads;
};

RunResult run_fixture(Qwen3Model& m, const DatReader& e) {
  ModelInputs in;
  in.input_ids = e.load("input_ids");
  in.labels = e.load("labels");
  RunResult r;
  {
    at::NoGradGuard ng;
    r.logits = m.forward(in).to(at::kFloat).cpu();
  }
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  r.loss = lo.loss.detach().cpu().reshape({1});
  for (const auto& p : m.parameters()) r.grads[p.name] = p.grad.to(at::kFloat).cpu();
  return r;
}

TEST(Qwen3ModelCuda, FixtureBf16Compute) {
  SKIP_WITHOUT_CUDA();
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  Qwen3Model m = Qwen3Model::load(cfg, w, cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16));
  RunResult r = run_fixture(m, e);
  // bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%) at every op boundary; two
  // layers of ~10 rounded ops plus the bf16 logits matmul give a few tenths of a percent per
  // activation, growing in the backward. Bounds: loss within 1% relative; logits within 2% of
  // their norm (relative L2); every gradient tensor within 5% relative L2 (norm gradients,
  // sums over all tokens, are the most sensitive).
  EXPECT_LT(rel_err(r.loss, e.load("loss")), 1e-2);
  EXPECT_LT(rel_err(r.logits, e.load("logits")), 2e-2);
  for (const auto& kv : r.grads) {
    EXPECT_LT(rel_err(kv.second, e.load("grad." + kv.first)), 5e-2) << kv.first;
  }
}

#if Q4_WITH_CUDA
int64_t peak_step_bytes(int64_t layers, bool ckpt, int64_t recompute_layers = -1,
                        bool offload = false) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  cfg.hidden_size = 256;
  cfg.intermediate_size = 768;
  cfg.num_hidden_layers = layers;
  cfg.num_attention_heads = 8;
  cfg.num_key_value_heads = 4;
  cfg.head_dim = 32;
  cfg.max_position_embeddings = 1024;
  ModelOptions o = cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16);
  o.gradient_checkpointing = ckpt;
  o.recompute_layers = recompute_layers;
  o.offload_layer_inputs = offload;
  o.trainable = TrainableSpec::nothing();  // no grads: measure activations only
  o.trainable.embeddings = true;           // ... but still a backward through every layer
  Qwen3Model m = Qwen3Model::random_init(cfg, o, 1, 0.02);
  ModelInputs in;
  in.input_ids = at::randint(0, cfg.vocab_size, {4, 512}, at::kLong);
  in.labels = in.input_ids.clone();
  torch::cuda::synchronize();
  const auto base = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  torch::cuda::synchronize();
  const auto peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
  return peak - base;
}
#endif

// Recomputed layers with their inputs in pinned host memory: bit-identical loss and gradients,
// and the peak no longer grows with the layer count by a layer input each.
TEST(Qwen3ModelCuda, OffloadedLayerInputsGiveIdenticalGradients) {
  SKIP_WITHOUT_CUDA();
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16);
  o.trainable = TrainableSpec::everything();
  Qwen3Model a = Qwen3Model::load(cfg, w, o);
  o.offload_layer_inputs = true;
  Qwen3Model b = Qwen3Model::load(cfg, w, o);
  at::Tensor la, lb;
  auto ga = run_backward(a, fixture_inputs(e), &la);
  auto gb = run_backward(b, fixture_inputs(e), &lb);
  EXPECT_TRUE(at::equal(la.cpu(), lb.cpu()));
  for (const auto& kv : ga) EXPECT_TRUE(at::equal(kv.second.cpu(), gb[kv.first].cpu())) << kv.first;
#if Q4_WITH_CUDA
  const int64_t boundary = 4 * 512 * 256 * 2;
  const int64_t on8 = peak_step_bytes(8, true, -1, true), on2 = peak_step_bytes(2, true, -1, true);
  RecordProperty("peak_offload_L2_L8", std::to_string(on2) + " " + std::to_string(on8));
  EXPECT_LT(on8 - on2, 2 * boundary);
#endif
}

TEST(Qwen3ModelCuda, CheckpointingPeakGrowsByOneLayerInput) {
  SKIP_WITHOUT_CUDA();
#if Q4_WITH_CUDA
  const int64_t boundary = 4 * 512 * 256 * 2;  // one bf16 layer input (B, T, H)
  const int64_t ck2 = peak_step_bytes(2, true), ck8 = peak_step_bytes(8, true);
  const int64_t no2 = peak_step_bytes(2, false), no8 = peak_step_bytes(8, false);
  RecordProperty("peak_ckpt_L2_L8", std::to_string(ck2) + " " + std::to_string(ck8));
  RecordProperty("peak_nockpt_L2_L8", std::to_string(no2) + " " + std::to_string(no8));
  // 6 more layers with checkpointing: 6 saved layer inputs (+ allocator rounding slack of one
  // more); without it each layer keeps ~20 activation tensors.
  EXPECT_LE(ck8 - ck2, 7 * boundary);
  EXPECT_GT(no8 - no2, 5 * (ck8 - ck2));
  // Recomputing the first 4 of 8: between the two, about half-way.
  const int64_t half8 = peak_step_bytes(8, true, 4);
  RecordProperty("peak_recompute4_L8", std::to_string(half8));
  EXPECT_GT(half8, ck8 + (no8 - ck8) / 4);
  EXPECT_LT(half8, no8 - (no8 - ck8) / 4);
#else
  GTEST_SKIP() << "built without Q4_WITH_CUDA (no allocator statistics)";
#endif
}

}  // namespace
}  // namespace q4::model
