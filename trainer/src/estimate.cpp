// Option mapping and the analytic memory budget (see estimate.h).
#include "q4/trainer/estimate.h"

#include <algorithm>
#include <fmt/format.h>

#include "q4/optim/state_codec.h"
#include "q4/trainer/memory.h"

namespace q4::trainer {

at::ScalarType to_scalar_type(Dtype d) {
  switch (d) {
    case Dtype::kFp16:
      return at::kHalf;
    case Dtype::kBf16:
      return at::kBFloat16;
    case Dtype::kFp32:
      return at::kFloat;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid Dtype ", static_cast<int>(d));
}

optim::StateMode to_optim(MomentState s) {
  switch (s) {
    case MomentState::kFp32:
      return optim::StateMode::kFp32;
    case MomentState::kInt8:
      return optim::StateMode::kInt8;
    case MomentState::k4Bit:
      return optim::StateMode::k4Bit;
    case MomentState::kNvfp4:
      return optim::StateMode::kNvfp4;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid MomentState ", static_cast<int>(s));
}

optim::MasterRounding to_optim(MasterRounding r) {
  switch (r) {
    case MasterRounding::kStochastic:
      return optim::MasterRounding::kStochastic;
    case MasterRounding::kNearest:
      return optim::MasterRounding::kNearest;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid MasterRounding ", static_cast<int>(r));
}

optim::LrScheduleKind to_optim(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kConstant:
      return optim::LrScheduleKind::kConstant;
    case ScheduleKind::kLinear:
      return optim::LrScheduleKind::kLinear;
    case ScheduleKind::kCosine:
      return optim::LrScheduleKind::kCosine;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid ScheduleKind ", static_cast<int>(k));
}

data::DataFormat to_data(DataFormat f) {
  switch (f) {
    case DataFormat::kAuto:
      return data::DataFormat::kAuto;
    case DataFormat::kTsv:
      return data::DataFormat::kTsv;
    case DataFormat::kJsonl:
      return data::DataFormat::kJsonl;
    case DataFormat::kText:
      return data::DataFormat::kText;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid DataFormat ", static_cast<int>(f));
}

data::OnError to_data(OnError e) {
  switch (e) {
    case OnError::kFail:
      return data::OnError::kFail;
    case OnError::kSkip:
      return data::OnError::kSkip;
  }
  TORCH_INTERNAL_ASSERT(false, "invalid OnError ", static_cast<int>(e));
}

data::Truncation to_data(Truncation t) {
  switch (t) {
    case Truncation::kCutLeft:
      return data::Truncation::kCutLeft;
    case Truncation::kCutRight:
      return data::Truncation::kCutRight;
    case Truncation::kDrop:
      return data::Truncation::kDrop;
    case Truncation::kAuto:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "Truncation ", static_cast<int>(t), " must be resolved first");
}

model::HfFormat to_model(HfExport e) {
  switch (e) {
    case HfExport::kModelOpt:
      return model::HfFormat::kModelOpt;
    case HfExport::kCompressedTensors:
      return model::HfFormat::kCompressedTensors;
    case HfExport::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "HfExport ", static_cast<int>(e), " has no HF format");
}

model::TrainableSpec trainable_spec(const Config& c) {
  const auto& t = c.train.trainable;
  model::TrainableSpec s;
  s.projections = t.projections;
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
  model::ModelOptions o;
  o.master_dtype = to_scalar_type(c.model.master_dtype);
  o.compute_dtype = to_scalar_type(resolved_compute_dtype(c));
  switch (c.model.grad_dtype) {
    case DtypeOrAuto::kAuto:
      break;  // the model library picks (fp32 with fp32 masters, else bf16)
    case DtypeOrAuto::kFp32:
      o.grad_dtype = at::kFloat;
      break;
    case DtypeOrAuto::kBf16:
      o.grad_dtype = at::kBFloat16;
      break;
    case DtypeOrAuto::kFp16:
      o.grad_dtype = at::kHalf;
      break;
  }
  o.device = at::Device(c.model.device);
  o.trainable = trainable_spec(c);
  o.gradient_checkpointing = c.train.gradient_checkpointing;
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
  o.state_mode = to_optim(c.optim.state);
  o.chunk_rows = c.optim.chunk_rows;
  o.rounding = to_optim(c.optim.master_rounding);
  o.seed = static_cast<uint64_t>(c.train.seed);
  // The trainer counts consecutive skips itself; the optimizer allows one more.
  o.max_consecutive_nonfinite = c.train.max_nonfinite_steps + 1;
  return o;
}

std::vector<ParamShape> parameter_shapes(const model::Qwen3Config& mc, const Config& c,
                                         bool separate_lm_head) {
  const auto spec = trainable_spec(c);
  std::vector<ParamShape> out;
  for (const auto& p : model::qwen3_parameters(mc, separate_lm_head)) {
    // Weight decay on the linears (lm_head included), not on the embedding or the norms.
    out.push_back({p.name, p.shape, spec.trains(p, mc.num_hidden_layers, !separate_lm_head),
                   p.kind == model::ParamKind::kQuantizedLinear});
  }
  return out;
}

MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head) {
  const auto opt = model_options(c);
  model::GradientLifetime life;
  life.applied_in_backward = in_backward_updates(c);
  life.accumulation_steps = c.train.grad_accum;
  const auto m =
      model::estimate_memory(mc, opt, c.train.batch_size, c.train.seq_len, separate_lm_head, life);
  MemoryBudget b;
  b.masters_bytes = m.master_bytes;
  b.frozen_bytes = m.frozen_bytes;
  const auto mode = to_optim(c.optim.state);
  const auto ao = adamw_options(c);
  int64_t scratch_elems = 0;  // the CPU step's chunk: chunk_rows rows of the widest tensor
  for (const auto& p : parameter_shapes(mc, c, separate_lm_head)) {
    if (!p.trainable) continue;
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    b.trainable_elements += n;
    scratch_elems = std::max(scratch_elems, std::min(n, ao.chunk_rows * p.shape.back()));
    if (mode == optim::StateMode::kFp32 || n < ao.small_tensor_threshold) {
      b.moments_bytes += 8 * n;
    } else {
      b.moments_bytes += 2 * optim::packed_moment_bytes(mode, n);
    }
  }
  // CUDA updates are fused kernels without scratch; the CPU step uses an arena of at most ~16
  // fp32 values per chunk element (PackedAdamW::scratch_peak_bytes), kept from the first update
  // on (the trainer does not release it), so it is counted in every phase.
  const int64_t scratch = opt.device.is_cuda() ? 0 : 16 * 4 * scratch_elems;
  for (const auto& mp : m.phases) {
    BudgetPhase p;
    p.name = model::memory_phase_name(mp.kind);
    p.gradients_bytes = mp.grad_bytes;
    p.activations_bytes = mp.activation_bytes;
    p.logits_bytes = mp.loss_bytes;
    p.optimizer_bytes = scratch;
    b.phases.push_back(p);
  }
  for (size_t i = 0; i < b.phases.size(); ++i) {
    if (b.phases[i].total_bytes() > b.phases[b.peak_phase].total_bytes()) b.peak_phase = i;
  }
  if (!b.phases.empty()) {
    const BudgetPhase& peak = b.phases[b.peak_phase];
    b.gradients_bytes = peak.gradients_bytes;
    b.activations_bytes = peak.activations_bytes;
    b.logits_bytes = peak.logits_bytes;
    b.optimizer_bytes = peak.optimizer_bytes;
  }
  return b;
}

const std::string& MemoryBudget::peak_phase_name() const {
  static const std::string kNone = "none";
  return phases.empty() ? kNone : phases[peak_phase].name;
}

nlohmann::json MemoryBudget::to_json() const {
  nlohmann::json ph = nlohmann::json::array();
  for (const auto& p : phases) {
    ph.push_back({{"name", p.name},
                  {"gradients_bytes", p.gradients_bytes},
                  {"activations_bytes", p.activations_bytes},
                  {"logits_bytes", p.logits_bytes},
                  {"optimizer_bytes", p.optimizer_bytes},
                  {"total_bytes", persistent_bytes() + p.total_bytes()}});
  }
  return {{"masters_bytes", masters_bytes},
          {"frozen_bytes", frozen_bytes},
          {"gradients_bytes", gradients_bytes},
          {"moments_bytes", moments_bytes},
          {"activations_bytes", activations_bytes},
          {"logits_bytes", logits_bytes},
          {"optimizer_bytes", optimizer_bytes},
          {"persistent_bytes", persistent_bytes()},
          {"total_bytes", total_bytes()},
          {"peak_phase", peak_phase_name()},
          {"phases", ph},
          {"trainable_elements", trainable_elements}};
}

std::string MemoryBudget::to_table() const {
  std::string s;
  auto row = [&](const char* name, int64_t bytes, const char* note) {
    s += fmt::format("  {:<20} {:>9.3f} GiB  {}\n", name, to_gib(bytes), note);
  };
  row("masters", masters_bytes, "whole run");
  row("frozen", frozen_bytes, "whole run");
  row("moments", moments_bytes, "whole run");
  s += fmt::format("  {:<20} {:>9} {:>11} {:>9} {:>9} {:>9}  (GiB; total = whole run + phase)\n",
                   "phase", "gradients", "activations", "logits", "optimizer", "total");
  for (size_t i = 0; i < phases.size(); ++i) {
    const BudgetPhase& p = phases[i];
    s += fmt::format("  {:<20} {:>9.3f} {:>11.3f} {:>9.3f} {:>9.3f} {:>9.3f}{}\n", p.name,
                     to_gib(p.gradients_bytes), to_gib(p.activations_bytes), to_gib(p.logits_bytes),
                     to_gib(p.optimizer_bytes), to_gib(persistent_bytes() + p.total_bytes()),
                     i == peak_phase ? "  <- peak" : "");
  }
  s += fmt::format("  peak phase: {}\n", peak_phase_name());
  row("total", total_bytes(), "whole run + the peak phase");
  s += fmt::format("  trainable elements: {}\n", trainable_elements);
  return s;
}

double train_flops_per_token(const model::Qwen3Config& mc, int64_t seq_len) {
  const double layer =
      static_cast<double>(mc.hidden_size) * (2.0 * mc.q_dim() + 2.0 * mc.kv_dim()) +
      3.0 * mc.hidden_size * mc.intermediate_size;
  const double matmul_params =
      layer * mc.num_hidden_layers + static_cast<double>(mc.vocab_size) * mc.hidden_size;
  return 6.0 * matmul_params +
         12.0 * mc.num_hidden_layers * static_cast<double>(seq_len) * mc.q_dim();
}

}  // namespace q4::trainer
