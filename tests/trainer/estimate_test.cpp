// Option mapping, parameter accounting and the VRAM probe on the tiny fixture model (CPU): the
// trainer's view of parameter names/shapes/trainability must equal the model library's, the
// budget's masters and moments follow from it, and the probe report has every phase with null
// device fields on CPU. Also model::write_dat(): the random-init file loads back to exactly the
// NVFP4 fake-quantized weights.
#include "q4/trainer/plan/estimate.h"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/quant/nvfp4.h"
#include "q4/trainer/app/probe.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/memory.h"

namespace fs = std::filesystem;
using namespace q4::trainer;

namespace {

const std::string kFixtures = Q4_FIXTURES_DIR;

Config tiny_config(const std::string& extra = "", const std::vector<std::string>& sets = {}) {
  const std::string yaml = "model:\n  config: " + kFixtures + "/qwen3_tiny.config.json\n" +
                           "  weights: " + kFixtures + "/qwen3_tiny.weights.dat\n" +
                           "  tokenizer: " + std::string(Q4_SOURCE_DIR) +
                           "/assets/qwen3/tokenizer.json\n" + extra;
  std::vector<Override> ov;
  for (const auto& s : sets) ov.push_back(parse_override(s));
  return parse_config(yaml, "tiny.yaml", "/", ov);
}

q4::model::Qwen3Config tiny_model_config() {
  return q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_tiny.config.json");
}

}  // namespace

TEST(Estimate, OptionMapping) {
  const Config c = tiny_config(
      "train: {gradient_checkpointing: true, trainable: {layers: last:1, lm_head: true}}\n"
      "optim: {state: 4bit, chunk_rows: 64, master_rounding: nearest, lr: 0.01}\n",
      {"model.master_dtype=bf16", "model.grad_dtype=fp32"});
  const auto o = model_options(c);
  EXPECT_EQ(o.master_dtype, at::kBFloat16);
  EXPECT_EQ(o.compute_dtype, at::kFloat);
  EXPECT_EQ(o.grad_dtype, at::kFloat);
  EXPECT_TRUE(o.gradient_checkpointing);
  EXPECT_EQ(o.trainable.last_n_layers, 1);
  EXPECT_TRUE(o.trainable.lm_head);
  const auto a = adamw_options(c);
  EXPECT_EQ(a.state_mode, q4::optim::StateMode::k4Bit);
  EXPECT_EQ(a.chunk_rows, 64);
  EXPECT_EQ(a.rounding, q4::optim::MasterRounding::kNearest);
  EXPECT_DOUBLE_EQ(a.lr, 0.01);
}

TEST(Estimate, ParameterShapesMatchTheModel) {
  const auto mc = tiny_model_config();
  for (const char* trainable :
       {"{layers: all}", "{layers: last:1, norms: false}", "{layers: none, lm_head: true}",
        "{layers: [0], projections: false, norms: true}", "{layers: all, embeddings: true}"}) {
    const Config c = tiny_config(std::string("train:\n  trainable: ") + trainable + "\n");
    q4::model::DatReader reader(c.model.weights);
    auto model = q4::model::Qwen3Model::load(mc, reader, model_options(c));
    const auto shapes = parameter_shapes(mc, c, !model.tied());
    const auto& params = model.parameters();
    ASSERT_EQ(shapes.size(), params.size()) << trainable;
    for (size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(shapes[i].name, params[i].name) << trainable;
      EXPECT_EQ(at::IntArrayRef(shapes[i].shape), params[i].master.sizes()) << params[i].name;
      EXPECT_EQ(shapes[i].trainable, params[i].trainable) << params[i].name << " " << trainable;
    }
    const auto b = estimate_budget(mc, c, !model.tied());
    EXPECT_EQ(b.trainable_elements, model.num_trainable_elements()) << trainable;
    EXPECT_EQ(b.masters_bytes, 2 * model.num_trainable_elements()) << trainable;  // fp16
  }
}

TEST(Estimate, MomentBytesByMode) {
  const auto mc = tiny_model_config();
  const Config fp32 = tiny_config("optim: {state: fp32}\n");
  const Config int8 = tiny_config("optim: {state: int8}\n");
  const auto b32 = estimate_budget(mc, fp32, true);
  const auto b8 = estimate_budget(mc, int8, true);
  EXPECT_EQ(b32.moments_bytes, 8 * b32.trainable_elements);
  // int8: 2 bytes per element plus one fp32 scale per 256 (small tensors stay fp32).
  EXPECT_LT(b8.moments_bytes, b32.moments_bytes / 3);
  EXPECT_GT(b8.moments_bytes, 2 * b8.trainable_elements - 8 * 4096);
  EXPECT_GT(b32.total_bytes(), b32.masters_bytes + b32.moments_bytes);
}

// The benchmark run's measured whole-run peak (peak allocated of q4train over load, 6 steps,
// export and export check): NVIDIA H200, scripts/bench/release_round.sh
// (docs/performance.md#memory, the H200 benchmark page):
// int8 19.10 GiB, 4bit 15.14 GiB. The chunked cross-entropy forms its gradients in its forward
// (on CUDA in one kernel, over the bf16 logits: no fp32 block), so the peak phase is the loss
// forward. The estimate must be within 5%.
TEST(Estimate, Bench4bWithinFivePercentOfTheMeasuredPeak) {
  const std::string path = std::string(Q4_SOURCE_DIR) + "/scripts/bench/bench-4b.yaml";
  for (const auto& [state, measured_gib] :
       std::vector<std::pair<std::string, double>>{{"int8", 19.10}, {"4bit", 15.14}}) {
    const Config c = load_config(path, {parse_override("optim.state=" + state)});
    ASSERT_TRUE(in_backward_updates(c));  // CUDA, grad_accum 1
    const auto mc = q4::model::Qwen3Config::from_json_file(c.model.config);
    const auto b = estimate_budget(mc, c, /*separate_lm_head=*/true);  // the shipped file's
    EXPECT_EQ(b.trainable_elements, 4411424256);
    EXPECT_EQ(b.peak_phase_name(), "loss forward") << b.to_table();
    const double est = to_gib(b.total_bytes());
    EXPECT_NEAR(est / measured_gib, 1.0, 0.05) << state << ": estimated " << est << " GiB\n"
                                               << b.to_table();
    // Phase-aware: the total is the whole-run terms plus the largest phase, below the plain sum
    // of every phase's terms.
    ASSERT_EQ(b.phases.size(), 5u) << b.to_table();  // no optimizer phase (in-backward)
    int64_t largest = 0;
    for (const auto& p : b.phases) largest = std::max(largest, p.total_bytes());
    EXPECT_EQ(b.total_bytes(), b.persistent_bytes() + largest);
    const auto j = b.to_json();
    EXPECT_EQ(j["total_bytes"].get<int64_t>(), b.total_bytes());
    EXPECT_EQ(j["peak_phase"], "loss forward");
    EXPECT_EQ(j["phases"].size(), b.phases.size());
  }
}

