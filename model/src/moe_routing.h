// The routers of a mixture-of-experts model across one forward (docs/model.md#mixture-of-experts):
// what each MoE layer's router chose, the load-balancing loss HF computes from it, and that
// loss's gradient.
//
// HF's loss (load_balancing_loss_func) pools the rows of every MoE layer: with M such rows
// (valid tokens x MoE layers), F_e the number of top-k choices of expert e and P_e the summed
// softmax probability of e over them, aux = E · Σ_e (F_e / M)(P_e / M). F is a count (no
// gradient), so d aux / d p_row = E · F / M² for every row of every layer; it is known only once
// the last layer has routed. Each layer therefore records its counts and sums in its forward
// (once per forward: a checkpointed layer's recompute finds them recorded), the aux gate after
// the last layer forms aux and, in backward, receives d loss / d aux before any layer's backward
// runs (every layer's gradient flows through it), and each router's tap adds
// d loss / d aux · p ⊙ (g − p·g), g = E · F / M², to its logits' gradient.
//
// The optional router z-loss (ST-MoE) pools the same M rows: z = (1/M) Σ_rows lse(logits)², whose
// gradient is local to each row, d z / d logits = 2 · lse · softmax(logits) / M; it rides the
// same gate (its d loss / d z) and taps.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace q4::model {

struct RouterRecord {
  int64_t num_experts = 0;
  at::Tensor valid;       // (N) fp32 on the device, 1 for a row that counts (HF's attention_mask)
  at::Tensor valid_rows;  // () fp32: the sum of valid
  std::vector<int64_t> moe_layers;       // the model's MoE layers, ascending
  std::vector<char> recorded;            // per decoder layer: routed in this forward
  std::vector<at::Tensor> counts;        // per decoder layer (E) fp32: top-k choices, valid rows
  std::vector<at::Tensor> prob_sums;     // per decoder layer (E) fp32: Σ softmax, valid rows
  std::vector<at::Tensor> entropy_sums;  // per decoder layer () fp32: Σ routing entropy (nats)
  bool z_loss = false;                   // this forward computes the z-loss
  std::vector<at::Tensor> z_sums;        // per decoder layer () fp32: Σ lse(logits)², valid rows
  at::Tensor aux;       // () fp32, the forward's load-balancing loss (differentiable with a graph)
  at::Tensor aux_grad;  // () fp32, d loss / d aux from the aux gate's backward (undefined: none)
  at::Tensor z;         // () fp32, the forward's z-loss (undefined unless z_loss)
  at::Tensor z_grad;    // () fp32, d loss / d z from the gate's backward (undefined: none)

  // A forward of B x T tokens begins: `valid` (B, T) or undefined (every row counts); with_z:
  // the z-loss is computed too.
  void begin(const at::Tensor& valid_bt, int64_t rows, const at::Device& device, bool with_z);
  // Layer `layer`'s routing, once per forward: logits (N, E) and their probs (N, E) fp32
  // softmax (both without a graph), chosen (N, k) int64.
  void record(int64_t layer, const at::Tensor& logits, const at::Tensor& probs,
              const at::Tensor& chosen);
  // Σ_l counts and Σ_l prob_sums over the MoE layers, and M (valid rows x MoE layers).
  at::Tensor total_counts() const;
  at::Tensor total_prob_sums() const;
  at::Tensor pooled_rows() const;
  // aux = E · Σ_e (F_e / M)(P_e / M), () fp32.
  at::Tensor aux_value() const;
  // d loss / d logits added by the aux loss, for one layer's router logits (N, E), fp32.
  at::Tensor aux_logit_grad(const at::Tensor& logits) const;
  // z = (1/M) Σ_l z_sums, () fp32.
  at::Tensor z_value() const;
  // d loss / d logits added by the z-loss, for one layer's router logits (N, E), fp32.
  at::Tensor z_logit_grad(const at::Tensor& logits) const;
};

}  // namespace q4::model
