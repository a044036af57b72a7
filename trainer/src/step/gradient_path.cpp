// The gradient paths of a step; see gradient_path.h.
#include "q4/trainer/step/gradient_path.h"

#include <ATen/ATen.h>

#include <unordered_set>
#include <utility>
#include <vector>

#include "q4/optim/host_accumulation.h"
#include "q4/trainer/runtime/nvtx.h"

namespace q4::trainer {

GradientPath::~GradientPath() { remove_hook(); }

void GradientPath::install_hook() {
  model_.begin_grad_step();
  model_.set_grad_ready_hook([this](model::Parameter& p) { on_gradient(p); });
  hooked_ = true;
}

void GradientPath::remove_hook() {
  if (!hooked_) return;
  model_.set_grad_ready_hook(nullptr);
  hooked_ = false;
}

namespace {

// What the one-process paths share: the optimizer's parameter indices, the forward weights kept
// from masters (offloaded masters' codes, model.forward_weights codes or kept) refreshed right
// after each update, the host ring (optim.offload: all with grad_accum > 1) and the device
// gradients kept through a micro-batch's backward.
class LocalPath : public GradientPath {
 public:
  LocalPath(model::Qwen3Model& model, optim::PackedAdamW& optimizer,
            const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
            const at::Device& device, bool host_ring)
      : GradientPath(model), optimizer_(optimizer), device_(device), host_ring_(host_ring) {
    by_index_.assign(static_cast<size_t>(optimizer_.num_params()), nullptr);
    for (const auto& [p, i] : optimizer_index) {
      by_index_[static_cast<size_t>(i)] = p;
      index_[p] = i;
    }
    // Right after each update, on its stream, from the updated values in device memory (an
    // offloaded master's staged copy): the forward weight is refreshed while the master is
    // fresh in cache, and an offloaded one is not read back over PCIe.
    optimizer_.set_master_updated_hook([this](int64_t i, const at::Tensor& master) {
      const model::Parameter* p = by_index_[static_cast<size_t>(i)];
      if (p == nullptr || !model::Qwen3Model::keeps_forward_weight(*p)) return;
      model_.refresh_forward_weights(*p, master);
      refreshed_.insert(p);
    });
  }
  ~LocalPath() override {
    optimizer_.set_master_updated_hook(nullptr);
    optimizer_.set_staging_arena({});
  }

  void begin_micro_batch(int64_t i, bool last) override {
    if (ring_) ring_->begin_micro_batch(i == 0, last);
  }
  void end_micro_batch() override {
    for (auto& [p, g] : kept_) p->grad = std::move(g);  // the next backward adds into it
    kept_.clear();
  }
  void finish_backward() override {
    remove_hook();
    if (ring_) ring_->finish();  // later reads of the host buffers are ordered after
  }