// The distillation run of the speed benchmark (scripts/bench/distill_step.sh: the 4B .dat as
// its own teacher) peaked at 28.4 GiB on an H100, against 19.1 without distillation. The
// estimate adds the teacher's bf16 weights for the whole run and its transients to the loss
// forward, and must be within 5% of that.
TEST(Estimate, DistillationAddsTheTeacher) {
  const std::string path = std::string(Q4_SOURCE_DIR) + "/scripts/bench/bench-4b.yaml";
  const std::string teacher_config = std::string(Q4_FIXTURES_DIR) + "/qwen3_4b.config.json";
  const Config sft = load_config(path);
  const Config kd =
      load_config(path, {parse_override("train.objective=distill"),
                         parse_override("distill.teacher=/not/read/by/the/estimate.dat"),
                         parse_override("distill.teacher_config=" + teacher_config)});
  const auto mc = q4::model::Qwen3Config::from_json_file(sft.model.config);
  const auto a = estimate_budget(mc, sft, true, objective_needs(sft)),
             b = estimate_budget(mc, kd, true, objective_needs(kd));
  EXPECT_EQ(a.teacher_bytes, 0);
  EXPECT_EQ(b.teacher_bytes, mc.num_parameters(!mc.tie_word_embeddings) * 2);
  EXPECT_EQ(b.persistent_bytes(), a.persistent_bytes() + b.teacher_bytes);
  EXPECT_GT(b.logits_bytes, a.logits_bytes);
  EXPECT_NEAR(to_gib(b.total_bytes()) / 28.4, 1.0, 0.05) << b.to_table();
  EXPECT_EQ(b.to_json()["teacher_bytes"].get<int64_t>(), b.teacher_bytes);
  // Offline, no teacher is on the device.
  const Config offline =
      load_config(path, {parse_override("train.objective=distill"),
                         parse_override("distill.topk_file=/not/read/by/the/estimate.dat")});
  EXPECT_EQ(estimate_budget(mc, offline, true, objective_needs(offline)).teacher_bytes, 0);
}

// GRPO (docs/trainer.md#grpo, "Memory"): a rollout phase before the training phases (which are
// the supervised run's), each term against its direct formula for the 4B shapes, and the
// reference model with grpo.beta > 0; the peak is the larger phase, not the sum.
TEST(Estimate, GrpoCountsTheRolloutAndTheReference) {
  const std::string path = std::string(Q4_SOURCE_DIR) + "/scripts/bench/bench-4b.yaml";
  const std::vector<std::string> common = {"train.batch_size=8", "train.grad_accum=2",
                                           "data.packing=false"};
  auto load = [&](std::vector<std::string> sets) {
    std::vector<Override> ov;
    for (const auto& s : common) ov.push_back(parse_override(s));
    for (const auto& s : sets) ov.push_back(parse_override(s));
    return load_config(path, ov);
  };
  const Config sft = load({});
  const std::vector<std::string> grpo = {"train.objective=grpo", "grpo.num_generations=4",
                                         "grpo.max_completion_length=256", "grpo.top_p=0.9"};
  std::vector<std::string> with_beta = grpo;
  with_beta.push_back("grpo.beta=0.04");
  const Config g = load(grpo), gb = load(with_beta);
  const auto mc = q4::model::Qwen3Config::from_json_file(sft.model.config);
  const auto a = estimate_budget(mc, sft, true, objective_needs(sft));
  const auto b = estimate_budget(mc, g, true, objective_needs(g));
  const auto c = estimate_budget(mc, gb, true, objective_needs(gb));
  ASSERT_EQ(b.phases.size(), a.phases.size() + 1);
  for (size_t i = 0; i < a.phases.size(); ++i) {
    EXPECT_EQ(b.phases[i + 1].name, a.phases[i].name);
    EXPECT_EQ(b.phases[i + 1].total_bytes(), a.phases[i].total_bytes()) << a.phases[i].name;
  }
  const BudgetPhase& r = b.phases[0];
  EXPECT_EQ(r.name, "rollout");
  // This rank's rows: batch_size x grad_accum; prompt + completion = seq_len; bf16.
  const int64_t R = 16, T = 1024, P = 1024 - 256, cs = 2;
  const int64_t H = mc.hidden_size, I = mc.intermediate_size, V = mc.vocab_size;
  const int64_t L = mc.num_hidden_layers, KVH = mc.num_key_value_heads, D = mc.head_dim;
  const int64_t QD = mc.num_attention_heads * D, KVD = KVH * D;
  EXPECT_EQ(r.kv_cache_bytes, 2 * L * R * KVH * T * D * cs);
  EXPECT_EQ(r.weights_bytes, (L * (H * QD + 2 * H * KVD + QD * H + 3 * H * I) + V * H) * cs);
  EXPECT_EQ(r.logits_bytes, R * V * (cs + 16 + 16));  // top_p: sort values, indices, cumsum
  EXPECT_EQ(r.activations_bytes,
            2 * R * P * H * cs + std::max(R * P * cs * (H + 2 * QD + 2 * KVD),
                                          R * P * cs * (2 * H + 3 * I)));
  EXPECT_EQ(r.gradients_bytes, 0);
  EXPECT_EQ(b.reference_bytes, 0);
  EXPECT_EQ(b.persistent_bytes(), a.persistent_bytes());
  int64_t peak = 0;
  for (const auto& p : b.phases) peak = std::max(peak, p.total_bytes());
  EXPECT_EQ(b.total_bytes(), b.persistent_bytes() + peak);
  EXPECT_LT(b.total_bytes(), a.total_bytes() + r.total_bytes());  // the larger, not the sum
  // grpo.beta > 0: the reference model, whole run, in the compute dtype.
  EXPECT_EQ(c.reference_bytes, mc.num_parameters(true) * cs);
  EXPECT_EQ(c.persistent_bytes(), b.persistent_bytes() + c.reference_bytes);
  const std::string table = c.to_table();
  for (const char* w : {"rollout", "kv cache", "weights", "reference"}) {
    EXPECT_NE(table.find(w), std::string::npos) << w << "\n" << table;
  }
  EXPECT_EQ(a.to_table().find("kv cache"), std::string::npos);
  EXPECT_EQ(c.to_json()["reference_bytes"].get<int64_t>(), c.reference_bytes);
  EXPECT_EQ(c.to_json()["phases"][0]["kv_cache_bytes"].get<int64_t>(), r.kv_cache_bytes);
}

