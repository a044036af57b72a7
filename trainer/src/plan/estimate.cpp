// The analytic memory budget (see estimate.h).
#include "q4/trainer/plan/estimate.h"

#include <fmt/format.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <tuple>

#include "q4/optim/state_codec.h"
#include "q4/optim/host_accumulation.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/memory.h"

namespace q4::trainer {

std::vector<ParamShape> parameter_shapes(const model::Qwen3Config& mc, const Config& c,
                                         bool separate_lm_head) {
  const auto spec = trainable_spec(c);
  const auto lora = model_options(c).lora;
  std::vector<ParamShape> out;
  std::vector<ParamShape> adapters;
  for (const auto& p : model::qwen3_parameters(mc, separate_lm_head)) {
    // Weight decay on the linears (lm_head included), not on the embedding or the norms.
    out.push_back({p.name, p.shape, spec.trains(p, mc.num_hidden_layers, !separate_lm_head),
                   p.kind == model::ParamKind::kQuantizedLinear});
    if (lora.adapts(p, spec, mc.num_hidden_layers)) {  // LoRA A (rank, in) and B (out, rank)
      adapters.push_back(
          {model::lora_param_name(p.name, "lora_A"), {lora.rank, p.shape[1]}, true, true});
      adapters.push_back(
          {model::lora_param_name(p.name, "lora_B"), {p.shape[0], lora.rank}, true, true});
    }
  }
  out.insert(out.end(), adapters.begin(), adapters.end());
  return out;
}

std::string lora_summary(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head) {
  if (c.train.method != TrainMethod::kLora) return "";
  int64_t adapters = 0, adapter_elems = 0, other = 0, total = 0;
  for (const auto& p : parameter_shapes(mc, c, separate_lm_head)) {
    int64_t n = 1;
    for (int64_t d : p.shape) n *= d;
    const bool adapter = p.name.find(".lora_") != std::string::npos;
    if (!adapter) total += n;
    if (adapter) {
      ++adapters;
      adapter_elems += n;
    } else if (p.trainable) {
      other += n;
    }
  }
  std::string targets;
  for (const auto& t : c.lora.targets) targets += (targets.empty() ? "" : ", ") + t;
  return fmt::format(
      "LoRA ({}): rank {}, alpha {} (scale {:.3g}) on {}: {} adapter tensors, {} elements "
      "({:.2f}% of the model's {}), plus {} other trainable elements{}",
      c.lora.merge_aware ? "merge-aware" : "plain", c.lora.rank, c.lora.alpha,
      c.lora.alpha / static_cast<double>(c.lora.rank), targets, adapters, adapter_elems,
      total > 0 ? 100.0 * static_cast<double>(adapter_elems) / static_cast<double>(total) : 0.0,
      total, other,
      model_options(c).cache_adapted_weights
          ? "; the adapted linears' frozen weights are kept dequantized (lora.cache_base_weights)"
          : "");
}

namespace {

// "30.53B", "3.35B", "12.4M", "900".
std::string count_text(int64_t n) {
  const double x = static_cast<double>(n);
  if (x >= 1e9) return fmt::format("{:.2f}B", x / 1e9);
  if (x >= 1e6) return fmt::format("{:.2f}M", x / 1e6);
  return fmt::format("{}", n);
}

}  // namespace

std::string moe_summary(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head) {
  if (!mc.is_moe()) return "";
  const auto& moe = mc.moe;
  int64_t sparse = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) sparse += mc.is_moe_layer(l);
  const bool routers_train = trainable_spec(c).router && sparse > 0;
  const auto coef = model_options(c).router_aux_loss_coef.value_or(moe.router_aux_loss_coef);
  const char* coef_source = c.train.router_aux_loss_coef.is_auto()
                                ? "config.json router_aux_loss_coef"
                                : "train.router_aux_loss_coef";
  const std::string z = c.train.router_z_loss_coef > 0
                            ? fmt::format("; router z-loss coefficient {:g}", c.train.router_z_loss_coef)
                            : "";
  return fmt::format(
      "mixture of experts: {} of {} layers sparse, {} experts of width {}, top {}{}; {} "
      "parameters, {} active per token; routers {} (train.trainable.router{}), load-balancing "
      "loss coefficient {:g} ({}){}{}",
      sparse, mc.num_hidden_layers, moe.num_experts, moe.moe_intermediate_size,
      moe.num_experts_per_tok, moe.norm_topk_prob ? " (renormalised)" : "",
      count_text(mc.num_parameters(separate_lm_head)),
      count_text(mc.num_active_parameters(separate_lm_head)), routers_train ? "train" : "frozen",
      c.train.method == TrainMethod::kLora ? "; train.method lora freezes them" : "", coef,
      coef_source, coef == 0 ? ", not added" : "", z);
}

