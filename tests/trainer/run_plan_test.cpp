// The run plan: the config resolved once (steps from epochs, warmup from its ratio, clipped to
// the run), the global batch rescaled by a reshard, the cadences and paths components ask for.
#include "q4/trainer/plan/run_plan.h"

#include <gtest/gtest.h>

#include "component_fixtures.h"
#include "q4/trainer/plan/estimate.h"

using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(RunPlan, StepsFromEpochsResolveOnce) {
  Config c = cpu_config("runs/x", /*grad_accum=*/2);
  c.train.epochs = 3;
  c.optim.schedule.warmup_ratio = 0.1;
  RunPlan plan(c, RunOptions{});
  EXPECT_TRUE(plan.length_from_data());
  EXPECT_EQ(plan.clip_warmup(), "");  // not before the data is batched
  const std::string notes = plan.resolve_length(/*micro_batches_per_epoch=*/10, /*ranks=*/1);
  EXPECT_EQ(plan.steps(), 15);  // ceil(3 x 10 / 2)
  EXPECT_EQ(plan.config().train.steps, 15);
  EXPECT_EQ(plan.config().train.epochs, 0);
  EXPECT_EQ(plan.config().optim.schedule.warmup_steps, 2);  // round(0.1 x 15)
  EXPECT_DOUBLE_EQ(plan.epochs_configured(), 3);
  EXPECT_NE(notes.find("train.epochs 3 -> train.steps 15"), std::string::npos) << notes;
}

TEST(RunPlan, StepsConfiguredClipTheWarmup) {
  Config c = cpu_config("runs/x");
  c.train.steps = 3;
  c.optim.schedule.warmup_steps = 10;
  RunPlan plan(c, RunOptions{});
  EXPECT_FALSE(plan.length_from_data());
  EXPECT_NE(plan.clip_warmup().find("clipped to 3"), std::string::npos);
  EXPECT_EQ(plan.config().optim.schedule.warmup_steps, 3);
  EXPECT_EQ(plan.steps(), 3);
}

TEST(RunPlan, CadencesPathsAndReshard) {
  Config c = cpu_config("runs/x");
  c.output.checkpoint_every = 0;
  c.output.checkpoint_minutes = 0;
  c.log.metrics = "";
  RunOptions o;
  o.resume = "runs/x";
  RunPlan off(c, o);
  EXPECT_FALSE(off.checkpoints_on());
  EXPECT_EQ(off.metrics_path(), "");
  EXPECT_TRUE(off.resuming());
  EXPECT_EQ(off.export_path(), "runs/x/model.dat");
  c.output.checkpoint_every = 5;
  c.log.metrics = "m.jsonl";
  RunPlan on(c, RunOptions{});
  EXPECT_TRUE(on.checkpoints_on());
  EXPECT_EQ(on.metrics_path(), "runs/x/m.jsonl");
  EXPECT_FALSE(on.resuming());
  on.rescale_grad_accum(4);
  EXPECT_EQ(on.grad_accum(), 4);
  EXPECT_TRUE(on.device().is_cpu());
  on.check_guard("here");  // no guard on the CPU
}

// gradient_checkpointing auto is resolved into the plan's config (what the model is built
// with) but saved as configured, so a resume on another GPU decides again.
TEST(RunPlan, RecomputeResolvesButIsSavedAsConfigured) {
  Config c = cpu_config("runs/x");
  c.model.device = "cuda";  // resolution is a CUDA matter; nothing runs here
  c.train.steps = 3;
  RunPlan plan(c, RunOptions{});
  const auto mc =
      q4::model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.config.json");
  const std::string line = plan.resolve_recompute(mc, true, int64_t{80} << 30);
  EXPECT_NE(line.find("gradient checkpointing auto: no decoder layer recomputes"),
            std::string::npos)
      << line;
  EXPECT_EQ(plan.config().train.gradient_checkpointing, Recompute::kFalse);
  const Config saved = plan.config_to_save();
  EXPECT_EQ(saved.train.gradient_checkpointing, Recompute::kAuto);
  EXPECT_EQ(saved.train.recompute_layers, -1);
  EXPECT_EQ(saved.train.steps, 3);
  EXPECT_NE(config_to_yaml(saved).find("gradient_checkpointing: \"auto\""), std::string::npos);
  // A budget between every layer recomputed and none: kept blocks, resolved but not saved.
  const int64_t L = mc.num_hidden_layers;
  Config all = c, none = c;
  set_recompute_layers(all, L, L);
  set_recompute_layers(none, 0, L);
  const int64_t mid = (estimate_budget(mc, all, true).total_bytes() +
                       estimate_budget(mc, none, true).total_bytes()) /
                      2;
  RunPlan tight(c, RunOptions{});
  const std::string chosen =
      tight.resolve_recompute(mc, true, static_cast<int64_t>(mid * 1.08) + (int64_t{1} << 30));
  const TrainConfig& t = tight.config().train;
  EXPECT_EQ(t.gradient_checkpointing, Recompute::kTrue) << chosen;
  EXPECT_GT(t.recompute_keep_attention + t.recompute_keep_mlp + (L - t.recompute_layers), 0)
      << chosen;
  const Config tight_saved = tight.config_to_save();
  EXPECT_EQ(tight_saved.train.recompute_keep_attention, 0);
  EXPECT_EQ(tight_saved.train.recompute_keep_mlp, 0);
}
