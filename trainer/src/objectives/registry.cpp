// The objectives' table: rules, needs, dry-run checks per train.objective (see registry.h).
#include "q4/trainer/objectives/registry.h"

#include <array>

#include "q4/io/enum_names.h"
#include "q4/trainer/objectives/grpo.h"
#include "q4/trainer/objectives/preference.h"
#include "q4/trainer/plan/setup.h"

namespace q4::trainer {
namespace {

using io::enum_name;
using NamedFiles = std::vector<std::pair<std::string, std::string>>;

// One objective: its kind, the config section of its own settings ("" for none), its rules when
// it is the run's, the rules on its settings when it is not, and its needs.
struct ObjectiveEntry {
  ObjectiveKind kind;
  const char* section;
  void (*rules)(const Config&);
  void (*rules_when_inactive)(const Config&);
  void (*needs)(const Config&, ObjectiveNeeds*);
  std::string (*summary)(const ObjectivePlan&);  // --dry-run and the start; "" for none
};

void no_rules(const Config&) {}
void no_needs(const Config&, ObjectiveNeeds*) {}
std::string no_summary(const ObjectivePlan&) { return ""; }
std::string preference_line(const ObjectivePlan& p) {
  return preference_summary(p.preference, p.reference_file);
}
std::string grpo_line(const ObjectivePlan& p) { return grpo_summary(p.grpo); }

void distill_rules(const Config& c) {
  const auto& d = c.distill;
  if (d.teacher.empty() && d.topk_file.empty()) {
    throw ConfigError(
        "config key distill.teacher: train.objective is distill, but neither distill.teacher "
        "nor distill.topk_file is set");
  }
  if (!d.topk_file.empty() && d.divergence != Divergence::kForwardKl) {
    throw ConfigError(
        std::string("config key distill.divergence: ") + io::enum_name(d.divergence) +
        " needs the teacher's whole distribution; distill.topk_file holds its top K (use "
        "forward_kl, or distill.teacher without distill.topk_file)");
  }
}

void distill_rules_when_inactive(const Config& c) {
  const auto& d = c.distill;
  for (const auto& [key, set] :
       {std::pair<const char*, bool>{"distill.teacher", !d.teacher.empty()},
        {"distill.topk_file", !d.topk_file.empty()}}) {
    if (set) {
      throw ConfigError(std::string("config key ") + key + ": set, but train.objective is " +
                        to_string(c.train.objective) + " (set it to distill)");
    }
  }
}

void distill_needs(const Config& c, ObjectiveNeeds* n) {
  if (!c.distill.topk_file.empty()) {
    n->inputs.push_back({"distill.topk_file", c.distill.topk_file});
    n->required_files.push_back({"distill.topk_file", c.distill.topk_file});
    return;
  }
  n->teacher_forward = true;
  n->inputs = teacher_inputs(c);
}

void preference_rules(const Config& c) {
  if (c.train.batch_size % 2 != 0) {
    throw ConfigError("config key train.batch_size: " + std::to_string(c.train.batch_size) +
                      " rows, but train.objective preference needs an even number (a pair's "
                      "chosen and rejected answers share a micro-batch)");
  }
  if (c.data.truncation == Truncation::kSplit) {
    throw ConfigError(
        "config key data.truncation: split would cut an answer into windows "
        "that are no longer a pair (use cut_left, cut_right or drop)");
  }
  if (!c.preference.reference.empty() && c.preference.loss == PreferenceLossKind::kSimpo) {
    throw ConfigError(
        "config key preference.reference: set, but preference.loss simpo uses "
        "no reference");
  }
}

void preference_rules_when_inactive(const Config& c) {
  if (!c.preference.reference.empty()) {
    throw ConfigError("config key preference.reference: set, but train.objective is " +
                      to_string(c.train.objective) + " (set it to preference)");
  }
}

void preference_needs(const Config& c, ObjectiveNeeds* n) {
  // Each answer is a row; on CUDA the rows lie end to end, so there is no padding to save.
  n->paired_sequences = true;
  n->packing_allowed = false;
  n->reference_pass = c.preference.loss != PreferenceLossKind::kSimpo;
  if (n->reference_pass && !c.preference.reference.empty()) {
    n->inputs.push_back({"preference.reference", c.preference.reference});
    if (!c.preference.reference_config.empty()) {
      n->inputs.push_back({"preference.reference_config", c.preference.reference_config});
    }
  }
}

void grpo_rules(const Config& c) {
  const auto& g = c.grpo;
  // A completion needs at least one prompt token before it in its row.
  if (g.max_completion_length >= c.train.seq_len) {
    throw ConfigError(
        "config key grpo.max_completion_length: " + std::to_string(g.max_completion_length) +
        " tokens leave no room for a prompt in train.seq_len " + std::to_string(c.train.seq_len) +
        " (prompt + completion must fit: raise train.seq_len or lower "
        "grpo.max_completion_length)");
  }
  // Each generation batch is whole groups: rows per step = prompts per step x num_generations.
  const int64_t rows = c.train.batch_size * c.train.grad_accum;
  if (rows % g.num_generations != 0) {
    throw ConfigError(
        "config keys train.batch_size, train.grad_accum: " + std::to_string(c.train.batch_size) +
        " x " + std::to_string(c.train.grad_accum) + " = " + std::to_string(rows) +
        " rows per step are not a multiple of grpo.num_generations " +
        std::to_string(g.num_generations) + " (each step trains whole groups)");
  }
  if (c.data.eval_fraction > 0 || !c.data.eval_files.empty()) {
    throw ConfigError(
        std::string("config key ") +
        (c.data.eval_files.empty() ? "data.eval_fraction" : "data.eval_files") +
        ": train.objective grpo has no validation loss (its data are prompts); the rewards are "
        "logged every step, and eval.prompts are answered");
  }
}

void grpo_needs(const Config&, ObjectiveNeeds* n) {
  // The rewards' settings apply too (the reward: section, read by the rollout loop).
  n->sections.push_back("reward");
  n->prompt_records = true;
  n->packing_allowed = false;  // one prompt + completion per row
}

// In the order their rules run.
const std::array<ObjectiveEntry, 4> kObjectives = {{
    {ObjectiveKind::kCrossEntropy, "", no_rules, no_rules, no_needs, no_summary},
    {ObjectiveKind::kDistill, "distill", distill_rules, distill_rules_when_inactive, distill_needs,
     no_summary},
    {ObjectiveKind::kPreference, "preference", preference_rules, preference_rules_when_inactive,
     preference_needs, preference_line},
    {ObjectiveKind::kGrpo, "grpo", grpo_rules, no_rules, grpo_needs, grpo_line},
}};

const ObjectiveEntry& entry(ObjectiveKind kind) {
  for (const auto& e : kObjectives) {
    if (e.kind == kind) return e;
  }
  throw ConfigError("config key train.objective: unknown value");
}

}  // namespace

void validate_objective_config(const Config& c) {
  for (const auto& e : kObjectives) {
    (e.kind == c.train.objective ? e.rules : e.rules_when_inactive)(c);
  }
}

ObjectiveNeeds objective_needs(const Config& c) {
  const ObjectiveEntry& e = entry(c.train.objective);
  ObjectiveNeeds n;
  if (*e.section != '\0') n.sections.push_back(e.section);
  e.needs(c, &n);
  return n;
}

RunPlan resolve_plan(const Config& c, const RunOptions& options, bool probe, bool dry_run) {
  validate_objective_config(c);
  (void)dry_run;
  if (c.train.objective == ObjectiveKind::kGrpo && probe) {
    throw ConfigError(
        "--probe: train.objective grpo is not probed (a probe measures steps of fixed synthetic "
        "batches, and a grpo step's batches are sampled rollouts); --dry-run estimates its "
        "memory, rollouts included");
  }
  return RunPlan(c, options, objective_needs(c), probe);
}

std::vector<std::pair<std::string, std::string>> teacher_inputs(const Config& c) {
  NamedFiles in;
  if (!c.distill.teacher.empty()) in.push_back({"distill.teacher", c.distill.teacher});
  if (!c.distill.teacher_config.empty()) {
    in.push_back({"distill.teacher_config", c.distill.teacher_config});
  }
  return in;
}

void check_objective_models(const RunPlan& plan, int64_t vocab_size) {
  const ObjectiveNeeds& n = plan.objective_needs();
  const ObjectivePlan o = plan.objective_plan();
  if (n.teacher_forward && !o.distill.teacher.empty()) {
    check_frozen_model_config(o.teacher, vocab_size);
  }
  if (n.reference_pass && !o.preference.reference.empty()) {
    check_frozen_model_config(o.reference, vocab_size);
  }
}

std::string objective_summary(const ObjectivePlan& objective) {
  return entry(objective.kind).summary(objective);
}

}  // namespace q4::trainer