TEST(Estimate, LayerBackwardDominatesWithoutTheLmHead) {
  // Frozen lm_head and embedding, one 8192-token sequence: the loss phases hold only a logits
  // block, while a recomputed layer's graph grows with the tokens.
  const std::string path = std::string(Q4_SOURCE_DIR) + "/scripts/bench/bench-4b.yaml";
  const Config c = load_config(
      path, {parse_override("train.trainable.lm_head=false"),
             parse_override("train.trainable.embeddings=false"),
             parse_override("train.batch_size=1"), parse_override("train.seq_len=8192")});
  const auto mc = q4::model::Qwen3Config::from_json_file(c.model.config);
  const auto b = estimate_budget(mc, c, true);
  EXPECT_EQ(b.peak_phase_name(), "layer backward") << b.to_table();
  EXPECT_EQ(b.logits_bytes, 0);
  EXPECT_GT(b.activations_bytes, 36 * 8192 * 2560 * 2);  // every checkpoint and one layer
}

TEST(Estimate, BufferedPathHoldsEveryGradient) {
  // grad_accum 2 (no in-backward updates): the full gradient buffer exists in every phase, and
  // the peak is not below the optimizer step's buffer.
  const std::string path = std::string(Q4_SOURCE_DIR) + "/scripts/bench/bench-4b.yaml";
  const Config c = load_config(path, {parse_override("train.grad_accum=2")});
  ASSERT_FALSE(in_backward_updates(c));
  const auto mc = q4::model::Qwen3Config::from_json_file(c.model.config);
  const auto b = estimate_budget(mc, c, true);
  const int64_t buffer = 4411424256LL * 2;  // bf16 gradients
  ASSERT_FALSE(b.phases.empty());
  EXPECT_EQ(b.phases.back().name, "optimizer step");
  EXPECT_EQ(b.phases.back().gradients_bytes, buffer);
  for (const auto& p : b.phases) EXPECT_GE(p.gradients_bytes, buffer) << p.name;
  EXPECT_GT(b.total_bytes(), b.persistent_bytes() + buffer);
  // With in-backward updates the same run holds far less.
  const Config ib = load_config(path);
  EXPECT_LT(estimate_budget(mc, ib, true).total_bytes() + buffer / 2, b.total_bytes());
}

