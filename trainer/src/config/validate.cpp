// The cross-field rules of a parsed config (validate_config): each error names its keys.
#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <sstream>

#include "q4/io/bounded_read.h"
#include "q4/io/enum_names.h"
#include "q4/trainer/config/config.h"

namespace fs = std::filesystem;

#include "config/config_text.h"

namespace q4::trainer {
using namespace config_detail;

// ---------------------------------------------------------------------------------------------
// Validation, one function per section, in the order the errors are looked for.

namespace {

// The table's per-field ranges.
void check_field_ranges(const Config& c) {
  // Per-field ranges from the table (parse_config has checked them with line numbers already;
  // this covers configs built or edited in code).
  Config copy = c;
  for (const auto& f : config_fields(copy)) {
    if (const auto* p = std::get_if<int64_t*>(&f.ptr)) check_range(f, **p, "");
    if (const auto* p = std::get_if<double*>(&f.ptr)) check_range(f, **p, "");
    if (const auto* p = std::get_if<IntOrAuto*>(&f.ptr); p && (*p)->value) {
      check_range(f, *(*p)->value, "");
    }
    if (const auto* p = std::get_if<FloatOrAuto*>(&f.ptr); p && (*p)->value) {
      check_range(f, *(*p)->value, "");
    }
  }
}

// model.*: the files a run reads, the device and its compute dtype.
void validate_model(const Config& c) {
  const auto& m = c.model;
  if (m.init == InitKind::kFile && m.weights.empty()) {
    throw ConfigError("config key model.weights: required when model.init is file");
  }
  if (m.init == InitKind::kRandom && m.config.empty()) {
    throw ConfigError(
        "config key model.config: required when model.init is random (or set "
        "model.dir)");
  }
  if (m.config.empty() && m.weights.empty()) {
    throw ConfigError("config key model.config: required (or set model.dir)");
  }
  if (m.config.empty()) {
    throw ConfigError(
        "config key model.config: required to know the architecture (or set "
        "model.dir)");
  }
  if (m.tokenizer.empty()) {
    throw ConfigError("config key model.tokenizer: required (or set model.dir)");
  }
  const bool cuda = device_is_cuda(c);
  if (m.device != "cpu" && !cuda) {
    range_error("model.device", "cpu, cuda or cuda:N", "'" + m.device + "'");
  }
  if (!cuda && m.compute_dtype == DtypeOrAuto::kFp16) {
    throw ConfigError(
        "config key model.compute_dtype: fp16 compute needs model.device cuda "
        "(CPU matmuls run in fp32 or bf16)");
  }
}

// train.*: the micro-batch's size and the trainable set.
void validate_train(const Config& c) {
  const auto& t = c.train;
  // Tokens of one micro-batch: each field's own range still allows 4096 rows of 262,144 tokens.
  // 2^22 tokens is already about 20 GiB per activation tensor at Qwen3-4B's hidden size 2560
  // in bf16, more than any one micro-batch fits; past it the allocator would fail with a raw
  // error instead of naming these keys.
  constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 22;
  if (t.batch_size * t.seq_len > kMaxMicroBatchTokens) {
    throw ConfigError("config keys train.batch_size x train.seq_len: expected at most " +
                      std::to_string(kMaxMicroBatchTokens) + " tokens per micro-batch, found " +
                      std::to_string(t.batch_size) + " x " + std::to_string(t.seq_len) + " = " +
                      std::to_string(t.batch_size * t.seq_len) +
                      " (use train.grad_accum for a larger batch per step)");
  }
  const auto& tr = t.trainable;
  if (tr.layers.kind == LayerSelection::Kind::kList) {
    std::set<int64_t> seen;
    for (int64_t i : tr.layers.layers) {
      if (i < 0) range_error("train.trainable.layers", "layer indices >= 0", std::to_string(i));
      if (!seen.insert(i).second) {
        range_error("train.trainable.layers", "distinct layer indices",
                    "layer " + std::to_string(i) + " twice");
      }
    }
    if (tr.layers.layers.empty()) {
      range_error("train.trainable.layers", "at least one index (or none)", "an empty list");
    }
  }
  const bool layers_train =
      tr.layers.kind != LayerSelection::Kind::kNone && (tr.projections || tr.norms);
  if (!layers_train && !tr.norms && !tr.lm_head && !tr.embeddings) {
    throw ConfigError(
        "config key train.trainable: nothing is trainable (select layers with "
        "projections or norms, or lm_head, or embeddings)");
  }
}

// optim.*: weight decay and the warmup.
void validate_optim(const Config& c) {
  const auto& o = c.optim;
  if (!(o.lr * o.weight_decay < 1)) {  // decoupled decay multiplies weights by 1 - lr * wd
    throw ConfigError(
        "config key optim.weight_decay: optim.lr * optim.weight_decay must be < 1 "
        "(weights would shrink to zero or flip sign), found " +
        fmt_double(o.lr) + " * " + fmt_double(o.weight_decay));
  }
  if (o.schedule.warmup_ratio > 0 && o.schedule.warmup_steps > 0) {
    throw ConfigError(
        "config key optim.schedule.warmup_ratio: set together with optim.schedule.warmup_steps; "
        "give one of them");
  }
  // optim.schedule.warmup_steps > train.steps is not an error: the trainer clips it to the run
  // with a note (clip_warmup_to_run), so a smoke run with --set train.steps=3 just works.
}

// output.*: the export and its formats.
void validate_output(const Config& c) {
  const auto& m = c.model;
  const auto& out = c.output;
  if (out.dir.empty()) range_error("output.dir", "a directory", "an empty value");
  if (out.export_every > 0 && out.export_path == "none") {
    throw ConfigError("config key output.export_every: set, but output.export_path is none");
  }
  if (out.export_dense && m.fake_quant) {
    throw ConfigError(
        "config key output.export_dense: set, but model.fake_quant is true (a straight-through "
        "model's weights are its NVFP4 quantization; set model.fake_quant: false)");
  }
  if (out.export_dense &&
      (out.hf_export == HfExport::kModelOpt || out.hf_export == HfExport::kCompressedTensors)) {
    throw ConfigError(std::string("config key output.export_dense: the ") +
                      enum_name(out.hf_export) +
                      " layout is NVFP4; with dense linears use output.hf_export: bf16");
  }
  if (out.hf_export != HfExport::kNone && out.export_path == "none") {
    throw ConfigError("config key output.hf_export: set, but output.export_path is none");
  }
}

// Recompute and offload: their companions need them on, and offload a GPU.
void validate_recompute(const Config& c) {
  const auto& m = c.model;
  const bool cuda = device_is_cuda(c);
  if (c.train.recompute_layers >= 0 && c.train.gradient_checkpointing != Recompute::kTrue) {
    throw ConfigError(
        "config key train.recompute_layers: set, but train.gradient_checkpointing "
        "is " +
        to_string(c.train.gradient_checkpointing) + " (set it to true)");
  }
  for (const auto& [key, n] : {std::pair<const char*, int64_t>{"train.recompute_keep_attention",
                                                               c.train.recompute_keep_attention},
                               {"train.recompute_keep_mlp", c.train.recompute_keep_mlp}}) {
    if (n > 0 && c.train.gradient_checkpointing != Recompute::kTrue) {
      throw ConfigError(std::string("config key ") + key + ": set, but " +
                        "train.gradient_checkpointing is " +
                        to_string(c.train.gradient_checkpointing) + " (set it to true)");
    }
  }
  if (c.train.offload_layer_inputs && c.train.gradient_checkpointing == Recompute::kFalse) {
    throw ConfigError(
        "config key train.offload_layer_inputs: true, but "
        "train.gradient_checkpointing is false (only recomputed layers offload "
        "their input)");
  }
  if (c.optim.offload != Offload::kNone && !cuda) {
    throw ConfigError("config key optim.offload: " + to_string(c.optim.offload) +
                      ", but model.device is " + m.device +
                      " (offload moves optimizer state from the GPU to the host)");
  }
}

// train.method lora: the adapters' settings.
void validate_lora(const Config& c) {
  if (c.train.method == TrainMethod::kLora) {
    if (!c.model.fake_quant) {
      throw ConfigError(
          "config key train.method: lora, but model.fake_quant is false (adapters "
          "train on the NVFP4 weights)");
    }
    if (c.lora.dropout != 0.0) {
      throw ConfigError("config key lora.dropout: " + fmt_double(c.lora.dropout) +
                        ", but only 0 is supported (a dropout mask would have to be replayed "
                        "by the recompute)");
    }
    if (c.lora.targets.empty()) {
      throw ConfigError("config key lora.targets: empty (name at least one of " +
                        model::lora_target_list(", ") + ")");
    }
    for (const auto& t : c.lora.targets) {
      if (std::find(std::begin(model::kLoraTargets), std::end(model::kLoraTargets), t) ==
          std::end(model::kLoraTargets)) {
        throw ConfigError("config key lora.targets: unknown linear '" + t + "' (expected " +
                          model::lora_target_list(" or ") + ")");
      }
    }
    const bool head =
        std::find(c.lora.targets.begin(), c.lora.targets.end(), "lm_head") != c.lora.targets.end();
    if (head && !c.lora.merge_aware) {
      throw ConfigError(
          "config key lora.targets: lm_head takes a merge-aware adapter only (set "
          "lora.merge_aware: true or drop lm_head)");
    }
    if (head && c.train.trainable.lm_head) {
      throw ConfigError(
          "config key train.trainable.lm_head: true, but lora.targets adapts "
          "lm_head (one or the other)");
    }
  }
}

// Offloaded masters, the memory guard and the metrics file name.
void validate_placement_guard_log(const Config& c) {
  const auto& m = c.model;
  const bool cuda = device_is_cuda(c);
  if (c.optim.offload == Offload::kAll && !c.model.fake_quant) {
    throw ConfigError(
        "config key optim.offload: all, but model.fake_quant is false (the GPU "
        "keeps the NVFP4 codes of offloaded masters; plain precision computes with "
        "the masters themselves)");
  }
  const ForwardWeightsOrAuto fw = c.model.forward_weights;
  if (c.optim.offload == Offload::kAll && fw != ForwardWeightsOrAuto::kAuto &&
      fw != ForwardWeightsOrAuto::kCodes) {
    throw ConfigError("config key model.forward_weights: " + to_string(fw) +
                      ", but optim.offload is all (offloaded masters' linears compute from their "
                      "codes on the GPU; use auto or codes)");
  }
  if (!c.model.fake_quant &&
      (fw == ForwardWeightsOrAuto::kCodes || fw == ForwardWeightsOrAuto::kKept)) {
    throw ConfigError("config key model.forward_weights: " + to_string(fw) +
                      ", but model.fake_quant is false (plain precision computes with the "
                      "masters themselves)");
  }
  if (c.model.master_init == model::MasterInit::kDither && !c.model.fake_quant) {
    throw ConfigError(
        "config key model.master_init: dither, but model.fake_quant is false (plain precision "
        "computes with the masters themselves, so dithering them would change the model)");
  }
  if (c.model.master_init == model::MasterInit::kDither && c.train.method == TrainMethod::kLora) {
    throw ConfigError(
        "config key model.master_init: dither, but train.method is lora (adapted linears keep "
        "their codes; no NVFP4 master trains)");
  }
  if (c.guard.max_gpu_gb > 0 && !cuda) {
    throw ConfigError("config key guard.max_gpu_gb: set, but model.device is " + m.device +
                      " (the guard watches GPU memory)");
  }
  if (c.log.metrics.find('/') != std::string::npos) {
    range_error("log.metrics", "a file name inside output.dir", "'" + c.log.metrics + "'");
  }
}

}  // namespace

// The per-objective rules live with the objectives (objectives/registry.h,
// validate_objective_config).
void validate_config(const Config& c) {
  check_field_ranges(c);
  validate_model(c);
  validate_train(c);
  validate_optim(c);
  validate_output(c);
  validate_recompute(c);
  validate_lora(c);
  validate_placement_guard_log(c);
  validate_reward(c);
}

}  // namespace q4::trainer
