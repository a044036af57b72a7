// Named ranges of the trainer's phases: NvtxRange r("forward") pushes an NVTX range for the
// scope (Nsight Systems timelines; compiled only when the build found NVTX3, Q4_HAVE_NVTX,
// header-only from the CUDA toolkit) and opens a user scope of the PyTorch profiler, which a
// --profile-trace shows as a `user_annotation` event (inactive, and nearly free, otherwise).
#pragma once

#include <ATen/record_function.h>

#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace q4::trainer {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) : scope_(at::RecordScope::USER_SCOPE) {
    if (scope_.isActive()) scope_.before(name);
#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
    nvtxRangePushA(name);
#endif
  }
  ~NvtxRange() {
#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;

 private:
  at::RecordFunction scope_;  // ends with the object
};

}  // namespace q4::trainer
