// The run plan: the config resolved once (steps from epochs, warmup from its ratio, clipped to
// the run), the global batch rescaled by a reshard, the cadences and paths components ask for,
// the step, recompute, placement and data plans, and the objective's rules run by resolve_plan.
#include "q4/trainer/plan/run_plan.h"

#include <gtest/gtest.h>

#include <functional>
#include <type_traits>

#include "component_fixtures.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"

using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(RunPlan, StepsFromEpochsResolveOnce) {
  Config c = cpu_config("runs/x", /*grad_accum=*/2);
  c.train.epochs = 3;
  c.optim.schedule.warmup_ratio = 0.1;
  const RunPlan configured = resolve_plan(c, RunOptions{});
  EXPECT_TRUE(configured.length_from_data());
  std::string note = "x";
  EXPECT_EQ(configured.with_warmup_clipped(&note).config().optim.schedule.warmup_steps, 0);
  EXPECT_EQ(note, "");  // not before the data is batched
  std::string notes;
  const RunPlan plan = configured.with_length(/*micro_batches_per_epoch=*/10, /*ranks=*/1, &notes);
  EXPECT_EQ(configured.steps(), c.train.steps);  // the plan it came from is unchanged
  EXPECT_EQ(configured.config().train.epochs, 3);
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
  const RunPlan configured = resolve_plan(c, RunOptions{});
  EXPECT_FALSE(configured.length_from_data());
  std::string note;
  const RunPlan plan = configured.with_warmup_clipped(&note);
  EXPECT_NE(note.find("clipped to 3"), std::string::npos);
  EXPECT_EQ(configured.config().optim.schedule.warmup_steps, 10);
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
  const RunPlan off = resolve_plan(c, o);
  EXPECT_FALSE(off.checkpoints_on());
  EXPECT_EQ(off.metrics_path(), "");
  EXPECT_TRUE(off.resuming());
  EXPECT_EQ(off.export_path(), "runs/x/model.dat");
  c.output.checkpoint_every = 5;
  c.log.metrics = "m.jsonl";
  const RunPlan on = resolve_plan(c, RunOptions{});
  EXPECT_TRUE(on.checkpoints_on());
  EXPECT_EQ(on.metrics_path(), "runs/x/m.jsonl");
  EXPECT_FALSE(on.resuming());
  EXPECT_EQ(on.with_grad_accum(4).grad_accum(), 4);
  EXPECT_EQ(on.with_grad_accum(4).step().grad_accum, 4);
  EXPECT_EQ(on.grad_accum(), 1);
  EXPECT_TRUE(on.device().is_cpu());
  on.check_guard("here");  // no guard on the CPU
}

// gradient_checkpointing auto is resolved into the plan's config (what the model is built
// with) but saved as configured, so a resume on another GPU decides again.
TEST(RunPlan, RecomputeResolvesButIsSavedAsConfigured) {
  Config c = cpu_config("runs/x");
  c.model.device = "cuda";  // resolution is a CUDA matter; nothing runs here
  c.train.steps = 3;
  const RunPlan configured = resolve_plan(c, RunOptions{});
  EXPECT_TRUE(configured.recompute().recompute_auto);
  const auto mc = q4::model::Qwen3Config::from_json_file(std::string(Q4_FIXTURES_DIR) +
                                                         "/qwen3_tiny.config.json");
  std::string line;
  const RunPlan plan = configured.with_recompute(mc, true, int64_t{80} << 30, &line);
  EXPECT_FALSE(plan.recompute().recompute_auto);
  EXPECT_FALSE(plan.recompute().enabled);
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
  std::string chosen;
  const RunPlan tight = configured.with_recompute(
      mc, true, static_cast<int64_t>(mid * kAllocatorMargin) + kCudaContextReserveBytes, &chosen);
  const TrainConfig& t = tight.config().train;
  EXPECT_TRUE(tight.recompute().enabled);
  EXPECT_EQ(tight.recompute().keep_attention, t.recompute_keep_attention);
  EXPECT_EQ(tight.recompute().keep_mlp, t.recompute_keep_mlp);
  EXPECT_EQ(t.gradient_checkpointing, Recompute::kTrue) << chosen;
  EXPECT_GT(t.recompute_keep_attention + t.recompute_keep_mlp + (L - t.recompute_layers), 0)
      << chosen;
  const Config tight_saved = tight.config_to_save();
  EXPECT_EQ(tight_saved.train.recompute_keep_attention, 0);
  EXPECT_EQ(tight_saved.train.recompute_keep_mlp, 0);
}

