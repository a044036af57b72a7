// Qwen3Model: parameter table, loading masters from a .dat in one pass, random init, and the
// forward (embedding -> decoder layers -> final norm) as in HF transformers Qwen3ForCausalLM.
// Trainable masters stay in master_dtype and reach the forward through straight-through taps;
// frozen weights are held once, in the compute dtype, as the forward uses them.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>
#include <tuple>

#include "q4/io/pinned.h"
#include "q4/model/weights_check.h"
#include "q4/quant/dither.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_impl.h"
#include "shape_text.h"
#include "stored_layers.h"

namespace q4::model {
namespace {

std::string shape_str(at::IntArrayRef s) { return bracketed(s); }

}  // namespace

// ---------------------------------------------------------------- Impl

Qwen3Model::Impl::Impl(const Qwen3Config& c, const ModelOptions& o, bool tied_lm_head)
    : cfg(c), opt(o), grad_dtype(o.resolved_grad_dtype()), tied(tied_lm_head) {
  cfg.validate();
  opt.validate(cfg.num_hidden_layers);
  opt.trainable.validate(cfg.num_hidden_layers);
  opt.lora.validate(cfg);
  linear_backend = opt.linear_backend ? opt.linear_backend : make_linear_backend(opt);
  const TrainableSpec& ts = opt.trainable;
  const int64_t D = cfg.head_dim;
  const int64_t L = cfg.num_hidden_layers;

  const std::vector<ParamSpec> specs = qwen3_parameters(cfg, !tied);
  params.resize(specs.size());
  shapes.resize(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    params[i].name = specs[i].name;
    params[i].trainable = ts.trains(specs[i], L, tied);
    params[i].quantized = false;  // set by the loader from the file's storage
    shapes[i] = specs[i].shape;
    index[specs[i].name] = i;
  }
  if (opt.lora.enabled()) make_adapters(specs);
  embed = find("model.embed_tokens.weight");
  final_norm = find("model.norm.weight");
  lm_head = tied ? embed : find("lm_head.weight");
  layers.resize(L);
  for (int64_t l = 0; l < L; ++l) {
    const std::string pre = "model.layers." + std::to_string(l) + ".";
    LayerParams& lp = layers[l];
    lp.q_proj = find(pre + "self_attn.q_proj.weight");
    lp.k_proj = find(pre + "self_attn.k_proj.weight");
    lp.v_proj = find(pre + "self_attn.v_proj.weight");
    lp.o_proj = find(pre + "self_attn.o_proj.weight");
    lp.q_norm = find(pre + "self_attn.q_norm.weight");
    lp.k_norm = find(pre + "self_attn.k_norm.weight");
    lp.ffn_slot = &ffn_for(cfg, l);
    for (const FfnParamSpec& f : lp.ffn_slot->param_specs(cfg)) {
      lp.ffn.push_back(find(pre + f.suffix));
    }
    lp.input_layernorm = find(pre + "input_layernorm.weight");
    lp.post_attention_layernorm = find(pre + "post_attention_layernorm.weight");
  }

  router.num_experts = cfg.moe.num_experts;
  router.recorded.assign(static_cast<size_t>(L), 0);
  for (int64_t l = 0; l < L; ++l) {
    if (cfg.is_moe_layer(l)) router.moe_layers.push_back(l);
  }

  trigger = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(opt.device));
  if (any_trainable()) trigger.set_requires_grad(true);

  // HF: inv_freq = 1 / (theta ** (arange(0, D, 2, int64).float() / D)), in fp32.
  at::Tensor exponent = at::arange(0, D, 2, at::kLong).to(at::kFloat) / static_cast<double>(D);
  inv_freq = at::pow(at::Scalar(cfg.rope_theta), exponent).reciprocal().to(opt.device);
}

Parameter* Qwen3Model::Impl::find(const std::string& name) {
  auto it = index.find(name);
  return it == index.end() ? nullptr : &params[it->second];
}

const std::vector<int64_t>& Qwen3Model::Impl::shape_of(const Parameter* p) const {
  return shapes[static_cast<size_t>(p - params.data())];
}

void Qwen3Model::Impl::keep_forward_weight(Parameter* p, ForwardWeights mode) {
  if (!p->trainable || !p->quantized || p->lora_a != nullptr) return;
  p->kept_weight = at::Tensor();
  p->qdata = at::Tensor();
  p->scale = at::Tensor();
  if (!opt.fake_quant) return;
  if (mode == ForwardWeights::kCodes) {
    const q4::quant::Nvfp4Tensor q = q4::quant::quantize_nvfp4(p->master, p->name, opt.block_rule);
    p->qdata = q.qdata;
    p->scale = q.scale;
  } else if (mode == ForwardWeights::kKept) {
    p->kept_weight = q4::quant::fake_quant_nvfp4_forward(p->master, p->name, opt.block_rule)
                         .to(opt.compute_dtype)
                         .contiguous();
  }
}

void Qwen3Model::Impl::offload_master(Parameter* p) {
  if (!p->trainable || !p->quantized) return;
  if (!opt.offload_masters) {
    keep_forward_weight(p, opt.forward_weights);
    return;
  }
  // Codes from the device master while it is there (one pass), then the master moves out.
  const q4::quant::Nvfp4Tensor q = q4::quant::quantize_nvfp4(p->master, p->name, opt.block_rule);
  p->qdata = q.qdata;
  p->scale = q.scale;
  if (p->master.is_cuda()) {
    at::Tensor host = q4::io::pinned_empty(p->master.sizes(), p->master.scalar_type());
    host.copy_(p->master);
    p->master = host;
  }
}

