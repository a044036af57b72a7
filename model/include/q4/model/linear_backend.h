// The linear slot (docs/design.md#architecture): how every linear of the decoder layers computes
// y = x·Wᵀ. A backend resolves a linear's weights once per use and runs its GEMMs; the model
// takes one at construction, ModelOptions::linear_backend or else make_linear_backend() for the
// device. Today's one backend fake-quantizes (or dequantizes) the NVFP4 weight into the compute
// dtype and runs a dense GEMM; a native FP4 GEMM backend for devices that have one plugs in here.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

#include "q4/model/qwen3.h"

namespace q4::model {

// The weights of one linear as its forward uses them, each resolved once (weight taps): w (out,
// in) in the compute dtype, and for a plain LoRA adapter its A (r, in) and B (out, r), whose term
// s·(x·Aᵀ)·Bᵀ is added to x·wᵀ.
struct LinearWeights {
  at::Tensor w;
  at::Tensor lora_a, lora_b;  // undefined without a plain adapter
};

class LinearBackend {
 public:
  virtual ~LinearBackend() = default;
  virtual const char* name() const = 0;
  // The weights of linear `p` of model `m`, in the current grad mode (taps when they train:
  // each call begins one use of every trainable tensor it returns).
  virtual LinearWeights weights(const Qwen3Model::Impl& m, Parameter* p) const = 0;
  // x (..., in) -> x·wᵀ (..., out), plus the plain adapter's term when `w` carries one.
  virtual at::Tensor apply(const Qwen3Model::Impl& m, const at::Tensor& x,
                           const LinearWeights& w) const = 0;
  // Two or three linears of one input (q/k/v, gate/up), each as apply() computes it (the
  // backend may share work between them).
  virtual std::vector<at::Tensor> apply_group(
      const Qwen3Model::Impl& m, const at::Tensor& x,
      const std::vector<const LinearWeights*>& ws) const = 0;
};

// The backend for `opt`'s device: fake-quant (or dequantize) + dense GEMM on every device today.
std::shared_ptr<const LinearBackend> make_linear_backend(const ModelOptions& opt);

}  // namespace q4::model