// The components' slices are made from the plan as resolved: the run length and warmup from the
// data, a reshard's grad_accum, the paths and cadences as the plan gives them.
TEST(RunPlan, SlicesFollowTheStages) {
  Config c = cpu_config("runs/x", /*grad_accum=*/2);
  c.train.epochs = 3;
  c.train.max_grad_norm = 0.5;
  c.optim.schedule.warmup_ratio = 0.1;
  c.log.metrics = "m.jsonl";
  c.eval.prompts = {"hi"};
  std::string notes;
  const RunPlan plan =
      resolve_plan(c, RunOptions{}).with_length(/*micro_batches_per_epoch=*/10, 1, &notes);
  const CheckpointPlan k = plan.checkpoint_plan();
  EXPECT_EQ(k.steps, 15);
  EXPECT_EQ(k.schedule.warmup_steps, 2);
  EXPECT_EQ(k.grad_accum, 2);
  EXPECT_EQ(plan.with_grad_accum(4).checkpoint_plan().grad_accum, 4);
  EXPECT_EQ(plan.with_grad_accum(4).report_plan().grad_accum, 4);
  const ReportPlan r = plan.report_plan();
  EXPECT_EQ(r.steps, 15);
  EXPECT_DOUBLE_EQ(r.epochs_configured, 3);
  EXPECT_EQ(r.schedule.warmup_steps, 2);
  EXPECT_EQ(r.metrics_path, "runs/x/m.jsonl");
  EXPECT_EQ(r.export_path, "runs/x/model.dat");
  const ExportPlan e = plan.export_plan();
  EXPECT_EQ(e.steps, 15);
  EXPECT_EQ(e.path, plan.export_path());
  EXPECT_EQ(plan.eval_plan().prompts, std::vector<std::string>{"hi"});
  EXPECT_TRUE(plan.loop_plan().has_prompts);
  EXPECT_DOUBLE_EQ(plan.step().max_grad_norm, 0.5);
}

// A plan never changes: every stage is a const member making a new plan.
static_assert(std::is_same_v<decltype(&RunPlan::with_length),
                             RunPlan (RunPlan::*)(int64_t, int64_t, std::string*) const>);
static_assert(std::is_same_v<decltype(&RunPlan::with_warmup_clipped),
                             RunPlan (RunPlan::*)(std::string*) const>);
static_assert(
    std::is_same_v<decltype(&RunPlan::with_grad_accum), RunPlan (RunPlan::*)(int64_t) const>);
// Set-up's loads are stages too: they take the plan so far and return the next one.
static_assert(std::is_same_v<decltype(&RunSetup::load_model),
                             RunPlan (RunSetup::*)(const RunPlan&, bool, bool)>);
static_assert(
    std::is_same_v<decltype(&RunSetup::load_data), RunPlan (RunSetup::*)(const RunPlan&, int64_t)>);

// How the step updates, decided once: optim.in_backward auto is on CUDA with grad_accum 1 (or
// masters on the host), one process (the probe runs alone); a reshard to grad_accum 2 decides
// again; offloaded masters sum their gradients in host memory.
TEST(RunPlan, StepPlanDecidesTheUpdatePathOnce) {
  Config c = cpu_config("runs/x");
  c.model.device = "cuda";
  const RunPlan one = resolve_plan(c, RunOptions{});
  EXPECT_TRUE(one.step().in_backward);
  EXPECT_FALSE(one.step().host_accumulation);
  EXPECT_FALSE(one.with_grad_accum(2).step().in_backward);
  RunOptions ranks;
  ranks.world.world_size = 2;
  ranks.world.rank = 1;
  ASSERT_TRUE(ranks.world.distributed());
  EXPECT_FALSE(resolve_plan(c, ranks).step().in_backward);
  EXPECT_EQ(resolve_plan(c, ranks).step().world, 2);
  EXPECT_TRUE(resolve_plan(c, ranks, /*probe=*/true).step().in_backward);
  c.optim.offload = Offload::kAll;
  c.model.fake_quant = true;
  c.train.grad_accum = 4;
  const RunPlan host = resolve_plan(c, RunOptions{});
  EXPECT_TRUE(host.step().in_backward);
  EXPECT_TRUE(host.step().host_accumulation);
  EXPECT_TRUE(host.placement().masters_on_host);
  EXPECT_TRUE(host.placement().moments_on_host);
  EXPECT_TRUE(host.placement().gradients_on_host);
  EXPECT_FALSE(resolve_plan(cpu_config("runs/x"), RunOptions{}).step().in_backward);
}