at::Tensor Qwen3Model::Impl::device_master(const Parameter* p) const {
  return p->master.device() == opt.device ? p->master : p->master.to(opt.device);
}

bool Qwen3Model::Impl::adapted(const ParamSpec& s) const {
  return opt.lora.adapts(s, opt.trainable, cfg.num_hidden_layers);
}

namespace {

// A stacked expert projection's kind: 'g' gate_proj, 'u' up_proj, 'd' down_proj, 0 another.
char expert_projection(const std::string& name) {
  for (const char* e : {"gate_proj", "up_proj", "down_proj"}) {
    const std::string tail = std::string(".mlp.experts.") + e + ".weight";
    if (name.size() > tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0)
      return e[0];
  }
  return 0;
}

}  // namespace

void Qwen3Model::Impl::make_adapters(const std::vector<ParamSpec>& specs) {
  // Sized once: base parameters point into it. A dense linear has an A and a B; a stacked
  // expert projection has per-expert blocks (docs/model.md#lora-on-experts), and an MoE layer's
  // up_proj shares its gate_proj's A (peft's fused gate_up_proj adapter), so has a B only.
  const int64_t r = opt.lora.rank, E = cfg.moe.num_experts;
  int64_t n = 0;
  for (const ParamSpec& s : specs) {
    if (adapted(s)) n += expert_projection(s.name) == 'u' ? 1 : 2;
  }
  adapters.reserve(static_cast<size_t>(n));
  const auto add = [&](const std::string& name, std::vector<int64_t> shape) {
    Parameter a;
    a.name = name;
    a.trainable = true;
    adapters.push_back(std::move(a));
    adapter_shapes.push_back(std::move(shape));
    return &adapters.back();
  };
  for (size_t i = 0; i < specs.size(); ++i) {
    if (!adapted(specs[i])) continue;
    const std::string& name = specs[i].name;
    const int64_t out = specs[i].shape[0], in = specs[i].shape[1];
    params[i].trainable = false;  // the adapter trains instead
    const char kind = expert_projection(name);
    if (kind == 0) {
      params[i].lora_a = add(lora_param_name(name, "lora_A"), {r, in});
      params[i].lora_b = add(lora_param_name(name, "lora_B"), {out, r});
      continue;
    }
    if (kind == 'u') {
      TORCH_INTERNAL_ASSERT(i > 0 && expert_projection(specs[i - 1].name) == 'g' &&
                            params[i - 1].lora_a != nullptr);
      params[i].lora_a = params[i - 1].lora_a;
    } else {
      const std::string base = name.substr(0, name.rfind(".mlp.experts.") + 13);
      params[i].lora_a = add(base + (kind == 'g' ? "gate_up_proj" : "down_proj") + ".lora_A.weight",
                             {E * r, in});
    }
    params[i].lora_b = add(lora_param_name(name, "lora_B"), {out, r});
  }
}

void Qwen3Model::Impl::init_adapters() {
  // PEFT's default: A ~ kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0, so
  // the adapted model starts as the base model.
  at::Generator gen = at::detail::createCPUGenerator(opt.lora.seed);
  for (size_t i = 0; i < adapters.size(); ++i) {
    const auto& shape = adapter_shapes[i];
    at::Tensor w = at::zeros(shape, at::kFloat);
    if (adapters[i].name.find(".lora_A.") != std::string::npos) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(shape[1]));
      w.uniform_(-bound, bound, gen);
    }
    adapters[i].master = w.to(opt.device).to(opt.master_dtype).contiguous();
  }
}

at::Tensor Qwen3Model::Impl::merged_weight(const Parameter* p) const {
  TORCH_CHECK(p->lora_a != nullptr, "merged_weight: ", p->name, " has no adapter");
  fence(p->lora_a);
  fence(p->lora_b);
  at::NoGradGuard no_grad;
  at::Tensor w = q4::quant::dequantize_nvfp4(p->qdata, p->scale, at::kFloat);
  const at::Tensor ba =
      lora_delta(p->lora_b->master.to(at::kFloat), p->lora_a->master.to(at::kFloat));
  return w.add_(ba, opt.lora.scale());
}

LinearWeights Qwen3Model::Impl::linear_weights(Parameter* p) const {
  return linear_backend->weights(*this, p);
}

at::Tensor Qwen3Model::Impl::linear(const at::Tensor& x, Parameter* p) const {
  return linear(x, linear_weights(p));
}

at::Tensor Qwen3Model::Impl::linear(const at::Tensor& x, const LinearWeights& w) const {
  return linear_backend->apply(*this, x, w);
}

std::vector<at::Tensor> Qwen3Model::Impl::linears(
    const at::Tensor& x, const std::vector<const LinearWeights*>& ws) const {
  return linear_backend->apply_group(*this, x, ws);
}

at::Tensor Qwen3Model::Impl::plain_lora(const at::Tensor& x, const LinearWeights& w) const {
  return at::linear(at::linear(x, w.lora_a) * opt.lora.scale(), w.lora_b);
}

bool Qwen3Model::Impl::any_trainable() const {
  return !adapters.empty() ||
         std::any_of(params.begin(), params.end(), [](const Parameter& p) { return p.trainable; });
}