 protected:
  // The host ring, created with the first step that uses it (held for the run); `staging` bytes
  // of its memory are the optimizer's staging arena (in-backward updates) for the run.
  void make_ring(int64_t staging) {
    if (!host_ring_ || ring_) return;
    ring_ = std::make_unique<optim::HostGradientAccumulator>(
        model_.options().resolved_grad_dtype(), device_,
        optim::kHostAccumulationRingBytes - staging);
    if (staging > 0) {
      staging_ = at::empty({staging}, at::TensorOptions().dtype(at::kByte).device(device_));
      optimizer_.set_staging_arena(staging_);
    }
  }
  // An offloaded master's gradient, summed in the host ring.
  bool on_host(const model::Parameter& p) const {
    return ring_ && p.qdata.defined() && p.master.is_cpu();
  }
  // A gradient summed on: in host memory, or on the device (put back after the micro-batch).
  void sum_on(model::Parameter& p) {
    if (on_host(p)) {
      ring_->add(&p, p.grad);
    } else {
      kept_.emplace_back(&p, p.grad);
    }
  }
  // The forward weight kept from a master after its update, unless the update's hook
  // refreshed it already.
  void refresh_after_update(const model::Parameter* p) {
    if (refreshed_.erase(p) == 0) model_.refresh_forward_weights(p);
  }
  // The update after the backward: the model's gradients (the host ring's sums where it holds
  // them) through the optimizer, then the forward weights its hook did not refresh.
  optim::StepResult buffered_update(optim::StepArgs args) {
    NvtxRange r("optimizer");
    const auto params = model_.trainable_parameters();
    std::vector<at::Tensor> grads;
    for (auto* p : params) {
      if (ring_ && ring_->holds(p)) {
        // In pinned host memory: the optimizer copies it in by DMA.
        grads.push_back(ring_->sum(p));
        if (at::Tensor part = ring_->take_sumsq_parts(p); part.defined()) {
          args.sumsq_parts.resize(params.size());
          args.sumsq_parts[grads.size() - 1] = std::move(part);
        }
        continue;
      }
      grads.push_back(p->grad.defined()
                          ? p->grad
                          : at::zeros(p->master.sizes(), p->master.options().device(device_)));
    }
    refreshed_.clear();
    const optim::StepResult res = optimizer_.step(grads, args);
    if (res.applied) {
      for (auto* p : params) {
        if (refreshed_.count(p) == 0) model_.refresh_forward_weights(p);
      }
    }
    refreshed_.clear();
    model_.zero_grad();
    return res;
  }

  optim::PackedAdamW& optimizer_;
  const at::Device device_;
  const bool host_ring_;
  std::vector<const model::Parameter*> by_index_;  // the parameter of each optimizer index
  std::unordered_map<const model::Parameter*, int64_t> index_;  // and the reverse
  // Parameters whose forward weights the optimizer's master-updated hook refreshed.
  std::unordered_set<const model::Parameter*> refreshed_;
  std::unique_ptr<optim::HostGradientAccumulator> ring_;
  at::Tensor staging_;  // with in-backward updates: the optimizer's share of the ring's memory
  std::vector<std::pair<model::Parameter*, at::Tensor>> kept_;  // device gradients to put back
};

// Updates after the backward; the gradients add up in the model's buffers (no hook).
class BufferedPath final : public LocalPath {
 public:
  using LocalPath::LocalPath;
  void begin_step(const optim::StepArgs& /*args*/, int64_t /*micro_batches*/) override {}
  optim::StepResult finish_step(optim::StepArgs args) override { return buffered_update(args); }
};

// Updates after the backward; an offloaded master's micro-batch gradients add up in pinned host
// memory as soon as each is complete, every other one in the model's buffer.
class HostRingPath final : public LocalPath {
 public:
  using LocalPath::LocalPath;
  void begin_step(const optim::StepArgs& /*args*/, int64_t /*micro_batches*/) override {
    make_ring(/*staging=*/0);
    install_hook();
  }
  void on_gradient(model::Parameter& p) override { sum_on(p); }
  optim::StepResult finish_step(optim::StepArgs args) override { return buffered_update(args); }
};

// Updates inside the backward (docs/design.md#training-numerics, "Updates inside the backward"):
// before the last micro-batch each gradient is summed on (in the host ring or on the device);
// in the last one each complete sum is applied at once, and the model frees the gradient.
class InBackwardPath final : public LocalPath {
 public:
  using LocalPath::LocalPath;
  bool in_backward() const override { return true; }
  void begin_step(const optim::StepArgs& args, int64_t /*micro_batches*/) override {
    args_ = args;
    make_ring(optim::kSharedStagingBytes);
    install_hook();
  }
  void begin_micro_batch(int64_t i, bool last) override {
    last_ = last;
    // Its backward updates: the optimizer's staging is taken only now.
    if (last_) optimizer_.begin_step(args_);
    LocalPath::begin_micro_batch(i, last);
  }
  void on_gradient(model::Parameter& p) override {
    if (!last_) {
      sum_on(p);
      return;
    }
    const int64_t i = index_.at(&p);
    if (on_host(p)) {
      ring_->add(&p, p.grad, [&](const at::Tensor& sum) { optimizer_.step_param(i, sum); });
    } else {
      optimizer_.step_param(i, p.grad);
    }
    refresh_after_update(&p);
  }
  void finish_backward() override {
    LocalPath::finish_backward();
    apply_unreached();
  }
  optim::StepResult finish_step(optim::StepArgs /*args*/) override {
    NvtxRange r("optimizer");
    const optim::StepResult res = optimizer_.end_step();  // the updates ran inside the backward
    model_.zero_grad();
    return res;
  }