// The data plan comes from the objective's needs: preference pairs stay together, unpacked, with
// a reference pass unless the loss is SimPO.
TEST(RunPlan, DataPlanFromTheObjective) {
  Config c = cpu_config("runs/x");
  const RunPlan sft = resolve_plan(c, RunOptions{});
  EXPECT_EQ(sft.data().group_size, 1);
  EXPECT_EQ(sft.data().packing, c.data.packing);
  EXPECT_FALSE(sft.data().reference_pass);
  c.train.objective = ObjectiveKind::kPreference;
  c.train.batch_size = 2;
  const RunPlan pref = resolve_plan(c, RunOptions{});
  EXPECT_EQ(pref.data().group_size, 2);
  EXPECT_TRUE(pref.data().paired_records);
  EXPECT_FALSE(pref.data().packing);
  EXPECT_TRUE(pref.data().reference_pass);
  c.preference.loss = PreferenceLossKind::kSimpo;
  EXPECT_FALSE(resolve_plan(c, RunOptions{}).data().reference_pass);
  c.train.objective = ObjectiveKind::kDistill;
  c.distill.teacher = "teacher.dat";
  EXPECT_TRUE(resolve_plan(c, RunOptions{}).objective_needs().teacher_forward);
  c.distill.topk_file = "topk.dat";
  const ObjectiveNeeds offline = resolve_plan(c, RunOptions{}).objective_needs();
  EXPECT_FALSE(offline.teacher_forward);
  ASSERT_EQ(offline.required_files.size(), 1u);
  EXPECT_EQ(offline.required_files[0].first, "distill.topk_file");
}

// Each objective rule resolve_plan runs refuses with one line naming the keys.
TEST(RunPlan, ObjectiveRulesErrWithOneLineNamingTheKeys) {
  const auto error = [](const Config& c) -> std::string {
    try {
      resolve_plan(c, RunOptions{});
    } catch (const ConfigError& e) {
      return e.what();
    }
    return "";
  };
  const auto check = [&](const Config& c, const std::vector<std::string>& keys) {
    const std::string m = error(c);
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    ASSERT_FALSE(m.empty());
    for (const auto& k : keys) EXPECT_NE(m.find(k), std::string::npos) << m << " / " << k;
  };
  // Each case: its changes to a CPU config, and the keys the error names.
  struct Case {
    std::function<void(Config&)> edit;
    std::vector<std::string> keys;
  };
  const std::vector<Case> cases = {
      {[](Config& c) { c.train.objective = ObjectiveKind::kDistill; },
       {"distill.teacher", "distill.topk_file", "train.objective"}},
      {[](Config& c) {
         c.train.objective = ObjectiveKind::kDistill;
         c.distill.topk_file = "t.dat";
         c.distill.divergence = Divergence::kReverseKl;
       },
       {"distill.divergence", "distill.topk_file"}},
      {[](Config& c) { c.distill.teacher = "t.dat"; }, {"distill.teacher", "train.objective"}},
      {[](Config& c) { c.distill.topk_file = "t.dat"; }, {"distill.topk_file", "train.objective"}},
      {[](Config& c) {
         c.train.objective = ObjectiveKind::kPreference;
         c.train.batch_size = 3;
       },
       {"train.batch_size", "train.objective"}},
      {[](Config& c) {
         c.train.objective = ObjectiveKind::kPreference;
         c.data.truncation = Truncation::kSplit;
       },
       {"data.truncation"}},
      {[](Config& c) {
         c.train.objective = ObjectiveKind::kPreference;
         c.preference.reference = "r.dat";
         c.preference.loss = PreferenceLossKind::kSimpo;
       },
       {"preference.reference", "preference.loss"}},
      {[](Config& c) { c.preference.reference = "r.dat"; },
       {"preference.reference", "train.objective"}},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    SCOPED_TRACE("case " + std::to_string(i));
    Config c = cpu_config("runs/x");
    cases[i].edit(c);
    check(c, cases[i].keys);
  }
}

// --dry-run prints the plan as a short block.
TEST(RunPlan, DescribeIsAShortBlock) {
  Config c = cpu_config("runs/x", /*grad_accum=*/2);
  const std::string s = resolve_plan(c, RunOptions{}).describe();
  EXPECT_NE(s.find("plan: 10 steps of 2 micro-batches x 1 rank; updates after the backward"),
            std::string::npos)
      << s;
  EXPECT_NE(s.find("plan: recompute none; moments on the device"), std::string::npos) << s;
  EXPECT_NE(s.find("plan: trained NVFP4 linears' forward weights: sweep\n"), std::string::npos)
      << s;
  EXPECT_NE(s.find("plan: data rows in groups of 1, packing"), std::string::npos) << s;
  EXPECT_EQ(std::count(s.begin(), s.end(), '\n'), 4);
}
