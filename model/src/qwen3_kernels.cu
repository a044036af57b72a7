// Fused Qwen3 layer kernels (launchers in qwen3_kernels.h). RMSNorm: one warp per row, 16-byte
// vector loads, fp32 statistics; the normalized value is rounded to the input dtype before the
// weight multiply, as HF does. The backward recomputes x * rstd, reduces the row dot product in
// a warp and accumulates the weight gradient per block in shared memory (one partial row per
// block, summed by the caller). RoPE: one thread per (token, head, pair) of rotated elements,
// fp32 arithmetic, one rounding per output.
#include <algorithm>
#include <cstdint>

#include "q4/quant/cuda_common.h"
#include "qwen3_kernels.h"

namespace q4::model::cuda {
namespace {

using quant::cuda::aligned16;
using quant::cuda::dispatch_dtype;
using quant::cuda::from_float;
using quant::cuda::kVec16;
using quant::cuda::Pack;
using quant::cuda::sm_count;
using quant::cuda::to_float;
using quant::cuda::warp_sum;

constexpr int kWarpsPerCta = 8;
constexpr int kThreads = kWarpsPerCta * 32;

template <typename T>
__global__ void __launch_bounds__(kThreads) rms_norm_fwd_kernel(const T* __restrict__ x,
                                                                 const T* __restrict__ w,
                                                                 T* __restrict__ y,
                                                                 float* __restrict__ rstd,
                                                                 int64_t rows, int n, float eps) {
  using P = Pack<T>;
  const int lane = threadIdx.x & 31;
  const int nv = n / P::kVec;
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / 32;
       row < rows; row += static_cast<int64_t>(gridDim.x) * kWarpsPerCta) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + row * n);
    float ss = 0.f;
    for (int i = lane; i < nv; i += 32) {
      P p;
      p.raw = xv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const float f = to_float(p.get(j));
        ss += f * f;
      }
    }
    ss = warp_sum(ss);
    const float r = rsqrtf(ss / static_cast<float>(n) + eps);
    if (lane == 0) rstd[row] = r;
    uint4* yv = reinterpret_cast<uint4*>(y + row * n);
    for (int i = lane; i < nv; i += 32) {
      P p, q, o;
      p.raw = xv[i];
      q.raw = wv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const T xn = from_float<T>(to_float(p.get(j)) * r);
        o.set(j, from_float<T>(to_float(q.get(j)) * to_float(xn)));
      }
      yv[i] = o.raw;
    }
  }
}

// Weight gradient: each warp accumulates its rows' dy * cast(x * rstd) in its own slice of
// shared memory (kWarpsPerCta copies of n floats, stored [j][i] for column i * kVec + j so that
// the lanes of a warp hit consecutive banks); a lane always owns the same columns, so no
// atomics. The block then sums the copies into its partial row.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    rms_norm_bwd_kernel(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ w,
                        const float* __restrict__ rstd, T* __restrict__ dx,
                        float* __restrict__ dw_partial, int64_t rows, int n) {
  using P = Pack<T>;
  extern __shared__ float sdw[];  // kWarpsPerCta * n floats when dw_partial
  const bool want_dw = dw_partial != nullptr;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x / 32;
  const int nv = n / P::kVec;
  float* mine = sdw + static_cast<int64_t>(warp) * n;
  if (want_dw) {
    for (int i = threadIdx.x; i < kWarpsPerCta * n; i += blockDim.x) sdw[i] = 0.f;
    __syncthreads();
  }
  const uint4* wv = reinterpret_cast<const uint4*>(w);
  for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + warp; row < rows;
       row += static_cast<int64_t>(gridDim.x) * kWarpsPerCta) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + row * n);
    const uint4* gv = reinterpret_cast<const uint4*>(dy + row * n);
    const float r = rstd[row];
    float dot = 0.f;
    for (int i = lane; i < nv; i += 32) {
      P px, pg, pw;
      px.raw = xv[i];
      pg.raw = gv[i];
      pw.raw = wv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const float xn = to_float(px.get(j)) * r;
        const float gy = to_float(pg.get(j));
        dot += gy * to_float(pw.get(j)) * xn;
        if (want_dw) mine[j * nv + i] += gy * to_float(from_float<T>(xn));
      }
    }
    dot = warp_sum(dot) / static_cast<float>(n);
    uint4* dxv = reinterpret_cast<uint4*>(dx + row * n);
    for (int i = lane; i < nv; i += 32) {
      P px, pg, pw, o;
      px.raw = xv[i];
      pg.raw = gv[i];
      pw.raw = wv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const float xn = to_float(px.get(j)) * r;
        const float g = to_float(pg.get(j)) * to_float(pw.get(j));
        o.set(j, from_float<T>(r * (g - xn * dot)));
      }
      dxv[i] = o.raw;
    }
  }
  if (want_dw) {
    __syncthreads();
    for (int c = threadIdx.x; c < n; c += blockDim.x) {
      const int idx = (c % P::kVec) * nv + c / P::kVec;
      float acc = 0.f;
#pragma unroll
      for (int k = 0; k < kWarpsPerCta; ++k) acc += sdw[k * n + idx];
      dw_partial[static_cast<int64_t>(blockIdx.x) * n + c] = acc;
    }
  }
}

