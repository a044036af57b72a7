// The Qwen3 model's analytic memory estimate (estimate_memory): offloaded masters, cached
// adapted weights, chunked MLP recompute and kept blocks at Qwen3-4B shapes on CUDA (no device
// is needed to estimate), and the estimate of a randomly initialised model.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <map>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

// optim.offload: all on CUDA: a trained NVFP4 linear costs its codes on the device (9/16 byte an
// element) and its master on the host; with accumulation its gradient is not carried on the
// device (pinned host buffer), so the buffered update holds only the other gradients.
TEST(Qwen3Model, MemoryEstimateWithOffloadedMasters) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = fp32_all();
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.grad_dtype = std::nullopt;
  o.device = at::Device(at::kCUDA, 0);
  int64_t linear = 0, other = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, true)) {
    (p.kind == ParamKind::kQuantizedLinear ? linear : other) += p.numel();
  }
  GradientLifetime accum;
  accum.accumulation_steps = 4;
  const MemoryEstimate resident = estimate_memory(cfg, o, 2, 64, true, accum);
  o.offload_masters = true;
  const MemoryEstimate off = estimate_memory(cfg, o, 2, 64, true, accum);
  EXPECT_EQ(resident.master_bytes, 2 * (linear + other));
  EXPECT_EQ(off.master_bytes, linear / 2 + linear / 16 + 2 * other);
  EXPECT_EQ(off.host_bytes - resident.host_bytes, 2 * linear + 2 * linear);  // master + bf16 grads
  ASSERT_NE(off.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  EXPECT_EQ(resident.phase(MemoryPhaseKind::kOptimizerStep)->grad_bytes, 2 * (linear + other));
  EXPECT_EQ(off.phase(MemoryPhaseKind::kOptimizerStep)->grad_bytes, 2 * other);
  EXPECT_LT(off.total_bytes(), resident.total_bytes());
  // The device staging the step adds those gradients up through is held for the whole run.
  GradientLifetime staged = accum;
  staged.host_staging_bytes = int64_t{1} << 20;
  const MemoryEstimate off_staged = estimate_memory(cfg, o, 2, 64, true, staged);
  for (const MemoryPhaseKind k : {MemoryPhaseKind::kForward, MemoryPhaseKind::kLayerBackward,
                                  MemoryPhaseKind::kOptimizerStep}) {
    EXPECT_EQ(off_staged.phase(k)->grad_bytes - off.phase(k)->grad_bytes, staged.host_staging_bytes)
        << memory_phase_name(k);
  }
  // Updated inside the last micro-batch's backward, the sums are carried as for the buffered
  // update until then; no optimizer step phase follows.
  GradientLifetime in_backward = accum;
  in_backward.applied_in_backward = true;
  const MemoryEstimate off_ib = estimate_memory(cfg, o, 2, 64, true, in_backward);
  EXPECT_EQ(off_ib.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  for (const MemoryPhaseKind k : {MemoryPhaseKind::kForward, MemoryPhaseKind::kLayerBackward}) {
    EXPECT_EQ(off_ib.phase(k)->grad_bytes, off.phase(k)->grad_bytes) << memory_phase_name(k);
  }
  ModelOptions on_device = o;  // resident masters: their gradients never leave the device
  on_device.offload_masters = false;
  EXPECT_EQ(estimate_memory(cfg, on_device, 2, 64, true, staged).total_bytes(),
            resident.total_bytes());
  // On the CPU nothing moves: the masters stay, and the linears' codes (which the forward
  // computes from, as on a GPU) come on top.
  o.device = at::kCPU;
  o.compute_dtype = at::kFloat;
  ModelOptions cpu_resident = o;
  cpu_resident.offload_masters = false;
  const MemoryEstimate cpu_off = estimate_memory(cfg, o, 2, 64, true, accum);
  EXPECT_GT(cpu_off.forward_weight_bytes, 0);
  EXPECT_EQ(cpu_off.total_bytes() - cpu_off.forward_weight_bytes,
            estimate_memory(cfg, cpu_resident, 2, 64, true, accum).total_bytes());
}

// The analytic estimate's options for a CUDA run in bf16 with fp16 masters, everything trained
// (no device is needed to estimate).
ModelOptions cuda_bf16_everything() {
  ModelOptions o;
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.device = at::Device(at::kCUDA, 0);
  o.trainable = TrainableSpec::everything();
  return o;
}

// Plain adapters with their frozen weights kept dequantized (cache_adapted_weights): 2 bytes a
// frozen adapted element for the whole run. Without recompute every layer's graph holds those
// weights at the peak anyway (the same tensors then), so the peak does not move; with recompute
// it grows by what was kept.
TEST(Qwen3Model, MemoryEstimateOfCachedAdaptedWeights) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = cuda_bf16_everything();
  o.trainable = TrainableSpec::nothing();
  o.lora.rank = 4;
  o.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  o.lora.merge_aware = false;
  int64_t adapted = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, true)) {
    if (o.lora.adapts(p, o.trainable, cfg.num_hidden_layers)) adapted += p.numel();
  }
  ASSERT_GT(adapted, 0);
  for (const bool recompute : {false, true}) {
    o.gradient_checkpointing = recompute;
    o.cache_adapted_weights = false;
    const MemoryEstimate plain = estimate_memory(cfg, o, 2, 64, true);
    o.cache_adapted_weights = true;
    const MemoryEstimate kept = estimate_memory(cfg, o, 2, 64, true);
    EXPECT_EQ(kept.frozen_bytes - plain.frozen_bytes, 2 * adapted);
    if (recompute) {
      EXPECT_GT(kept.total_bytes(), plain.total_bytes());
    } else {
      EXPECT_EQ(kept.total_bytes(), plain.total_bytes());
    }
    o.lora.merge_aware = true;  // merge-aware adapters keep nothing
    const MemoryEstimate merged = estimate_memory(cfg, o, 2, 64, true);
    o.cache_adapted_weights = false;
    EXPECT_EQ(estimate_memory(cfg, o, 2, 64, true).total_bytes(), merged.total_bytes());
    o.lora.merge_aware = false;
  }
}