at::Tensor Qwen3Model::Impl::weight(Parameter* p) const {
  // A kept forward weight is that weight already (no copy to keep).
  if (inference_weights && !at::GradMode::is_enabled() && !p->kept_weight.defined() &&
      (p->trainable || p->lora_a != nullptr)) {
    if (p->inference_weight.defined()) return p->inference_weight;
    at::Tensor w = forward_weight(p);
    const int64_t bytes = static_cast<int64_t>(w.numel() * w.element_size());
    if (inference_bytes + bytes <= inference_budget) {
      auto* self = const_cast<Impl*>(this);
      self->inference_bytes += bytes;
      p->inference_weight = w;
    }
    return w;
  }
  return forward_weight(p);
}

at::Tensor Qwen3Model::Impl::forward_weight(Parameter* p) const {
  if (p->lora_a != nullptr) {
    // Merge-aware: fake_quant(W + s·B·A), straight through to A and B; plain: W itself (the
    // linear adds s·(x·Aᵀ)·Bᵀ), but for lm_head, whose loss takes one weight: W + s·B·A in the
    // compute dtype (a PEFT adapter's lm_head; the trainer trains merge-aware ones only).
    if (opt.lora.merge_aware) return tap_lora_merged(this, p, opt.compute_dtype, grad_dtype);
    if (p == lm_head) {
      const at::Tensor ba = at::mm(weight(p->lora_b), weight(p->lora_a));
      return q4::quant::dequantize_nvfp4(p->qdata, p->scale, opt.compute_dtype)
          .add(ba, opt.lora.scale());
    }
    if (!opt.cache_adapted_weights) {
      return q4::quant::dequantize_nvfp4(p->qdata, p->scale, opt.compute_dtype);
    }
    if (!p->dequantized.defined()) {
      p->dequantized = q4::quant::dequantize_nvfp4(p->qdata, p->scale, opt.compute_dtype);
    }
    return p->dequantized;
  }
  if (!p->trainable) return p->master;
  fence(p);
  return tap_weight(this, p, opt.compute_dtype, grad_dtype);
}

at::Tensor Qwen3Model::Impl::embed_lookup(const at::Tensor& ids) const {
  if (!embed->trainable) return at::embedding(embed->master, ids);
  fence(embed);
  return tap_embedding(this, embed, ids, opt.compute_dtype, grad_dtype);
}

RopeTables Qwen3Model::Impl::rope(const at::Tensor& position_ids) const {
  // HF: freqs = inv_freq (D/2) x positions, emb = cat(freqs, freqs); cos/sin in fp32, then cast.
  at::Tensor freqs = position_ids.to(at::kFloat).unsqueeze(-1) * inv_freq;  // (B, T, D/2)
  at::Tensor emb = at::cat({freqs, freqs}, -1);                             // (B, T, D)
  return {emb.cos().to(opt.compute_dtype), emb.sin().to(opt.compute_dtype)};
}

at::Tensor Qwen3Model::Impl::layer_forward(int64_t layer, const at::Tensor& h,
                                           const RopeTables& rope_t, const AttnMask& mask,
                                           KvCache* cache) const {
  return ffn_of(layer).forward(*this, layer, attention_block(layer, h, rope_t, mask, cache));
}

at::Tensor Qwen3Model::Impl::attention_block(int64_t layer, const at::Tensor& h,
                                             const RopeTables& rope_t, const AttnMask& mask,
                                             KvCache* cache) const {
  const LayerParams& lp = layers[layer];
  const int64_t B = h.size(0), T = h.size(1);
  const int64_t NH = cfg.num_attention_heads, KVH = cfg.num_key_value_heads, D = cfg.head_dim;
  const double eps = cfg.rms_norm_eps;

  at::Tensor x = rms_norm(h, weight(lp.input_layernorm), eps, opt.fused_cuda_kernels);  // (B, T, H)
  const LinearWeights wq = linear_weights(lp.q_proj), wk = linear_weights(lp.k_proj),
                      wv = linear_weights(lp.v_proj);
  const std::vector<at::Tensor> qkv = linears(x, {&wq, &wk, &wv});
  at::Tensor a;  // (B, T, NH*D)
  if (mask.kind == AttnMask::Kind::kVarlen) {
    // Token-major layout throughout: no transposes, and the kernel takes (B*T, heads, D) views.
    TORCH_INTERNAL_ASSERT(cache == nullptr);
    at::Tensor q = rms_norm(qkv[0].view({B, T, NH, D}), weight(lp.q_norm), eps,
                            opt.fused_cuda_kernels);  // (B, T, NH, D)
    at::Tensor k = rms_norm(qkv[1].view({B, T, KVH, D}), weight(lp.k_norm), eps,
                            opt.fused_cuda_kernels);  // (B, T, KVH, D)
    at::Tensor v = qkv[2].view({B * T, KVH, D});
    q = apply_rope_bthd(q, rope_t, opt.fused_cuda_kernels).view({B * T, NH, D});
    k = apply_rope_bthd(k, rope_t, opt.fused_cuda_kernels).view({B * T, KVH, D});
    a = attention_varlen(q, k, v, mask.allowed, mask.max_seqlen).view({B, T, NH * D});
  } else {
    at::Tensor q =
        rms_norm(qkv[0].view({B, T, NH, D}), weight(lp.q_norm), eps, opt.fused_cuda_kernels)
            .transpose(1, 2);  // (B, NH, T, D)
    at::Tensor k =
        rms_norm(qkv[1].view({B, T, KVH, D}), weight(lp.k_norm), eps, opt.fused_cuda_kernels)
            .transpose(1, 2);  // (B, KVH, T, D)
    at::Tensor v = qkv[2].view({B, T, KVH, D}).transpose(1, 2);
    q = apply_rope(q, rope_t);
    k = apply_rope(k, rope_t);
    if (cache != nullptr) {
      const int64_t past = cache->length;
      cache->k[layer].narrow(2, past, T).copy_(k);
      cache->v[layer].narrow(2, past, T).copy_(v);
      k = cache->k[layer].narrow(2, 0, past + T);
      v = cache->v[layer].narrow(2, 0, past + T);
    }
    a = attention(q, k, v, mask);                   // (B, NH, T, D)
    a = a.transpose(1, 2).reshape({B, T, NH * D});  // (B, T, NH*D)
  }
  return h + linear(a, lp.o_proj);  // (B, T, H)
}