template <typename T>
__global__ void rope_kernel(const T* __restrict__ x, const T* __restrict__ cosv,
                            const T* __restrict__ sinv, T* __restrict__ y, int64_t tokens,
                            int heads, int d, bool backward) {
  const int half = d / 2;
  const int64_t total = tokens * heads * half;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int j = static_cast<int>(idx % half);
    const int64_t th = idx / half;  // token * heads + head
    const int64_t t = th / heads;
    const T* xr = x + th * d;
    const T* c = cosv + t * d;
    const T* s = sinv + t * d;
    const float x1 = to_float(xr[j]), x2 = to_float(xr[j + half]);
    const float c1 = to_float(c[j]), c2 = to_float(c[j + half]);
    const float s1 = to_float(s[j]), s2 = to_float(s[j + half]);
    float y1, y2;
    if (!backward) {  // y = x cos + rotate_half(x) sin, rotate_half(x) = (-x2, x1)
      y1 = x1 * c1 - x2 * s1;
      y2 = x2 * c2 + x1 * s2;
    } else {  // dx = dy cos + rotate_half^T(dy sin), rotate_half^T(v) = (v2, -v1)
      y1 = x1 * c1 + x2 * s2;
      y2 = x2 * c2 - x1 * s1;
    }
    T* yr = y + th * d;
    yr[j] = from_float<T>(y1);
    yr[j + half] = from_float<T>(y2);
  }
}

__device__ __forceinline__ float sigmoid_f(float x) { return 1.f / (1.f + __expf(-x)); }

// One 16-byte vector of each operand per thread (grid-stride); kVec-aligned tail elementwise.
template <typename T>
__global__ void swiglu_fwd_kernel(const T* __restrict__ g, const T* __restrict__ u,
                                  T* __restrict__ h, int64_t n) {
  using P = Pack<T>;
  const int64_t nv = n / P::kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv;
       i += stride) {
    P pg, pu, o;
    pg.raw = reinterpret_cast<const uint4*>(g)[i];
    pu.raw = reinterpret_cast<const uint4*>(u)[i];
#pragma unroll
    for (int j = 0; j < P::kVec; ++j) {
      const float x = to_float(pg.get(j));
      const T s = from_float<T>(x * sigmoid_f(x));
      o.set(j, from_float<T>(to_float(s) * to_float(pu.get(j))));
    }
    reinterpret_cast<uint4*>(h)[i] = o.raw;
  }
  for (int64_t i = nv * P::kVec + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    const float x = to_float(g[i]);
    const T s = from_float<T>(x * sigmoid_f(x));
    h[i] = from_float<T>(to_float(s) * to_float(u[i]));
  }
}