// ModelOptions::mlp_chunk_tokens in the estimate, at Qwen3-4B shapes on CUDA (bf16 varlen
// path) with one sequence of 131,072 tokens, every layer recomputed with its input on the host
// and in-backward updates: the layer backward is the peak phase. Unchunked its largest step is
// the MLP block's, which holds the recomputed MLP graph (2H + 3I values and an fp32 norm scale
// per token) and three (tokens, I) SwiGLU gradients beside two boundary gradients. Chunked, the
// attention block's backward is the larger step: hs's gradient, hs and the incoming gradient
// (3 boundaries) with FlashAttention-2's working tensors (4 q_dim + 2 kv_dim values with GQA,
// an fp32 q_dim accumulator and NH fp32 softmax sums per token). Per token the layer backward
// loses (2H + 3I)·2 + 4 + 3I·2 - H·2 - attention work bytes, exactly; the gradients gain the
// MLP taps' seeds (every MLP weight, bf16) in place of the held down-projection seed. The
// checkpointed forward's transient drops from the MLP's (2H + 3I) values per token to the
// attention block's (H + 2 q_dim + 2 kv_dim). A layer of no more tokens than a chunk is not
// chunked.
TEST(Qwen3Model, MemoryEstimateOfChunkedMlpRecompute) {
  const auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  ModelOptions o = cuda_bf16_everything();
  o.offload_layer_inputs = true;
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const int64_t T = 131072, H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), NH = cfg.num_attention_heads;
  auto estimate = [&](int64_t chunk, int64_t tokens) {
    ModelOptions c = o;
    c.mlp_chunk_tokens = chunk;
    return estimate_memory(cfg, c, 1, tokens, true, ib);
  };
  const MemoryEstimate whole = estimate(0, T), chunked = estimate(8192, T);
  const MemoryPhase* lb_whole = whole.phase(MemoryPhaseKind::kLayerBackward);
  const MemoryPhase* lb_chunked = chunked.phase(MemoryPhaseKind::kLayerBackward);
  ASSERT_NE(lb_whole, nullptr);
  ASSERT_NE(lb_chunked, nullptr);
  EXPECT_EQ(whole.phases[whole.peak_phase].kind, MemoryPhaseKind::kLayerBackward);
  EXPECT_EQ(chunked.phases[chunked.peak_phase].kind, MemoryPhaseKind::kLayerBackward);
  const int64_t attention_work = 2 * (4 * QD + 2 * KVD) + 4 * QD + 4 * NH;
  const int64_t saved_per_token = (2 * H + 3 * I) * 2 + 4 + 3 * I * 2 - H * 2 - attention_work;
  EXPECT_EQ(lb_whole->activation_bytes - lb_chunked->activation_bytes, T * saved_per_token);
  EXPECT_GT(saved_per_token * T, int64_t{8} << 30);  // 8.4 GiB of a 21.9 GiB phase
  const int64_t mlp_taps = 3 * H * I + H, down = H * I;
  EXPECT_EQ(lb_chunked->grad_bytes - lb_whole->grad_bytes, 2 * (mlp_taps - down));
  EXPECT_LT(chunked.total_bytes(), whole.total_bytes() - (int64_t{8} << 30));
  // While the attention step is the larger one, the chunk size does not change the peak; a chunk
  // of half the sequence makes the MLP step the larger one again.
  EXPECT_EQ(estimate(4096, T).total_bytes(), chunked.total_bytes());
  EXPECT_GT(estimate(65536, T).total_bytes(), chunked.total_bytes());
  // The checkpointed forward's transient.
  EXPECT_EQ(whole.phase(MemoryPhaseKind::kForward)->activation_bytes -
                chunked.phase(MemoryPhaseKind::kForward)->activation_bytes,
            T * 2 * ((2 * H + 3 * I) - (H + 2 * QD + 2 * KVD)));
  EXPECT_EQ(estimate(8192, 8192).total_bytes(), estimate(0, 8192).total_bytes());
  EXPECT_LT(estimate(8192, 16384).total_bytes(), estimate(0, 16384).total_bytes());
}

