// NVTX ranges for Nsight Systems timelines: NvtxRange r("forward") pushes a named range for the
// scope. Compiles to nothing unless the build found NVTX3 (Q4_HAVE_NVTX, header-only, from the
// CUDA toolkit), so CPU builds pay nothing.
#pragma once

#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
#include <nvtx3/nvToolsExt.h>
#endif

namespace q4::trainer {

class NvtxRange {
 public:
  explicit NvtxRange(const char* name) {
#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~NvtxRange() {
#if defined(Q4_HAVE_NVTX) && Q4_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  NvtxRange(const NvtxRange&) = delete;
  NvtxRange& operator=(const NvtxRange&) = delete;
};

}  // namespace q4::trainer
