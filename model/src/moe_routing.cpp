// RouterRecord (moe_routing.h) and the aux gate: the load-balancing loss of a mixture-of-experts
// forward, as HF transformers' load_balancing_loss_func computes it, and its gradient.
#include "moe_routing.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>

#include "qwen3_impl.h"

namespace q4::model {

void RouterRecord::begin(const at::Tensor& valid_bt, int64_t rows, const at::Device& device,
                         bool with_z) {
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  valid = valid_bt.defined() ? valid_bt.reshape({rows}).to(device).ne(0).to(at::kFloat)
                             : at::ones({rows}, f32);
  valid_rows = valid.sum();
  const size_t L = recorded.size();
  recorded.assign(L, 0);
  counts.assign(L, at::Tensor());
  prob_sums.assign(L, at::Tensor());
  entropy_sums.assign(L, at::Tensor());
  z_loss = with_z;
  z_sums.assign(L, at::Tensor());
  aux = at::Tensor();
  aux_grad = at::Tensor();
  z = at::Tensor();
  z_grad = at::Tensor();
}

void RouterRecord::record(int64_t layer, const at::Tensor& logits, const at::Tensor& probs,
                          const at::Tensor& chosen) {
  const size_t l = static_cast<size_t>(layer);
  if (recorded[l]) return;  // a recompute routes the same rows the same way
  recorded[l] = 1;
  const int64_t k = chosen.size(1);
  const at::Tensor v = valid.unsqueeze(1);  // (N, 1)
  // Integer-valued fp32 sums: exact (below 2^24 rows), whatever the order of the adds.
  counts[l] = at::zeros({num_experts}, valid.options())
                  .index_add_(0, chosen.reshape({-1}), v.expand({v.size(0), k}).reshape({-1}));
  prob_sums[l] = (probs * v).sum(0);
  entropy_sums[l] = (-(probs * probs.clamp_min(1e-30).log()).sum(1) * valid).sum();
  if (z_loss) z_sums[l] = (at::logsumexp(logits.to(at::kFloat), 1).square() * valid).sum();
}

at::Tensor RouterRecord::total_counts() const {
  at::Tensor t;
  for (int64_t l : moe_layers) t = t.defined() ? t + counts[l] : counts[l];
  return t;
}

at::Tensor RouterRecord::total_prob_sums() const {
  at::Tensor t;
  for (int64_t l : moe_layers) t = t.defined() ? t + prob_sums[l] : prob_sums[l];
  return t;
}

at::Tensor RouterRecord::pooled_rows() const {
  return valid_rows * static_cast<double>(moe_layers.size());
}

at::Tensor RouterRecord::aux_value() const {
  const at::Tensor m = pooled_rows().clamp_min(1);
  return (total_counts() / m * (total_prob_sums() / m)).sum() * static_cast<double>(num_experts);
}

at::Tensor RouterRecord::aux_logit_grad(const at::Tensor& logits) const {
  const at::Tensor m = pooled_rows().clamp_min(1);
  const at::Tensor g = total_counts() * static_cast<double>(num_experts) / (m * m);  // (E)
  const at::Tensor p = at::softmax(logits.to(at::kFloat), 1);                        // (N, E)
  const at::Tensor pg = (p * g).sum(1, /*keepdim=*/true);                            // (N, 1)
  return p * (g - pg) * valid.unsqueeze(1) * aux_grad;
}

at::Tensor RouterRecord::z_value() const {
  at::Tensor t;
  for (int64_t l : moe_layers) t = t.defined() ? t + z_sums[l] : z_sums[l];
  return t / pooled_rows().clamp_min(1);
}

at::Tensor RouterRecord::z_logit_grad(const at::Tensor& logits) const {
  const at::Tensor x = logits.to(at::kFloat);
  const at::Tensor lse = at::logsumexp(x, 1, /*keepdim=*/true);  // (N, 1)
  const at::Tensor scale = valid.unsqueeze(1) * (2.0 * z_grad / pooled_rows().clamp_min(1));
  return at::softmax(x, 1) * lse * scale;
}

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// h -> (h, aux): the identity on the hidden states after the last decoder layer, and the
// forward's load-balancing loss. Backward stores d loss / d aux for the routers' taps, then
// hands h's gradient on: every layer's backward (and recompute) runs after it.
struct RouterAuxGate : public torch::autograd::Function<RouterAuxGate> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& h, const at::Tensor& trigger,
                               int64_t impl) {
    ctx->saved_data["impl"] = impl;
    const auto* im = reinterpret_cast<const Qwen3Model::Impl*>(static_cast<intptr_t>(impl));
    const RouterRecord& r = im->router;
    return {h.view_as(h), r.aux_value(),
            r.z_loss ? r.z_value() : at::zeros({}, r.valid_rows.options())};
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = reinterpret_cast<const Qwen3Model::Impl*>(
        static_cast<intptr_t>(ctx->saved_data["impl"].toInt()));
    im->router.aux_grad = grads[1].defined() ? grads[1].to(at::kFloat) : at::Tensor();
    im->router.z_grad =
        grads[2].defined() && im->router.z_loss ? grads[2].to(at::kFloat) : at::Tensor();
    return {grads[0], at::Tensor(), at::Tensor()};
  }
};