// Kept blocks in the estimate (Qwen3-4B shapes, CUDA bf16, 4 x 1024 tokens, everything
// trainable): a recomputed layer keeping its attention block holds that block's graph and
// weights and hs besides its input; keeping its MLP block, that block's graph (hs included) and
// weights. Those are layer_keep_costs' bytes, exactly what the saved activations behind the loss
// grow by; with offloaded inputs, a layer keeping its attention block keeps its input on the
// device as well. The multiply-adds: q/k/v/o projections plus causal attention over 1024-token
// rows, and the MLP's gate and up.
TEST(Qwen3Model, MemoryEstimateOfKeptBlocks) {
  const auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  ModelOptions o = cuda_bf16_everything();
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const int64_t L = cfg.num_hidden_layers, H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), B = 4, T = 1024;
  const LayerKeepCosts costs = layer_keep_costs(cfg, o, B, T, true, L - 1);
  const int64_t attn_per_token =
      2 * (H + 3 * QD + 3 * KVD) + 4 * (1 + 2 * cfg.num_attention_heads + cfg.num_key_value_heads);
  const int64_t attn_weights = H * QD + 2 * H * KVD + QD * H;
  EXPECT_EQ(costs.attention.kept_bytes, B * T * (attn_per_token + 2 * H) + 2 * attn_weights);
  EXPECT_EQ(costs.mlp.kept_bytes, B * T * (2 * (2 * H + 3 * I) + 4) + 2 * 3 * H * I);
  EXPECT_DOUBLE_EQ(costs.attention.saved_macs,
                   static_cast<double>(B * T) * (attn_weights + QD * (T + 1)));
  EXPECT_DOUBLE_EQ(costs.mlp.saved_macs, static_cast<double>(B * T) * 2 * H * I);
  auto behind_loss = [&](int64_t keep_attention, int64_t keep_mlp, bool offload) {
    ModelOptions k = o;
    k.recompute_keep_attention = keep_attention;
    k.recompute_keep_mlp = keep_mlp;
    k.offload_layer_inputs = offload;
    return estimate_memory(cfg, k, B, T, true, ib);
  };
  auto acts = [](const MemoryEstimate& e) {
    return e.phase(MemoryPhaseKind::kLossBackward)->activation_bytes;
  };
  const MemoryEstimate all = behind_loss(0, 0, false);
  EXPECT_EQ(acts(behind_loss(1, 0, false)) - acts(all), costs.attention.kept_bytes);
  EXPECT_EQ(acts(behind_loss(0, 1, false)) - acts(all), costs.mlp.kept_bytes);
  EXPECT_EQ(acts(behind_loss(3, 5, false)) - acts(all),
            3 * costs.attention.kept_bytes + 5 * costs.mlp.kept_bytes);
  // Offloaded inputs: the layer keeping its attention block keeps its input on the device.
  ModelOptions off = o;
  off.offload_layer_inputs = true;
  const LayerKeepCosts off_costs = layer_keep_costs(cfg, off, B, T, true, L - 1);
  EXPECT_EQ(off_costs.attention.kept_bytes, costs.attention.kept_bytes + B * T * H * 2);
  const MemoryEstimate all_off = behind_loss(0, 0, true), keep_off = behind_loss(1, 1, true);
  EXPECT_EQ(acts(keep_off) - acts(all_off),
            off_costs.attention.kept_bytes + off_costs.mlp.kept_bytes);
  EXPECT_EQ(all_off.host_bytes - keep_off.host_bytes, B * T * H * 2);
  // Every block kept raises the estimate, up to keeping every layer whole.
  int64_t prev = all.total_bytes();
  for (int64_t k = 1; k <= L; ++k) {
    const int64_t t = behind_loss(k, 0, false).total_bytes();
    EXPECT_GT(t, prev) << k;
    prev = t;
  }
  ModelOptions none = o;
  none.gradient_checkpointing = false;
  EXPECT_LT(prev, estimate_memory(cfg, none, B, T, true, ib).total_bytes());
  EXPECT_THROW(behind_loss(L, 1, false), c10::Error);  // more kept blocks than layers
}