// train.gradient_checkpointing auto at Qwen3-4B shapes on CUDA (estimated, nothing runs): no
// recompute when that fits the budget less its margin, every layer when only that fits (then
// offloaded), and in between never fewer recomputed layers than the whole-layer choice, whose
// estimate would not fit.
TEST(Estimate, RecomputeByBudgetPicksTheFewestLayersThatFit) {
  const Config c = tiny_config("train: {batch_size: 4, seq_len: 1024}\n",
                               {"model.device=cuda", "train.trainable.lm_head=true"});
  EXPECT_EQ(c.train.gradient_checkpointing, Recompute::kAuto);
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  const int64_t L = mc.num_hidden_layers;
  std::vector<int64_t> est;
  for (int64_t n = 0; n <= L; ++n) {
    Config t = c;
    set_recompute_layers(t, n, L);
    est.push_back(estimate_budget(mc, t, true).total_bytes());
    if (n > 0) {
      EXPECT_LT(est[n], est[n - 1]) << n;
    }
  }
  // The budget that exactly admits an estimate e: e x 1.08 + 1 GiB (the margin).
  auto budget_for = [](int64_t e) { return static_cast<int64_t>(e * 1.08) + (int64_t{1} << 30); };
  RecomputeChoice r = choose_recompute(mc, c, true, budget_for(est[0]) + 1000);
  EXPECT_TRUE(r.fits);
  EXPECT_EQ(r.recompute_layers, 0);
  EXPECT_EQ(r.estimate_bytes, est[0]);
  EXPECT_EQ(r.budget_source, "free device memory");
  for (int64_t k : {int64_t{1}, int64_t{12}, L}) {
    // Just under what k - 1 recomputed layers need: at least k recompute (keeping a block in a
    // recomputed layer only adds to its estimate).
    r = choose_recompute(mc, c, true, budget_for(est[k - 1]) - 1000);
    EXPECT_TRUE(r.fits) << k;
    EXPECT_GE(r.recompute_layers, k);
    EXPECT_LE(r.estimate_bytes, r.usable_bytes);
  }
  // Just what every layer recomputed needs: no block is kept.
  r = choose_recompute(mc, c, true, budget_for(est[L]) + 1000);
  EXPECT_EQ(r.recompute_layers, L);
  EXPECT_EQ(r.keep_attention + r.keep_mlp, 0);
  EXPECT_FALSE(r.offload_layer_inputs);
  // Past every layer recomputed: their inputs go to the host, L layer inputs fewer on the GPU.
  Config off = c;
  set_recompute_layers(off, L, L, /*offload_layer_inputs=*/true);
  EXPECT_TRUE(model_options(off).offload_layer_inputs);
  const MemoryBudget ob = estimate_budget(mc, off, true);
  const int64_t boundary = 4 * 1024 * mc.hidden_size * 2;  // one bf16 layer input
  EXPECT_EQ(ob.host_bytes, L * boundary);
  EXPECT_LE(ob.total_bytes(), est[L] - (L - 2) * boundary);
  r = choose_recompute(mc, c, true, budget_for(est[L]) - (int64_t{1} << 28));
  EXPECT_TRUE(r.fits);
  EXPECT_EQ(r.recompute_layers, L);
  EXPECT_TRUE(r.offload_layer_inputs);
  // What is left beside the offloaded inputs keeps blocks; a layer keeping its attention block
  // keeps its input on the device (its graph holds it).
  EXPECT_EQ(r.host_bytes, (L - r.keep_attention) * boundary);
  EXPECT_NE(r.describe().find("inputs in pinned host memory"), std::string::npos) << r.describe();
  r = choose_recompute(mc, c, true, budget_for(ob.total_bytes()) + 1000);
  EXPECT_TRUE(r.offload_layer_inputs);
  EXPECT_EQ(r.keep_attention + r.keep_mlp, 0);
  EXPECT_EQ(r.host_bytes, L * boundary);
  r = choose_recompute(mc, c, true, budget_for((ob.total_bytes() + est[L]) / 2));
  EXPECT_TRUE(r.offload_layer_inputs);
  EXPECT_GT(r.keep_attention + r.keep_mlp, 0);
  EXPECT_LE(r.estimate_bytes, r.usable_bytes);
  r = choose_recompute(mc, c, true, budget_for(ob.total_bytes()) - (int64_t{1} << 24));
  EXPECT_FALSE(r.fits);
  EXPECT_EQ(r.recompute_layers, L);
  EXPECT_NE(r.describe().find("OVER"), std::string::npos) << r.describe();
  // guard.max_gpu_gb is the budget when set, whatever memory is free.
  Config g = c;
  g.guard.max_gpu_gb = static_cast<double>(budget_for(est[L / 2 - 1]) - 1000) / 1e9;
  r = choose_recompute(mc, g, true, int64_t{80} << 30);
  EXPECT_EQ(r.budget_source, "guard.max_gpu_gb");
  EXPECT_GE(r.recompute_layers, L / 2);
  EXPECT_LT(r.recompute_layers, L);
  // Resolving makes a plan with the choice in its config; the model options follow it.
  std::string line;
  const RunPlan resolved = resolve_plan(g, RunOptions{}).with_recompute(mc, true, 0, &line);
  EXPECT_NE(line.find(fmt::format("the first {} of {} decoder layers", r.recompute_layers, L)),
            std::string::npos)
      << line;
  const TrainConfig& gt = resolved.config().train;
  EXPECT_EQ(gt.gradient_checkpointing, Recompute::kTrue);
  EXPECT_EQ(gt.recompute_layers, r.recompute_layers);
  EXPECT_EQ(gt.recompute_keep_attention, r.keep_attention);
  EXPECT_EQ(gt.recompute_keep_mlp, r.keep_mlp);
  const auto o = model_options(resolved.config(), resolved.recompute());
  EXPECT_TRUE(o.recomputes(r.recompute_layers - 1));
  EXPECT_FALSE(o.recomputes(r.recompute_layers));
  EXPECT_EQ(o.recompute_keep_attention, r.keep_attention);
  EXPECT_EQ(o.recompute_keep_mlp, r.keep_mlp);
  EXPECT_EQ(model_options(resolved.config()).recompute_layers, o.recompute_layers);
  resolved.with_recompute(mc, true, 0, &line);
  EXPECT_EQ(line, "");  // resolved once
  // None recomputed is written as false; auto on the CPU is no recompute.
  Config none = c;
  set_recompute_layers(none, 0, L);
  EXPECT_EQ(none.train.gradient_checkpointing, Recompute::kFalse);
  EXPECT_FALSE(model_options(tiny_config()).gradient_checkpointing);
  // Unresolved auto on CUDA: every layer (the safe side).
  EXPECT_TRUE(model_options(c).recomputes(L - 1));
}

// auto between every layer recomputed and none (Qwen3-4B shapes, CUDA): the budget left over
// goes to kept blocks (model::layer_keep_costs), the choice that fits with the most recompute
// saved. One sequence of 32,768 tokens, everything trainable: the attention block saves 5.5x
// the MLP's recompute per byte kept (the attention core grows with the sequence); 16 x 256
// tokens with merge-aware adapters on q/k/v/o only: the MLP block saves 1.4x the attention's
// (whose merged weights are kept with its graph). Over budgets from the one extreme to the
// other: the choice fits and its estimate is the one of the config it writes, more budget
// saves at least as much recompute, never less than whole layers alone would, only the block
// that saves more per byte is kept on its own, and (32k) whole layers only once every recomputed
// layer keeps that block.
TEST(Estimate, RecomputeByBudgetKeepsTheBlockThatSavesMostPerByte) {
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  const int64_t L = mc.num_hidden_layers;
  struct Case {
    Config c;
    bool attention_first;
  };
  const std::vector<Case> cases = {
      {tiny_config("train: {batch_size: 1, seq_len: 32768}\n",
                   {"model.device=cuda", "train.trainable.lm_head=true"}),
       true},
      {tiny_config("train: {method: lora, batch_size: 16, seq_len: 256}\n"
                   "lora: {targets: [q_proj, k_proj, v_proj, o_proj]}\n",
                   {"model.device=cuda"}),
       false},
  };
  auto budget_for = [](int64_t e) { return static_cast<int64_t>(e * 1.08) + (int64_t{1} << 30); };
  for (const Case& k : cases) {
    const Config& c = k.c;
    SCOPED_TRACE(k.attention_first ? "attention first" : "MLP first");
    const auto costs = q4::model::layer_keep_costs(mc, model_options(c), c.train.batch_size,
                                                   c.train.seq_len, true, L - 1);
    const double ratio = costs.attention.macs_per_byte() / costs.mlp.macs_per_byte();
    EXPECT_GT(k.attention_first ? ratio : 1 / ratio, 1.3) << ratio;
    auto saved = [&](int64_t n, int64_t ka, int64_t km) {
      return static_cast<double>(L - n) * (costs.attention.saved_macs + costs.mlp.saved_macs) +
             ka * costs.attention.saved_macs + km * costs.mlp.saved_macs;
    };
    std::vector<int64_t> est;  // whole layers: the first n recompute
    for (int64_t n = 0; n <= L; ++n) {
      Config t = c;
      set_recompute_layers(t, n, L);
      est.push_back(estimate_budget(mc, t, true).total_bytes());
    }
    double prev_saved = 0;
    int64_t most_kept = 0;
    for (int64_t i = 1; i < 8; ++i) {
      const int64_t budget = budget_for(est[L] + (est[0] - est[L]) * i / 8);
      const RecomputeChoice r = choose_recompute(mc, c, true, budget);
      SCOPED_TRACE(r.describe());
      ASSERT_TRUE(r.fits);
      EXPECT_FALSE(r.offload_layer_inputs);
      EXPECT_LE(r.estimate_bytes, r.usable_bytes);
      Config t = c;
      set_recompute_layers(t, r.recompute_layers, L, false, r.keep_attention, r.keep_mlp);
      EXPECT_EQ(estimate_budget(mc, t, true).total_bytes(), r.estimate_bytes);
      const double s = saved(r.recompute_layers, r.keep_attention, r.keep_mlp);
      EXPECT_GE(s, prev_saved);
      prev_saved = s;
      int64_t n = 0;  // whole layers alone: the fewest recomputed that fit
      while (est[n] > r.usable_bytes) ++n;
      EXPECT_GE(s, saved(n, 0, 0));
      const int64_t first = k.attention_first ? r.keep_attention : r.keep_mlp;
      const int64_t second = k.attention_first ? r.keep_mlp : r.keep_attention;
      EXPECT_EQ(second, 0);
      most_kept = std::max(most_kept, first);
      if (k.attention_first && r.recompute_layers < L) {
        EXPECT_EQ(first, r.recompute_layers);
      }
      if (first > 0) {
        EXPECT_NE(r.describe().find(k.attention_first ? "keep the attention block's activations"
                                                      : "keep the MLP block's activations"),
                  std::string::npos);
      }
    }
    EXPECT_GT(most_kept, L / 2);
  }
}

