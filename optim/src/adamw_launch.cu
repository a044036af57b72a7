// The public step launchers of cuda_launch.h: alignment checks, the batching of packed-moment
// tensors into runs of one kind, and the hand-over to the fp32 (adamw_fp32_kernel.cu) and
// packed-moment (adamw_block_kernels.cu) kernels.
#include <vector>

#include "adamw_kernels.cuh"

namespace q4::optim::cuda {

using impl::ensure_tables;
using quant::cuda::aligned16;
using quant::cuda::check_cuda;

void launch_adamw_step(const StepParams& params, cudaStream_t stream) {
  if (params.n == 0) return;
  ensure_tables();
  StepParams p = params;
  p.vec_ok = aligned16(p.grad) && aligned16(p.master) &&
             (p.mode == 0 ? aligned16(p.m32) && aligned16(p.v32)
                          : aligned16(p.m_codes) && aligned16(p.v_codes));
  if (p.mode == 0) {
    impl::launch_fp32_step(p, stream);
  } else {
    impl::launch_block_step(p, stream);
  }
  check_cuda(cudaGetLastError(), "q4::optim CUDA: adamw step launch");
}

bool same_block_kind(const StepParams& a, const StepParams& b) {
  return a.mode == b.mode && a.exact == b.exact && a.stochastic == b.stochastic &&
         a.grad_dtype == b.grad_dtype && a.master_dtype == b.master_dtype;
}

void launch_adamw_steps(const StepParams* params, int count, cudaStream_t stream) {
  if (count == 0) return;
  ensure_tables();
  std::vector<StepParams> ps(params, params + count);
  for (StepParams& p : ps) {
    if (p.mode == 0 || p.n == 0) {
      throw std::runtime_error("q4::optim CUDA: launch_adamw_steps takes packed-moment tensors");
    }
    p.vec_ok =
        aligned16(p.grad) && aligned16(p.master) && aligned16(p.m_codes) && aligned16(p.v_codes);
  }
  for (int first = 0; first < count;) {
    int last = first + 1;
    while (last < count && last - first < kStepBatch && same_block_kind(ps[first], ps[last]))
      ++last;
    const StepParams* run = ps.data() + first;
    const int n = last - first;
    impl::launch_block_steps(run, n, stream);
    check_cuda(cudaGetLastError(), "q4::optim CUDA: adamw batched step launch");
    first = last;
  }
}

}  // namespace q4::optim::cuda
