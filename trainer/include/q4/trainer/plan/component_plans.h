// The slices of a resolved plan that the run's components take (docs/design.md#trainer-layers):
// plain values, made by RunPlan (plan/run_plan.h) from the resolved config, so that no component
// outside the plan layer reads the raw Config. A component takes its slice once, when it is made,
// after the plan stages it depends on (the run length, the recompute, a resume's grad_accum).
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <string>
#include <vector>

#include "q4/data/chat.h"
#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/trainer/config/config.h"

namespace q4::trainer {

// A frozen model (a distillation teacher, a preference reference) to load beside the model that
// trains: `path` a .dat or Hugging Face folder, `config_path` its config.json (empty: the folder's
// config.json, else `default_config`, the run's model.config). `key` and `config_key` name them
// in errors, `role` in messages.
struct FrozenModelSpec {
  std::string path, config_path, key, config_key, role;
  std::string default_config;  // model.config
  bool keep_dense =
      true;  // an HF folder's dense linears stay dense (else NVFP4 like model.weights)
  bool fake_quant = true;  // its NVFP4 linears compute through the quantizer (ModelOptions)
};
// What GRPO's rollout source reads (step/rollout_source.h): the grpo section, the sampler's seed
// and the rows' layout.
struct RolloutPlan {
  GrpoConfig grpo;               // grpo.*
  int64_t seed = 0;              // train.seed
  int64_t seq_len = 0;           // train.seq_len
  int64_t batch_size = 0;        // train.batch_size: rows per micro-batch
  data::BatcherOptions batcher;  // the rows' layout: unpacked, one example a group
};

// What the objective needs (objectives/objective.h make_objective and its helpers):
// train.objective, its section, and the frozen models it may load.
struct ObjectivePlan {
  ObjectiveKind kind = ObjectiveKind::kCrossEntropy;  // train.objective
  DistillConfig distill;                              // distill.*
  PreferenceConfig preference;                        // preference.*
  GrpoConfig grpo;                                    // grpo.*
  RewardConfig reward;                                // reward.* (GRPO's rewards)
  FrozenModelSpec teacher;                            // distill.teacher (setup.h teacher_spec)
  FrozenModelSpec reference;                          // preference.reference (reference_spec)
  FrozenModelSpec starting_model;  // the starting weights, GRPO's reference (starting_model_spec)
  std::string reference_file;      // <output.dir>/reference_logprobs.dat (the reference pass)
  // The options a frozen model is loaded with where no trained model lends its own (the
  // preference reference, --write-teacher-topk's teacher): options.h model_options.
  model::ModelOptions model;
};

// What --dry-run's check of GRPO's prompt files reads (objectives/grpo.h check_grpo_prompts).
struct PromptCheckPlan {
  std::string tokenizer;                       // model.tokenizer
  data::DatasetOptions dataset;                // options.h dataset_options
  std::vector<std::string> files, eval_files;  // data.files, data.eval_files
  int64_t max_completion_length = 0;           // grpo.max_completion_length
  int64_t seq_len = 0;                         // train.seq_len
  RewardConfig reward;                         // reward.*
};

// guard.max_gpu_gb on the run's device.
struct MemoryGuard {
  double max_gpu_gb = 0;  // 0: off
  c10::Device device{c10::kCPU};
  // The allocator's reserved memory and the device's used memory against max_gpu_gb (GuardStop,
  // run_plan.h, naming `where`); nothing on the CPU or with the guard off.
  void check(const std::string& where) const;
};

// What the evaluator needs (output/evaluator.h): the answers to eval.prompts.
struct EvalPlan {
  c10::Device device{c10::kCPU};
  std::vector<std::string> prompts;  // eval.prompts
  int64_t max_new_tokens = 32;       // eval.max_new_tokens
  // The chat template as configured, resolved when the prompts are rendered (options.h
  // chat_options).
  ChatSettings chat;
};

// What the exporter needs (output/exporter.h).
struct ExportPlan {
  std::string path;        // output.export_path resolved ("" for none)
  std::string output_dir;  // output.dir
  int64_t steps = 0;       // the run length: the final export
  bool overwrite = false;  // --overwrite
  bool export_dense = false;
  bool verify_export = true;
  HfExport hf_export = HfExport::kNone;
  bool lora = false;  // train.method lora: the adapter folder too
  bool lora_merge_aware = true;
  std::string model_dir;      // model.dir
  std::string model_weights;  // model.weights
  std::string model_config;   // model.config
  std::string tokenizer;      // model.tokenizer
  MemoryGuard guard;
};

// What the checkpointer needs (output/checkpointer.h), the LR schedule's terms included.
struct CheckpointPlan {
  std::string output_dir;              // output.dir
  int64_t keep = 2;                    // output.keep
  double checkpoint_minutes = 0;       // output.checkpoint_minutes
  int64_t seed = 0;                    // train.seed
  bool lora = false;                   // train.method lora
  LoraConfig lora_config;              // lora.*
  int64_t batch_size = 1;              // train.batch_size
  int64_t grad_accum = 1;              // as resolved
  int64_t steps = 0;                   // the run length
  double lr = 0;                       // optim.lr
  ScheduleConfig schedule;             // optim.schedule.* (warmup resolved to steps)
  bool allow_schedule_change = false;  // --allow-schedule-change
};

// What the run log needs (report/run_log.h): the summary's settings and the files it writes.
struct ReportPlan {
  c10::Device device{c10::kCPU};
  ProgressStyle progress = ProgressStyle::kAuto;  // log.progress
  std::string output_dir;                         // output.dir
  std::string metrics;                            // log.metrics (a name in output.dir)
  std::string metrics_path;                       // its path ("" when off)
  std::string export_path;                        // ExportPlan::path
  bool tensorboard = true;                        // log.tensorboard
  bool report = true;                             // log.report
  HfExport hf_export = HfExport::kNone;
  bool export_dense = false;
  std::string model_config;  // model.config
  std::string tokenizer;     // model.tokenizer
  // The summary's model line.
  InitKind init = InitKind::kFile;
  int64_t init_seed = 0;
  std::string weights;      // model.weights
  std::string device_name;  // model.device as configured
  Dtype master_dtype = Dtype::kFp16;
  Dtype compute_dtype = Dtype::kFp32;  // resolved
  bool fake_quant = true;
  int64_t data_files = 0;  // data.files
  // The run's shape.
  int64_t steps = 0;
  double epochs_configured = 0;
  int64_t grad_accum = 1;
  int64_t batch_size = 1;
  int64_t seq_len = 0;
  bool packing = true;
  double lr = 0;
  ScheduleConfig schedule;
  int64_t eval_every = 0;  // eval.every
};

// What the run loop needs (app/trainer.cpp): the cadences and the run directory. None of it
// changes in the plan's stages.
struct LoopPlan {
  std::string output_dir;           // output.dir
  std::string config_source;        // the config file (Config::source)
  std::string metrics;              // log.metrics (a name in output.dir, "" for none)
  bool random_init = false;         // model.init random: init.dat is the run's
  int64_t log_every = 1;            // log.every
  int64_t eval_every = 0;           // eval.every
  bool eval_at_start = true;        // eval.at_start
  bool eval_at_end = true;          // eval.at_end
  bool has_prompts = false;         // eval.prompts given
  int64_t max_nonfinite_steps = 0;  // train.max_nonfinite_steps
  int64_t export_every = 0;         // output.export_every
  int64_t checkpoint_every = 0;     // output.checkpoint_every
  bool in_backward_forced = false;  // optim.in_backward: true
};

// What the VRAM probe needs (app/probe_run.cpp) besides the settings its report records
// (RunPlan::probe_settings).
struct ProbePlan {
  std::vector<std::string> data_files;  // data.files (none: synthetic sequences)
  std::string output_dir;               // output.dir (the report's default folder)
  bool quantize_lm_head = true;         // model.quantize_lm_head (the export it times)
};

}  // namespace q4::trainer