// optim.offload: moments takes the moments off the GPU estimate and counts them as host memory;
// on the CPU it is refused.
TEST(Estimate, OffloadedMomentsLeaveTheDevice) {
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  const Config c = tiny_config("train: {batch_size: 4, seq_len: 1024}\n",
                               {"model.device=cuda", "train.trainable.lm_head=true"});
  Config off = c;
  off.optim.offload = Offload::kMoments;
  EXPECT_TRUE(adamw_options(off).offload_moments);
  EXPECT_FALSE(adamw_options(c).offload_moments);
  const MemoryBudget a = estimate_budget(mc, c, true), b = estimate_budget(mc, off, true);
  EXPECT_GT(a.moments_bytes, int64_t{8} * 1000 * 1000 * 1000);  // int8 m and v of 4.41e9 elements
  EXPECT_EQ(b.moments_bytes, 0);
  EXPECT_TRUE(b.moments_on_host);
  EXPECT_EQ(b.host_bytes, a.moments_bytes);
  // Each phase loses the moments, less the staging the updates go through while they run (in
  // the backward: in-backward updates).
  const int64_t staging = optim::kMaxStagedBytes;
  ASSERT_EQ(a.phases.size(), b.phases.size());
  for (size_t i = 0; i < a.phases.size(); ++i) {
    const std::string& name = b.phases[i].name;
    const bool updating = name != "forward" && name != "loss forward";
    EXPECT_EQ(a.phases[i].optimizer_bytes, 0) << name;
    EXPECT_EQ(b.phases[i].optimizer_bytes, updating ? staging : 0) << name;
    EXPECT_EQ(a.persistent_bytes() + a.phases[i].total_bytes() -
                  (b.persistent_bytes() + b.phases[i].total_bytes()),
              a.moments_bytes - b.phases[i].optimizer_bytes)
        << name;
  }
  EXPECT_NE(b.to_table().find("in pinned host memory"), std::string::npos);
  try {
    tiny_config("optim: {offload: moments}\n");
    ADD_FAILURE() << "optim.offload on the CPU was accepted";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("optim.offload: moments, but model.device is cpu"),
              std::string::npos)
        << e.what();
  }
}

// optim.offload: all with accumulation: updated inside the last micro-batch's backward, the
// staging is the ring's share (counted with the ring in every phase), not a second arena, so
// that backward costs no more than the buffered one's; buffered, the update takes its own.
TEST(Estimate, InBackwardOffloadSharesTheRing) {
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  Config buffered =
      tiny_config("train: {batch_size: 4, seq_len: 1024, grad_accum: 8}\n",
                  {"model.device=cuda", "train.trainable.lm_head=true", "optim.offload=all",
                   "optim.in_backward=false", "train.gradient_checkpointing=true"});
  Config in_backward = buffered;
  in_backward.optim.in_backward = InBackward::kTrue;
  const MemoryBudget a = estimate_budget(mc, buffered, true);
  const MemoryBudget b = estimate_budget(mc, in_backward, true);
  for (const auto& p : a.phases) {
    EXPECT_EQ(p.optimizer_bytes, p.name == "optimizer step" ? optim::kMaxStagedBytes : 0) << p.name;
  }
  for (const auto& p : b.phases) EXPECT_EQ(p.optimizer_bytes, 0) << p.name;
  EXPECT_LE(b.total_bytes(), a.total_bytes());
}