std::string moe_lora_note(const model::Qwen3Config& mc, const Config& c) {
  if (!mc.is_moe() || c.train.method != TrainMethod::kLora) return "";
  std::string mlp;
  const auto& ts = c.lora.targets;
  if (std::find(ts.begin(), ts.end(), "experts") != ts.end()) return "";
  for (const auto& t : ts) {
    if (t == "gate_proj" || t == "up_proj" || t == "down_proj")
      mlp += (mlp.empty() ? "" : ", ") + t;
  }
  if (mlp.empty()) return "";
  int64_t sparse = 0;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) sparse += mc.is_moe_layer(l);
  const int64_t dense = mc.num_hidden_layers - sparse;
  return fmt::format(
      "lora.targets {}: the experts of the {} mixture-of-experts layers are not adapted (the "
      "target experts adapts them; the routers stay frozen); {}",
      mlp, sparse,
      dense > 0 ? fmt::format("these targets adapt only the {} dense layers' MLPs", dense)
                : std::string("these targets adapt nothing here (no layer has a dense MLP)"));
}

namespace {

// Online distillation (docs/trainer.md#distillation): the teacher's weights for the whole run;
// in the loss forward, one teacher layer's forward transients (no autograd: the widest is the
// MLP's (tokens, I) gate/up/product) besides its final hidden states, and per logits chunk the
// teacher's logits block and the divergence's fp32 blocks (the student's copy, the teacher's
// log-probabilities, their exp and a logsumexp temporary).
void add_teacher(const model::Qwen3Config& student, const Config& c, const model::ModelOptions& opt,
                 MemoryBudget* b) {
  FrozenModelSpec spec;
  spec.path = c.distill.teacher;
  spec.config_path = c.distill.teacher_config;
  spec.default_config = c.model.config;
  const std::string path = frozen_config_path(spec);
  require_file(path, c.distill.teacher_config.empty() ? "distill.teacher (its config.json)"
                                                      : "distill.teacher_config");
  const auto t = as_input_error("distill.teacher_config",
                                [&] { return model::Qwen3Config::from_json_file(path); });
  const int64_t cs = opt.compute_dtype == at::kFloat ? 4 : 2;
  b->teacher_bytes = t.num_parameters(/*include_lm_head=*/!t.tie_word_embeddings) * cs;
  const int64_t tokens = c.train.batch_size * c.train.seq_len;
  const int64_t chunk = std::min(opt.loss_chunk_tokens, tokens);
  const int64_t V = student.vocab_size;
  const int64_t teacher_forward =
      tokens * cs * (2 * t.hidden_size + 3 * t.intermediate_size) + tokens * t.hidden_size * cs;
  const int64_t divergence = chunk * V * (cs + 4 * 4);
  for (auto& p : b->phases) {
    if (p.name == model::memory_phase_name(model::MemoryPhaseKind::kLossForward)) {
      p.logits_bytes += std::max(teacher_forward, divergence);
    }
  }
}

// GRPO (docs/trainer.md#grpo, "Memory"): the rollout phase, before the step's training phases
// (nothing of those is alive then: no gradients between steps), with the optimizer's CPU arena
// (`scratch`, kept for the run); and the reference model with grpo.beta > 0.
void add_rollout(const model::Qwen3Config& mc, const Config& c, const model::ModelOptions& opt,
                 bool separate_lm_head, int64_t scratch, MemoryBudget* b) {
  model::RolloutShape shape;
  shape.rows = c.train.batch_size * c.train.grad_accum;  // this rank's share
  shape.completion_tokens = c.grpo.max_completion_length;
  shape.prompt_tokens = c.train.seq_len - c.grpo.max_completion_length;  // the longest allowed
  shape.top_k = c.grpo.top_k;
  shape.top_p = c.grpo.top_p;
  const model::RolloutMemory r = model::estimate_rollout_memory(mc, opt, shape, separate_lm_head);
  BudgetPhase p;
  p.name = "rollout";
  p.activations_bytes = r.prefill_bytes;
  p.logits_bytes = r.sampling_bytes;
  p.optimizer_bytes = scratch;
  p.kv_cache_bytes = r.kv_cache_bytes;
  p.weights_bytes = r.weights_bytes;
  b->phases.insert(b->phases.begin(), p);
  if (c.grpo.beta > 0) {
    const int64_t cs = opt.compute_dtype == at::kFloat ? 4 : 2;
    b->reference_bytes = mc.num_parameters(/*include_lm_head=*/separate_lm_head) * cs;
  }
}

}  // namespace

MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head,
                             const ObjectiveNeeds& needs) {
  return estimate_budget(mc, c, separate_lm_head, needs, configured_recompute(c));
}

MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head,
                             const ObjectiveNeeds& needs, const RecomputePlan& recompute) {
  const auto opt = model_options(c, recompute);
  model::GradientLifetime life;
  life.applied_in_backward = in_backward_updates(c);
  life.accumulation_steps = c.train.grad_accum;
  life.host_staging_bytes = optim::kHostAccumulationRingBytes;
  const auto m =
      model::estimate_memory(mc, opt, c.train.batch_size, c.train.seq_len, separate_lm_head, life);
  MemoryBudget b;
  b.masters_bytes = m.master_bytes;
  b.host_bytes = m.host_bytes;
  b.frozen_bytes = m.frozen_bytes;
  b.forward_weights_bytes = m.forward_weight_bytes;
  const auto mode = c.optim.state;
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
  b.masters_on_host = opt.offload_masters && opt.device.is_cuda();
  if (ao.offload_moments && opt.device.is_cuda()) {  // in pinned host memory, not on the GPU
    b.host_bytes += b.moments_bytes;
    b.moments_on_host = true;
    b.moments_bytes = 0;
  }
  // CUDA updates are fused kernels without scratch; the CPU step uses an arena of at most ~16
  // fp32 values per chunk element (PackedAdamW::scratch_peak_bytes), kept from the first update
  // on (the trainer does not release it), so it is counted in every phase.
  const int64_t scratch = opt.device.is_cuda() ? 0 : 16 * 4 * scratch_elems;
  // State in pinned host memory is updated through device copies (PackedAdamW staging), which
  // take kMaxStagedBytes while updates run (the optimizer step, or the backward with
  // in-backward updates); updated inside the backward from sums in host memory, the staging is
  // the ring's share that host_staging_bytes counts already (kSharedStagingBytes).
  const bool shared = b.masters_on_host && life.applied_in_backward && c.train.grad_accum > 1;
  const int64_t staging =
      opt.device.is_cuda() && (b.masters_on_host || b.moments_on_host) && !shared
          ? optim::kMaxStagedBytes
          : 0;
  for (const auto& mp : m.phases) {
    BudgetPhase p;
    p.name = model::memory_phase_name(mp.kind);
    p.gradients_bytes = mp.grad_bytes;
    p.activations_bytes = mp.activation_bytes;
    p.logits_bytes = mp.loss_bytes;
    const bool updating = life.applied_in_backward
                              ? mp.kind != model::MemoryPhaseKind::kForward &&
                                    mp.kind != model::MemoryPhaseKind::kLossForward
                              : mp.kind == model::MemoryPhaseKind::kOptimizerStep;
    p.optimizer_bytes = scratch + (updating ? staging : 0);
    b.phases.push_back(p);
  }
  if (needs.teacher_forward) add_teacher(mc, c, opt, &b);
  if (needs.prompt_records) add_rollout(mc, c, opt, separate_lm_head, scratch, &b);
  for (size_t i = 0; i < b.phases.size(); ++i) {
    if (b.phases[i].total_bytes() > b.phases[b.peak_phase].total_bytes()) b.peak_phase = i;
  }
  if (!b.phases.empty()) {
    const BudgetPhase& peak = b.phases[b.peak_phase];
    b.gradients_bytes = peak.gradients_bytes;
    b.activations_bytes = peak.activations_bytes;
    b.logits_bytes = peak.logits_bytes;
    b.optimizer_bytes = peak.optimizer_bytes;
    b.kv_cache_bytes = peak.kv_cache_bytes;
    b.weights_bytes = peak.weights_bytes;
  }
  return b;
}

DeviceBudget device_budget(const Config& c, int64_t free_bytes) {
  DeviceBudget d;
  if (c.guard.max_gpu_gb > 0) {
    d.budget_bytes = static_cast<int64_t>(c.guard.max_gpu_gb * 1e9);
    d.source = "guard.max_gpu_gb";
  } else {
    d.budget_bytes = free_bytes;
    d.source = "free device memory";
  }
  d.usable_bytes = static_cast<int64_t>(
      static_cast<double>(d.budget_bytes - kCudaContextReserveBytes) / kAllocatorMargin);
  return d;
}