// Qwen3-30B-A3B shapes (docs/model.md#mixture-of-experts): the stacked experts are 3·E·I·H
// elements per layer, counted as masters when they train and as compute-dtype frozen weights when
// they do not; every token's k routes hold 3·(H + I) compute-dtype values each in the layer's
// graph, so the activations grow with k; the active parameters are k of E experts.
TEST(Qwen3Model, MemoryEstimateOfMixtureOfExperts) {
  auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_30b_a3b.config.json");
  const int64_t L = 48, H = 2048, I = 768, E = 128, V = 151936;
  const int64_t experts = L * 3 * E * I * H;
  const int64_t attention = L * H * (2 * 4096 + 2 * 512);
  const int64_t routers = L * E * H;
  const int64_t norms = L * (2 * H + 2 * 128) + H;
  EXPECT_EQ(cfg.num_parameters(true), experts + attention + routers + norms + 2 * V * H);
  EXPECT_EQ(cfg.num_active_parameters(true),
            experts / E * 8 + attention + routers + norms + 2 * V * H);
  EXPECT_NEAR(static_cast<double>(cfg.num_parameters(true)), 30.5e9, 0.05e9);
  EXPECT_NEAR(static_cast<double>(cfg.num_active_parameters(true)), 3.3e9, 0.06e9);
  EXPECT_EQ(cfg.layer_active_linear_parameters(0),
            H * (2 * 4096 + 2 * 512) + E * H + 8 * 3 * I * H);

  ModelOptions o = cuda_bf16_everything();
  o.gradient_checkpointing = false;
  const MemoryEstimate all = estimate_memory(cfg, o, 1, 256, true);
  EXPECT_EQ(all.master_bytes, 2 * cfg.num_parameters(true));  // fp16 masters, experts included
  o.trainable.projections = false;                            // experts and attention frozen
  const MemoryEstimate frozen = estimate_memory(cfg, o, 1, 256, true);
  EXPECT_EQ(all.master_bytes - frozen.master_bytes, 2 * (experts + attention));
  EXPECT_EQ(frozen.frozen_bytes - all.frozen_bytes, 2 * (experts + attention));  // bf16

  // The routes: k = 8 against k = 4, every layer's graph kept for 256 tokens.
  o.trainable.projections = true;
  Qwen3Config k4 = cfg;
  k4.moe.num_experts_per_tok = 4;
  const MemoryEstimate four = estimate_memory(k4, o, 1, 256, true);
  const int64_t per_route = 2 * 3 * (H + I) + 16;  // bf16 x/gate/up/product/out/weighted + ids
  EXPECT_EQ(all.phase(MemoryPhaseKind::kForward)->activation_bytes -
                four.phase(MemoryPhaseKind::kForward)->activation_bytes,
            L * 256 * 4 * per_route);
  // A layer's backward holds its experts' fake-quantized stacks (bf16) while it runs.
  EXPECT_GE(all.phase(MemoryPhaseKind::kLayerBackward)->activation_bytes, 2 * experts / L);
}

