// --dry-run: what a run checks before its first step, without loading weights, and the memory
// estimate (see trainer.h). After resolve_plan it reads the plan only.
#include <iostream>

#include "q4/trainer/app/trainer.h"
#include "q4/trainer/objectives/grpo.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/dry_run_stages.h"
#include "q4/trainer/plan/estimate.h"

namespace q4::trainer {

int run_dry_run(const Config& config, std::ostream& out, bool overwrite) {
  std::string note;
  RunOptions options;
  options.overwrite = overwrite;  // the output checks only
  RunPlan plan =
      resolve_plan(config, options, /*probe=*/false, /*dry_run=*/true).with_warmup_clipped(&note);
  const ObjectiveNeeds& needs = plan.objective_needs();
  if (!note.empty()) out << note << "\n";
  if (const std::string w = plan.ignored_settings_warning(); !w.empty()) out << w << "\n";
  plan.check_inputs(/*need_data=*/plan.steps() > 0);
  plan.check_outputs();
  const DryRunModel model = dry_run_model(plan);
  const model::Qwen3Config& mc = model.config;
  // The frozen models the run loads (a teacher only without distill.topk_file), their files and
  // vocabularies checked as the run checks them before loading them.
  if (plan.steps() > 0) check_objective_models(plan, mc.vocab_size);
  if (plan.steps() > 0 && needs.prompt_records) {
    check_grpo_prompts(plan.prompt_check_plan(), out);  // prompts are sampled from, not batched
  } else if (plan.steps() > 0) {
    plan = dry_run_data(plan, mc, out);
  }
  std::string recompute_note, fit_note;
  plan = plan_memory(plan, mc, model.separate_lm_head, &recompute_note, &fit_note);
  const auto b = plan.memory_estimate(mc, model.separate_lm_head);
  out << dry_run_model_lines(plan, model, recompute_note);
  if (const auto summary = objective_summary(plan.objective_plan()); !summary.empty()) {
    out << summary << "\n";
  }
  out << "memory estimate (device, one micro-batch):\n" << b.to_table();
  if (!fit_note.empty()) out << fit_note << "\n";
  out << plan.describe();
  out << dry_run_files_and_config(plan);
  // Last, so that a GPU run can still be estimated here: but "ok" means it starts here.
  plan.check_device();
  out << "dry run ok: config valid, inputs present, data read and batched, device available; "
         "no weights loaded\n";
  return kExitOk;
}

}  // namespace q4::trainer