namespace {

// choose_recompute without the advice (which itself chooses recompute for its placements).
RecomputeChoice choose_recompute_only(const model::Qwen3Config& mc, const Config& c,
                                      bool separate_lm_head, int64_t free_bytes,
                                      const ObjectiveNeeds& needs) {
  RecomputeChoice r;
  r.layers = mc.num_hidden_layers;
  r.mlp_chunk_tokens = resolved_mlp_chunk_tokens(c);
  const DeviceBudget d = device_budget(c, free_bytes);
  r.budget_bytes = d.budget_bytes;
  r.budget_source = d.source;
  r.usable_bytes = d.usable_bytes;
  const int64_t L = r.layers;
  auto estimate = [&](int64_t n, bool offload, int64_t ka, int64_t km) {
    return estimate_budget(mc, c, separate_lm_head, needs,
                           RecomputePlan::first(n, L, offload, ka, km));
  };
  auto take = [&](int64_t n, bool offload, int64_t ka, int64_t km) {
    const MemoryBudget b = estimate(n, offload, ka, km);
    r.recompute_layers = n;
    r.offload_layer_inputs = offload;
    r.keep_attention = ka;
    r.keep_mlp = km;
    r.estimate_bytes = b.total_bytes();
    r.host_bytes = b.host_bytes;
    r.fits = r.estimate_bytes <= r.usable_bytes;
  };
  // Whether recomputing the first n layers, ka and km of them keeping their attention or MLP
  // block, fits (with the recomputed inputs on the host when `offload`).
  bool offload = false;
  auto fits = [&](int64_t n, int64_t ka, int64_t km) {
    return estimate(n, offload, ka, km).total_bytes() <= r.usable_bytes;
  };
  if (fits(0, 0, 0)) {
    take(0, false, 0, 0);
    return r;
  }
  if (!fits(L, 0, 0)) {
    // Every layer recomputed, their inputs on the host (OVER when even that does not fit).
    offload = true;
    if (!fits(L, 0, 0)) {
      take(L, true, 0, 0);
      return r;
    }
  }
  // Between every layer (its inputs on the host when needed) and none. The recompute a choice
  // saves against every layer recomputed, in multiply-adds (model::layer_keep_costs, the top
  // layer's for every layer): a whole kept layer saves both blocks' recompute, a kept block its
  // own.
  model::ModelOptions opt = model_options(c);
  opt.offload_layer_inputs = offload;
  const model::LayerKeepCosts costs = model::layer_keep_costs(
      mc, opt, c.train.batch_size, c.train.seq_len, separate_lm_head, L - 1);
  r.attention_macs_per_byte = costs.attention.macs_per_byte();
  r.mlp_macs_per_byte = costs.mlp.macs_per_byte();
  const double per_layer = costs.attention.saved_macs + costs.mlp.saved_macs;
  auto saved = [&](int64_t n, int64_t ka, int64_t km) {
    return static_cast<double>(L - n) * per_layer +
           static_cast<double>(ka) * costs.attention.saved_macs +
           static_cast<double>(km) * costs.mlp.saved_macs;
  };
  // The most recompute saved among the choices that fit: for each number n of recomputed
  // layers that fits, the (ka, km) frontier, walked with ka rising and km falling (the estimate
  // grows with every block kept, so what fits is closed downwards in ka and km). Equal savings:
  // the smaller estimate. The optimum keeps the block that saves more per byte first and spends
  // what that leaves on the other; whole layers (the previous choice by layer alone, ka = km =
  // 0) are among the candidates.
  int64_t best_n = L, best_ka = 0, best_km = 0;
  double best_saved = -1;
  int64_t best_bytes = 0;
  for (int64_t n = L; n >= 1 && fits(n, 0, 0); --n) {
    int64_t km = 0;
    while (km < n && fits(n, 0, km + 1)) ++km;
    for (int64_t ka = 0; ka <= n; ++ka) {
      while (km >= 0 && (ka + km > n || !fits(n, ka, km))) --km;
      if (km < 0) break;
      const double s = saved(n, ka, km);
      if (s < best_saved) continue;
      const int64_t bytes = estimate(n, offload, ka, km).total_bytes();
      if (s > best_saved || bytes < best_bytes) {
        best_n = n;
        best_ka = ka;
        best_km = km;
        best_saved = s;
        best_bytes = bytes;
      }
    }
  }
  take(best_n, offload, best_ka, best_km);
  return r;
}

// A placement candidate: its estimate at the least memory (auto: every layer recomputed, inputs
// on the host, the least auto can reach) and whether that fits.
struct Trial {
  std::vector<size_t> choice;  // per dimension: 0 unchanged, k its k-th option
  Config config;
  int64_t least_bytes = 0;
  bool fits = false;
};

// One option of a placement dimension: its settings (as --set takes them) and their edit.
struct PlacementOption {
  std::vector<std::string> settings;
  std::function<void(Config&)> apply;
};
using PlacementDims = std::vector<std::vector<PlacementOption>>;

// The dimensions, each a list of options milder first; only what the config does not set.
PlacementDims placement_dimensions(const Config& c, bool cuda) {
  PlacementDims dims;
  if (cuda && c.train.gradient_checkpointing != Recompute::kAuto) {
    dims.push_back({{{"train.gradient_checkpointing=auto"}, [](Config& t) {
                       t.train.gradient_checkpointing = Recompute::kAuto;
                       t.train.recompute_layers = -1;
                       t.train.recompute_keep_attention = 0;
                       t.train.recompute_keep_mlp = 0;
                       t.train.offload_layer_inputs = false;
                     }}});
  }
  std::vector<PlacementOption> states;
  for (const auto mode : {optim::StateMode::kInt8, optim::StateMode::k4Bit}) {
    const bool smaller =
        c.optim.state == optim::StateMode::kFp32 ||
        (c.optim.state == optim::StateMode::kInt8 && mode == optim::StateMode::k4Bit);
    if (!smaller) continue;
    states.push_back(
        {{"optim.state=" + optim::to_string(mode)}, [mode](Config& t) { t.optim.state = mode; }});
  }
  if (!states.empty()) dims.push_back(states);
  std::vector<PlacementOption> offloads;
  for (const auto o : {Offload::kMoments, Offload::kAll}) {
    if (!cuda || static_cast<int>(o) <= static_cast<int>(c.optim.offload)) continue;
    offloads.push_back(
        {{"optim.offload=" + to_string(o)}, [o](Config& t) { t.optim.offload = o; }});
  }
  if (!offloads.empty()) dims.push_back(offloads);
  std::vector<PlacementOption> tokens;
  const int64_t b1 = c.train.batch_size;
  if (b1 > 1) {
    tokens.push_back({{"train.batch_size=1"}, [](Config& t) { t.train.batch_size = 1; }});
  }
  for (int64_t s = c.train.seq_len / 2; s >= 128; s /= 2) {
    PlacementOption o{{}, [s](Config& t) {
                        t.train.batch_size = 1;
                        t.train.seq_len = s;
                      }};
    if (b1 > 1) o.settings.push_back("train.batch_size=1");
    o.settings.push_back("train.seq_len=" + std::to_string(s));
    tokens.push_back(o);
  }
  if (!tokens.empty()) dims.push_back(tokens);
  return dims;
}

// Every combination of the dimensions' options that the config rules accept (a micro-batch
// holds whole row groups of the objective: preference pairs), with its least estimate.
std::vector<Trial> placement_trials(const Config& c, const ObjectiveNeeds& needs,
                                    const PlacementDims& dims,
                                    const std::function<int64_t(const Config&)>& least,
                                    int64_t usable_bytes) {
  std::vector<Trial> trials;
  std::vector<size_t> choice(dims.size(), 0);
  while (true) {
    size_t d = 0;
    while (d < dims.size() && choice[d] == dims[d].size()) choice[d++] = 0;
    if (d == dims.size()) break;
    ++choice[d];
    Trial t{choice, c};
    for (size_t i = 0; i < dims.size(); ++i) {
      if (choice[i] > 0) dims[i][choice[i] - 1].apply(t.config);
    }
    try {
      validate_config(t.config);
    } catch (const ConfigError&) {
      continue;
    }
    if (t.config.train.batch_size % needs.group_size() != 0) continue;
    t.least_bytes = least(t.config);
    t.fits = t.least_bytes <= usable_bytes;
    trials.push_back(std::move(t));
  }
  return trials;
}

uint32_t changed_dims(const std::vector<size_t>& ch) {
  uint32_t mask = 0;
  for (size_t i = 0; i < ch.size(); ++i) mask |= ch[i] > 0 ? 1u << i : 0u;
  return mask;
}

size_t mildness(const std::vector<size_t>& ch) {
  size_t n = 0;
  for (size_t k : ch) n += k;
  return n;
}

// Per set of changed dimensions, its mildest fitting trial, kept when no smaller set fits;
// fewest changes first, then lower dimensions first (recompute, the moments' format, offload,
// tokens).
std::vector<const Trial*> mildest_fitting(const std::vector<Trial>& trials) {
  std::vector<uint32_t> fitting_masks;
  for (const Trial& t : trials) {
    if (t.fits) fitting_masks.push_back(changed_dims(t.choice));
  }
  std::vector<uint32_t> masks = fitting_masks;
  auto count = [](uint32_t m) {
    int n = 0;
    for (; m != 0; m &= m - 1) ++n;
    return n;
  };
  std::sort(masks.begin(), masks.end(), [&](uint32_t x, uint32_t y) {
    const int px = count(x), py = count(y);
    if (px != py) return px < py;
    for (uint32_t bit = 1; bit != 0; bit <<= 1) {
      if ((x & bit) != (y & bit)) return (x & bit) != 0;
    }
    return false;
  });
  masks.erase(std::unique(masks.begin(), masks.end()), masks.end());
  std::vector<const Trial*> out;
  for (uint32_t m : masks) {
    const bool smaller_fits = std::any_of(fitting_masks.begin(), fitting_masks.end(),
                                          [m](uint32_t f) { return f != m && (f & m) == f; });
    if (smaller_fits) continue;
    const Trial* best = nullptr;
    for (const Trial& t : trials) {
      if (!t.fits || changed_dims(t.choice) != m) continue;
      if (best == nullptr || mildness(t.choice) < mildness(best->choice) ||
          (mildness(t.choice) == mildness(best->choice) && t.least_bytes < best->least_bytes)) {
        best = &t;
      }
    }
    out.push_back(best);
  }
  return out;
}

}  // namespace

