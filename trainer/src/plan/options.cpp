// Library options from the run's resolved config (the run plan's): the model's, the optimizer's
// and its LR schedule's, the data loader's and the batcher's, the HF export format. The one
// place where config fields become library option structs; the enumerated settings the
// libraries define are already their enums (config.h).
#include "q4/trainer/plan/options.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <utility>

namespace q4::trainer {

namespace {

// The library value of a config enum from its (config value, library value) table; a config
// value without one (an `auto` or `none` not resolved first) is an internal error.
template <typename From, typename To, size_t N>
To library_value(From v, const std::pair<From, To> (&table)[N], const char* what) {
  for (const auto& [from, to] : table) {
    if (from == v) return to;
  }
  TORCH_INTERNAL_ASSERT(false, what, " ", static_cast<int>(v), " has no library value");
}

}  // namespace

at::ScalarType to_scalar_type(Dtype d) {
  static constexpr std::pair<Dtype, at::ScalarType> kTable[] = {
      {Dtype::kFp16, at::kHalf}, {Dtype::kBf16, at::kBFloat16}, {Dtype::kFp32, at::kFloat}};
  return library_value(d, kTable, "Dtype");
}

model::HfFormat to_model(HfExport e) {
  static constexpr std::pair<HfExport, model::HfFormat> kTable[] = {
      {HfExport::kModelOpt, model::HfFormat::kModelOpt},
      {HfExport::kCompressedTensors, model::HfFormat::kCompressedTensors},
      {HfExport::kBf16, model::HfFormat::kBf16}};
  return library_value(e, kTable, "HfExport");
}

model::TrainableSpec trainable_spec(const Config& c) {
  const auto& t = c.train.trainable;
  model::TrainableSpec s;
  s.projections = t.projections && c.train.method == TrainMethod::kFull;  // lora: adapters train
  s.router = t.router && c.train.method == TrainMethod::kFull;
  s.norms = t.norms;
  s.lm_head = t.lm_head;
  s.embeddings = t.embeddings;
  switch (t.layers.kind) {
    case LayerSelection::Kind::kAll:
      s.last_n_layers = -1;
      break;
    case LayerSelection::Kind::kNone:
      s.last_n_layers = 0;
      s.projections = false;
      s.router = false;
      break;
    case LayerSelection::Kind::kLast:
      s.last_n_layers = t.layers.last_n;
      break;
    case LayerSelection::Kind::kList:
      s.layers = t.layers.layers;
      break;
  }
  return s;
}

model::ModelOptions model_options(const Config& c) {
  return model_options(c, configured_recompute(c));
}

model::ModelOptions model_options(const Config& c, const RecomputePlan& recompute) {
  model::ModelOptions o;
  o.master_dtype = to_scalar_type(c.model.master_dtype);
  o.compute_dtype = to_scalar_type(resolved_compute_dtype(c));
  // auto: the model library picks (fp32 with fp32 masters, else bf16).
  static constexpr std::pair<DtypeOrAuto, at::ScalarType> kGradDtype[] = {
      {DtypeOrAuto::kFp32, at::kFloat},
      {DtypeOrAuto::kBf16, at::kBFloat16},
      {DtypeOrAuto::kFp16, at::kHalf}};
  if (c.model.grad_dtype != DtypeOrAuto::kAuto) {
    o.grad_dtype = library_value(c.model.grad_dtype, kGradDtype, "DtypeOrAuto");
  }
  o.device = at::Device(c.model.device);
  o.trainable = trainable_spec(c);
  o.gradient_checkpointing = recompute.enabled;
  if (recompute.enabled && !recompute.recompute_auto) {
    o.recompute_layers = recompute.layers;
    o.recompute_keep_attention = recompute.keep_attention;
    o.recompute_keep_mlp = recompute.keep_mlp;
  }
  o.offload_layer_inputs = recompute.offload_layer_inputs;
  o.mlp_chunk_tokens = resolved_mlp_chunk_tokens(c);
  o.fake_quant = c.model.fake_quant;
  o.block_rule = c.quant.block_rule;
  o.master_init = c.model.master_init;
  o.master_init_seed = static_cast<uint64_t>(c.train.seed);
  o.offload_masters = c.optim.offload == Offload::kAll;
  // auto until RunPlan::with_forward_weights writes its choice into the config: sweep.
  switch (c.model.forward_weights) {
    case ForwardWeightsOrAuto::kAuto:
    case ForwardWeightsOrAuto::kSweep:
      o.forward_weights = model::ForwardWeights::kSweep;
      break;
    case ForwardWeightsOrAuto::kCodes:
      o.forward_weights = model::ForwardWeights::kCodes;
      break;
    case ForwardWeightsOrAuto::kKept:
      o.forward_weights = model::ForwardWeights::kKept;
      break;
  }
  if (o.offload_masters) o.forward_weights = model::ForwardWeights::kCodes;
  o.router_aux_loss_coef = c.train.router_aux_loss_coef.value;
  o.router_z_loss_coef = c.train.router_z_loss_coef;
  if (c.train.method == TrainMethod::kLora) {
    o.lora.rank = c.lora.rank;
    o.lora.alpha = c.lora.alpha;
    o.lora.targets = c.lora.targets;
    o.lora.merge_aware = c.lora.merge_aware;
    o.lora.seed = static_cast<uint64_t>(c.train.seed);
    // auto: when no layer recomputes (resolved recompute, or false), whose graphs hold every
    // adapted linear's weight from its forward to its backward anyway.
    o.cache_adapted_weights =
        !c.lora.merge_aware &&
        (c.lora.cache_base_weights == AutoBool::kTrue ||
         (c.lora.cache_base_weights == AutoBool::kAuto && !o.gradient_checkpointing));
  }
  o.loss_chunk_tokens = c.model.loss_chunk_tokens;
  return o;
}

optim::AdamWOptions adamw_options(const Config& c) {
  optim::AdamWOptions o;
  o.lr = c.optim.lr;
  o.beta1 = c.optim.beta1;
  o.beta2 = c.optim.beta2;
  o.eps = c.optim.eps;
  o.weight_decay = c.optim.weight_decay;
  o.state_mode = c.optim.state;
  o.chunk_rows = c.optim.chunk_rows;
  o.rounding = c.optim.master_rounding;
  o.offload_moments = c.optim.offload != Offload::kNone;
  o.seed = static_cast<uint64_t>(c.train.seed);
  // The trainer counts consecutive skips itself; the optimizer allows one more.
  o.max_consecutive_nonfinite = c.train.max_nonfinite_steps + 1;
  return o;
}

optim::LrScheduleOptions lr_schedule_options(const Config& c, int64_t steps) {
  optim::LrScheduleOptions s;
  s.kind = c.optim.schedule.kind;
  s.peak_lr = c.optim.lr;
  s.warmup_steps = c.optim.schedule.warmup_steps;
  s.total_steps = std::max<int64_t>(steps, c.optim.schedule.warmup_steps + 1);
  s.min_lr = c.optim.lr * c.optim.schedule.min_lr_ratio;
  return s;
}

data::ChatOptions chat_options(const Config& c) { return chat_options(chat_settings(c)); }

data::ChatOptions chat_options(const ChatSettings& chat) {
  data::ChatOptions o;
  o.chat_template =
      data::resolve_chat_template(chat.chat_template, data::tokenizer_folder(chat.tokenizer));
  if (chat.enable_thinking != AutoBool::kAuto) {
    o.enable_thinking = chat.enable_thinking == AutoBool::kTrue;
  }
  return o;
}

data::DatasetOptions dataset_options(const Config& c) {
  data::DatasetOptions o;
  o.format = c.data.format;
  o.system_prompt = c.data.system_prompt;
  o.on_error = c.data.on_error;
  o.text_unit = c.data.text_unit;
  o.skip_hint = "set data.on_error: skip";
  o.preference_hint = "set train.objective: preference to train on preference pairs";
  o.chat = chat_options(c);
  return o;
}

RecomputePlan configured_recompute(const Config& c) {
  RecomputePlan r;
  switch (c.train.gradient_checkpointing) {
    case Recompute::kTrue:
      r.enabled = true;
      r.layers = c.train.recompute_layers;
      r.keep_attention = c.train.recompute_keep_attention;
      r.keep_mlp = c.train.recompute_keep_mlp;
      break;
    case Recompute::kFalse:
      r.enabled = false;
      break;
    case Recompute::kAuto:
      // Before it is resolved (RunPlan::with_recompute): every layer on CUDA, none on the CPU.
      r.enabled = device_is_cuda(c);
      r.recompute_auto = r.enabled;
      break;
  }
  r.offload_layer_inputs = r.enabled && c.train.offload_layer_inputs;
  return r;
}

RecomputePlan RecomputePlan::first(int64_t n, int64_t num_layers, bool offload_layer_inputs,
                                   int64_t keep_attention, int64_t keep_mlp) {
  RecomputePlan r;
  r.enabled = n > 0;
  r.layers = n > 0 && n < num_layers ? n : -1;
  r.offload_layer_inputs = n > 0 && offload_layer_inputs;
  r.keep_attention = n > 0 ? keep_attention : 0;
  r.keep_mlp = n > 0 ? keep_mlp : 0;
  return r;
}

data::BatcherOptions batcher_options(const Config& c, int64_t pad_id, bool pack, int64_t group) {
  data::BatcherOptions bo;
  bo.batch_size = c.train.batch_size;
  bo.max_seq_len = c.train.seq_len;
  bo.seed = static_cast<uint64_t>(c.train.seed);
  bo.shuffle = c.data.shuffle;
  bo.pack = pack;
  bo.pack_window = c.data.pack_window;
  bo.truncation = c.data.truncation;
  bo.pad_id = pad_id;
  // A preference pair's chosen and rejected answers stay together (the objective pairs them).
  bo.group = group;
  if (device_is_cuda(c)) {
    bo.fixed_len = bo.pack;
    bo.pad_multiple = 64;
    bo.flatten = true;  // varlen attention: rows end to end, no padding between them
  }
  return bo;
}

RunPaths run_paths(const Config& c) {
  RunPaths p;
  p.output_dir = c.output.dir;
  p.export_path = resolved_export_path(c);
  p.metrics = c.log.metrics;
  p.report = c.log.report;
  p.hf_export = c.output.hf_export != HfExport::kNone;
  p.lora = c.train.method == TrainMethod::kLora;
  p.random_init = c.model.init == InitKind::kRandom;
  p.config_source = c.source;
  p.model_config = c.model.config;
  p.tokenizer = c.model.tokenizer;
  p.weights = c.model.weights;
  p.data_files = c.data.files;
  p.eval_files = c.data.eval_files;
  return p;
}

}  // namespace q4::trainer
