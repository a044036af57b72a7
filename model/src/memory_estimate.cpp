// Analytic device-memory budget of one training step, used by the trainer's --dry-run and VRAM
// probe next to the allocator's measurements. Counts what this implementation keeps: trainable
// masters + grads, frozen weights in the compute dtype, checkpointed layer inputs (or every
// layer's saved tensors without checkpointing), one layer's working set and one loss chunk.
#include <ATen/ATen.h>

#include <algorithm>

#include "q4/model/qwen3.h"

namespace q4::model {

MemoryEstimate estimate_memory(const Qwen3Config& cfg, const ModelOptions& opt, int64_t batch,
                               int64_t seq_len, bool include_lm_head) {
  opt.validate();
  opt.trainable.validate(cfg.num_hidden_layers);
  const int64_t ms = static_cast<int64_t>(c10::elementSize(opt.master_dtype));
  const int64_t cs = static_cast<int64_t>(c10::elementSize(opt.compute_dtype));
  const int64_t gs = static_cast<int64_t>(c10::elementSize(opt.resolved_grad_dtype()));
  const TrainableSpec& ts = opt.trainable;
  const int64_t H = cfg.hidden_size, I = cfg.intermediate_size, V = cfg.vocab_size;
  const int64_t L = cfg.num_hidden_layers;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim();
  const bool tied = !include_lm_head;

  MemoryEstimate est;
  auto add = [&](int64_t numel, bool trainable) {
    if (trainable) {
      est.master_bytes += numel * ms;
      est.grad_bytes += numel * gs;
    } else {
      est.frozen_bytes += numel * cs;
    }
  };
  for (const ParamSpec& p : qwen3_parameters(cfg, include_lm_head)) {
    add(p.numel(), ts.trains(p, L, tied));
  }
  const int64_t proj = 2 * QD * H + 2 * KVD * H + 3 * H * I;  // one layer's linears

  const int64_t tokens = batch * seq_len;
  // Saved by one layer's graph, per token, in the compute dtype: norm outputs, q/k/v before and
  // after norm/RoPE, attention output, o_proj output, MLP gate/up/silu/product; plus the fp32
  // RMSNorm inputs (4 norms). Attention probabilities only on the eager (no SDPA) path.
  const int64_t layer_per_token = cs * (4 * H + 4 * QD + 5 * KVD + 4 * I) + 4 * (2 * H + QD + KVD);
  // Tensors a layer graph keeps besides activations: the fake-quantized weights of its trainable
  // linears (at::linear saves its weight for the input gradient).
  const int64_t layer_weights = ts.projections ? proj * cs : 0;
  const int64_t boundary = tokens * H * cs;  // a layer input/output
  if (opt.gradient_checkpointing) {
    est.activation_bytes = L * boundary + tokens * layer_per_token + layer_weights + 2 * boundary;
  } else {
    est.activation_bytes = L * (tokens * layer_per_token + layer_weights) + 2 * boundary;
  }
  // Loss: final hidden (N, H), one fp32 (chunk, V) block plus its compute-dtype copy in
  // backward, the grad of the hidden states, and lm_head's compute-dtype weight + grad.
  const int64_t chunk = std::min(opt.loss_chunk_tokens, tokens);
  const bool lm_trains = ts.lm_head || (tied && ts.embeddings);
  est.loss_bytes = boundary + chunk * V * (4 + cs) + boundary + V * H * cs * (lm_trains ? 2 : 0);
  return est;
}

}  // namespace q4::model