RecomputeChoice choose_recompute(const model::Qwen3Config& mc, const Config& c,
                                 bool separate_lm_head, int64_t free_bytes,
                                 const ObjectiveNeeds& needs) {
  RecomputeChoice r = choose_recompute_only(mc, c, separate_lm_head, free_bytes, needs);
  if (!r.fits) r.advice = advise_placements(mc, c, separate_lm_head, free_bytes, needs).summary();
  return r;
}

PlacementAdvice advise_placements(const model::Qwen3Config& mc, const Config& c,
                                  bool separate_lm_head, int64_t free_bytes,
                                  const ObjectiveNeeds& needs) {
  PlacementAdvice a;
  a.budget = device_budget(c, free_bytes);
  a.lora = c.train.method == TrainMethod::kLora;
  const bool cuda = device_is_cuda(c);
  const int64_t L = mc.num_hidden_layers;
  auto is_auto = [&](const Config& t) {
    return cuda && t.train.gradient_checkpointing == Recompute::kAuto;
  };
  // The estimate as a run would make it, and the least memory a config can reach.
  auto estimate = [&](const Config& t) -> std::pair<int64_t, int64_t> {
    if (!is_auto(t)) {
      const MemoryBudget b = estimate_budget(mc, t, separate_lm_head, needs);
      return {b.total_bytes(), b.host_bytes};
    }
    const RecomputeChoice r = choose_recompute_only(mc, t, separate_lm_head, free_bytes, needs);
    return {r.estimate_bytes, r.host_bytes};
  };
  auto least = [&](const Config& t) {
    if (!is_auto(t)) return estimate_budget(mc, t, separate_lm_head, needs).total_bytes();
    return estimate_budget(mc, t, separate_lm_head, needs,
                           RecomputePlan::first(L, L, /*offload_layer_inputs=*/true))
        .total_bytes();
  };
  a.config_bytes = estimate(c).first;
  a.config_fits = a.config_bytes <= a.budget.usable_bytes;

  const PlacementDims dims = placement_dimensions(c, cuda);
  const std::vector<Trial> trials = placement_trials(c, needs, dims, least, a.budget.usable_bytes);
  auto placement = [&](const Trial& t) {
    Placement p;
    for (size_t i = 0; i < dims.size(); ++i) {
      if (t.choice[i] == 0) continue;
      const auto& s = dims[i][t.choice[i] - 1].settings;
      p.settings.insert(p.settings.end(), s.begin(), s.end());
    }
    std::tie(p.estimate_bytes, p.host_bytes) = estimate(t.config);
    return p;
  };
  for (const Trial* t : mildest_fitting(trials)) a.fitting.push_back(placement(*t));
  if (a.fitting.empty() && !trials.empty()) {
    const auto it = std::min_element(
        trials.begin(), trials.end(),
        [](const Trial& x, const Trial& y) { return x.least_bytes < y.least_bytes; });
    a.smallest = placement(*it);
    if (is_auto(it->config)) a.smallest.estimate_bytes = it->least_bytes;
  }
  if (a.fitting.empty() && trials.empty()) {
    a.smallest.estimate_bytes = least(c);
  }
  return a;
}