TEST(Estimate, RecomputeLayersMistakesNameTheKey) {
  auto message = [](const std::function<void()>& fn) {
    try {
      fn();
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // Each train: section refused as it is read, and a part of its message; kept blocks need
  // gradient_checkpointing true.
  const std::vector<std::pair<std::string, std::string>> refused = {
      {"{recompute_layers: 1}",
       "train.recompute_layers: set, but train.gradient_checkpointing is auto"},
      {"{gradient_checkpointing: false, offload_layer_inputs: true}",
       "train.offload_layer_inputs: true, but train.gradient_checkpointing is false"},
      {"{recompute_layers: -2}", "train.recompute_layers"},
      {"{recompute_keep_mlp: 1}",
       "train.recompute_keep_mlp: set, but train.gradient_checkpointing is auto"},
      {"{gradient_checkpointing: false, recompute_keep_attention: 1}",
       "train.recompute_keep_attention: set, but train.gradient_checkpointing is false"},
      {"{recompute_keep_attention: -1}", "train.recompute_keep_attention"},
  };
  for (const auto& [train, part] : refused) {
    const std::string m = message([&train = train] { tiny_config("train: " + train + "\n"); });
    EXPECT_NE(m.find(part), std::string::npos) << train << ": " << m;
  }
  const Config c = tiny_config("train: {gradient_checkpointing: true, recompute_layers: 3}\n");
  EXPECT_NE(message([&] {
              load_model_config(c);
            }).find("train.recompute_layers: 3 is more than the 2 decoder layers"),
            std::string::npos);
  const Config ok = tiny_config("train: {gradient_checkpointing: true, recompute_layers: 1}\n");
  EXPECT_NO_THROW(load_model_config(ok));
  EXPECT_TRUE(model_options(ok).recomputes(0));
  EXPECT_FALSE(model_options(ok).recomputes(1));
  // Kept blocks: at most the recomputed layers.
  const Config many = tiny_config(
      "train: {gradient_checkpointing: true, recompute_layers: 1, recompute_keep_attention: 1, "
      "recompute_keep_mlp: 1}\n");
  EXPECT_NE(message([&] { load_model_config(many); })
                .find("train.recompute_keep_attention + train.recompute_keep_mlp: 1 + 1 is more "
                      "than the 1 recomputed decoder layers"),
            std::string::npos);
  const Config blocks = tiny_config(
      "train: {gradient_checkpointing: true, recompute_keep_attention: 1, recompute_keep_mlp: "
      "1}\n");
  EXPECT_NO_THROW(load_model_config(blocks));
  const auto o = model_options(blocks);
  EXPECT_EQ(o.layer_recompute(0, 2), q4::model::LayerRecompute::kMlp);
  EXPECT_EQ(o.layer_recompute(1, 2), q4::model::LayerRecompute::kAttention);
  // Written back as given (config.yaml of the run).
  const Config back = parse_config(config_to_yaml(blocks), "back.yaml", "/");
  EXPECT_EQ(back.train.recompute_keep_attention, 1);
  EXPECT_EQ(back.train.recompute_keep_mlp, 1);
}

TEST(Estimate, FlopsPerToken) {
  const auto mc = tiny_model_config();
  // 6 x matmul params + 12 x L x T x q_dim, by hand for the fixture shapes.
  const double layer = 64.0 * (2 * 64 + 2 * 32) + 3.0 * 64 * 192;
  const double expected = 6.0 * (2 * layer + 384.0 * 64) + 12.0 * 2 * 24 * 64;
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, 24), expected);
}

// The FLOPs a run computes: with everything trained, llm.c's count; frozen linears lose their
// weight-gradient GEMMs, layers below the lowest trained one their backward, and adapters add
// their own (tiny fixture, by hand: H 64, q 64, kv 32, I 192, V 384, 2 layers, T 24).
TEST(Estimate, FlopsPerTokenCountWhatTrains) {
  const auto mc = tiny_model_config();
  const double T = 24, q = 64, core = T * q;
  const double layer = 64.0 * (2 * 64 + 2 * 32) + 3.0 * 64 * 192, head = 384.0 * 64;
  const std::vector<std::string> base = {"train.seq_len=24", "train.batch_size=2",
                                         "train.trainable.norms=false"};
  auto with = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), base.begin(), base.end());
    return tiny_config("", sets);
  };
  Config full = with({"train.trainable.lm_head=true", "train.trainable.embeddings=true"});
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, full, true), train_flops_per_token(mc, 24));
  // Projections of every layer train, lm_head frozen: no weight gradient for lm_head.
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, with({}), true),
                   6 * 2 * layer + 4 * head + 12 * 2 * core);
  // Only the last layer trains: the first runs forward only.
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, with({"train.trainable.layers=last:1"}), true),
                   2 * layer + 6 * layer + 4 * head + 4 * core + 12 * core);
  // Plain LoRA rank 4 on q_proj and down_proj: frozen linears forward and input gradient, the
  // adapters 6 x r x (in + out) each.
  const Config plain = with({"train.method=lora", "lora.rank=4", "lora.merge_aware=false",
                             "lora.targets=[q_proj, down_proj]"});
  const double adapters = 6 * 4 * ((64 + 64) + (192 + 64));
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, plain, true),
                   4 * 2 * layer + 2 * adapters + 4 * head + 12 * 2 * core);
  // Merge-aware: the merged weights' gradients are formed (6n), and the merge and the factors'
  // gradients add 6 x n x r per micro-batch of 48 tokens.
  Config merged = plain;
  merged.lora.merge_aware = true;
  const double n_adapted = 64.0 * 64 + 64.0 * 192;
  EXPECT_DOUBLE_EQ(
      train_flops_per_token(mc, merged, true),
      4 * 2 * layer + 2 * (2 * n_adapted + 6 * n_adapted * 4 / 48) + 4 * head + 12 * 2 * core);
  EXPECT_LT(train_flops_per_token(mc, plain, true), train_flops_per_token(mc, 24));
}

// A mixture-of-experts model (tests/fixtures/qwen3_moe_tiny: 3 layers, layer 1 dense; H 64, q 64,
// kv 32, I 192, experts 8 of width 32, top 2, V 384) computes with its routers and the k routed
// experts of each sparse layer, not with all E: by hand, the MFU's count of active parameters.
TEST(Estimate, FlopsPerTokenCountActiveExperts) {
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_moe_tiny.config.json");
  const double T = 24, core = T * 64, attn = 64.0 * (2 * 64 + 2 * 32), head = 384.0 * 64;
  const double router = 8.0 * 64, routed = 2 * 3.0 * 64 * 32, dense = 3.0 * 64 * 192;
  const double moe_layer = attn + router + routed, dense_layer = attn + dense;
  EXPECT_EQ(mc.layer_active_linear_parameters(0), static_cast<int64_t>(moe_layer));
  EXPECT_EQ(mc.layer_active_linear_parameters(1), static_cast<int64_t>(dense_layer));
  const double all = 6.0 * (2 * moe_layer + dense_layer + head) + 12.0 * 3 * core;
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, 24), all);
  const std::vector<std::string> base = {
      "model.config=" + kFixtures + "/qwen3_moe_tiny.config.json",
      "model.init=random",
      "train.seq_len=24",
      "train.batch_size=2",
      "train.trainable.norms=false",
      "train.trainable.lm_head=true",
      "train.trainable.embeddings=true"};
  auto with = [&](std::vector<std::string> sets) {
    sets.insert(sets.end(), base.begin(), base.end());
    return tiny_config("", sets);
  };
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, with({}), true), all);
  // Frozen routers: their weight gradients (2 x E x H each) are not formed.
  EXPECT_DOUBLE_EQ(train_flops_per_token(mc, with({"train.trainable.router=false"}), true),
                   all - 2 * 2 * router);
}

