// --dry-run's resolution stages (app/dry_run.cpp): the run length from the data as the run reads
// it, and the memory plan, without loading weights (docs/design.md#trainer-components).
#pragma once

#include <iosfwd>
#include <string>

#include "q4/model/qwen3_config.h"
#include "q4/trainer/plan/run_plan.h"

namespace q4::trainer {

// The data as the run reads it: the real tokenizer, every file, the validation split, the
// truncation policy and the batcher's packing (which sizes an epoch); no weights. What it read is
// said on `out`. Returns the plan with the run length resolved.
RunPlan dry_run_data(const RunPlan& plan, const model::Qwen3Config& mc, std::ostream& out);

// gradient_checkpointing auto: the choice the run would make here (with what fits instead when
// even its least is over the budget) and model.forward_weights auto's after it:
// `recompute_note`, and the plan with them. Other settings:
// whether the estimate fits, and what would when it does not (advise_placements): `fit_note`.
// The device memory it plans with: guard.max_gpu_gb, or this machine's GPU's free memory; none
// without either (or on the CPU): a CUDA run then gets the fit on common cards (80, 141 GB).
RunPlan plan_memory(const RunPlan& plan, const model::Qwen3Config& mc, bool separate_lm_head,
                    std::string* recompute_note, std::string* fit_note);

// The model as --dry-run sees it without its weights: model.config read, train.trainable checked
// against its layers, and whether lm_head is stored apart from the embedding (the shipped NVFP4
// files store it separately even when config.json says tied; a random init follows config.json).
struct DryRunModel {
  model::Qwen3Config config;
  bool separate_lm_head = true;
};
DryRunModel dry_run_model(const RunPlan& plan);

// --dry-run's report of the resolved plan: the model and the run's shape (with `recompute_note`,
// the experts and LoRA lines), one line each.
std::string dry_run_model_lines(const RunPlan& plan, const DryRunModel& model,
                                const std::string& recompute_note);
// Its last lines: the weights file, a non-empty output.dir, and the resolved config whole (YAML).
std::string dry_run_files_and_config(const RunPlan& plan);

}  // namespace q4::trainer