at::Tensor Qwen3Model::Impl::layer_maybe_checkpointed(int64_t layer, const at::Tensor& h,
                                                      const RopeTables& rope_t,
                                                      const AttnMask& mask, KvCache* cache) const {
  const bool building_graph =
      at::GradMode::is_enabled() && (h.requires_grad() || trigger.requires_grad());
  if (!building_graph || cache != nullptr) return layer_forward(layer, h, rope_t, mask, cache);
  switch (opt.layer_recompute(layer, cfg.num_hidden_layers)) {
    case LayerRecompute::kNone:
      break;
    case LayerRecompute::kLayer:
      return checkpoint_layer(this, layer, h, rope_t, mask);
    case LayerRecompute::kAttention: {
      return ffn_of(layer).forward(*this, layer,
                                   checkpoint_attention(this, layer, h, rope_t, mask));
    }
    case LayerRecompute::kMlp:
      return checkpoint_mlp(this, layer, attention_block(layer, h, rope_t, mask, nullptr));
  }
  return layer_forward(layer, h, rope_t, mask, cache);
}

at::Tensor Qwen3Model::Impl::hidden_states(const ModelInputs& in, KvCache* cache) {
  TORCH_CHECK(in.input_ids.defined() && in.input_ids.dim() == 2,
              "input_ids: expected a (B, T) int64 tensor, got ",
              in.input_ids.defined() ? shape_str(in.input_ids.sizes()) : std::string("none"));
  TORCH_CHECK(in.input_ids.scalar_type() == at::kLong, "input_ids: expected int64, got ",
              c10::toString(in.input_ids.scalar_type()));
  const int64_t B = in.input_ids.size(0), T = in.input_ids.size(1);
  TORCH_CHECK(T > 0 && B > 0, "input_ids: empty batch ", shape_str(in.input_ids.sizes()));
  auto check_bt = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(!t.defined() || (t.dim() == 2 && t.size(0) == B && t.size(1) == T), what,
                ": expected shape ", shape_str(in.input_ids.sizes()), " like input_ids, got ",
                t.defined() ? shape_str(t.sizes()) : std::string());
  };
  check_bt(in.attention_mask, "attention_mask");
  check_bt(in.position_ids, "position_ids");
  check_bt(in.segment_ids, "segment_ids");
  const at::Device dev = opt.device;
  const int64_t past = cache ? cache->length : 0;
  if (cache) {
    TORCH_CHECK(
        static_cast<int64_t>(cache->k.size()) == cfg.num_hidden_layers && cache->k[0].size(0) == B,
        "KV cache: built for ", cache->k.empty() ? 0 : cache->k[0].size(0), " sequences and ",
        cache->k.size(), " layers, used with batch ", B);
    TORCH_CHECK(past + T <= cache->capacity(), "KV cache: ", past, " cached + ", T,
                " new tokens exceed its capacity ", cache->capacity());
  }

  at::Tensor ids = in.input_ids.to(dev);
  at::Tensor pos =
      in.position_ids.defined()
          ? in.position_ids.to(dev)
          : at::arange(past, past + T, at::TensorOptions().dtype(at::kLong).device(dev))
                .unsqueeze(0)
                .expand({B, T});
  RopeTables rope_t = rope(pos);
  AttnMask mask;
  if (uses_varlen(in, cache)) {
    TORCH_CHECK(in.cu_seqlens.dim() == 1 && in.cu_seqlens.scalar_type() == at::kInt &&
                    in.cu_seqlens.numel() >= 2 && in.max_seqlen > 0,
                "cu_seqlens: expected (S + 1) int32 cumulative lengths and max_seqlen > 0");
    mask.kind = AttnMask::Kind::kVarlen;
    mask.allowed = in.cu_seqlens.to(dev, /*non_blocking=*/true);
    mask.max_seqlen = in.max_seqlen;
  } else if (cache != nullptr && cache->key_valid.defined()) {
    mask = cached_attention_mask(in, *cache, past, T);
  } else {
    mask = build_attention_mask(in, past, T, dev);
  }

  if (cfg.is_moe()) {
    // The rows the load-balancing loss counts: HF's attention_mask (packing's padding too).
    at::Tensor valid = in.attention_mask;
    if (in.segment_ids.defined()) {
      const at::Tensor seg = in.segment_ids.ne(0);
      valid = valid.defined() ? valid.ne(0).logical_and(seg) : seg;
    }
    router.begin(valid, B * T, dev, opt.router_z_loss_coef > 0);
  }
  at::Tensor h = embed_lookup(ids);  // (B, T, H)
  for (int64_t l = 0; l < cfg.num_hidden_layers; ++l) {
    h = layer_maybe_checkpointed(l, h, rope_t, mask, cache);
  }
  if (cfg.is_moe()) h = router_aux_gate(this, h);
  if (cache) cache->length += T;
  return rms_norm(h, weight(final_norm), cfg.rms_norm_eps, opt.fused_cuda_kernels);
}