// The dry run's line on a mixture-of-experts model, and LoRA's note that the experts are no
// adapter target when lora.targets names an MLP projection.
TEST(Estimate, MoeSummaryAndLoraNote) {
  const auto mc = q4::model::Qwen3Config::from_json_file(kFixtures + "/qwen3_moe_tiny.config.json");
  const std::string moe_config = "model.config=" + kFixtures + "/qwen3_moe_tiny.config.json";
  const Config full = tiny_config("", {moe_config, "model.init=random"});
  const std::string line = moe_summary(mc, full, true);
  EXPECT_NE(line.find("2 of 3 layers sparse, 8 experts of width 32, top 2 (renormalised)"),
            std::string::npos)
      << line;
  EXPECT_NE(line.find(fmt::format("{} parameters, {} active per token", mc.num_parameters(true),
                                  mc.num_active_parameters(true))),
            std::string::npos)
      << line;
  EXPECT_NE(line.find("routers train"), std::string::npos) << line;
  EXPECT_NE(line.find("coefficient 0.02"), std::string::npos) << line;
  EXPECT_EQ(moe_summary(tiny_model_config(), full, true), "");
  EXPECT_EQ(moe_lora_note(mc, full), "");
  const Config lora = tiny_config(
      "", {moe_config, "model.init=random", "train.method=lora", "lora.targets=[q_proj, up_proj]"});
  EXPECT_NE(moe_summary(mc, lora, true).find("routers frozen"), std::string::npos);
  const std::string note = moe_lora_note(mc, lora);
  EXPECT_NE(note.find("lora.targets up_proj: the experts of the 2 mixture-of-experts layers are "
                      "not adapted"),
            std::string::npos)
      << note;
  EXPECT_NE(note.find("only the 1 dense layers' MLPs"), std::string::npos) << note;
  const Config attention_only = tiny_config(
      "", {moe_config, "model.init=random", "train.method=lora", "lora.targets=[q_proj]"});
  EXPECT_EQ(moe_lora_note(mc, attention_only), "");
}

// What fits instead (advise_placements): an 8B model, one sequence of 128 tokens with 4-bit
// moments on a 24 GB card does not fit; the advice never repeats what is set (the moments'
// format, the batch, a sequence already at the floor), offloading the moments fits, each listed
// estimate is the estimate of the config with those settings and fits, and no listed placement
// contains another. With too little memory for anything: the smallest estimate.
TEST(Estimate, AdviceListsPlacementsThatFitAndNothingAlreadySet) {
  const auto mc = q4::model::Qwen3Config::from_json_file(std::string(Q4_SOURCE_DIR) +
                                                         "/configs/models/Qwen3-8B.config.json");
  const Config c = tiny_config("", {"model.device=cuda", "train.batch_size=1", "train.seq_len=128",
                                    "optim.state=4bit", "guard.max_gpu_gb=24"});
  const PlacementAdvice a = advise_placements(mc, c, true, 0);
  EXPECT_EQ(a.budget.source, "guard.max_gpu_gb");
  EXPECT_FALSE(a.config_fits);
  ASSERT_FALSE(a.fitting.empty()) << a.summary();
  bool moments = false;
  for (const Placement& p : a.fitting) {
    for (const auto& s : p.settings) {
      EXPECT_EQ(s.find("optim.state"), std::string::npos) << a.summary();
      EXPECT_EQ(s.find("train.batch_size"), std::string::npos) << a.summary();
      EXPECT_EQ(s.find("train.seq_len"), std::string::npos) << a.summary();
    }
    EXPECT_LE(p.estimate_bytes, a.budget.usable_bytes) << p.describe();
    moments |= p.settings == std::vector<std::string>{"optim.offload=moments"};
  }
  EXPECT_TRUE(moments) << a.summary();
  Config off = c;
  off.optim.offload = Offload::kMoments;
  const RecomputeChoice r = choose_recompute(mc, off, true, 0);
  EXPECT_TRUE(r.fits);
  for (const Placement& p : a.fitting) {
    if (p.settings == std::vector<std::string>{"optim.offload=moments"}) {
      EXPECT_EQ(p.estimate_bytes, r.estimate_bytes);
      EXPECT_EQ(p.host_bytes, r.host_bytes);
    }
  }
  // The OVER line of auto carries the advice instead of settings that are already made.
  const std::string line = choose_recompute(mc, c, true, 0).describe();
  EXPECT_NE(line.find("OVER"), std::string::npos) << line;
  EXPECT_NE(line.find("optim.offload=moments"), std::string::npos) << line;
  EXPECT_EQ(line.find("optim.state"), std::string::npos) << line;

  // Recompute by hand off, int8 moments, 4 x 1024 tokens: every option applies; each listed
  // placement is minimal (no other listed one is a subset of it).
  const Config wide =
      tiny_config("", {"model.device=cuda", "train.batch_size=4", "train.seq_len=1024",
                       "train.gradient_checkpointing=false", "guard.max_gpu_gb=44"});
  const PlacementAdvice w = advise_placements(mc, wide, true, 0);
  EXPECT_FALSE(w.config_fits);
  ASSERT_FALSE(w.fitting.empty()) << w.summary();
  for (size_t i = 0; i < w.fitting.size(); ++i) {
    for (size_t j = 0; j < w.fitting.size(); ++j) {
      if (i == j) continue;
      const auto& x = w.fitting[i].settings;
      const auto& y = w.fitting[j].settings;
      const bool subset = std::all_of(y.begin(), y.end(), [&](const std::string& s) {
        return std::find(x.begin(), x.end(), s) != x.end();
      });
      EXPECT_FALSE(subset) << w.summary();
    }
  }
  EXPECT_EQ(w.fitting[0].settings, std::vector<std::string>{"train.gradient_checkpointing=auto"})
      << w.summary();

  Config tiny_card = c;
  tiny_card.guard.max_gpu_gb = 4;
  const PlacementAdvice none = advise_placements(mc, tiny_card, true, 0);
  EXPECT_TRUE(none.fitting.empty());
  EXPECT_GT(none.smallest.estimate_bytes, none.budget.usable_bytes);
  EXPECT_NE(none.summary().find("nothing fits"), std::string::npos) << none.summary();
  EXPECT_NE(none.summary().find("optim.offload=all"), std::string::npos) << none.summary();
}