std::string Placement::describe() const {
  std::string s;
  for (const auto& x : settings) s += (s.empty() ? "" : ", ") + x;
  if (s.empty()) s = "the config as it is";
  s += fmt::format(" (estimate {:.1f} GiB", to_gib(estimate_bytes));
  if (host_bytes > 0) s += fmt::format(", {:.1f} GiB in pinned host memory", to_gib(host_bytes));
  return s + ")";
}

std::string PlacementAdvice::summary() const {
  const std::string usable =
      fmt::format("{:.1f} GiB usable of {:.1f} GiB {}", to_gib(budget.usable_bytes),
                  to_gib(budget.budget_bytes), budget.source);
  if (fitting.empty()) {
    return fmt::format(
        "nothing fits the {}: the smallest estimate is {} (fewer trained parameters: "
        "train.trainable.*{}, or a larger card)",
        usable, smallest.describe(), lora ? "" : ", train.method lora");
  }
  std::string s = "fits the " + usable + " with: ";
  for (size_t i = 0; i < fitting.size(); ++i) s += (i ? "; " : "") + fitting[i].describe();
  return s;
}

std::string RecomputeChoice::describe() const {
  std::string what =
      recompute_layers == 0 ? std::string("no decoder layer recomputes")
      : recompute_layers == layers
          ? fmt::format("all {} decoder layers recompute", layers)
          : fmt::format("the first {} of {} decoder layers recompute", recompute_layers, layers);
  if (offload_layer_inputs) {
    what += fmt::format(", their inputs in pinned host memory ({:.1f} GiB)", to_gib(host_bytes));
  }
  if (recompute_layers > 0 && mlp_chunk_tokens > 0) {
    what += fmt::format(", their MLP in chunks of {} tokens", mlp_chunk_tokens);
  }
  auto keep = [](int64_t n) { return n == 1 ? "keeps" : "keep"; };
  if (keep_attention > 0 && keep_mlp > 0) {
    what +=
        fmt::format("; of those, {} {} the attention block's activations and {} the MLP block's",
                    keep_attention, keep(keep_attention), keep_mlp);
  } else if (keep_attention > 0) {
    what +=
        fmt::format("; of those, {} {} the attention block's activations (only the MLP recomputes)",
                    keep_attention, keep(keep_attention));
  } else if (keep_mlp > 0) {
    what +=
        fmt::format("; of those, {} {} the MLP block's activations (only the attention recomputes)",
                    keep_mlp, keep(keep_mlp));
  }
  if (keep_attention + keep_mlp > 0) {
    what += fmt::format(
        " [multiply-adds of recompute saved per byte kept: attention {:.0f}, MLP {:.0f}]",
        attention_macs_per_byte, mlp_macs_per_byte);
  }
  return fmt::format(
      "gradient checkpointing auto: {} (estimate {:.1f} GiB {} {:.1f} GiB usable of {:.1f} GiB "
      "{}){}",
      what, to_gib(estimate_bytes), fits ? "within" : "OVER", to_gib(usable_bytes),
      to_gib(budget_bytes), budget_source, fits || advice.empty() ? "" : "; " + advice);
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
                  {"kv_cache_bytes", p.kv_cache_bytes},
                  {"weights_bytes", p.weights_bytes},
                  {"total_bytes", persistent_bytes() + p.total_bytes()}});
  }
  return {{"masters_bytes", masters_bytes},
          {"frozen_bytes", frozen_bytes},
          {"forward_weights_bytes", forward_weights_bytes},
          {"teacher_bytes", teacher_bytes},
          {"reference_bytes", reference_bytes},
          {"gradients_bytes", gradients_bytes},
          {"moments_bytes", moments_bytes},
          {"activations_bytes", activations_bytes},
          {"logits_bytes", logits_bytes},
          {"optimizer_bytes", optimizer_bytes},
          {"kv_cache_bytes", kv_cache_bytes},
          {"weights_bytes", weights_bytes},
          {"persistent_bytes", persistent_bytes()},
          {"total_bytes", total_bytes()},
          {"peak_phase", peak_phase_name()},
          {"phases", ph},
          {"trainable_elements", trainable_elements},
          {"host_bytes", host_bytes},
          {"moments_on_host", moments_on_host},
          {"masters_on_host", masters_on_host}};
}