// ---------------------------------------------------------------- Qwen3Model

Qwen3Model::Qwen3Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Qwen3Model::Qwen3Model(Qwen3Model&&) noexcept = default;
Qwen3Model& Qwen3Model::operator=(Qwen3Model&&) noexcept = default;
Qwen3Model::~Qwen3Model() = default;

const Qwen3Config& Qwen3Model::config() const { return impl_->cfg; }
const ModelOptions& Qwen3Model::options() const { return impl_->opt; }
bool Qwen3Model::tied() const { return impl_->tied; }

namespace {

// The dither seed of the parameter at `index` of the table (ModelOptions::master_init): the run's
// seed and the index mixed by splitmix64's finalizer, so neighbouring parameters draw unrelated
// streams and the load order does not matter.
uint64_t dither_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ull * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Qwen3Model::load's pass over the entries of `weights` into the parameters of `m`.
class WeightLoader {
 public:
  WeightLoader(Qwen3Model::Impl& m, const DatReader& weights)
      : m_(m), weights_(weights), path_(weights.path()), dev_(m.opt.device) {}

  // One entry: a raw parameter, or one half of an NVFP4 pair. Entries that are not Qwen3
  // parameters are ignored here (export copies them).
  void entry(size_t i) {
    const DatEntry& e = weights_.entries()[i];
    KeyRef ref = classify_key(e.key);
    Parameter* p = m_.find(ref.name);
    if (p == nullptr) return;
    const std::string where = path_ + ": entry " + std::to_string(i) + " '" + e.key + "'";
    TORCH_CHECK(seen_.insert(e.key).second, where, ": duplicate key");
    if (ref.part == KeyRef::Part::kRaw) {
      raw(e, ref, p, where);
    } else {
      packed(e, ref, p, where);
    }
  }

  // After every entry: no half pair left, every parameter loaded.
  void check_complete() const {
    for (const auto& kv : pending_) {
      TORCH_CHECK(false, path_, ": ", kv.first, (kv.second.qdata.defined() ? ".scale" : ".qdata"),
                  " is missing (its ", (kv.second.qdata.defined() ? ".qdata" : ".scale"),
                  " is present)");
    }
  }

 private:
  void raw(const DatEntry& e, const KeyRef& ref, Parameter* p, const std::string& where) {
    const auto& shape = m_.shape_of(p);
    TORCH_CHECK(e.type == ElemType::kFloat16 || e.type == ElemType::kBFloat16 ||
                    e.type == ElemType::kFloat32,
                where, ": expected element type fp16, bf16 or fp32, got ", elem_type_name(e.type));
    TORCH_CHECK(e.shape == shape, where, ": expected shape ", shape_str(shape), ", got ",
                shape_str(e.shape));
    TORCH_CHECK(!p->master.defined() && pending_.count(ref.name) == 0, where, ": parameter ",
                ref.name, " is stored both raw and quantized");
    TORCH_CHECK(p->lora_a == nullptr, where, ": ", ref.name,
                " is stored unquantized; LoRA adapters (lora.targets) go on NVFP4 linears");
    at::Tensor w = weights_.load(e);
    check_finite_weight(w, e.type, where);
    finish(p, w.to(dev_), false);
  }

  // A quantized parameter needs its qdata and scale; whichever comes first waits (on the host)
  // for the other, so at most one linear's packed data is pending at a time in practice.
  void packed(const DatEntry& e, const KeyRef& ref, Parameter* p, const std::string& where) {
    const auto& shape = m_.shape_of(p);
    TORCH_CHECK(shape.size() == 2 && shape[1] % q4::quant::kNvfp4BlockSize == 0, where,
                ": parameter ", ref.name, " of shape ", shape_str(shape),
                " cannot be stored as NVFP4");
    TORCH_CHECK(!p->master.defined(), where, ": parameter ", ref.name,
                " is stored both raw and quantized");
    Pending& pd = pending_[ref.name];
    if (ref.part == KeyRef::Part::kQData) {
      TORCH_CHECK(e.type == ElemType::kUInt8 || e.type == ElemType::kE2M1Packed, where,
                  ": expected element type uint8 or e2m1 (0 or 100), got ", elem_type_name(e.type));
      const std::vector<int64_t> want{shape[0], shape[1] / 2};
      TORCH_CHECK(e.shape == want, where, ": expected shape ", shape_str(want), ", got ",
                  shape_str(e.shape));
      pd.qdata = weights_.load(e);
    } else {
      TORCH_CHECK(e.type == ElemType::kE4M3Scale, where, ": expected element type e4m3 (101), got ",
                  elem_type_name(e.type));
      const std::vector<int64_t> want{shape[0], shape[1] / q4::quant::kNvfp4BlockSize};
      TORCH_CHECK(e.shape == want, where, ": expected shape ", shape_str(want), ", got ",
                  shape_str(e.shape));
      pd.scale = weights_.load(e);
      check_finite_weight(pd.scale, e.type, where);
    }
    if (!pd.qdata.defined() || !pd.scale.defined()) return;
    if (p->lora_a != nullptr) {
      // An adapted linear keeps the file's codes: its forward is built from W itself.
      p->quantized = true;
      p->qdata = pd.qdata.to(dev_).contiguous();
      p->scale = pd.scale.to(dev_).contiguous();
      pending_.erase(ref.name);
      return;
    }
    // Dequantized values (<= 5 significant bits, |x| <= 2688) are exact in fp16/bf16/fp32.
    const at::ScalarType dt = p->trainable ? m_.opt.master_dtype : m_.opt.compute_dtype;
    at::Tensor w = q4::quant::dequantize_nvfp4(pd.qdata.to(dev_), pd.scale.to(dev_), dt);
    pending_.erase(ref.name);
    if (p->trainable && m_.opt.fake_quant && m_.opt.master_init == MasterInit::kDither) {
      const auto index = static_cast<uint64_t>(p - m_.params.data());
      w = q4::quant::dither_nvfp4(w, dither_seed(m_.opt.master_init_seed, index), p->name,
                                  m_.opt.block_rule);
    }
    finish(p, w, true);
  }

