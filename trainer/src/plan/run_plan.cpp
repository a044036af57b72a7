// The run as configured, resolved once: the one place that reads train.steps and turns
// train.epochs / warmup_ratio into a steps-based schedule (docs/trainer.md#epochs).
#include "q4/trainer/plan/run_plan.h"

#include <ATen/Context.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <fmt/format.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"

namespace fs = std::filesystem;

namespace q4::trainer {

RunPlan::RunPlan(const Config& config, const RunOptions& options, const ObjectiveNeeds& needs,
                 bool probe)
    : config_(config),
      configured_train_(config.train),
      configured_forward_weights_(config.model.forward_weights),
      options_(options),
      needs_(needs),
      device_(config.model.device),
      probe_(probe),
      steps_(config.train.steps),
      epochs_(config.train.epochs),
      length_from_data_(config.train.epochs > 0 || config.optim.schedule.warmup_ratio > 0) {
  decide();
}

void RunPlan::decide() {
  const Config& c = config_;
  const bool cuda = device_.is_cuda();
  step_.grad_accum = c.train.grad_accum;
  step_.world = std::max<int64_t>(options_.world.world_size, 1);
  step_.max_grad_norm = c.train.max_grad_norm;
  // Several processes apply their updates after the gradient sync (the probe runs alone).
  step_.in_backward = in_backward_updates(c) && (probe_ || !options_.world.distributed());
  step_.host_accumulation = (probe_ || !options_.world.distributed()) && c.train.grad_accum > 1 &&
                            c.optim.offload == Offload::kAll && cuda;
  recompute_ = configured_recompute(c);
  placement_.moments_on_host = cuda && c.optim.offload != Offload::kNone;
  placement_.masters_on_host = cuda && c.optim.offload == Offload::kAll;
  placement_.gradients_on_host = step_.host_accumulation;
  data_.group_size = needs_.group_size();
  data_.paired_records = needs_.paired_sequences;
  data_.packing = resolved_packing(c, needs_);
  data_.reference_pass = needs_.reference_pass;
  data_.prompt_records = needs_.prompt_records;
}

bool RunPlan::checkpoints_on() const {
  return config_.output.checkpoint_every > 0 || config_.output.checkpoint_minutes > 0;
}

std::string RunPlan::export_path() const { return resolved_export_path(config_); }

std::string RunPlan::metrics_path() const {
  if (config_.log.metrics.empty()) return "";
  return (fs::path(config_.output.dir) / config_.log.metrics).string();
}

RunPlan RunPlan::with_warmup_clipped(std::string* note) const {
  RunPlan p = *this;
  *note = length_from_data_ ? "" : clip_warmup_to_run(p.config_);
  return p;
}

RunPlan RunPlan::with_recompute(const model::Qwen3Config& mc, bool separate_lm_head,
                                int64_t free_bytes, std::string* line) const {
  RunPlan p = *this;
  p.configured_train_ = config_.train;
  line->clear();
  if (config_.train.gradient_checkpointing != Recompute::kAuto) return p;
  const RecomputeChoice r = choose_recompute(mc, config_, separate_lm_head, free_bytes, needs_);
  set_recompute_layers(p.config_, r.recompute_layers, r.layers, r.offload_layer_inputs,
                       r.keep_attention, r.keep_mlp);
  p.decide();
  *line = r.describe();
  return p;
}

RunPlan RunPlan::with_forward_weights(const model::Qwen3Config& mc, bool separate_lm_head,
                                      int64_t free_bytes, std::string* line) const {
  RunPlan p = *this;
  line->clear();
  const Config& c = config_;
  if (c.model.forward_weights != ForwardWeightsOrAuto::kAuto || !device_.is_cuda()) return p;
  if (c.optim.offload == Offload::kAll || !c.model.fake_quant) return p;  // codes / none
  // With the recompute chosen before (recompute saves more time per byte than these do): the
  // fastest whose estimate fits, kept (no per-forward pass), then codes (a dequantize pass).
  const DeviceBudget d = device_budget(c, free_bytes);
  for (const ForwardWeightsOrAuto mode :
       {ForwardWeightsOrAuto::kKept, ForwardWeightsOrAuto::kCodes, ForwardWeightsOrAuto::kSweep}) {
    p.config_.model.forward_weights = mode;
    const int64_t bytes = estimate_budget(mc, p.config_, separate_lm_head, needs_).total_bytes();
    if (bytes <= d.usable_bytes || mode == ForwardWeightsOrAuto::kSweep) {
      *line = fmt::format(
          "model.forward_weights auto: {} (estimate {:.1f} GiB of {:.1f} GiB usable, {})",
          to_string(mode), to_gib(bytes), to_gib(d.usable_bytes), d.source);
      break;
    }
  }
  p.decide();
  return p;
}

Config RunPlan::config_to_save() const {
  Config c = config_;
  c.model.forward_weights = configured_forward_weights_;
  c.train.gradient_checkpointing = configured_train_.gradient_checkpointing;
  c.train.recompute_layers = configured_train_.recompute_layers;
  c.train.offload_layer_inputs = configured_train_.offload_layer_inputs;
  c.train.recompute_keep_attention = configured_train_.recompute_keep_attention;
  c.train.recompute_keep_mlp = configured_train_.recompute_keep_mlp;
  return c;
}

RunPlan RunPlan::with_length(int64_t micro_batches_per_epoch, int64_t ranks,
                             std::string* notes) const {
  RunPlan p = *this;
  *notes = resolve_run_length(p.config_, micro_batches_per_epoch, ranks);
  p.steps_ = p.config_.train.steps;
  return p;
}

RunPlan RunPlan::with_grad_accum(int64_t grad_accum) const {
  RunPlan p = *this;
  p.config_.train.grad_accum = grad_accum;
  p.decide();
  return p;
}

std::string RunPlan::describe() const {
  const auto on_host = [](bool host) { return host ? "host" : "device"; };
  std::string s = fmt::format(
      "plan: {} step{} of {} micro-batch{} x {} rank{}; updates {}{}\n", steps_,
      steps_ == 1 ? "" : "s", step_.grad_accum, step_.grad_accum == 1 ? "" : "es", step_.world,
      step_.world == 1 ? "" : "s", step_.in_backward ? "in the backward" : "after the backward",
      step_.host_accumulation ? ", gradients summed in pinned host memory" : "");
  const RecomputePlan& r = recompute_;
  std::string recompute = r.recompute_auto ? "auto (decided at start)"
                          : !r.enabled     ? "none"
                          : r.layers < 0   ? "every layer"
                                           : fmt::format("the first {} layers", r.layers);
  if (r.enabled && !r.recompute_auto && r.offload_layer_inputs) recompute += ", inputs on the host";
  if (r.enabled && !r.recompute_auto && r.keep_attention + r.keep_mlp > 0) {
    recompute += fmt::format(" (keeping attention {}, MLP {})", r.keep_attention, r.keep_mlp);
  }
  s +=
      fmt::format("plan: recompute {}; moments on the {}, masters on the {}, gradients on the {}\n",
                  recompute, on_host(placement_.moments_on_host),
                  on_host(placement_.masters_on_host), on_host(placement_.gradients_on_host));
  const auto fw = model_options(config_).forward_weights;
  s += fmt::format("plan: trained NVFP4 linears' forward weights: {}{}\n", io::enum_name(fw),
                   config_.model.forward_weights == ForwardWeightsOrAuto::kAuto &&
                           device_.is_cuda() && config_.model.fake_quant &&
                           config_.optim.offload != Offload::kAll
                       ? " until auto decides at start"
                       : "");
  s += fmt::format(
      "plan: data rows in groups of {}, packing {}{}\n", data_.group_size,
      data_.packing ? "on" : "off",
      data_.reference_pass ? ", reference log-probabilities before the first step" : "");
  return s;
}

LoopPlan RunPlan::loop_plan() const {
  const Config& c = config_;
  LoopPlan l;
  l.output_dir = c.output.dir;
  l.config_source = c.source;
  l.metrics = c.log.metrics;
  l.random_init = c.model.init == InitKind::kRandom;
  l.log_every = c.log.every;
  l.eval_every = c.eval.every;
  l.eval_at_start = c.eval.at_start;
  l.eval_at_end = c.eval.at_end;
  l.has_prompts = !c.eval.prompts.empty();
  l.max_nonfinite_steps = c.train.max_nonfinite_steps;
  l.export_every = c.output.export_every;
  l.checkpoint_every = c.output.checkpoint_every;
  l.in_backward_forced = c.optim.in_backward == InBackward::kTrue;
  return l;
}

ProbePlan RunPlan::probe_plan() const {
  return ProbePlan{config_.data.files, config_.output.dir, config_.model.quantize_lm_head};
}

ObjectivePlan RunPlan::objective_plan() const { return trainer::objective_plan(config_); }

PromptCheckPlan RunPlan::prompt_check_plan() const { return trainer::prompt_check_plan(config_); }

data::BatcherOptions RunPlan::batcher_options(int64_t pad_id) const {
  return trainer::batcher_options(config_, pad_id, data_.packing, data_.group_size);
}

RolloutPlan RunPlan::rollout_plan(int64_t pad_id) const {
  RolloutPlan r;
  r.grpo = config_.grpo;
  r.seed = config_.train.seed;
  r.seq_len = config_.train.seq_len;
  r.batch_size = config_.train.batch_size;
  r.batcher = trainer::batcher_options(config_, pad_id, /*pack=*/false, 1);
  return r;
}

nlohmann::json RunPlan::probe_settings() const {
  const Config& c = config_;
  return {{"config", c.source},
          {"batch_size", c.train.batch_size},
          {"seq_len", c.train.seq_len},
          {"grad_accum", c.train.grad_accum},
          {"master_dtype", to_string(c.model.master_dtype)},
          {"compute_dtype", to_string(resolved_compute_dtype(c))},
          {"gradient_checkpointing", to_string(c.train.gradient_checkpointing)},
          {"recompute_layers", c.train.recompute_layers},
          {"recompute_keep_attention", c.train.recompute_keep_attention},
          {"recompute_keep_mlp", c.train.recompute_keep_mlp},
          {"mlp_chunk_tokens", resolved_mlp_chunk_tokens(c)},
          {"forward_weights", io::enum_name(model_options(c).forward_weights)},
          {"optim_state", to_string(c.optim.state)},
          {"data", c.data.files.empty() ? "synthetic" : "files"}};
}

void RunPlan::check_device() const { check_device_available(config_); }

std::string RunPlan::ignored_settings_warning() const {
  return trainer::ignored_settings_warning(config_, needs_);
}

void RunPlan::check_inputs(bool need_data) const { check_input_files(config_, needs_, need_data); }

void RunPlan::check_outputs() const {
  check_output_paths(run_paths(config_), needs_, options_.overwrite);
}

std::vector<std::string> RunPlan::run_dir_leftovers() const {
  return trainer::run_dir_leftovers(run_paths(config_), needs_);
}

std::vector<std::string> RunPlan::clean_stale_files() const {
  return trainer::clean_stale_files(run_paths(config_));
}

MemoryBudget RunPlan::memory_estimate(const model::Qwen3Config& mc, bool separate_lm_head) const {
  return estimate_budget(mc, config_, separate_lm_head, needs_);
}

std::string RunPlan::moe_summary(const model::Qwen3Config& mc, bool separate_lm_head) const {
  return trainer::moe_summary(mc, config_, separate_lm_head);
}

std::string RunPlan::moe_lora_note(const model::Qwen3Config& mc) const {
  return trainer::moe_lora_note(mc, config_);
}

double RunPlan::flops_per_token(const model::Qwen3Config& mc, bool separate_lm_head) const {
  return train_flops_per_token(mc, config_, separate_lm_head);
}

void MemoryGuard::check(const std::string& where) const {
  if (!(max_gpu_gb > 0) || !device.is_cuda()) return;
  const auto m = memory_snapshot(device);
  const double limit = max_gpu_gb * 1e9;
  auto over = [&](const std::optional<int64_t>& v) { return v && static_cast<double>(*v) > limit; };
  if (over(m.reserved_bytes) || over(m.device_used_bytes)) {
    throw GuardStop(fmt::format(
        "guard: GPU memory passed guard.max_gpu_gb = {:.2f} GB {} (allocator reserved {:.2f} GB, "
        "device used {:.2f} GB); stopped without export",
        max_gpu_gb, where, to_gb(m.reserved_bytes.value_or(0)),
        to_gb(m.device_used_bytes.value_or(0))));
  }
}

MemoryGuard RunPlan::guard() const { return MemoryGuard{config_.guard.max_gpu_gb, device_}; }

EvalPlan RunPlan::eval_plan() const {
  const Config& c = config_;
  EvalPlan e;
  e.device = device_;
  e.prompts = c.eval.prompts;
  e.max_new_tokens = c.eval.max_new_tokens;
  e.chat = chat_settings(c);
  return e;
}

ExportPlan RunPlan::export_plan() const {
  const Config& c = config_;
  ExportPlan e;
  e.path = export_path();
  e.output_dir = c.output.dir;
  e.steps = steps_;
  e.overwrite = options_.overwrite;
  e.export_dense = c.output.export_dense;
  e.verify_export = c.output.verify_export;
  e.hf_export = c.output.hf_export;
  e.lora = c.train.method == TrainMethod::kLora;
  e.lora_merge_aware = c.lora.merge_aware;
  e.model_dir = c.model.dir;
  e.model_weights = c.model.weights;
  e.model_config = c.model.config;
  e.tokenizer = c.model.tokenizer;
  e.guard = guard();
  return e;
}

CheckpointPlan RunPlan::checkpoint_plan() const {
  const Config& c = config_;
  CheckpointPlan k;
  k.output_dir = c.output.dir;
  k.keep = c.output.keep;
  k.checkpoint_minutes = c.output.checkpoint_minutes;
  k.seed = c.train.seed;
  k.lora = c.train.method == TrainMethod::kLora;
  k.lora_config = c.lora;
  k.batch_size = c.train.batch_size;
  k.grad_accum = step_.grad_accum;
  k.steps = steps_;
  k.lr = c.optim.lr;
  k.schedule = c.optim.schedule;
  k.allow_schedule_change = options_.allow_schedule_change;
  return k;
}

ReportPlan RunPlan::report_plan() const {
  const Config& c = config_;
  ReportPlan r;
  r.device = device_;
  r.progress = c.log.progress;
  r.output_dir = c.output.dir;
  r.metrics = c.log.metrics;
  r.metrics_path = metrics_path();
  r.export_path = export_path();
  r.tensorboard = c.log.tensorboard;
  r.report = c.log.report;
  r.hf_export = c.output.hf_export;
  r.export_dense = c.output.export_dense;
  r.model_config = c.model.config;
  r.tokenizer = c.model.tokenizer;
  r.init = c.model.init;
  r.init_seed = c.model.init_seed;
  r.weights = c.model.weights;
  r.device_name = c.model.device;
  r.master_dtype = c.model.master_dtype;
  r.compute_dtype = resolved_compute_dtype(c);
  r.fake_quant = c.model.fake_quant;
  r.data_files = static_cast<int64_t>(c.data.files.size());
  r.steps = steps_;
  r.epochs_configured = epochs_;
  r.grad_accum = step_.grad_accum;
  r.batch_size = c.train.batch_size;
  r.seq_len = c.train.seq_len;
  r.packing = data_.packing;
  r.lr = c.optim.lr;
  r.schedule = c.optim.schedule;
  r.eval_every = c.eval.every;
  return r;
}

void check_device_available(const Config& c) {
  if (!device_is_cuda(c)) return;
  const std::string fix = "; or set model.device: cpu";
  if (!at::hasCUDA()) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
    throw ConfigError("config key model.device: " + c.model.device +
                      ", but no CUDA device is visible to this process (check nvidia-smi and "
                      "CUDA_VISIBLE_DEVICES)" +
                      fix);
#else
    throw ConfigError("config key model.device: " + c.model.device +
                      ", but this q4train is a CPU-only build (LibTorch " + TORCH_VERSION +
                      " without CUDA): build it against LibTorch 2.x with CUDA (README, GPU "
                      "build)" +
                      fix);
#endif
  }
  const at::Device d(c.model.device);
  if (d.has_index()) {
    const c10::impl::VirtualGuardImpl impl(c10::DeviceType::CUDA);
    const int n = static_cast<int>(impl.deviceCount());
    if (d.index() >= n) {
      throw ConfigError(fmt::format(
          "config key model.device: {}, but this process sees {} CUDA device{} (cuda:0 to "
          "cuda:{}){}",
          c.model.device, n, n == 1 ? "" : "s", n - 1, fix));
    }
  }
}