std::string MemoryBudget::to_table() const {
  std::string s;
  auto row = [&](const char* name, int64_t bytes, const char* note) {
    s += fmt::format("  {:<20} {:>9.3f} GiB  {}\n", name, to_gib(bytes), note);
  };
  row("masters", masters_bytes,
      masters_on_host ? "whole run; NVFP4 codes of the linears, their masters on the host "
                        "(optim.offload: all)"
                      : "whole run");
  row("frozen", frozen_bytes, "whole run");
  if (forward_weights_bytes > 0) {
    row("forward weights", forward_weights_bytes,
        "whole run; the trained NVFP4 linears' (model.forward_weights)");
  }
  row("moments", moments_bytes,
      moments_on_host ? "whole run; in pinned host memory (optim.offload)" : "whole run");
  if (teacher_bytes > 0) row("teacher", teacher_bytes, "whole run (distillation)");
  if (reference_bytes > 0) row("reference", reference_bytes, "whole run (grpo.beta > 0)");
  // GRPO's rollout phase adds two columns: its KV cache and the forward weights it keeps.
  const bool rollout = std::any_of(phases.begin(), phases.end(), [](const BudgetPhase& p) {
    return p.kv_cache_bytes > 0 || p.weights_bytes > 0;
  });
  s += fmt::format("  {:<20} {:>9} {:>11} {:>9} {:>9} ", "phase", "gradients", "activations",
                   "logits", "optimizer");
  if (rollout) s += fmt::format("{:>9} {:>9} ", "kv cache", "weights");
  s += fmt::format("{:>9}  (GiB; total = whole run + phase)\n", "total");
  for (size_t i = 0; i < phases.size(); ++i) {
    const BudgetPhase& p = phases[i];
    s += fmt::format("  {:<20} {:>9.3f} {:>11.3f} {:>9.3f} {:>9.3f} ", p.name,
                     to_gib(p.gradients_bytes), to_gib(p.activations_bytes),
                     to_gib(p.logits_bytes), to_gib(p.optimizer_bytes));
    if (rollout) {
      s += fmt::format("{:>9.3f} {:>9.3f} ", to_gib(p.kv_cache_bytes), to_gib(p.weights_bytes));
    }
    s += fmt::format("{:>9.3f}{}\n", to_gib(persistent_bytes() + p.total_bytes()),
                     i == peak_phase ? "  <- peak" : "");
  }
  if (rollout) {
    s += "  rollout: the generation batch's KV cache (prompt + completion tokens of each row), its "
         "prefill (activations) and sampler (logits), and the trained linears' forward weights "
         "(kept within half the device memory free when it starts)\n";
  }
  s += fmt::format("  peak phase: {}\n", peak_phase_name());
  row("total", total_bytes(), "whole run + the peak phase");
  if (host_bytes > 0) {
    row("host (pinned)", host_bytes,
        "offloaded masters, moments, gradients and layer inputs, not on the GPU");
  }
  s += fmt::format("  trainable elements: {}\n", trainable_elements);
  return s;
}

