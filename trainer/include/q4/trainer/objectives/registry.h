// The objectives a run can train with, in one table (docs/design.md#trainer-components): per
// train.objective, its config rules, what it needs of the run (ObjectiveNeeds: paired rows,
// packing, a reference pass, a teacher, the files it reads), and its --dry-run checks and lines.
// The layers below (config, rundir, plan) get these facts as values from here and never look at
// the objective's kind; make_objective (objective.h) builds the objective itself.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "q4/trainer/config/config.h"
#include "q4/trainer/config/objective_needs.h"
#include "q4/trainer/plan/run_plan.h"

namespace q4::trainer {

// The per-objective cross-field rules: an objective's own settings checked when it is the run's
// (distill.teacher or distill.topk_file set, an even train.batch_size for pairs, ...), and the
// settings that would change what a run computes refused under another objective
// (distill.teacher, preference.reference). ConfigError naming the keys. load_config runs them
// after validate_config (so the message names the config file); resolve_plan runs them too.
void validate_objective_config(const Config& c);

// What the run's objective needs.
ObjectiveNeeds objective_needs(const Config& c);

// The run's plan from its config: the objective's rules checked (validate_objective_config)
// and its needs resolved here,
// the rest by the plan (run_plan.h). Run, probe, --dry-run and the tools start from it.
// train.objective grpo is refused with several processes and for the probe.
RunPlan resolve_plan(const Config& c, const RunOptions& options, bool probe = false,
                     bool dry_run = false);

// The teacher's files (distill.teacher, distill.teacher_config), as (config key, path): what
// --write-teacher-topk reads.
std::vector<std::pair<std::string, std::string>> teacher_inputs(const Config& c);

// --dry-run: the frozen models the plan's objective loads (an online teacher, a preference
// reference), their files and vocabularies checked against `vocab_size` as the run checks them.
void check_objective_models(const RunPlan& plan, int64_t vocab_size);
// --dry-run and the start: the objective's summary line ("" for none).
std::string objective_summary(const ObjectivePlan& objective);

}  // namespace q4::trainer
