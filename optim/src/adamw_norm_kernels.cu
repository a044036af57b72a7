// Gradient-norm kernels: the sum of squares of one or many tensors in fixed-order partial sums
// (clipping, docs/optim.md) and the non-finite flag of in-backward steps.
#include "adamw_kernels.cuh"

namespace q4::optim::cuda::impl {
namespace {

// ---- sum of squares ----
// One tensor's part of CTA `cta` of `ctas`: each thread sums the squares of its 16-byte vectors
// (grid-stride over the tensor's CTAs, four in flight) and then, one element at a time, the
// unaligned head and the tail, into fixed accumulators; the CTA reduces in a fixed tree and writes
// row[cta]; CTA 0 zeroes the row past `ctas`. Deterministic for a given n, pointer alignment
// and CTA count (a function of n): the single- and multi-tensor launches give the same bits.
template <typename G>
__device__ __forceinline__ void sumsq_body(const G* g, int64_t n, float* row, int cta, int ctas) {
  constexpr int V = 16 / sizeof(G);  // elements per vector
  __shared__ float red[256];
  float acc[2] = {0.0f, 0.0f};
  const int64_t tid = static_cast<int64_t>(cta) * blockDim.x + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(ctas) * blockDim.x;
  // Elements before the first 16-byte boundary, then whole vectors, then the tail.
  const int64_t mis = static_cast<int64_t>((reinterpret_cast<uintptr_t>(g) & 15) / sizeof(G));
  const int64_t head = mis == 0 ? 0 : (V - mis < n ? V - mis : n);
  const int64_t nvec = (n - head) / V;
  const Vec<G, V>* vp = reinterpret_cast<const Vec<G, V>*>(g + head);
  int64_t i = tid;
  for (; i + 3 * stride < nvec; i += 4 * stride) {
    Vec<G, V> r[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) r[k] = vp[i + k * stride];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int e = 0; e < V; ++e) {
        const float x = to_float(r[k].v[e]);
        acc[k & 1] = __fadd_rn(acc[k & 1], __fmul_rn(x, x));
      }
    }
  }
  for (; i < nvec; i += stride) {
    const Vec<G, V> r0 = vp[i];
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x0 = to_float(r0.v[e]);
      acc[0] = __fadd_rn(acc[0], __fmul_rn(x0, x0));
    }
  }
  const int64_t rest = n - head - nvec * V;  // < V
  if (tid < head) {
    const float x = to_float(g[tid]);
    acc[1] = __fadd_rn(acc[1], __fmul_rn(x, x));
  } else if (tid < head + rest) {
    const float x = to_float(g[head + nvec * V + (tid - head)]);
    acc[1] = __fadd_rn(acc[1], __fmul_rn(x, x));
  }
  red[threadIdx.x] = acc[0] + acc[1];
  __syncthreads();
  for (int s = blockDim.x / 2; s > 0; s >>= 1) {
    if (static_cast<int>(threadIdx.x) < s) red[threadIdx.x] += red[threadIdx.x + s];
    __syncthreads();
  }
  if (threadIdx.x == 0) row[cta] = red[0];
  if (cta == 0) {
    for (int k = ctas + threadIdx.x; k < kSumsqPartials; k += blockDim.x) row[k] = 0.0f;
  }
}

template <typename G>
__global__ void sumsq_kernel(const G* g, int64_t n, float* partials) {
  sumsq_body<G>(g, n, partials, blockIdx.x, gridDim.x);
}

// Several tensors in one launch (the buffered step's norm pass over a few hundred gradients
// would otherwise pay a launch and a pipeline ramp per tensor): tensor k owns CTAs
// [cta_start[k], cta_start[k + 1]) and writes partial row k, exactly as its own launch would.
constexpr int kSumsqBatch = 32;
struct SumsqBatch {
  const void* ptr[kSumsqBatch];
  int64_t n[kSumsqBatch];
  int cta_start[kSumsqBatch + 1];
  int count;
};