double train_flops_per_token(const model::Qwen3Config& mc, int64_t seq_len) {
  // The weights each token multiplies with, layer by layer (a mixture-of-experts layer: its
  // router and k of its E experts).
  double matmul_params = static_cast<double>(mc.vocab_size) * mc.hidden_size;
  for (int64_t l = 0; l < mc.num_hidden_layers; ++l) {
    matmul_params += static_cast<double>(mc.layer_active_linear_parameters(l));
  }
  return 6.0 * matmul_params +
         12.0 * mc.num_hidden_layers * static_cast<double>(seq_len) * mc.q_dim();
}

double train_flops_per_token(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head) {
  const auto spec = trainable_spec(c);
  const auto lora = model_options(c).lora;
  const int64_t L = mc.num_hidden_layers;
  const bool tied = !separate_lm_head;
  const auto params = model::qwen3_parameters(mc, separate_lm_head);
  auto trains = [&](const model::ParamSpec& p) { return spec.trains(p, L, tied); };
  auto adapted = [&](const model::ParamSpec& p) {
    return c.train.method == TrainMethod::kLora && lora.adapts(p, spec, L);
  };
  // The lowest layer whose backward runs (L: none; -1: the embedding trains, all of them).
  int64_t reach = L;
  bool below_head = false;  // something besides lm_head trains: its input gradient is needed
  for (const auto& p : params) {
    if (!trains(p) && !adapted(p)) continue;
    if (p.group == model::ParamGroup::kEmbedding) reach = -1;
    if (p.layer >= 0) reach = std::min(reach, p.layer);
    below_head |= p.group != model::ParamGroup::kLmHead;
  }
  const double tokens = static_cast<double>(c.train.batch_size * c.train.seq_len);
  double flops = 0;
  auto linear = [&](const model::ParamSpec& p, bool backward, bool weight_trains) {
    // A token computes with k of a stacked expert projection's E experts.
    const double n = static_cast<double>(model::active_elements(p, mc));
    const double in = static_cast<double>(p.shape[1]), out = static_cast<double>(p.shape[0]);
    const double r = static_cast<double>(lora.rank);
    flops += 2 * n;
    if (backward) flops += 2 * n;
    if (adapted(p) && lora.merge_aware) {
      flops += 2 * n + 6 * n * r / tokens;
    } else if (adapted(p)) {
      flops += 6 * r * (in + out);
    } else if (weight_trains) {
      flops += 2 * n;
    }
  };
  for (const auto& p : params) {
    const bool layer_matmul =
        p.kind == model::ParamKind::kQuantizedLinear || p.group == model::ParamGroup::kRouter;
    if (layer_matmul && p.group != model::ParamGroup::kLmHead) {
      linear(p, p.layer >= reach, trains(p));
    } else if (p.group == model::ParamGroup::kLmHead) {
      linear(p, below_head, trains(p));
    } else if (p.group == model::ParamGroup::kEmbedding && tied) {
      // The tied lm_head's GEMM uses the embedding's weight.
      model::ParamSpec head = p;
      head.group = model::ParamGroup::kLmHead;
      linear(head, below_head, trains(p));
    }
  }
  for (int64_t l = 0; l < L; ++l) {
    const double core = static_cast<double>(c.train.seq_len) * static_cast<double>(mc.q_dim());
    flops += 4 * core + (l >= reach ? 8 * core : 0);
  }
  return flops;
}

}  // namespace q4::trainer
