// What the run's objective asks of the layers below it, as plain values (docs/design.md#trainer-
// components): the objectives layer decides them from train.objective (objectives/registry.h,
// objective_needs), the app layer passes them down; config, rundir and plan read these values
// and never the objective's kind.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace q4::trainer {

struct ObjectiveNeeds {
  bool labels = true;             // next-token labels, -100 where not supervised
  bool paired_sequences = false;  // chosen/rejected rows side by side (preference objectives)
  bool packing_allowed = true;    // several examples may share a row (data.packing)
  // The reference's log-probabilities are computed once before the first step and kept in the
  // run directory (rundir kReferenceFile).
  bool reference_pass = false;
  // A teacher model runs a forward next to the student in every step (online distillation):
  // its weights and transients count in the memory estimate.
  bool teacher_forward = false;
  // The data are prompts to sample from (TRL's prompt-only format, data/prompt_dataset.h), not
  // examples to batch (GRPO).
  bool prompt_records = false;
  // The config sections whose settings apply to this objective ("distill", "preference").
  std::vector<std::string> sections;
  // Files and folders the objective reads, as (config key, path), paths as configured.
  std::vector<std::pair<std::string, std::string>> inputs;
  // Files that must exist before anything loads (a top-K file, a teacher's .dat), as (key, path).
  std::vector<std::pair<std::string, std::string>> required_files;

  // Rows the batcher and the validation split keep together: 2 for pairs, else 1.
  int64_t group_size() const { return paired_sequences ? 2 : 1; }
};

}  // namespace q4::trainer