template <typename T>
__device__ __forceinline__ void swiglu_bwd_one(T dh_t, T g_t, T u_t, T* dg, T* du) {
  const float dh = to_float(dh_t), x = to_float(g_t), uu = to_float(u_t);
  const float sig = sigmoid_f(x);
  const T s = from_float<T>(x * sig);
  *du = from_float<T>(dh * to_float(s));
  const float ds = to_float(from_float<T>(dh * uu));  // mul's gradient w.r.t. silu(g), rounded
  *dg = from_float<T>(ds * sig * (1.f + x * (1.f - sig)));
}

template <typename T>
__global__ void swiglu_bwd_kernel(const T* __restrict__ dh, const T* __restrict__ g,
                                  const T* __restrict__ u, T* __restrict__ dg,
                                  T* __restrict__ du, int64_t n) {
  using P = Pack<T>;
  const int64_t nv = n / P::kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < nv;
       i += stride) {
    P ph, pg, pu, og, ou;
    ph.raw = reinterpret_cast<const uint4*>(dh)[i];
    pg.raw = reinterpret_cast<const uint4*>(g)[i];
    pu.raw = reinterpret_cast<const uint4*>(u)[i];
#pragma unroll
    for (int j = 0; j < P::kVec; ++j) {
      T a, b;
      swiglu_bwd_one<T>(ph.get(j), pg.get(j), pu.get(j), &a, &b);
      og.set(j, a);
      ou.set(j, b);
    }
    reinterpret_cast<uint4*>(dg)[i] = og.raw;
    reinterpret_cast<uint4*>(du)[i] = ou.raw;
  }
  for (int64_t i = nv * P::kVec + static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
       i < n; i += stride) {
    swiglu_bwd_one<T>(dh[i], g[i], u[i], dg + i, du + i);
  }
}

// The same with 16-byte vectors: a thread rotates kVec consecutive pairs (half % kVec == 0 and
// every pointer 16-byte aligned, checked by the launcher).
template <typename T>
__global__ void rope_vec_kernel(const T* __restrict__ x, const T* __restrict__ cosv,
                                const T* __restrict__ sinv, T* __restrict__ y, int64_t tokens,
                                int heads, int d, bool backward) {
  using P = Pack<T>;
  const int half = d / 2;
  const int hv = half / P::kVec;  // vectors per half row
  const int64_t total = tokens * heads * hv;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int jv = static_cast<int>(idx % hv);
    const int64_t th = idx / hv;
    const int64_t t = th / heads;
    const int64_t xo = th * d + static_cast<int64_t>(jv) * P::kVec;
    const int64_t co = t * d + static_cast<int64_t>(jv) * P::kVec;
    P x1, x2, c1, c2, s1, s2, y1, y2;
    x1.raw = *reinterpret_cast<const uint4*>(x + xo);
    x2.raw = *reinterpret_cast<const uint4*>(x + xo + half);
    c1.raw = *reinterpret_cast<const uint4*>(cosv + co);
    c2.raw = *reinterpret_cast<const uint4*>(cosv + co + half);
    s1.raw = *reinterpret_cast<const uint4*>(sinv + co);
    s2.raw = *reinterpret_cast<const uint4*>(sinv + co + half);
#pragma unroll
    for (int j = 0; j < P::kVec; ++j) {
      const float a = to_float(x1.get(j)), b = to_float(x2.get(j));
      const float ca = to_float(c1.get(j)), cb = to_float(c2.get(j));
      const float sa = to_float(s1.get(j)), sb = to_float(s2.get(j));
      if (!backward) {
        y1.set(j, from_float<T>(a * ca - b * sa));
        y2.set(j, from_float<T>(b * cb + a * sb));
      } else {
        y1.set(j, from_float<T>(a * ca + b * sb));
        y2.set(j, from_float<T>(b * cb - a * sa));
      }
    }
    *reinterpret_cast<uint4*>(y + xo) = y1.raw;
    *reinterpret_cast<uint4*>(y + xo + half) = y2.raw;
  }
}

int64_t fwd_blocks(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>((rows + kWarpsPerCta - 1) / kWarpsPerCta,
                                                int64_t{sm_count()} * 16));
}

}  // namespace