 private:
  // Sums of earlier micro-batches that the last one's backward did not reach: updated now
  // (end_step() gives the parameters no micro-batch reached a zero gradient).
  void apply_unreached() {
    for (auto* p : model_.trainable_parameters()) {
      if (!p->grad.defined()) continue;
      optimizer_.step_param(index_.at(p), p->grad);
      refresh_after_update(p);
      p->grad = at::Tensor();
    }
    if (!ring_) return;
    for (const void* key : ring_->unapplied()) {
      const auto* p = static_cast<const model::Parameter*>(key);
      optimizer_.step_param(index_.at(p), ring_->sum(key).to(device_));
      refresh_after_update(p);
    }
  }

  optim::StepArgs args_;
  bool last_ = false;  // the micro-batch being back-propagated is the step's last
};

// ZeRO-2 (grad_sync.h): the reduces launch from the backward when a step has one micro-batch.
class DataParallelPath final : public GradientPath {
 public:
  DataParallelPath(GradSync& sync, DistComm& comm, optim::PackedAdamW& optimizer,
                   model::Qwen3Model& model)
      : GradientPath(model), sync_(sync), comm_(comm), optimizer_(optimizer) {}
  void begin_step(const optim::StepArgs& /*args*/, int64_t micro_batches) override {
    sync_.begin_step();
    if (micro_batches == 1) install_hook();
  }
  void on_gradient(model::Parameter& p) override { sync_.on_gradient(p); }
  optim::StepResult finish_step(optim::StepArgs args) override {
    std::vector<at::Tensor> grads = sync_.finish_step(optimizer_.num_params());
    // The optimizer writes owned masters, which the previous step's broadcasts read: all of
    // them are waited for first (the forward waited for each master it used, so this orders
    // the rest).
    sync_.wait_masters();
    NvtxRange r("optimizer");
    // Clipping and the non-finite guard see the global norm: the owners' sums of squares add.
    args.reduce_sumsq = [this](double s) { return comm_.allreduce_sum(s); };
    return optimizer_.step(grads, args);
  }
  // Launched, not waited for: the next forward waits for each master right before its first
  // use (GradSync, the model's master fence).
  void step_closed(const optim::StepResult& res) override {
    if (res.applied) sync_.broadcast_masters();
  }

 private:
  GradSync& sync_;
  DistComm& comm_;
  optim::PackedAdamW& optimizer_;
};

}  // namespace

std::unique_ptr<GradientPath> make_local_path(
    model::Qwen3Model& model, optim::PackedAdamW& optimizer,
    const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
    const at::Device& device, bool in_backward, int64_t grad_accum) {
  const bool host_ring = grad_accum > 1 && model.options().offload_masters && device.is_cuda();
  if (in_backward) {
    return std::make_unique<InBackwardPath>(model, optimizer, optimizer_index, device, host_ring);
  }
  if (host_ring) {
    return std::make_unique<HostRingPath>(model, optimizer, optimizer_index, device, true);
  }
  return std::make_unique<BufferedPath>(model, optimizer, optimizer_index, device, false);
}

std::unique_ptr<GradientPath> make_data_parallel_path(GradSync& sync, DistComm& comm,
                                                      optim::PackedAdamW& optimizer) {
  return std::make_unique<DataParallelPath>(sync, comm, optimizer, sync.model());
}

}  // namespace q4::trainer
