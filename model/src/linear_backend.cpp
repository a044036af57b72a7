// The one linear backend today (linear_backend.h): each linear's weight is resolved into the
// compute dtype by the model's weight taps (fake_quant(master) straight-through for a trained
// NVFP4 linear, dequantize(file) held once for a frozen one; docs/design.md#training-numerics)
// and multiplied by a dense GEMM; plain LoRA adapters add their term inside the GEMMs.
#include "q4/model/linear_backend.h"

#include <ATen/ATen.h>

#include <algorithm>

#include "qwen3_impl.h"

namespace q4::model {
namespace {

class FakeQuantDenseLinear final : public LinearBackend {
 public:
  const char* name() const override { return "fake-quant dense GEMM"; }

  LinearWeights weights(const Qwen3Model::Impl& m, Parameter* p) const override {
    LinearWeights w;
    w.w = m.weight(p);
    if (p->lora_a != nullptr && !m.opt.lora.merge_aware) {
      w.lora_a = m.weight(p->lora_a);
      w.lora_b = m.weight(p->lora_b);
    }
    return w;
  }

  at::Tensor apply(const Qwen3Model::Impl& m, const at::Tensor& x,
                   const LinearWeights& w) const override {
    if (!w.lora_a.defined()) return at::linear(x, w.w);
    // Plain adapter: one autograd function with the adapter's term inside the GEMMs.
    return plain_lora_linear(x, w.w, w.lora_a, w.lora_b, m.opt.lora.scale());
  }

  // One plain_lora_linears when every linear carries a plain adapter, else apply() each.
  std::vector<at::Tensor> apply_group(const Qwen3Model::Impl& m, const at::Tensor& x,
                                      const std::vector<const LinearWeights*>& ws) const override {
    const bool all_plain = std::all_of(ws.begin(), ws.end(),
                                       [](const LinearWeights* w) { return w->lora_a.defined(); });
    if (all_plain) return plain_lora_linears(x, ws, m.opt.lora.scale());
    std::vector<at::Tensor> out;
    for (const LinearWeights* w : ws) out.push_back(apply(m, x, *w));
    return out;
  }
};

}  // namespace

std::shared_ptr<const LinearBackend> make_linear_backend(const ModelOptions& opt) {
  // Every device computes with fake-quantized weights in a dense GEMM today; a backend with
  // native FP4 GEMMs is chosen here from the device's capability.
  (void)opt;
  return std::make_shared<const FakeQuantDenseLinear>();
}

}  // namespace q4::model
