// Where a step's gradients go (docs/design.md#trainer-components, "One step"): the one owner of
// the model's grad-ready hook for the step. TrainStep draws the micro-batches, runs their
// forwards and backwards and calls the path around them; the path sums, reduces or applies the
// gradients and runs the optimizer update:
//
//   begin_step -> (begin_micro_batch -> backward: on_gradient per parameter -> end_micro_batch)
//   per micro-batch -> finish_backward -> finish_step (the update) -> step_closed
//
// The paths: buffered (one process, the update after the backward), in-backward (one process,
// each tensor updated inside the last micro-batch's backward), host ring (one process,
// optim.offload: all with grad_accum > 1: offloaded masters' gradients summed in pinned host
// memory, optim/host_accumulation.h; with in-backward updates too) and data parallel (ZeRO-2
// reduces to each parameter's owner, GradSync).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/trainer/distributed/grad_sync.h"

namespace q4::trainer {

class GradientPath {
 public:
  explicit GradientPath(model::Qwen3Model& model) : model_(model) {}
  virtual ~GradientPath();                     // removes the grad-ready hook if this path holds it
  GradientPath(const GradientPath&) = delete;  // the model's hook points at this object
  GradientPath& operator=(const GradientPath&) = delete;

  // Before the step's first micro-batch: `args` are the step's optimizer arguments,
  // `micro_batches` this rank's count of them.
  virtual void begin_step(const optim::StepArgs& args, int64_t micro_batches) = 0;
  // Before micro-batch `i`'s forward; `last`: the step's last one.
  virtual void begin_micro_batch(int64_t /*i*/, bool /*last*/) {}
  // From the model's grad-ready hook: `p.grad` is p's complete gradient of this micro-batch.
  virtual void on_gradient(model::Parameter& /*p*/) {}
  // After a micro-batch's backward.
  virtual void end_micro_batch() {}
  // After the last micro-batch's backward (the hook is removed).
  virtual void finish_backward() { remove_hook(); }
  // The optimizer update of the step (or the end of the updates the backward made); the model's
  // gradients are freed.
  virtual optim::StepResult finish_step(optim::StepArgs args) = 0;
  // After the step's closing collective (data parallel: the updated masters go out).
  virtual void step_closed(const optim::StepResult& /*res*/) {}
  // Whether the updates run inside the backward.
  virtual bool in_backward() const { return false; }

 protected:
  // The model's grad-ready hook calls on_gradient (and the model's count of a parameter's uses
  // restarts) until remove_hook().
  void install_hook();
  void remove_hook();

  model::Qwen3Model& model_;

 private:
  bool hooked_ = false;
};

// One process: in-backward updates (`in_backward`), else buffered ones; with
// optim.offload: all on CUDA and `grad_accum` > 1 the offloaded masters' gradients add up in
// pinned host memory (the host ring). `optimizer_index`: the optimizer's index of each
// parameter; `device`: the run's.
std::unique_ptr<GradientPath> make_local_path(
    model::Qwen3Model& model, optim::PackedAdamW& optimizer,
    const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
    const at::Device& device, bool in_backward, int64_t grad_accum);

// Data parallel (ZeRO-2): gradients reduced to their owners (from inside the backward with one
// micro-batch a step, after the last one otherwise), the owned shards updated with the global
// norm, the updated masters broadcast once the step is closed.
std::unique_ptr<GradientPath> make_data_parallel_path(GradSync& sync, DistComm& comm,
                                                      optim::PackedAdamW& optimizer);

}  // namespace q4::trainer
