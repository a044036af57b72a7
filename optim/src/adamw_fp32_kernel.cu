// The fused AdamW step with fp32 moments: one thread per 4 elements, persistent grid.
#include "adamw_kernels.cuh"

namespace q4::optim::cuda::impl {
namespace {

// ---- fp32 moments ----
constexpr int kFp32Elems = 4;  // elements per thread

template <typename G, typename M>
__global__ void adamw_fp32_kernel(StepParams p) {
  if (p.skip != nullptr && *p.skip != 0) return;  // non-finite gradient (in-backward step)
  constexpr int E = kFp32Elems;
  M* master = static_cast<M*>(p.master);
  const int64_t groups = (p.n + E - 1) / E;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; gi < groups;
       gi += stride) {
    const int64_t i0 = gi * E;
    const bool vec = p.vec_ok != 0 && i0 + E <= p.n;
    float g[E], m[E], v[E], w[E];
    if (p.grad != nullptr) {
      load_f32<G, E>(static_cast<const G*>(p.grad), i0, p.n, vec, g);
#pragma unroll
      for (int e = 0; e < E; ++e) g[e] = __fmul_rn(g[e], p.grad_scale);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) g[e] = 0.0f;
    }
    load_f32<float, E>(p.m32, i0, p.n, vec, m);
    load_f32<float, E>(p.v32, i0, p.n, vec, v);
    load_f32<M, E>(master, i0, p.n, vec, w);
    M out[E];
    const bool sr = p.stochastic != 0;
    const uint32_t range_key = detail::sr_range_key(p.sr_key, i0);  // i0: a multiple of E
#pragma unroll
    for (int e = 0; e < E; ++e) {
      adam_moments(g[e], m[e], v[e], p);
      out[e] = write_master<M>(adam_master(w[e], m[e], v[e], p), sr,
                               sr ? detail::sr_bits_in_range(range_key, i0 + e) : 0U);
    }
    if (vec) {
      store_vec<float, E>(p.m32 + i0, m);
      store_vec<float, E>(p.v32 + i0, v);
      store_vec<M, E>(master + i0, out);
    } else {
#pragma unroll
      for (int e = 0; e < E; ++e) {
        if (i0 + e < p.n) {
          p.m32[i0 + e] = m[e];
          p.v32[i0 + e] = v[e];
          master[i0 + e] = out[e];
        }
      }
    }
  }
}

constexpr int kCtasPerSm = 8;  // 8 x 256 threads = the 2048-thread limit of an SM (sm_80/90)

// Persistent grid: enough CTAs for `threads` threads, at most kCtasPerSm per SM.
int64_t persistent_grid(int64_t threads) {
  const int64_t need = (threads + kThreads - 1) / kThreads;
  const int64_t cap = static_cast<int64_t>(sm_count()) * kCtasPerSm;
  return need < 1 ? 1 : (need < cap ? need : cap);
}

}  // namespace

void launch_fp32_step(const StepParams& p, cudaStream_t s) {
  dispatch_step_dtypes(p, [&](auto grad, auto master) {
    using G = decltype(grad);
    using M = decltype(master);
    adamw_fp32_kernel<G, M>
        <<<persistent_grid((p.n + kFp32Elems - 1) / kFp32Elems), kThreads, 0, s>>>(p);
  });
}

}  // namespace q4::optim::cuda::impl
