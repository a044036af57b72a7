// The model's options and what they select: TrainableSpec (which parameters train), LoraSpec
// (which linears get adapters; the target table is kLoraTargets, qwen3_params.h) and
// ModelOptions (dtypes, device, recompute), with their validation.
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>

#include "qwen3_impl.h"

namespace q4::model {
namespace {

bool is_float_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

}  // namespace
// ---------------------------------------------------------------- options

TrainableSpec TrainableSpec::everything() {
  TrainableSpec s;
  s.projections = s.lm_head = s.norms = s.embeddings = true;
  return s;
}

TrainableSpec TrainableSpec::nothing() {
  TrainableSpec s;
  s.projections = false;
  s.router = false;
  return s;
}

bool TrainableSpec::layer_selected(int64_t layer, int64_t num_layers) const {
  if (!layers.empty()) return std::find(layers.begin(), layers.end(), layer) != layers.end();
  if (last_n_layers >= 0) return layer >= num_layers - last_n_layers;
  return true;
}

void TrainableSpec::validate(int64_t num_layers) const {
  TORCH_CHECK(last_n_layers >= -1 && last_n_layers <= num_layers,
              "trainable.last_n_layers: expected -1 (all) or 0..", num_layers, ", got ",
              last_n_layers);
  for (int64_t l : layers) {
    TORCH_CHECK(l >= 0 && l < num_layers, "trainable.layers: layer index ", l, " is outside [0, ",
                num_layers, ")");
  }
}

at::ScalarType default_grad_dtype(at::ScalarType master_dtype, at::ScalarType compute_dtype) {
  if (master_dtype == at::kFloat && compute_dtype == at::kFloat) return at::kFloat;
  return at::kBFloat16;
}

at::ScalarType ModelOptions::resolved_grad_dtype() const {
  return grad_dtype ? *grad_dtype : default_grad_dtype(master_dtype, compute_dtype);
}

std::string linear_short_name(const std::string& name) {
  if (name == "lm_head.weight") return "lm_head";
  // An MoE layer's three stacked expert projections: the one target "experts"
  // (docs/model.md#lora-on-experts).
  if (name.find(".mlp.experts.") != std::string::npos) {
    for (const char* e : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string tail = std::string(".mlp.experts.") + e + ".weight";
      if (name.size() > tail.size() &&
          name.compare(name.size() - tail.size(), tail.size(), tail) == 0) {
        return "experts";
      }
    }
    return "";
  }
  for (size_t i = 0; i < kLoraProjectionTargets; ++i) {
    const char* l = kLoraTargets[i];
    const std::string tail = std::string(".") + l + ".weight";
    if (name.size() > tail.size() &&
        name.compare(name.size() - tail.size(), tail.size(), tail) == 0) {
      return l;
    }
  }
  return "";
}

std::string lora_param_name(const std::string& linear, const char* part) {
  const std::string tail = ".weight";
  TORCH_CHECK(linear.size() > tail.size() &&
                  linear.compare(linear.size() - tail.size(), tail.size(), tail) == 0,
              "lora_param_name: ", linear, " is not a weight");
  return linear.substr(0, linear.size() - tail.size()) + "." + part + tail;
}

bool LoraSpec::adapts(const ParamSpec& p, const TrainableSpec& trainable,
                      int64_t num_layers) const {
  if (!enabled() || p.kind != ParamKind::kQuantizedLinear) return false;
  const std::string s = linear_short_name(p.name);
  if (s.empty() || std::find(targets.begin(), targets.end(), s) == targets.end()) return false;
  return p.layer < 0 || trainable.layer_selected(p.layer, num_layers);
}

void LoraSpec::validate() const {
  if (!enabled()) return;
  TORCH_CHECK(rank > 0, "lora.rank: expected > 0, got ", rank);
  TORCH_CHECK(alpha > 0 && std::isfinite(alpha), "lora.alpha: expected > 0, got ", alpha);
  TORCH_CHECK(!targets.empty(), "lora.targets: expected at least one of ", lora_target_list(", "));
  for (const auto& t : targets) {
    TORCH_CHECK(std::find(std::begin(kLoraTargets), std::end(kLoraTargets), t) !=
                    std::end(kLoraTargets),
                "lora.targets: unknown linear '", t, "' (expected ", lora_target_list(" or "), ")");
  }
  // alpha / rank scales fp32 GEMMs: it must be a finite fp32 number.
  TORCH_CHECK(std::isfinite(static_cast<float>(scale())), "lora.alpha: ", alpha, " / lora.rank ",
              rank, " is not a finite fp32 number");
}

void LoraSpec::validate(const Qwen3Config& cfg) const {
  validate();
  if (!enabled()) return;
  int64_t smallest = 0;
  std::string which;
  for (const ParamSpec& p : qwen3_parameters(cfg, /*include_lm_head=*/true)) {
    if (p.kind != ParamKind::kQuantizedLinear || p.shape.size() != 2) continue;
    const std::string s = linear_short_name(p.name);
    if (s.empty() || std::find(targets.begin(), targets.end(), s) == targets.end()) continue;
    // A stacked expert projection: each expert's (out, in) block has its own adapter.
    const int64_t out = s == "experts" ? p.shape[0] / cfg.moe.num_experts : p.shape[0];
    const int64_t d = std::min(out, p.shape[1]);
    if (smallest == 0 || d < smallest) {
      smallest = d;
      which = s;
    }
  }
  TORCH_CHECK(std::find(targets.begin(), targets.end(), "experts") == targets.end() || cfg.is_moe(),
              "lora.targets: experts names the experts of a mixture-of-experts model, but the model "
              "is dense");
  TORCH_CHECK(smallest == 0 || rank <= smallest, "lora.rank: expected at most ", smallest,
              " (the smallest dimension of the adapted linears, ", which, "'s), got ", rank);
}

void ModelOptions::validate() const {
  TORCH_CHECK(is_float_dtype(master_dtype),
              "ModelOptions.master_dtype: expected fp16, bf16 or fp32, got ",
              c10::toString(master_dtype));
  TORCH_CHECK(is_float_dtype(compute_dtype),
              "ModelOptions.compute_dtype: expected fp16, bf16 or fp32, got ",
              c10::toString(compute_dtype));
  TORCH_CHECK(is_float_dtype(resolved_grad_dtype()),
              "ModelOptions.grad_dtype: expected fp16, bf16 or fp32, got ",
              c10::toString(resolved_grad_dtype()));
  TORCH_CHECK(loss_chunk_tokens > 0, "ModelOptions.loss_chunk_tokens: expected > 0, got ",
              loss_chunk_tokens);
  TORCH_CHECK(recompute_layers >= -1, "ModelOptions.recompute_layers: expected >= -1, got ",
              recompute_layers);
  TORCH_CHECK(mlp_chunk_tokens >= 0, "ModelOptions.mlp_chunk_tokens: expected >= 0, got ",
              mlp_chunk_tokens);
  TORCH_CHECK(recompute_keep_attention >= 0 && recompute_keep_mlp >= 0,
              "ModelOptions.recompute_keep_attention / recompute_keep_mlp: expected >= 0, got ",
              recompute_keep_attention, " / ", recompute_keep_mlp);
  TORCH_CHECK(device.is_cpu() || device.is_cuda(),
              "ModelOptions.device: expected cpu or cuda, got ", device.str());
  const auto coef_ok = [](double c) { return std::isfinite(c) && c >= 0; };
  TORCH_CHECK(!router_aux_loss_coef || coef_ok(*router_aux_loss_coef),
              "ModelOptions.router_aux_loss_coef: expected a finite number >= 0, got ",
              router_aux_loss_coef.value_or(0));
  TORCH_CHECK(coef_ok(router_z_loss_coef),
              "ModelOptions.router_z_loss_coef: expected a finite number >= 0, got ",
              router_z_loss_coef);
  TORCH_CHECK(!offload_masters || fake_quant,
              "ModelOptions.offload_masters needs fake_quant (plain precision computes with the "
              "masters themselves)");
  TORCH_CHECK(forward_weights == ForwardWeights::kSweep || fake_quant,
              "ModelOptions.forward_weights ", io::enum_name(forward_weights),
              " needs fake_quant (plain precision computes with the masters themselves)");
  TORCH_CHECK(master_init == MasterInit::kCodes || fake_quant,
              "ModelOptions.master_init dither needs fake_quant (plain precision computes with "
              "the masters themselves, so moving them would change the model)");
  TORCH_CHECK(!offload_masters || forward_weights != ForwardWeights::kKept,
              "ModelOptions.forward_weights kept: offloaded masters compute from codes");
  lora.validate();
  TORCH_CHECK(!lora.enabled() || fake_quant,
              "lora: adapters train on the NVFP4 weights, which plain precision (fake_quant off) "
              "does not use");
}

void ModelOptions::validate(int64_t num_layers) const {
  validate();
  TORCH_CHECK(recompute_layers <= num_layers,
              "ModelOptions.recompute_layers: expected at most the ", num_layers,
              " decoder layers, got ", recompute_layers);
  const int64_t recomputed =
      gradient_checkpointing ? (recompute_layers < 0 ? num_layers : recompute_layers) : 0;
  TORCH_CHECK(recompute_keep_attention + recompute_keep_mlp <= recomputed,
              "ModelOptions.recompute_keep_attention + recompute_keep_mlp: expected at most the ",
              recomputed, " recomputed decoder layers, got ", recompute_keep_attention, " + ",
              recompute_keep_mlp);
}

LayerRecompute ModelOptions::layer_recompute(int64_t layer, int64_t num_layers) const {
  if (!gradient_checkpointing) return LayerRecompute::kNone;
  // Recomputed: [0, n); of those, the top recompute_keep_mlp keep their MLP block and the
  // recompute_keep_attention below them their attention block.
  const int64_t n = recompute_layers < 0 ? num_layers : std::min(recompute_layers, num_layers);
  if (layer >= n) return LayerRecompute::kNone;
  if (layer >= n - recompute_keep_mlp) return LayerRecompute::kAttention;
  if (layer >= n - recompute_keep_mlp - recompute_keep_attention) return LayerRecompute::kMlp;
  return LayerRecompute::kLayer;
}

}  // namespace q4::model