  // w: on the device, master-ready values (dequantized or raw), any float dtype.
  void finish(Parameter* p, const at::Tensor& w, bool quantized) {
    p->quantized = quantized;
    // A frozen linear computes with the file's own values, dequantize(file) (docs/design.md
    // #training-numerics): quantizing them again would move the blocks whose largest value
    // selects another scale (docs/design.md#nvfp4-arithmetic).
    if (p->trainable) {
      p->master = w.to(m_.opt.master_dtype).contiguous();
      m_.offload_master(p);
    } else {
      p->master = w.to(m_.opt.compute_dtype).contiguous();
    }
  }

  struct Pending {
    at::Tensor qdata, scale;
  };
  Qwen3Model::Impl& m_;
  const DatReader& weights_;
  const std::string& path_;
  const at::Device dev_;
  std::unordered_map<std::string, Pending> pending_;
  std::set<std::string> seen_;
};

}  // namespace

Qwen3Model Qwen3Model::load(const Qwen3Config& cfg, const DatReader& weights, ModelOptions opt) {
  const bool has_lm_head =
      weights.find("lm_head.weight.qdata") != nullptr || weights.find("lm_head.weight") != nullptr;
  TORCH_CHECK(has_lm_head || cfg.tie_word_embeddings, weights.path(),
              ": no lm_head.weight(.qdata) entry, but ", cfg.source,
              " has tie_word_embeddings false");
  auto impl = std::make_unique<Impl>(cfg, opt, !has_lm_head);
  Impl& m = *impl;
  const auto& path = weights.path();
  const auto& entries = weights.entries();
  // The config and the weights describe the same number of decoder layers: extra layers in
  // the file would be dropped silently, missing ones are named below.
  int64_t stored_layers = 0;
  for (const DatEntry& e : entries) stored_layers = count_stored_layer(e.key, stored_layers);
  TORCH_CHECK(stored_layers <= cfg.num_hidden_layers, path, " stores ", stored_layers,
              " decoder layers but ", cfg.source, " has num_hidden_layers ", cfg.num_hidden_layers,
              "; the config and the weights must describe the same model");
  WeightLoader loader(m, weights);
  for (size_t i = 0; i < entries.size(); ++i) loader.entry(i);
  loader.check_complete();
  TORCH_CHECK(stored_layers == 0 || stored_layers == cfg.num_hidden_layers, path, " stores ",
              stored_layers, " decoder layers but ", cfg.source, " has num_hidden_layers ",
              cfg.num_hidden_layers, "; the config and the weights must describe the same model");
  for (size_t i = 0; i < m.params.size(); ++i) {
    TORCH_CHECK(m.params[i].master.defined() || m.params[i].qdata.defined(), path,
                ": missing parameter ", m.params[i].name, " (expected ", m.params[i].name,
                " raw or ", m.params[i].name, ".qdata/.scale, shape ", shape_str(m.shapes[i]), ")");
  }
  m.init_adapters();
  return Qwen3Model(std::move(impl));
}

Qwen3Model Qwen3Model::random_init(const Qwen3Config& cfg, ModelOptions opt, uint64_t seed,
                                   double std) {
  auto impl = std::make_unique<Impl>(cfg, opt, cfg.tie_word_embeddings);
  Impl& m = *impl;
  at::Generator gen = at::detail::createCPUGenerator(seed);
  const std::vector<ParamSpec> specs = qwen3_parameters(cfg, !m.tied);  // m.params' order
  for (size_t i = 0; i < m.params.size(); ++i) {
    Parameter& p = m.params[i];
    const bool is_norm = specs[i].group == ParamGroup::kNorm;
    at::Tensor w =
        is_norm ? at::ones(m.shapes[i], at::kFloat)
                : at::normal(0.0, std, m.shapes[i], gen, at::TensorOptions().dtype(at::kFloat));
    p.quantized = specs[i].kind == ParamKind::kQuantizedLinear;
    w = w.to(m.opt.device);
    if (p.lora_a != nullptr) {
      const q4::quant::Nvfp4Tensor q = q4::quant::quantize_nvfp4(w, p.name, m.opt.block_rule);
      p.qdata = q.qdata;
      p.scale = q.scale;
    } else if (p.trainable) {
      p.master = w.to(m.opt.master_dtype);
      m.offload_master(&p);
    } else if (p.quantized && m.opt.fake_quant) {
      p.master =
          q4::quant::fake_quant_nvfp4_forward(w, p.name, m.opt.block_rule).to(m.opt.compute_dtype);
    } else {
      p.master = w.to(m.opt.compute_dtype);
    }
  }
  m.init_adapters();
  return Qwen3Model(std::move(impl));
}

at::Tensor Qwen3Model::hidden_states(const ModelInputs& in, KvCache* cache) {
  return impl_->hidden_states(in, cache);
}

