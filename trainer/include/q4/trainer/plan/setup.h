// Set-up of a run (docs/design.md#trainer-components): the model (from model.weights, an HF
// folder imported once, or a random init written to <output.dir>/init.dat), the tokenizer, the
// training and validation batchers, and the optimizer with its schedule. Set-up failures caused
// by inputs (config.json, tokenizer, data, weights) are rethrown as ConfigError so that main
// exits 2 naming the file. The helpers below are shared with --dry-run and the probe.
#pragma once

#include <c10/util/Exception.h>

#include <iosfwd>
#include <memory>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/data/prompt_dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/plan/run_plan.h"

namespace q4::trainer {

// Runs `fn`; a c10::Error it throws is an input problem: ConfigError with the same message.
// Exceptions that are not about the input stay runtime errors (exit 1), told apart by type: an
// allocator's OutOfMemoryError, std::bad_alloc (not a c10::Error), and a failed internal assert
// (c10 gives it no type of its own; its message always starts with "INTERNAL ASSERT FAILED").
template <class F>
auto as_input_error(const std::string& what, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error& e) {
    if (e.msg().rfind("INTERNAL ASSERT FAILED", 0) == 0) throw;
    throw ConfigError(what + ": " + e.what_without_backtrace());
  }
}

// An input file: a regular file (or a link to one). A directory, FIFO or device is named as
// such (a FIFO would block the read, a device like /dev/zero never end it).
void require_file(const std::string& path, const std::string& key);
// model.config parsed, and train.trainable.layers checked against its layer count.
model::Qwen3Config load_model_config(const Config& c);
// Files that the run needs before it loads anything; with `need_data`, the objective's too
// (`needs`: its required files, and an online teacher's weights).
void check_input_files(const Config& c, const ObjectiveNeeds& needs, bool need_data);
// on_error: skip: a warning on stderr naming every reported line and its reason.
void report_skipped_lines(const data::LoadSummary& s, std::ostream& err);
// No example at all: say so (naming each file's format rule), rather than blaming seq_len.
std::string no_examples_message(const Config& c);
// "a, b, c, ... (N in all)".
std::string join_names(const std::vector<std::string>& v, size_t max_shown);
// The keys a batcher error (nothing left after truncation) is about, for its message.
std::string truncation_keys(const Config& c, const std::string& files_key);

// What truncation to train.seq_len did to a batcher's examples: one line on `out` ("<what>
// truncation to train.seq_len N (policy): counts") when it truncated, split or dropped any, and a
// warning on `err` naming the settings when it lost more than data::kTruncationWarnShare of the
// supervised tokens. `what` is "" or "validation ".
void report_truncation(const Config& c, const data::TruncationStats& stats, const std::string& what,
                       std::ostream& out, std::ostream& err);
// data.eval_fraction: ceil(fraction x N) groups of `group` consecutive examples (at least one;
// a preference pair is a group of 2) chosen by a Fisher-Yates shuffle seeded by train.seed are
// moved from `train` to the returned list; both keep file order. The same seed and data give the
// same split (resume relies on it).
std::vector<data::Example> hold_out(std::vector<data::Example>* train, double fraction,
                                    int64_t seed, int64_t group = 1);
// The examples of one data file (`key` names it in errors): its records, or (`pairs`:
// DataPlan::paired_records) its preference pairs laid out as chosen, rejected, chosen, ... Its
// summary goes to `out` after `prefix`, skipped lines to `err`.
std::vector<data::Example> load_examples(const Config& c, bool pairs, const std::string& file,
                                         const data::Tokenizer& tok, const std::string& key,
                                         const std::string& prefix, std::ostream& out,
                                         std::ostream& err);
// The probe's data when the config names no files: `count` random-token sequences of exactly
// seq_len tokens, every position supervised, drawn from `seed`.
std::vector<data::Example> synthetic_examples(int64_t count, int64_t seq_len, int64_t vocab,
                                              uint64_t seed);
// One micro-batch on the model's device. CUDA: pinned staging and non-blocking copies, queued on
// the current stream without waiting for it. Labels stay on the host (loss() finds the
// supervised rows there). The varlen path needs cu_seqlens only; the masked path the segments.
model::ModelInputs to_inputs(const data::Batch& b, const model::Qwen3Model& model,
                             const at::Device& device);

