// The FFN slot of a decoder layer (docs/design.md#architecture): the block
// hs -> hs + ffn(post_attention_layernorm(hs)) after the attention block. The model, its
// checkpoints, the parameter table and the memory estimate reach the block only through `Ffn`:
// its parameters, its forward with and without a graph, the backward of its recompute, and its
// sizes. Two implementations: the dense SwiGLU MLP (ffn_swiglu.cpp) and the mixture of experts
// (ffn_moe.cpp). Virtual calls are per layer, never per element.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

#include "q4/model/qwen3.h"
#include "q4/model/qwen3_params.h"

namespace q4::model {

// One tensor of a layer's FFN in the parameter table: its name after "model.layers.N.", shape,
// kind and group.
struct FfnParamSpec {
  std::string suffix;  // "mlp.gate_proj.weight"
  std::vector<int64_t> shape;
  ParamKind kind;
  ParamGroup group;
};

// What the FFN block allocates, for the memory estimate (memory_estimate.cpp), in bytes per
// token (or row) of the layer, and the work of its recompute.
struct FfnCosts {
  int64_t graph_per_token = 0;  // its graph's saved tensors, its input hs included
  int64_t forward_per_row = 0;  // a no-graph forward's transients beside its input, per row
  int64_t chunk_per_row = 0;    // a chunk's recompute: graph and gradients, hs rows excluded
  int64_t inner_per_token = 0;  // one inner activation (SwiGLU: the (tokens, I) product)
  double recompute_macs_per_token = 0;  // multiply-accumulates its recompute runs
};

class Ffn {
 public:
  virtual ~Ffn() = default;
  virtual const char* name() const = 0;

  // ---- parameters: the table's rows and the model's tensors
  // The layer's FFN tensors in table order, the post-attention norm excepted (the layer's).
  virtual std::vector<FfnParamSpec> param_specs(const Qwen3Config& cfg) const = 0;
  // Whether `p` belongs to the FFN block (its post-attention norm included).
  virtual bool owns(const ParamSpec& p) const = 0;
  // Whether the recompute forms `p`'s gradient by hand (the last projection, whose forward the
  // recompute skips) instead of through autograd.
  virtual bool hand_formed_grad(const ParamSpec& p) const = 0;
  // The block's parameters in layer `layer` of `m`: its norm, then param_specs' tensors.
  virtual std::vector<Parameter*> parameters(const Qwen3Model::Impl& m, int64_t layer) const = 0;

  // ---- compute; hs (B, T, H) the residual stream after attention
  // out = hs + ffn(norm(hs)) with a graph when grad mode is on.
  virtual at::Tensor forward(const Qwen3Model::Impl& m, int64_t layer,
                             const at::Tensor& hs) const = 0;
  // The same without a graph (a checkpoint's forward), over row chunks of `chunk_tokens` of the
  // flattened tokens when there are more (0: one pass).
  virtual at::Tensor forward_no_graph(const Qwen3Model::Impl& m, int64_t layer,
                                      const at::Tensor& hs, int64_t chunk_tokens) const = 0;
  // The backward of the block recomputed from hs (a node of the recomputed attention graph or a
  // leaf), from `g` the gradient of out: appends to roots/seeds what torch::autograd::backward
  // must be given (hs with its whole gradient, the block's weight taps with theirs). Each tap
  // begins one use and delivers one gradient.
  virtual void backward_roots(const Qwen3Model::Impl& m, int64_t layer, const at::Tensor& hs,
                              const at::Tensor& g, std::vector<at::Tensor>* roots,
                              std::vector<at::Tensor>* seeds) const = 0;

  // ---- sizes
  virtual FfnCosts costs(const Qwen3Config& cfg, const ModelOptions& opt) const = 0;
};

// Whether `name` ends with `tail`.
inline bool name_has_tail(const std::string& name, const char* tail) {
  const std::string t(tail);
  return name.size() >= t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0;
}

// The FFN block's own parameters, the same for every kind: the layer's post-attention norm and
// everything under "mlp." (Ffn::owns, Ffn::parameters).
bool ffn_block_owns(const ParamSpec& p);
std::vector<Parameter*> ffn_block_parameters(const Qwen3Model::Impl& m, int64_t layer);

// The FFN of decoder layer `layer` of `cfg` (stateless; one instance per kind for the
// process): the mixture of experts where cfg.is_moe_layer(layer), else the dense SwiGLU MLP.
const Ffn& ffn_for(const Qwen3Config& cfg, int64_t layer);
// The two kinds, for ffn_for.
const Ffn& dense_swiglu_ffn();
const Ffn& moe_ffn();

}  // namespace q4::model