bool Qwen3Model::uses_varlen_attention(const ModelInputs& in) const {
  return impl_->uses_varlen(in, nullptr);
}

bool Qwen3Model::Impl::uses_varlen(const ModelInputs& in, const KvCache* cache) const {
  return in.cu_seqlens.defined() && cache == nullptr &&
         varlen_attention_available(opt.device, opt.compute_dtype, cfg.head_dim);
}

at::Tensor Qwen3Model::forward(const ModelInputs& in, KvCache* cache) {
  at::Tensor h = impl_->hidden_states(in, cache);
  return at::linear(h, impl_->weight(impl_->lm_head));  // (B, T, V)
}

namespace {

void check_labels(const ModelInputs& in) {
  TORCH_CHECK(in.labels.defined() && in.labels.sizes() == in.input_ids.sizes() &&
                  in.labels.scalar_type() == at::kLong,
              "labels: expected an int64 tensor shaped like input_ids ",
              shape_str(in.input_ids.sizes()));
}

// The label each position predicts, flat (B*T) int64 where the labels live: HF shift, position
// t predicts labels[t + 1] and the last position nothing (-100). After the forward (which
// checks the batch is not empty).
at::Tensor shifted_labels(const ModelInputs& in) {
  const int64_t B = in.labels.size(0), T = in.labels.size(1);
  return at::cat({in.labels.narrow(1, 1, T - 1), at::full({B, 1}, -100, in.labels.options())}, 1)
      .reshape({-1});
}

}  // namespace

LossOutput Qwen3Model::loss(const ModelInputs& in, const LossTerm* term) {
  check_labels(in);
  at::Tensor h = impl_->hidden_states(in, nullptr);  // (B, T, H)
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2);
  at::Tensor next = shifted_labels(in);  // (B*T) int64
  // Only the supervised rows reach the lm_head (the (rows, V) logits dominate the step when
  // answers are short): their flat indices are found where the labels live. Labels on the host
  // (or on the CPU device) cost no device sync; labels already on a CUDA device cost one (the
  // row count).
  at::Tensor rows = next.ne(-100).nonzero().reshape({-1});  // (N) int64 flat positions
  at::Tensor targets = next.index_select(0, rows);          // (N)
  const at::Device dev = impl_->opt.device;
  if (dev.is_cuda() && rows.numel() > 0) {
    // CUDA: pad the rows to a multiple of kLossRowQuantum with ignored (-100) copies of the first
    // row, so that the lm_head GEMMs see a few recurring shapes instead of a new one every step:
    // a shape cuBLAS has not seen costs 3-4 ms of host time while the GPU idles (Kineto,
    // docs/performance.md). Padded rows add 0 to the loss and to every gradient.
    constexpr int64_t kLossRowQuantum = 64;
    const int64_t pad = (kLossRowQuantum - rows.numel() % kLossRowQuantum) % kLossRowQuantum;
    if (pad > 0) {
      rows = at::cat({rows, rows.narrow(0, 0, 1).expand({pad})});
      targets = at::cat({targets, at::full({pad}, -100, targets.options())});
    }
  }
  if (dev.is_cuda() && !next.is_cuda()) {
    // Pinned staging: the copies are queued behind the forward instead of waiting for it.
    rows = rows.pin_memory().to(dev, /*non_blocking=*/true);
    targets = targets.pin_memory().to(dev, /*non_blocking=*/true);
  } else {
    rows = rows.to(dev);
    targets = targets.to(dev);
  }
  at::Tensor hs = h.reshape({B * T, H}).index_select(0, rows);  // (N, H)
  LossOutput out;
  if (term == nullptr) {
    std::tie(out.loss_sum, out.num_tokens) =
        chunked_cross_entropy_sum(hs, impl_->weight(impl_->lm_head), targets,
                                  impl_->opt.loss_chunk_tokens, impl_->opt.fused_cuda_kernels);
    out.ce_sum = out.loss_sum.detach();
  } else {
    if (term->prepare) term->prepare(rows);
    out.loss_sum = chunked_loss_with_term(hs, impl_->weight(impl_->lm_head), targets,
                                          impl_->opt.loss_chunk_tokens, *term, &out.ce_sum,
                                          &out.term_sum, impl_->opt.fused_cuda_kernels);
    out.num_tokens = targets.ne(-100).sum();
  }
  const at::Tensor& count = out.num_tokens;
  const double coef = impl_->router_aux_loss_coef();
  if (impl_->router.aux.defined()) {
    // HF's loss: mean CE + coef · aux; as a sum, coef · aux once per supervised token.
    out.aux_loss = impl_->router.aux.detach();
    if (coef > 0) {
      out.loss_sum = out.loss_sum + impl_->router.aux * count.clamp_min(1).to(at::kFloat) * coef;
    }
  }
  if (impl_->router.z.defined()) {
    out.z_loss = impl_->router.z.detach();
    out.loss_sum = out.loss_sum + impl_->router.z * count.clamp_min(1).to(at::kFloat) *
                                      impl_->opt.router_z_loss_coef;
  }
  out.loss = out.loss_sum / count.clamp_min(1).to(at::kFloat);
  return out;
}

