// DMA staging of CUDA parameters' state in pinned host memory, private to the step (adamw.cpp;
// docs/optim.md#staging-of-host-state). Without CUDA an empty class, so that PackedAdamW::Impl
// holds one either way.
#pragma once

#if Q4_WITH_CUDA
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>

#include <deque>
#include <functional>
#include <optional>
#include <utility>
#include <vector>

#include "optim_state.h"
#include "q4/io/pinned.h"
#endif

namespace q4::optim::detail {

#if Q4_WITH_CUDA
// DMA staging of a CUDA parameter's state in pinned host memory (PackedAdamW::
// set_master_updated_hook). The device copies live in one arena of kMaxStagedBytes, taken from
// the caller's stream when a step begins (or the caller's own, set_staging_arena) and used as a
// ring (a parameter whose copies would take over half of it is updated through its aliases
// instead): a parameter's host tensors are copied in on `in_` (without waiting for the caller's
// stream: the state was written back by the previous step, which ended waiting for `out_`),
// updated by `launch` on the caller's stream once they are in, and the written ones copied back
// on `out_`; a region is reused after its copy back (stream-ordered waits, no host wait).
class HostStager {
 public:
  bool applies(const ParamState& p, const at::Tensor& grad) const {
    return p.info.master_on_host || p.info.moments_on_host || (grad.defined() && !grad.is_cuda());
  }

  // Before the step's first update: the arena (`given`, else one of kMaxStagedBytes), when a
  // parameter of `ps` has state to stage.
  void begin(const std::vector<ParamState>& ps, const at::Tensor& given) {
    int dev = -1;
    for (const ParamState& p : ps) {
      if (p.info.device.is_cuda() && (p.info.master_on_host || p.info.moments_on_host)) {
        dev = p.info.device.index();
        break;
      }
    }
    if (dev < 0) return;
    const c10::cuda::CUDAStream run = at::cuda::getCurrentCUDAStream(dev);
    in_ = at::cuda::getStreamFromPool(false, dev);
    out_ = at::cuda::getStreamFromPool(false, dev);
    // From the caller's pool; the copy streams start after what the caller's stream did so far,
    // which is the last use of that memory.
    arena_ = given.defined()
                 ? given
                 : at::empty({kMaxStagedBytes},
                             at::TensorOptions().dtype(at::kByte).device(at::kCUDA, dev));
    at::cuda::CUDAEvent ready;
    ready.record(run);
    ready.block(*in_);
    ready.block(*out_);
    head_ = 0;
  }