TEST(Qwen3Model, RandomInitAndMemoryEstimate) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  cfg.tie_word_embeddings = true;
  ModelOptions o = fp32_all();
  o.master_dtype = at::kHalf;
  o.grad_dtype = std::nullopt;  // default: bf16 for fp16 masters
  Qwen3Model m = Qwen3Model::random_init(cfg, o, 7, 0.02);
  EXPECT_TRUE(m.tied());
  ModelInputs in;
  in.input_ids = at::randint(0, cfg.vocab_size, {2, 8}, at::kLong);
  in.labels = in.input_ids.clone();
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  // Random logits over V classes: loss near log(V).
  EXPECT_NEAR(lo.loss.item<double>(), std::log(static_cast<double>(cfg.vocab_size)), 0.5);
  EXPECT_EQ(lo.num_tokens.item<int64_t>(), 14);
  for (Parameter* p : m.trainable_parameters()) EXPECT_TRUE(p->grad.defined()) << p->name;
  EXPECT_EQ(m.num_trainable_elements(), cfg.num_parameters(false));

  MemoryEstimate est = estimate_memory(cfg, o, 2, 8, false);
  EXPECT_EQ(est.master_bytes, cfg.num_parameters(false) * 2);
  EXPECT_EQ(est.grad_buffer_bytes, cfg.num_parameters(false) * 2);  // bf16 grads by default
  EXPECT_EQ(est.frozen_bytes, 0);
  // Buffered updates (the default lifetime): the whole buffer in the optimizer step; the total
  // is the persistent terms plus the largest phase.
  const MemoryPhase* step = est.phase(MemoryPhaseKind::kOptimizerStep);
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->grad_bytes, est.grad_buffer_bytes);
  int64_t largest = 0;
  for (const auto& p : est.phases) largest = std::max(largest, p.total_bytes());
  EXPECT_EQ(est.phases[est.peak_phase].total_bytes(), largest);
  EXPECT_EQ(est.total_bytes(), est.master_bytes + est.frozen_bytes + largest);
  // In-backward updates: no optimizer phase and never more than the buffered path.
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const MemoryEstimate est_ib = estimate_memory(cfg, o, 2, 8, false, ib);
  EXPECT_EQ(est_ib.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  EXPECT_LE(est_ib.total_bytes(), est.total_bytes());
  ModelOptions nock = o;
  nock.gradient_checkpointing = false;
  Qwen3Config deep = cfg;
  deep.num_hidden_layers = 36;
  // The loss backward's activations: checkpointed, they grow by one layer input per layer;
  // without checkpointing, by a whole layer's graph.
  auto loss_acts = [](const Qwen3Config& c, const ModelOptions& mo) {
    return estimate_memory(c, mo, 4, 1024, false)
        .phase(MemoryPhaseKind::kLossBackward)
        ->activation_bytes;
  };
  const auto a2 = loss_acts(cfg, o);
  const auto a36 = loss_acts(deep, o);
  EXPECT_EQ(a36 - a2, 34 * 4 * 1024 * cfg.hidden_size * 4);
  EXPECT_GT(loss_acts(deep, nock), 4 * a36);
  // Recomputing the first N layers: each layer that keeps its activations adds the difference
  // between its graph and its checkpointed input, so the estimate falls step by step from no
  // recompute (N = 0) to every layer (N = 36).
  int64_t prev = estimate_memory(deep, nock, 4, 1024, false).total_bytes();
  const int64_t per_layer = (loss_acts(deep, nock) - a36) / 36;
  for (int64_t n : {1, 10, 35}) {
    ModelOptions part = o;
    part.recompute_layers = n;
    const int64_t t = estimate_memory(deep, part, 4, 1024, false).total_bytes();
    EXPECT_LT(t, prev) << n;
    prev = t;
    // The saved activations behind the loss: exactly 36 - n layer graphs more than all-recomputed.
    EXPECT_EQ(loss_acts(deep, part) - a36, (36 - n) * per_layer) << n;
  }
  EXPECT_LT(estimate_memory(deep, o, 4, 1024, false).total_bytes(), prev);
}

}  // namespace
}  // namespace q4::model
