// Preference-tuning losses (see preference.h).
#include "q4/trainer/preference.h"

#include <ATen/ATen.h>

#include <cmath>

namespace q4::trainer {

void PreferenceLossOptions::validate() const {
  TORCH_CHECK(std::isfinite(beta) && beta > 0, "preference.beta: expected a finite value > 0, got ",
              beta);
  TORCH_CHECK(label_smoothing >= 0 && label_smoothing < 0.5,
              "preference.label_smoothing: expected 0 <= value < 0.5, got ", label_smoothing);
  TORCH_CHECK(std::isfinite(simpo_gamma), "preference.simpo_gamma: expected a finite value, got ",
              simpo_gamma);
}

namespace {

// -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z), stable for any z.
at::Tensor sigmoid_loss(const at::Tensor& z, double beta, double eps) {
  at::Tensor loss = -at::log_sigmoid(z * beta) * (1.0 - eps);
  if (eps > 0) loss = loss - at::log_sigmoid(z * -beta) * eps;
  return loss;
}

void check_pairs(const PreferencePairs& p, bool needs_reference) {
  const int64_t n = p.chosen_logps.defined() ? p.chosen_logps.numel() : -1;
  TORCH_CHECK(n >= 0 && p.chosen_logps.dim() == 1, "preference_loss: chosen_logps must be (P)");
  auto same = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.dim() == 1 && t.numel() == n, "preference_loss: ", what,
                " must be (", n, ") like chosen_logps");
  };
  same(p.rejected_logps, "rejected_logps");
  same(p.chosen_tokens, "chosen_tokens");
  same(p.rejected_tokens, "rejected_tokens");
  if (needs_reference) {
    same(p.ref_chosen_logps, "ref_chosen_logps");
    same(p.ref_rejected_logps, "ref_rejected_logps");
  }
}

}  // namespace

PreferenceLossOutput preference_loss(const PreferencePairs& p, const PreferenceLossOptions& o) {
  o.validate();
  const bool reference = o.kind != PreferenceLossKind::kSimpo;
  check_pairs(p, reference);
  const auto dt = p.chosen_logps.scalar_type();
  const at::Tensor nc = p.chosen_tokens.to(dt), nr = p.rejected_tokens.to(dt);
  PreferenceLossOutput out;
  switch (o.kind) {
    case PreferenceLossKind::kSigmoid: {
      const at::Tensor dc = p.chosen_logps - p.ref_chosen_logps.to(dt);
      const at::Tensor dr = p.rejected_logps - p.ref_rejected_logps.to(dt);
      out.losses = sigmoid_loss(dc - dr, o.beta, o.label_smoothing);
      out.chosen_rewards = (dc * o.beta).detach();
      out.rejected_rewards = (dr * o.beta).detach();
      break;
    }
    case PreferenceLossKind::kIpo: {
      const at::Tensor dc = (p.chosen_logps - p.ref_chosen_logps.to(dt)) / nc;
      const at::Tensor dr = (p.rejected_logps - p.ref_rejected_logps.to(dt)) / nr;
      out.losses = (dc - dr - 1.0 / (2.0 * o.beta)).pow(2);
      out.chosen_rewards = (dc * o.beta).detach();
      out.rejected_rewards = (dr * o.beta).detach();
      break;
    }
    case PreferenceLossKind::kSimpo: {
      const at::Tensor ac = p.chosen_logps / nc, ar = p.rejected_logps / nr;
      out.losses = sigmoid_loss(ac - ar - o.simpo_gamma / o.beta, o.beta, o.label_smoothing);
      out.chosen_rewards = (ac * o.beta).detach();
      out.rejected_rewards = (ar * o.beta).detach();
      break;
    }
  }
  return out;
}

}  // namespace q4::trainer