  void update(ParamState& p, const at::Tensor& grad, int64_t index,
              const std::function<void(ParamState&, const at::Tensor&)>& launch,
              const std::function<void(int64_t, const at::Tensor&)>& hook) {
    const c10::cuda::CUDAStream run = at::cuda::getCurrentCUDAStream(p.info.device.index());
    const bool grad_in = grad.defined() && !grad.is_cuda();
    const int64_t bytes = staged_bytes(p, grad_in ? static_cast<int64_t>(grad.nbytes()) : 0);
    if (!arena_.defined() || bytes > arena_.numel() / 2) {
      // Too large to stage within the bound (the embedding, lm_head): updated in place through
      // the device aliases, over PCIe.
      launch(p, grad_in ? io::device_alias(grad.contiguous(), p.info.device) : grad);
      return;
    }
    Region r;
    r.begin = place(bytes);
    int64_t at = r.begin;
    ParamState s = p;  // the same parameter, its host tensors replaced by device copies
    std::vector<std::pair<at::Tensor, at::Tensor>> copies;  // (host, device copy)
    std::vector<bool> written;                              // copied back after the update
    const auto stage = [&](const at::Tensor& host, bool back) {
      const int64_t n = static_cast<int64_t>(host.nbytes());
      at::Tensor d = arena_.narrow(0, at, n).view(host.scalar_type()).view(host.sizes());
      at += round_up(n);
      copies.emplace_back(host, d);
      written.push_back(back);
      return d;
    };
    at::Tensor g = grad;
    if (p.info.master_on_host) s.flat = stage(p.master.detach().view({-1}), true);
    if (p.info.moments_on_host) {
      if (p.info.mode == StateMode::kFp32) {
        s.m32 = stage(p.m32, true);
        s.v32 = stage(p.v32, true);
      } else {
        s.m.codes = stage(p.m.codes, true);
        s.m.scales = stage(p.m.scales, true);
        s.v.codes = stage(p.v.codes, true);
        s.v.scales = stage(p.v.scales, true);
      }
    }
    if (grad_in) g = stage(grad.contiguous(), false);
    r.end = at;
    {
      const c10::cuda::CUDAStreamGuard on_in(*in_);
      for (auto& [host, d] : copies) d.copy_(host, /*non_blocking=*/true);
    }
    at::cuda::CUDAEvent copied;
    copied.record(*in_);
    copied.block(run);
    launch(s, g);
    if (hook && p.info.master_on_host) hook(index, s.flat.view(p.master.sizes()));
    at::cuda::CUDAEvent updated;
    updated.record(run);
    updated.block(*out_);
    {
      const c10::cuda::CUDAStreamGuard on_out(*out_);
      for (size_t k = 0; k < copies.size(); ++k) {
        if (written[k]) copies[k].first.copy_(copies[k].second, /*non_blocking=*/true);
      }
    }
    // The region is free again once copied back, and once the update has read it (a gradient
    // copied in is not copied back).
    r.done.record(*out_);
    live_.push_back(std::move(r));
  }

  // After the step's last update: the caller's stream waits for every copy back; the arena
  // returns to its pool once both copy streams are done with it.
  void finish() {
    if (!arena_.defined()) return;
    const c10::cuda::CUDAStream run = at::cuda::getCurrentCUDAStream(out_->device_index());
    for (const c10::cuda::CUDAStream& st : {*in_, *out_}) {
      at::cuda::CUDAEvent done;
      done.record(st);
      done.block(run);
    }
    arena_ = at::Tensor();
    live_.clear();
  }

 private:
  struct Region {
    int64_t begin = 0, end = 0;
    at::cuda::CUDAEvent done;  // copied back on out_
  };
  static int64_t round_up(int64_t n) { return (n + 511) / 512 * 512; }
  // Device bytes of a parameter's copies (each 512-byte aligned) plus `grad_bytes`.
  static int64_t staged_bytes(const ParamState& p, int64_t grad_bytes) {
    int64_t b = round_up(grad_bytes);
    if (p.info.master_on_host) b += round_up(static_cast<int64_t>(p.flat.nbytes()));
    if (p.info.moments_on_host) {
      if (p.info.mode == StateMode::kFp32) {
        b += 2 * round_up(static_cast<int64_t>(p.m32.nbytes()));
      } else {
        for (const PackedMoment* m : {&p.m, &p.v}) {
          b += round_up(static_cast<int64_t>(m->codes.nbytes())) +
               round_up(static_cast<int64_t>(m->scales.nbytes()));
        }
      }
    }
    return b;
  }
  // The next `bytes` of the ring; the copy-in stream waits for the regions it overwrites.
  int64_t place(int64_t bytes) {
    const int64_t size = arena_.numel();
    TORCH_INTERNAL_ASSERT(bytes <= size, "HostStager: ", bytes, " bytes over an arena of ", size);
    if (head_ + bytes > size) head_ = 0;
    const int64_t b = head_, e = head_ + bytes;
    for (auto it = live_.begin(); it != live_.end();) {
      if (it->begin < e && b < it->end) {
        it->done.block(*in_);
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
    head_ = e;
    return b;
  }

  std::optional<c10::cuda::CUDAStream> in_, out_;
  at::Tensor arena_;  // (bytes) uint8 on the device
  int64_t head_ = 0;
  std::deque<Region> live_;
};
#else
class HostStager {};
#endif

}  // namespace q4::optim::detail