// The run's frozen models: distill.teacher (dense linears dense, fake-quantized NVFP4 linears) and
// preference.reference (loaded as model.weights is: a plain-precision run's dense linears dense).
FrozenModelSpec teacher_spec(const Config& c);
// The run's starting weights as a frozen model (GRPO's reference with grpo.beta > 0): the random
// init's init.dat, the imported Hugging Face folder's file, or model.weights, loaded as
// model.weights is.
FrozenModelSpec starting_model_spec(const Config& c);
FrozenModelSpec reference_spec(const Config& c);
// The objective's slice of the config (component_plans.h ObjectivePlan, RunPlan::objective_plan).
ObjectivePlan objective_plan(const Config& c);
// What --dry-run's GRPO prompt check reads (component_plans.h PromptCheckPlan).
PromptCheckPlan prompt_check_plan(const Config& c);
// A run directory in spec.path (run_dir.h run_dir_model, as q4chat and q4eval take one) resolved
// to its export, and an empty config_path to its model.config; other paths as they are.
// ConfigError naming spec.key for a checkpoint or a run without an export.
FrozenModelSpec resolved_frozen_spec(const FrozenModelSpec& spec);
// The config.json a frozen model is read with (see FrozenModelSpec::config_path).
std::string frozen_config_path(const FrozenModelSpec& spec);
// Its config.json, read and checked (the files exist; its vocabulary is `vocab_size`, the trained
// model's): what load_frozen_model checks before loading anything, and what --dry-run checks.
model::Qwen3Config check_frozen_model_config(const FrozenModelSpec& spec, int64_t vocab_size);
// Loads it on `student`'s device in its compute dtype, nothing trainable; its vocabulary must be
// `vocab_size` (the trained model's). The load is reported on `out`.
std::unique_ptr<model::Qwen3Model> load_frozen_model(const FrozenModelSpec& spec,
                                                     const model::ModelOptions& student,
                                                     int64_t vocab_size, std::ostream& out);

// The model, data and optimizer of a run, owned here; the other components borrow them. The
// loads are stages of the plan's resolution: each takes the plan so far and returns the plan
// with what it learned (the recompute, the run length); the caller keeps the newest.
class RunSetup {
 public:
  // What set-up loaded goes to `out` (the probe's model and data lines: `err`).
  RunSetup(std::ostream& out, std::ostream& err, bool probe = false);
  ~RunSetup();

  // model.config, the tokenizer (training; the probe only with data files) and, with
  // `load_weights`, the model (without: what load_data needs, for tools that read a run's data).
  // Returns `plan` with train.gradient_checkpointing auto resolved (RunPlan::with_recompute).
  [[nodiscard]] RunPlan load_model(const RunPlan& plan, bool need_tokenizer,
                                   bool load_weights = true);
  // The batcher over data.files (and, for training, the validation batcher), or (the probe
  // without files) over synthetic sequences. Returns `plan` with the run length from the data
  // (RunPlan::with_length; the probe's plan unchanged).
  [[nodiscard]] RunPlan load_data(const RunPlan& plan, int64_t ranks);
  // The optimizer over the parameters `sync` gives this rank, and the LR schedule over `plan`'s
  // run length.
  void make_optimizer(const RunPlan& plan, GradSync& sync);

  const model::Qwen3Config& model_config() const { return mc_; }
  model::Qwen3Model& model() { return *model_; }
  const model::Qwen3Model& model() const { return *model_; }
  const data::Tokenizer* tokenizer() const { return tok_.get(); }
  // The .dat the export copies untrained tensors from ("" for the probe's in-memory init).
  const std::string& source_path() const { return source_path_; }
  bool separate_lm_head() const { return separate_lm_head_; }
  data::Batcher* batcher() { return batcher_.get(); }
  const data::Batcher* batcher() const { return batcher_.get(); }
  // The validation batcher (null without held-out examples); the evaluator takes it.
  std::unique_ptr<data::Batcher> take_validation_batcher() { return std::move(val_batcher_); }
  const data::Batcher* validation_batcher() const { return val_batcher_.get(); }
  // GRPO (DataPlan::prompt_records): the prompts of data.files, each one example of batcher()
  // (which then only orders them: one batch per generation batch), and where each came from
  // ("file:line"), for messages and the rewards.
  const std::vector<data::PromptRecord>& prompts() const { return prompts_; }
  const std::vector<std::string>& prompt_origins() const { return prompt_origins_; }
  optim::PackedAdamW& optimizer() { return *optimizer_; }
  const optim::LrSchedule& schedule() const { return *schedule_; }
  // Optimizer index per owned parameter (in-backward updates).
  const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index() const {
    return optimizer_index_;
  }

 private:
  void load_validation(const RunPlan& plan, std::vector<data::Example>* train, int64_t pad_id);
  // GRPO: the prompts and the batcher that orders them.
  RunPlan load_prompts(const RunPlan& plan);

  std::ostream& out_;
  std::ostream& err_;
  std::ostream& log_;  // out_, or err_ for the probe
  model::Qwen3Config mc_;
  std::unique_ptr<data::Tokenizer> tok_;
  std::unique_ptr<model::Qwen3Model> model_;
  std::string source_path_;
  bool separate_lm_head_ = true;
  std::unique_ptr<data::Batcher> batcher_;
  std::unique_ptr<data::Batcher> val_batcher_;
  std::vector<data::PromptRecord> prompts_;
  std::vector<std::string> prompt_origins_;
  std::unique_ptr<optim::PackedAdamW> optimizer_;
  std::unique_ptr<optim::LrSchedule> schedule_;
  std::unordered_map<const model::Parameter*, int64_t> optimizer_index_;
};

}  // namespace q4::trainer