// logits -> logits; backward adds the aux loss's part of their gradient (aux_logit_grad).
struct RouterTap : public torch::autograd::Function<RouterTap> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& logits, int64_t impl) {
    ctx->saved_data["impl"] = impl;
    ctx->save_for_backward({logits});
    return logits.view_as(logits);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto* im = reinterpret_cast<const Qwen3Model::Impl*>(
        static_cast<intptr_t>(ctx->saved_data["impl"].toInt()));
    const at::Tensor logits = ctx->get_saved_variables()[0];
    at::Tensor g = grads[0].defined() ? grads[0] : at::zeros_like(logits);
    const RouterRecord& r = im->router;
    if (r.aux_grad.defined() || r.z_grad.defined()) {
      at::Tensor add = r.aux_grad.defined() ? r.aux_logit_grad(logits) : at::Tensor();
      if (r.z_grad.defined()) add = add.defined() ? add + r.z_logit_grad(logits) : r.z_logit_grad(logits);
      g = (g.to(at::kFloat) + add).to(logits.scalar_type());
    }
    return {g, at::Tensor()};
  }
};

}  // namespace

at::Tensor router_aux_gate(const Qwen3Model::Impl* impl, const at::Tensor& h) {
  const bool graph = at::GradMode::is_enabled() && h.requires_grad();
  RouterRecord& r = impl->router;
  if (!graph) {
    r.aux = r.aux_value();
    r.z = r.z_loss ? r.z_value() : at::Tensor();
    return h;
  }
  const variable_list out = RouterAuxGate::apply(
      h, impl->trigger, static_cast<int64_t>(reinterpret_cast<intptr_t>(impl)));
  r.aux = out[1];
  r.z = r.z_loss ? out[2] : at::Tensor();
  return out[0];
}

at::Tensor router_tap(const Qwen3Model::Impl* impl, const at::Tensor& logits) {
  if (!at::GradMode::is_enabled() || !logits.requires_grad()) return logits;
  return RouterTap::apply(logits, static_cast<int64_t>(reinterpret_cast<intptr_t>(impl)));
}

}  // namespace q4::model

namespace q4::model {

RouterStats Qwen3Model::router_stats() const {
  RouterStats s;
  const RouterRecord& r = impl_->router;
  if (r.moe_layers.empty() || !r.valid_rows.defined()) return s;
  if (r.aux.defined()) s.aux_loss = r.aux.item<double>();
  const double rows = r.valid_rows.item<double>();
  const double k = static_cast<double>(impl_->cfg.moe.num_experts_per_tok);
  const double mean = rows * k / static_cast<double>(r.num_experts);
  for (int64_t l : r.moe_layers) {
    if (!r.recorded[l]) continue;
    const at::Tensor c = r.counts[l].cpu();
    RouterStats::Layer x;
    x.layer = l;
    x.max_load = mean > 0 ? c.max().item<double>() / mean : 0.0;
    x.min_load = mean > 0 ? c.min().item<double>() / mean : 0.0;
    x.entropy = rows > 0 ? r.entropy_sums[l].item<double>() / rows : 0.0;
    s.layers.push_back(x);
  }
  return s;
}

double RouterStats::max_load() const {
  double m = 0;
  for (const Layer& l : layers) m = std::max(m, l.max_load);
  return m;
}

double RouterStats::min_load() const {
  double m = layers.empty() ? 0.0 : layers[0].min_load;
  for (const Layer& l : layers) m = std::min(m, l.min_load);
  return m;
}

double RouterStats::mean_entropy() const {
  double m = 0;
  for (const Layer& l : layers) m += l.entropy;
  return layers.empty() ? 0.0 : m / static_cast<double>(layers.size());
}

}  // namespace q4::model