TEST(Probe, CpuReportHasEveryPhase) {
  const fs::path dir = fs::temp_directory_path() / ("q4_probe_test_" + std::to_string(::getpid()));
  const Config c = tiny_config(
      "train: {batch_size: 2, seq_len: 16, gradient_checkpointing: true}\n"
      "output: {dir: " +
      dir.string() + "}\n");
  RunOptions o;
  o.probe_report = (dir / "probe.json").string();
  std::ostringstream out, err;
  ASSERT_EQ(run_probe(c, o, out, err), kExitOk) << err.str();
  std::ifstream in(o.probe_report);
  const auto j = nlohmann::json::parse(in);
  EXPECT_EQ(j["device"], "cpu");
  ASSERT_EQ(j["phases"].size(), probe_phase_names().size());
  double prev = -1;
  for (size_t i = 0; i < probe_phase_names().size(); ++i) {
    const auto& p = j["phases"][i];
    EXPECT_EQ(p["name"], probe_phase_names()[i]);
    EXPECT_TRUE(p["allocated_bytes"].is_null());
    EXPECT_TRUE(p["reserved_bytes"].is_null());
    EXPECT_TRUE(p["peak_allocated_bytes"].is_null());
    EXPECT_TRUE(p["device_used_bytes"].is_null());
    EXPECT_TRUE(p["device_total_bytes"].is_null());
    EXPECT_GT(p["rss_bytes"].get<int64_t>(), 0);
    EXPECT_GE(p["elapsed_ms"].get<double>(), prev);
    prev = p["elapsed_ms"].get<double>();
  }
  for (const char* k : {"masters_bytes", "gradients_bytes", "moments_bytes", "activations_bytes",
                        "logits_bytes", "total_bytes", "peak_phase", "phases"}) {
    EXPECT_TRUE(j["budget"].contains(k)) << k;
  }
  EXPECT_TRUE(j["measured"]["peak_allocated_bytes"].is_null());
  EXPECT_EQ(j["info"]["tokens"], 32);
  const double loss = j["info"]["loss"].get<double>();
  // Random tokens under a trained-on-nothing tiny model: near-uniform, ln(384) = 5.95.
  EXPECT_GT(loss, 4.0);
  EXPECT_LT(loss, 8.0);
  EXPECT_TRUE(j["info"]["step_applied"].get<bool>());
  EXPECT_TRUE(j["info"]["steady"].is_null());  // no --probe-steps
  q4::io::remove_tree(dir);
}

TEST(Probe, SteadyStateStepsAreTimedAndTrain) {
  // --probe-steps 3: three more steps on the same batch after the instrumented one; the report
  // has their medians, tok/s = tokens / median step, and the loss went down (same batch,
  // lr 1e-2 on a tiny model).
  const fs::path dir =
      fs::temp_directory_path() / ("q4_probe_steady_" + std::to_string(::getpid()));
  const Config c = tiny_config(
      "train: {batch_size: 2, seq_len: 16}\n"
      "optim: {lr: 1.0e-2}\n"
      "output: {dir: " +
      dir.string() + "}\n");
  RunOptions o;
  o.probe_report = (dir / "probe.json").string();
  o.probe_steps = 3;
  std::ostringstream out, err;
  ASSERT_EQ(run_probe(c, o, out, err), kExitOk) << err.str();
  std::ifstream in(o.probe_report);
  const auto j = nlohmann::json::parse(in);
  const auto& st = j["info"]["steady"];
  ASSERT_TRUE(st.is_object()) << j.dump(2);
  EXPECT_EQ(st["steps"], 3);
  const double step = st["step_ms_median"].get<double>();
  EXPECT_GT(step, 0.0);
  for (const char* k : {"forward_ms_median", "backward_ms_median", "optimizer_ms_median"}) {
    EXPECT_GT(st[k].get<double>(), 0.0) << k;
    EXPECT_LE(st[k].get<double>(), step * 1.0001) << k;  // each phase is part of a step
  }
  EXPECT_NEAR(st["tokens_per_s"].get<double>(), 32.0 / (step / 1e3), 1e-6 * 32.0 / (step / 1e3));
  EXPECT_TRUE(st["peak_allocated_bytes"].is_null());  // CPU: no allocator statistics
  EXPECT_LT(st["last_loss"].get<double>(), j["info"]["loss"].get<double>());
  EXPECT_NE(err.str().find("steady state, median of 3 steps"), std::string::npos) << err.str();
  q4::io::remove_tree(dir);
}

TEST(Trainer, WriteModelDatLoadsBackQuantized) {
  const auto mc = tiny_model_config();
  q4::model::ModelOptions opt;
  opt.trainable = q4::model::TrainableSpec::everything();
  opt.master_dtype = at::kFloat;
  auto model = q4::model::Qwen3Model::random_init(mc, opt, 3, 0.05);
  const fs::path p = fs::temp_directory_path() / ("q4_init_" + std::to_string(::getpid()) + ".dat");
  q4::model::write_dat(model, p.string(), /*quantize_lm_head=*/false);
  q4::model::DatReader reader(p.string());
  EXPECT_EQ(reader.find("lm_head.weight")->type, q4::model::ElemType::kFloat16);
  EXPECT_EQ(reader.find("model.layers.0.mlp.up_proj.weight.qdata")->type,
            q4::model::ElemType::kE2M1Packed);
  auto back = q4::model::Qwen3Model::load(mc, reader, opt);
  for (const auto& name :
       {"model.layers.1.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"}) {
    const auto& w = model.parameter(name).master;
    const auto q = q4::quant::quantize_nvfp4(w, name);
    const auto expected = q4::quant::dequantize_nvfp4(q.qdata, q.scale);
    EXPECT_TRUE(at::equal(back.parameter(name).master, expected)) << name;
  }
  // Raw tensors are stored fp16.
  EXPECT_TRUE(at::equal(back.parameter("model.norm.weight").master,
                        model.parameter("model.norm.weight").master.to(at::kHalf).to(at::kFloat)));
  fs::remove(p);
}
