// Private state of PackedAdamW, shared by the step (adamw.cpp) and the state file I/O
// (state_io.cpp).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <limits>
#include <memory>
#include <vector>

#include "cpu_kernels.h"
#include "q4/optim/adamw.h"
#include "q4/optim/state_codec.h"

namespace q4::optim {
namespace detail {

struct ParamState {
  at::Tensor master;  // as registered (any shape), updated in place
  at::Tensor flat;    // (numel) view of master the update writes (a device alias when the master
                      // is in pinned host memory)
  // (numel) view of master on its own device, for the state file.
  at::Tensor host_flat() const { return master.detach().view({-1}); }
  ParamInfo info;
  at::Tensor m32;  // (numel) fp32 first moment (mode fp32)
  at::Tensor v32;  // (numel) fp32 second moment (mode fp32)
  PackedMoment m;  // packed first moment (int8 / 4bit / nvfp4)
  PackedMoment v;  // packed second moment
};

struct StepConsts;  // adamw.cpp: one step's fp32 constants
class HostStager;   // host_stager.h: DMA staging of state in pinned host memory (CUDA)

// Waits for the device when a parameter's moments are in pinned host memory (offload_moments),
// before the host reads or writes them (state file, decoded moments, the first step's rescale).
void wait_for_host_moments(const std::vector<ParamState>& ps);

}  // namespace detail

struct PackedAdamW::Impl {
  AdamWOptions opt;
  std::vector<detail::ParamState> ps;
  std::vector<ParamInfo> infos;
  int64_t step = 0;         // applied steps (Adam t)
  int64_t skipped = 0;      // skipped steps in total
  int64_t consecutive = 0;  // skipped steps in a row
  bool frozen = false;      // no add_param after step()/load()
  detail::Scratch scratch;
  // In-backward step (begin_step .. end_step).
  bool in_step = false;
  double prev_norm = std::numeric_limits<double>::quiet_NaN();  // last step's global norm
  double cur_lr = 0.0, cur_coef = 1.0, cur_grad_scale = 1.0;
  int64_t cur_t = 0;
  double cur_max_norm = 0.0;       // the step's max_grad_norm
  bool cur_first_unclipped = false;  // step 1 without a previous norm: clipped in end_step()
  std::vector<char> stepped;     // per parameter: updated in this step
  at::Tensor partials;           // (P, kSumsqPartials) fp32 on the device (CUDA params)
  at::Tensor skip;               // (P) int32 on the device: non-finite flag per parameter
  // CUDA parameters with state in pinned host memory: their updates' staging (one per step)
  // and what sees each master updated in device memory (set_master_updated_hook).
  std::shared_ptr<detail::HostStager> stager;
  std::function<void(int64_t, const at::Tensor&)> master_updated;
  at::Tensor staging_arena;      // set_staging_arena(); undefined: one taken per step
  double host_sumsq = 0.0;       // CPU parameters' sum of squares
  int64_t host_nonfinite = 0;    // CPU parameters skipped

  // The phases of PackedAdamW::step (adamw.cpp). check_step: the gradients against the
  // registered parameters, and the arguments; returns the step's lr. step_grad_norm: the global
  // norm of grad_scale * grads (sumsq_parts, reduce_sumsq). apply_updates: every parameter's
  // update with the step's constants (Adam t), the CPU chunk loop or the CUDA kernels.
  double check_step(const std::vector<at::Tensor>& grads, const StepArgs& args) const;
  double step_grad_norm(const std::vector<at::Tensor>& grads, const StepArgs& args);
  void apply_updates(const std::vector<at::Tensor>& grads, const detail::StepConsts& c, int64_t t);
};

}  // namespace q4::optim
