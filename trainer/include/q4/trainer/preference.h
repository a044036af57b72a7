// Preference-tuning losses over per-pair log-probabilities, as TRL defines them: DPO's sigmoid
// loss (with conservative label smoothing), IPO, and the reference-free SimPO. The inputs are
// each answer's summed log-probability under the policy (differentiable) and under the frozen
// reference, and its token count; IPO and SimPO use per-token averages (sum / tokens), as TRL's
// trainers do. Everything is element-wise over pairs, in the inputs' dtype and device, so the
// caller sums the per-pair losses over its micro-batch and differentiates.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>

#include "q4/io/enum_names.h"

namespace q4::trainer {

enum class PreferenceLossKind {
  kSigmoid,  // DPO: -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z),
             // z = (pi_c - pi_r) - (ref_c - ref_r) on summed log-probabilities
  kIpo,      // IPO: (z - 1 / (2 beta))^2, z on per-token averages
  kSimpo,    // SimPO, reference-free: the sigmoid loss of z = avg_c - avg_r - gamma / beta
};

struct PreferenceLossOptions {
  PreferenceLossKind kind = PreferenceLossKind::kSigmoid;
  double beta = 0.1;             // > 0: the implicit reward's scale
  double label_smoothing = 0.0;  // sigmoid and SimPO: in [0, 0.5), the chance a label is flipped
  double simpo_gamma = 0.5;      // SimPO: the target reward margin (TRL's simpo_gamma)
  void validate() const;         // errors name the field
};

// One micro-batch of pairs (P of them), each tensor (P).
struct PreferencePairs {
  at::Tensor chosen_logps;    // policy, summed over the chosen answer's tokens (differentiable)
  at::Tensor rejected_logps;  // policy, rejected answer
  at::Tensor chosen_tokens;   // answer token counts (> 0), any numeric dtype
  at::Tensor rejected_tokens;
  at::Tensor ref_chosen_logps;  // the reference's sums (undefined for SimPO)
  at::Tensor ref_rejected_logps;
};

struct PreferenceLossOutput {
  at::Tensor losses;            // (P) per pair, differentiable
  at::Tensor chosen_rewards;    // (P) detached: beta (pi_c - ref_c), SimPO beta avg_c
  at::Tensor rejected_rewards;  // (P) detached
};

PreferenceLossOutput preference_loss(const PreferencePairs& pairs,
                                     const PreferenceLossOptions& options);

}  // namespace q4::trainer

Q4_ENUM_NAMES(q4::trainer::PreferenceLossKind,
              {"sigmoid", q4::trainer::PreferenceLossKind::kSigmoid},
              {"ipo", q4::trainer::PreferenceLossKind::kIpo},
              {"simpo", q4::trainer::PreferenceLossKind::kSimpo});