cudaError_t launch_rms_norm_fwd(const void* x, const void* w, void* y, float* rstd, int64_t rows,
                                int64_t n, float eps, DType dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    rms_norm_fwd_kernel<T><<<static_cast<unsigned>(fwd_blocks(rows)), kThreads, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, rows,
        static_cast<int>(n), eps);
    return cudaGetLastError();
  });
}

int64_t rms_norm_bwd_blocks(int64_t rows) {
  return std::max<int64_t>(1, std::min<int64_t>((rows + kWarpsPerCta - 1) / kWarpsPerCta,
                                                int64_t{sm_count()} * 2));
}

cudaError_t launch_rms_norm_bwd(const void* dy, const void* x, const void* w, const float* rstd,
                                void* dx, float* dw_partial, int64_t rows, int64_t n, DType dt,
                                cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const int64_t blocks = dw_partial ? rms_norm_bwd_blocks(rows) : fwd_blocks(rows);
  const size_t smem =
      dw_partial ? static_cast<size_t>(kWarpsPerCta) * static_cast<size_t>(n) * sizeof(float) : 0;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    if (smem > 48 * 1024) {
      cudaError_t e = cudaFuncSetAttribute(rms_norm_bwd_kernel<T>,
                                           cudaFuncAttributeMaxDynamicSharedMemorySize,
                                           static_cast<int>(smem));
      if (e != cudaSuccess) return e;
    }
    rms_norm_bwd_kernel<T><<<static_cast<unsigned>(blocks), kThreads, smem, stream>>>(
        static_cast<const T*>(dy), static_cast<const T*>(x), static_cast<const T*>(w), rstd,
        static_cast<T*>(dx), dw_partial, rows, static_cast<int>(n));
    return cudaGetLastError();
  });
}

cudaError_t launch_rope(const void* x, const void* cos, const void* sin, void* y, int64_t tokens,
                        int64_t heads, int64_t d, bool backward, DType dt, cudaStream_t stream) {
  const int64_t total = tokens * heads * (d / 2);
  if (total == 0) return cudaSuccess;
  const int64_t blocks =
      std::max<int64_t>(1, std::min<int64_t>((total + 255) / 256, int64_t{sm_count()} * 32));
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = kVec16<T>;
    if ((d / 2) % kVec == 0 && aligned16(x) && aligned16(cos) && aligned16(sin) && aligned16(y)) {
      const int64_t vtotal = total / kVec;
      const int64_t vblocks =
          std::max<int64_t>(1, std::min<int64_t>((vtotal + 255) / 256, int64_t{sm_count()} * 32));
      rope_vec_kernel<T><<<static_cast<unsigned>(vblocks), 256, 0, stream>>>(
          static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
          static_cast<T*>(y), tokens, static_cast<int>(heads), static_cast<int>(d), backward);
      return cudaGetLastError();
    }
    rope_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(
        static_cast<const T*>(x), static_cast<const T*>(cos), static_cast<const T*>(sin),
        static_cast<T*>(y), tokens, static_cast<int>(heads), static_cast<int>(d), backward);
    return cudaGetLastError();
  });
}

namespace {
int64_t elementwise_blocks(int64_t n) {
  return std::max<int64_t>(1, std::min<int64_t>((n / 8 + 255) / 256, int64_t{sm_count()} * 16));
}
}  // namespace

cudaError_t launch_swiglu_fwd(const void* g, const void* u, void* h, int64_t n, DType dt,
                              cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    swiglu_fwd_kernel<T><<<static_cast<unsigned>(elementwise_blocks(n)), 256, 0, stream>>>(
        static_cast<const T*>(g), static_cast<const T*>(u), static_cast<T*>(h), n);
    return cudaGetLastError();
  });
}

cudaError_t launch_swiglu_bwd(const void* dh, const void* g, const void* u, void* dg, void* du,
                              int64_t n, DType dt, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    swiglu_bwd_kernel<T><<<static_cast<unsigned>(elementwise_blocks(n)), 256, 0, stream>>>(
        static_cast<const T*>(dh), static_cast<const T*>(g), static_cast<const T*>(u),
        static_cast<T*>(dg), static_cast<T*>(du), n);
    return cudaGetLastError();
  });
}