Qwen3Model::TokenLogprobs Qwen3Model::token_logprobs(const ModelInputs& in, double temperature) {
  check_labels(in);
  at::Tensor h = impl_->hidden_states(in, nullptr);  // (B, T, H)
  const int64_t B = h.size(0), T = h.size(1), H = h.size(2);
  const at::Tensor next = shifted_labels(in);
  TokenLogprobs out;
  out.positions = next.ne(-100).nonzero().reshape({-1});
  const at::Device dev = impl_->opt.device;
  const at::Tensor rows = out.positions.to(dev);
  const at::Tensor targets = next.index_select(0, out.positions).to(dev);
  out.logprobs = chunked_token_logprobs(h.reshape({B * T, H}).index_select(0, rows),
                                        impl_->weight(impl_->lm_head), targets,
                                        impl_->opt.loss_chunk_tokens, temperature);
  return out;
}

std::vector<Parameter>& Qwen3Model::parameters() {
  impl_->fence(nullptr);
  return impl_->params;
}

const std::vector<Parameter>& Qwen3Model::parameters() const {
  impl_->fence(nullptr);
  return impl_->params;
}

std::vector<Parameter*> Qwen3Model::trainable_parameters() {
  impl_->fence(nullptr);
  std::vector<Parameter*> out;
  for (auto& p : impl_->params) {
    if (p.trainable) out.push_back(&p);
  }
  for (auto& p : impl_->adapters) out.push_back(&p);
  return out;
}

std::vector<Parameter>& Qwen3Model::adapters() {
  impl_->fence(nullptr);
  return impl_->adapters;
}

Parameter& Qwen3Model::parameter(const std::string& name) {
  impl_->fence(nullptr);
  Parameter* p = impl_->find(name);
  TORCH_CHECK(p != nullptr, "no parameter named '", name, "' in this Qwen3 model");
  return *p;
}

const Parameter& Qwen3Model::parameter(const std::string& name) const {
  return const_cast<Qwen3Model*>(this)->parameter(name);
}

void Qwen3Model::zero_grad() {
  for (auto& p : impl_->adapters) p.grad = at::Tensor();
  for (auto& p : impl_->params) p.grad = at::Tensor();
}

void Qwen3Model::set_recompute(bool gradient_checkpointing, int64_t recompute_layers,
                               bool offload_layer_inputs, int64_t recompute_keep_attention,
                               int64_t recompute_keep_mlp) {
  ModelOptions o = impl_->opt;
  o.gradient_checkpointing = gradient_checkpointing;
  o.recompute_layers = recompute_layers;
  o.offload_layer_inputs = offload_layer_inputs;
  o.recompute_keep_attention = recompute_keep_attention;
  o.recompute_keep_mlp = recompute_keep_mlp;
  o.validate(impl_->cfg.num_hidden_layers);
  impl_->opt = o;
}

void Qwen3Model::set_cache_adapted_weights(bool cache) {
  impl_->opt.cache_adapted_weights = cache;
  if (!cache) {
    for (Parameter& p : impl_->params) p.dequantized = at::Tensor();
  }
}

void Qwen3Model::set_grad_ready_hook(GradReadyHook hook) { impl_->grad_ready = std::move(hook); }

void Qwen3Model::set_master_fence(MasterFence fence) { impl_->master_fence = std::move(fence); }

void Qwen3Model::refresh_forward_weights(const Parameter* only) {
  if (only != nullptr) {
    if (keeps_forward_weight(*only)) refresh_forward_weights(*only, only->master);
    return;
  }
  for (const auto& p : impl_->params) {
    if (keeps_forward_weight(p)) refresh_forward_weights(p, p.master);
  }
}

void Qwen3Model::refresh_forward_weights(const Parameter& p, const at::Tensor& master) {
  TORCH_INTERNAL_ASSERT(keeps_forward_weight(p) && master.sizes() == p.master.sizes(),
                        "refresh_forward_weights: ", p.name,
                        " keeps no forward weight or has another shape");
  at::NoGradGuard no_grad;
  const at::Device dev = p.qdata.defined() ? p.qdata.device() : p.kept_weight.device();
  const at::Tensor values = master.device() == dev ? master : q4::io::device_alias(master, dev);
  if (p.qdata.defined()) {
    q4::quant::quantize_nvfp4_into(values, {p.qdata, p.scale}, p.name, impl_->opt.block_rule);
  } else {
    // In place: the graph that used the previous values is done with them. The version bump
    // (the CUDA kernel writes through a raw pointer) makes a saved-tensor unpack of an alias
    // that a graph still holds an error instead of a read of the new values.
    q4::quant::fake_quant_nvfp4_forward_into(values, p.kept_weight, p.name, impl_->opt.block_rule);
    p.kept_weight.unsafeGetTensorImpl()->bump_version();
  }
}

void Qwen3Model::set_forward_weights(ForwardWeights mode) {
  ModelOptions o = impl_->opt;
  o.forward_weights = mode;
  o.validate();
  impl_->opt = o;
  if (o.offload_masters) return;  // codes whatever the mode (validate: not kept)
  at::NoGradGuard no_grad;
  for (auto& p : impl_->params) {
    if (p.lora_a != nullptr || !p.trainable || !p.quantized) continue;
    impl_->fence(&p);
    impl_->keep_forward_weight(&p, mode);
  }
}

void Qwen3Model::begin_grad_step() {
  for (auto& p : impl_->params) p.pending_uses = 0;
  for (auto& p : impl_->adapters) p.pending_uses = 0;
}

int64_t Qwen3Model::num_trainable_elements() const {
  int64_t n = 0;
  for (const auto& p : impl_->params) {
    if (p.trainable) n += p.master.numel();
  }
  for (const auto& p : impl_->adapters) n += p.master.numel();
  return n;
}

}  // namespace q4::model