std::string clip_warmup_to_run(Config& c) {
  const int64_t steps = c.train.steps;
  const int64_t warmup = c.optim.schedule.warmup_steps;
  if (steps <= 0 || warmup <= steps) return "";
  c.optim.schedule.warmup_steps = steps;
  return fmt::format(
      "note: optim.schedule.warmup_steps {} is longer than the run (train.steps {}); clipped to "
      "{}",
      warmup, steps, steps);
}

std::string resolve_run_length(Config& c, int64_t micro_batches_per_epoch, int64_t ranks) {
  std::string notes;
  const int64_t per_step = c.train.grad_accum * std::max<int64_t>(ranks, 1);
  if (c.train.epochs > 0) {
    // The batcher never lets a micro-batch cross an epoch's end, so an epoch is exactly
    // micro_batches_per_epoch micro-batches (with packing, epoch 0's count: later epochs may
    // differ by a few rows); the tolerance keeps 3 x 4 / 12 from rounding up to 2.
    const double exact = c.train.epochs * static_cast<double>(micro_batches_per_epoch) /
                         static_cast<double>(per_step);
    const auto steps = std::max<int64_t>(1, static_cast<int64_t>(std::ceil(exact - 1e-9)));
    notes += fmt::format(
        "train.epochs {} -> train.steps {} ({} micro-batch{} per epoch, {} per step: "
        "train.grad_accum {} x {} rank{})\n",
        c.train.epochs, steps, micro_batches_per_epoch, micro_batches_per_epoch == 1 ? "" : "es",
        per_step, c.train.grad_accum, ranks, ranks == 1 ? "" : "s");
    c.train.steps = steps;
    c.train.epochs = 0;
  }
  if (c.optim.schedule.warmup_ratio > 0) {
    const auto warmup = static_cast<int64_t>(
        std::llround(c.optim.schedule.warmup_ratio * static_cast<double>(c.train.steps)));
    notes += fmt::format("optim.schedule.warmup_ratio {} -> optim.schedule.warmup_steps {}\n",
                         c.optim.schedule.warmup_ratio, warmup);
    c.optim.schedule.warmup_steps = warmup;
    c.optim.schedule.warmup_ratio = 0;
  }
  if (const std::string note = clip_warmup_to_run(c); !note.empty()) notes += note + "\n";
  return notes;
}

}  // namespace q4::trainer