template <typename G>
__global__ void sumsq_multi_kernel(SumsqBatch b, float* partials) {
  int k = 0;
  while (k + 1 < b.count && b.cta_start[k + 1] <= static_cast<int>(blockIdx.x)) ++k;
  sumsq_body<G>(static_cast<const G*>(b.ptr[k]), b.n[k],
                partials + static_cast<int64_t>(k) * kSumsqPartials,
                static_cast<int>(blockIdx.x) - b.cta_start[k], b.cta_start[k + 1] - b.cta_start[k]);
}

// CTAs of the sum of squares: at least 4 vectors per thread where the tensor has them, at most
// kSumsqPartials (small tensors -- norms, biases -- take one CTA instead of a full grid).
int sumsq_grid(int64_t n, int dtype_bytes) {
  const int64_t vecs = n * dtype_bytes / 16;
  const int64_t per_cta = static_cast<int64_t>(kThreads) * 4;
  const int64_t g = (vecs + per_cta - 1) / per_cta;
  return static_cast<int>(g < 1 ? 1 : (g > kSumsqPartials ? kSumsqPartials : g));
}

__global__ void nonfinite_flag_kernel(const float* partials, int n, int32_t* flag) {
  float s = 0.0f;
  for (int i = threadIdx.x; i < n; i += 32) s += partials[i];
  s = warp_sum(s);
  if (threadIdx.x == 0) *flag = isfinite(s) ? 0 : 1;
}

}  // namespace
}  // namespace q4::optim::cuda::impl

namespace q4::optim::cuda {

using impl::dispatch_code;
using impl::kSumsqBatch;
using impl::kThreads;
using impl::nonfinite_flag_kernel;
using impl::sumsq_grid;
using impl::sumsq_kernel;
using impl::sumsq_multi_kernel;
using impl::SumsqBatch;
using quant::cuda::check_cuda;

void launch_sumsq(const void* g, int dtype, int64_t n, float* partials, cudaStream_t stream) {
  dispatch_code(dtype, "grad dtype", [&](auto tag) {
    using G = decltype(tag);
    sumsq_kernel<G>
        <<<sumsq_grid(n, sizeof(G)), kThreads, 0, stream>>>(static_cast<const G*>(g), n, partials);
  });
  check_cuda(cudaGetLastError(), "q4::optim CUDA: sumsq launch");
}

void launch_sumsq_many(const void* const* ptrs, const int64_t* ns, int count, int dtype,
                       float* partials, cudaStream_t stream) {
  const int bytes = dtype == kDtF32 ? 4 : 2;
  for (int first = 0; first < count; first += kSumsqBatch) {
    SumsqBatch b{};
    b.count = count - first < kSumsqBatch ? count - first : kSumsqBatch;
    int ctas = 0;
    for (int k = 0; k < b.count; ++k) {
      b.ptr[k] = ptrs[first + k];
      b.n[k] = ns[first + k];
      b.cta_start[k] = ctas;
      ctas += sumsq_grid(ns[first + k], bytes);
    }
    b.cta_start[b.count] = ctas;
    float* rows = partials + static_cast<int64_t>(first) * kSumsqPartials;
    dispatch_code(dtype, "grad dtype", [&](auto tag) {
      sumsq_multi_kernel<decltype(tag)><<<ctas, kThreads, 0, stream>>>(b, rows);
    });
    check_cuda(cudaGetLastError(), "q4::optim CUDA: sumsq launch");
  }
}

void launch_nonfinite_flag(const float* partials, int n, int32_t* flag, cudaStream_t stream) {
  nonfinite_flag_kernel<<<1, 32, 0, stream>>>(partials, n, flag);
  check_cuda(cudaGetLastError(), "q4::optim CUDA: nonfinite flag launch");
}

}  // namespace q4::optim::cuda