namespace {

// ---- softmax cross-entropy over logit rows (the chunked loss) ----
// One CTA per row. Pass 1: each thread keeps an online (max, sum of exp(x - max)) over its
// elements in fp32, merged across the CTA; pass 2 overwrites the row with the logits' gradient
// of the row's CE, softmax - onehot(label) (0 for an unlabelled row), rounded to T. The label's
// logit is read before pass 2. Vector path: V a multiple of the 16-byte width and aligned rows.
constexpr int kXentThreads = 512;

struct MaxSum {
  float m;
  float s;
};

__device__ __forceinline__ MaxSum merge(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

__device__ __forceinline__ void online_add(MaxSum& a, float x) {
  if (x > a.m) {
    a.s = a.s * expf(a.m - x) + 1.f;  // a.m = -inf: expf(-inf) = 0
    a.m = x;
  } else {
    a.s += expf(x - a.m);
  }
}

template <typename T, bool kVecPath>
__global__ void __launch_bounds__(kXentThreads) softmax_xent_kernel(
    T* __restrict__ logits, const int64_t* __restrict__ labels, float* __restrict__ loss_rows,
    int64_t V, bool want_grad) {
  using P = Pack<T>;
  __shared__ MaxSum red[kXentThreads / 32];
  __shared__ float label_logit;
  const int64_t row = blockIdx.x;
  T* x = logits + row * V;
  const int64_t label = labels[row];
  const bool valid = label >= 0 && label < V;
  if (threadIdx.x == 0) label_logit = valid ? to_float(x[label]) : 0.f;
  MaxSum acc{-INFINITY, 0.f};
  if (kVecPath) {
    const int64_t nv = V / P::kVec;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    for (int64_t i = threadIdx.x; i < nv; i += kXentThreads) {
      P p;
      p.raw = xv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) online_add(acc, to_float(p.get(j)));
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kXentThreads) online_add(acc, to_float(x[i]));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    acc = merge(acc, {__shfl_xor_sync(0xffffffffu, acc.m, o), __shfl_xor_sync(0xffffffffu, acc.s, o)});
  }
  if ((threadIdx.x & 31) == 0) red[threadIdx.x / 32] = acc;
  __syncthreads();  // also orders label_logit's read before pass 2's writes
  MaxSum all = red[0];
#pragma unroll
  for (int w = 1; w < kXentThreads / 32; ++w) all = merge(all, red[w]);
  if (threadIdx.x == 0) loss_rows[row] = valid ? all.m + logf(all.s) - label_logit : 0.f;
  if (!want_grad) return;
  const float inv = 1.f / all.s;
  if (kVecPath) {
    const int64_t nv = V / P::kVec;
    uint4* xv = reinterpret_cast<uint4*>(x);
    for (int64_t i = threadIdx.x; i < nv; i += kXentThreads) {
      P p;
      p.raw = xv[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const int64_t col = i * P::kVec + j;
        const float g = expf(to_float(p.get(j)) - all.m) * inv - (col == label ? 1.f : 0.f);
        p.set(j, from_float<T>(valid ? g : 0.f));
      }
      xv[i] = p.raw;
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kXentThreads) {
      const float g = expf(to_float(x[i]) - all.m) * inv - (i == label ? 1.f : 0.f);
      x[i] = from_float<T>(valid ? g : 0.f);
    }
  }
}

}  // namespace

cudaError_t launch_softmax_xent(void* logits, const int64_t* labels, float* loss_rows, int64_t rows,
                                int64_t V, bool want_grad, DType dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    const bool vec = V % Pack<T>::kVec == 0 && aligned16(logits);
    if (vec) {
      softmax_xent_kernel<T, true><<<static_cast<unsigned>(rows), kXentThreads, 0, stream>>>(
          static_cast<T*>(logits), labels, loss_rows, V, want_grad);
    } else {
      softmax_xent_kernel<T, false><<<static_cast<unsigned>(rows), kXentThreads, 0, stream>>>(
          static_cast<T*>(logits), labels, loss_rows, V, want_grad);
    }
    return cudaGetLastError();
  });
}

}  // namespace q4::model::cuda
