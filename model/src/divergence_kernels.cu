// Fused distillation loss over logit rows (launchers in divergence_kernels.h; the rule in
// docs/model.md#fused-divergence). One CTA per row, fp32 arithmetic on the logits read in their
// dtype:
//   pass 1: online (max, sums) over the student's row: sum exp(x - m) for the cross-entropy,
//           sum exp((x - m) / T) for its distribution at T (and, top-K, the same over the tokens
//           outside the K), and over the teacher's row sum exp((y - m_t) / T);
//   reverse KL only: one more read sweep for the KL value, which its gradient needs;
//   last pass: the row overwritten by the gradient of (1 - w) * CE + w * T^2 * KL (forward KL:
//           the KL value summed in the same sweep).
// Probabilities that are 0 contribute 0 to a KL (0 log 0 = 0), so -inf logits are masks.
// Rows whose label is outside [0, V) are zeroed and give 0.
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "divergence_kernels.h"
#include "q4/quant/cuda_common.h"

namespace q4::model::cuda {
namespace {

using quant::cuda::aligned16;
using quant::cuda::dispatch_dtype;
using quant::cuda::from_float;
using quant::cuda::Pack;
using quant::cuda::to_float;
using quant::cuda::warp_sum;

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;

// Running max m of a row's raw logits and sums relative to it: s1 = sum exp(x - m), st = sum
// exp((x - m) / T), tail = the part of st outside the top-K mask.
struct RowStat {
  float m = -INFINITY;
  float s1 = 0.f, st = 0.f, tail = 0.f;
};

// Adds x to the running statistics. need_s1 false (the teacher): s1 is not kept. unit_t: T = 1
// (inv_t == 1.f, so one exp serves both sums).
__device__ __forceinline__ void stat_add(RowStat& a, float x, float inv_t, bool unit_t,
                                         bool need_s1, bool in_tail) {
  if (x == -INFINITY) return;  // a mask: no mass (and no exp(-inf - -inf))
  if (x > a.m) {
    const float d = a.m - x;  // < 0; -inf for the first element
    const float rt = expf(d * inv_t);
    a.s1 *= expf(d);
    a.st *= rt;
    a.tail *= rt;
    a.m = x;
  }
  const float dx = x - a.m;
  const float et = expf(dx * inv_t);
  a.st += et;
  if (need_s1) a.s1 += unit_t ? et : expf(dx);
  if (in_tail) a.tail += et;
}

__device__ __forceinline__ RowStat stat_merge(RowStat a, const RowStat& b, float inv_t) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return a;
  const float da = a.m - m, db = b.m - m;
  const float ra = expf(da * inv_t), rb = expf(db * inv_t);
  a.s1 = a.s1 * expf(da) + b.s1 * expf(db);
  a.st = a.st * ra + b.st * rb;
  a.tail = a.tail * ra + b.tail * rb;
  a.m = m;
  return a;
}

// The CTA's merged statistics, on every thread. `sh` holds kWarps entries.
__device__ RowStat block_stat(RowStat v, float inv_t, RowStat* sh) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    RowStat b;
    b.m = __shfl_xor_sync(0xffffffffu, v.m, o);
    b.s1 = __shfl_xor_sync(0xffffffffu, v.s1, o);
    b.st = __shfl_xor_sync(0xffffffffu, v.st, o);
    b.tail = __shfl_xor_sync(0xffffffffu, v.tail, o);
    v = stat_merge(v, b, inv_t);
  }
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  RowStat all = sh[0];
  for (int w = 1; w < kWarps; ++w) all = stat_merge(all, sh[w], inv_t);
  __syncthreads();  // sh may be reused
  return all;
}

// The CTA's sum of v, on every thread. `sh` holds kWarps floats.
__device__ float block_sum(float v, float* sh) {
  v = warp_sum(v);
  if ((threadIdx.x & 31) == 0) sh[threadIdx.x / 32] = v;
  __syncthreads();
  float all = 0.f;
  for (int w = 0; w < kWarps; ++w) all += sh[w];
  __syncthreads();
  return all;
}

// p log(p / q) from p = exp(lp), log p and log q; 0 when p = 0 (0 log 0 = 0).
__device__ __forceinline__ float kl_part(float p, float lp, float lq) {
  return p == 0.f ? 0.f : p * (lp - lq);
}

// Calls f(col, x, y) for each element of the row this thread owns (y = 0.f when t is null).
// kWrite: x[col] becomes f's fp32 result in x's dtype; otherwise f's result is not used.
// kVec: 16-byte loads and stores (V a multiple of the width, rows aligned).
template <typename T, bool kVec, bool kWrite, typename X, typename F>
__device__ __forceinline__ void sweep_row(X* x, const T* t, int64_t V, F&& f) {
  using P = Pack<T>;
  if (kVec) {
    const int64_t nv = V / P::kVec;
    for (int64_t i = threadIdx.x; i < nv; i += kThreads) {
      P px, pt;
      px.raw = reinterpret_cast<const uint4*>(x)[i];
      if (t != nullptr) pt.raw = reinterpret_cast<const uint4*>(t)[i];
#pragma unroll
      for (int j = 0; j < P::kVec; ++j) {
        const float y = t != nullptr ? to_float(pt.get(j)) : 0.f;
        if constexpr (kWrite) {
          px.set(j, from_float<T>(f(i * P::kVec + j, to_float(px.get(j)), y)));
        } else {
          f(i * P::kVec + j, to_float(px.get(j)), y);
        }
      }
      if constexpr (kWrite) reinterpret_cast<uint4*>(x)[i] = px.raw;
    }
  } else {
    for (int64_t i = threadIdx.x; i < V; i += kThreads) {
      const float y = t != nullptr ? to_float(t[i]) : 0.f;
      if constexpr (kWrite) {
        x[i] = from_float<T>(f(i, to_float(x[i]), y));
      } else {
        f(i, to_float(x[i]), y);
      }
    }
  }
}

template <typename T, bool kVec, typename F>
__device__ __forceinline__ void read_row(const T* x, const T* t, int64_t V, F&& f) {
  sweep_row<T, kVec, false>(x, t, V, f);
}

// x[col] = f(col, x[col], y[col]) for each element this thread owns; f returns fp32.
template <typename T, bool kVec, typename F>
__device__ __forceinline__ void write_row(T* x, const T* t, int64_t V, F&& f) {
  sweep_row<T, kVec, true>(x, t, V, f);
}

struct LossArgs {
  int64_t V;
  float inv_t, t, w;  // 1 / T, T, the term's weight
  bool want_grad;
};

// A row whose label is outside [0, V) gives 0 and, with gradients, a zero row x: whether it is
// one (the kernel then returns).
template <typename T>
__device__ __forceinline__ bool ignored_row(int64_t row, int64_t label, T* x, float* ce_rows,
                                            float* term_rows, const LossArgs& a) {
  if (label < 0 || label >= a.V) {
    if (threadIdx.x == 0) ce_rows[row] = term_rows[row] = 0.f;
    if (a.want_grad) {
      for (int64_t i = threadIdx.x; i < a.V; i += kThreads) x[i] = from_float<T>(0.f);
    }
    return true;
  }
  return false;
}

// Online distillation: student x and teacher y rows, forward or reverse KL.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    distill_xent_kernel(T* __restrict__ logits, const T* __restrict__ teacher,
                        const int64_t* __restrict__ labels, float* __restrict__ ce_rows,
                        float* __restrict__ term_rows, LossArgs a, bool reverse) {
  __shared__ RowStat sh_stat[kWarps];
  __shared__ float sh_sum[kWarps];
  __shared__ float label_logit;
  const int64_t row = blockIdx.x, V = a.V;
  T* x = logits + row * V;
  const T* y = teacher + row * V;
  const int64_t label = labels[row];
  if (ignored_row(row, label, x, ce_rows, term_rows, a)) return;
  if (threadIdx.x == 0) label_logit = to_float(x[label]);
  const bool unit = a.inv_t == 1.f;
  RowStat ss, st;
  read_row<T, kVec>(x, y, V, [&](int64_t, float xv, float yv) {
    stat_add(ss, xv, a.inv_t, unit, /*need_s1=*/true, false);
    stat_add(st, yv, a.inv_t, unit, /*need_s1=*/false, false);
  });
  ss = block_stat(ss, a.inv_t, sh_stat);  // its barrier orders label_logit before the writes
  st = block_stat(st, a.inv_t, sh_stat);
  // log p_s = (x - m_s) / T - lss, log p_t = (y - m_t) / T - lst: x - m is exact for logits of
  // one magnitude, so large logits lose nothing to the offset.
  const float lss = logf(ss.st), lst = logf(st.st), inv_s1 = 1.f / ss.s1;
  float kl = 0.f;
  if (reverse) {  // KL(p_s || p_t), needed by its gradient before the row is written
    float part = 0.f;
    read_row<T, kVec>(x, y, V, [&](int64_t, float xv, float yv) {
      const float ls = (xv - ss.m) * a.inv_t - lss;
      part += kl_part(expf(ls), ls, (yv - st.m) * a.inv_t - lst);
    });
    kl = block_sum(part, sh_sum);
  }
  if (a.want_grad) {
    float part = 0.f;  // forward KL's value, summed on the way
    write_row<T, kVec>(x, y, V, [&](int64_t col, float xv, float yv) {
      const float ls = (xv - ss.m) * a.inv_t - lss, lt = (yv - st.m) * a.inv_t - lst;
      const float ps = expf(ls);
      float gt;
      if (reverse) {
        gt = ps == 0.f ? 0.f : a.t * ps * (ls - lt - kl);
      } else {
        const float pt = expf(lt);
        part += kl_part(pt, lt, ls);
        gt = a.t * (ps - pt);
      }
      const float p1 = unit ? ps : expf(xv - ss.m) * inv_s1;  // the CE's softmax
      return (1.f - a.w) * (p1 - (col == label ? 1.f : 0.f)) + a.w * gt;
    });
    if (!reverse) kl = block_sum(part, sh_sum);
  } else if (!reverse) {
    float part = 0.f;
    read_row<T, kVec>(x, y, V, [&](int64_t, float xv, float yv) {
      const float lt = (yv - st.m) * a.inv_t - lst;
      part += kl_part(expf(lt), lt, (xv - ss.m) * a.inv_t - lss);
    });
    kl = block_sum(part, sh_sum);
  }
  if (threadIdx.x == 0) {
    ce_rows[row] = (ss.m - label_logit) + logf(ss.s1);
    term_rows[row] = a.t * a.t * kl;
  }
}

// The top-K forward KL's values of a row: the K tokens' part and the tail factor.
struct TopkRow {
  float kl;     // the K tokens' part plus the tail's
  float ratio;  // q_r / s_r (0 without a tail or without teacher mass there)
};

// The top-K part of the KL and the tail (topk_divergence_chunk's rule): q_k = exp(lq_k),
// q_r = max(1 - sum q_k, 0), log s_r = max(log(tail / st), -80).
__device__ TopkRow topk_row(const float* x_ids, const float* lq, int K, const RowStat& s, float lss,
                            float inv_t, bool tail, float* sh) {
  float part = 0.f, mass = 0.f;
  for (int k = threadIdx.x; k < K; k += kThreads) {
    const float q = expf(lq[k]);
    mass += q;
    part += kl_part(q, lq[k], (x_ids[k] - s.m) * inv_t - lss);
  }
  TopkRow r{block_sum(part, sh), 0.f};
  const float q_mass = block_sum(mass, sh);
  if (tail) {
    const float qr = fmaxf(1.f - q_mass, 0.f);
    if (qr > 0.f) {
      const float lsr = fmaxf(logf(s.tail) - logf(s.st), -80.f);
      const float log_ratio = logf(fmaxf(qr, 1e-30f)) - lsr;
      r.kl += qr * log_ratio;
      r.ratio = expf(log_ratio);
    }
  }
  return r;
}

// Offline distillation: the student's row against the teacher's top K (ids, log-probabilities).
// Shared memory: a bit per column (in the top K), then the K ids' logits.
template <typename T, bool kVec>
__global__ void __launch_bounds__(kThreads)
    topk_distill_xent_kernel(T* __restrict__ logits, const int64_t* __restrict__ ids,
                             const float* __restrict__ logprobs, const int64_t* __restrict__ labels,
                             float* __restrict__ ce_rows, float* __restrict__ term_rows, LossArgs a,
                             int K) {
  extern __shared__ uint32_t smem[];
  __shared__ RowStat sh_stat[kWarps];
  __shared__ float sh_sum[kWarps];
  __shared__ float label_logit;
  const int64_t row = blockIdx.x, V = a.V;
  const int64_t words = (V + 31) / 32;
  uint32_t* mask = smem;
  float* x_ids = reinterpret_cast<float*>(smem + words);  // K floats
  T* x = logits + row * V;
  const int64_t* id = ids + row * K;
  const float* lq = logprobs + row * K;
  const int64_t label = labels[row];
  if (ignored_row(row, label, x, ce_rows, term_rows, a)) return;
  for (int64_t i = threadIdx.x; i < words; i += kThreads) mask[i] = 0u;
  __syncthreads();
  for (int k = threadIdx.x; k < K; k += kThreads) {
    atomicOr(&mask[id[k] >> 5], 1u << (id[k] & 31));
    x_ids[k] = to_float(x[id[k]]);
  }
  if (threadIdx.x == 0) label_logit = to_float(x[label]);
  __syncthreads();
  const bool unit = a.inv_t == 1.f;
  RowStat s;
  read_row<T, kVec>(x, static_cast<const T*>(nullptr), V, [&](int64_t col, float xv, float) {
    stat_add(s, xv, a.inv_t, unit, true, ((mask[col >> 5] >> (col & 31)) & 1u) == 0u);
  });
  s = block_stat(s, a.inv_t, sh_stat);
  const float lss = logf(s.st), inv_s1 = 1.f / s.s1;  // log p_s = (x - m) / T - lss
  const TopkRow r = topk_row(x_ids, lq, K, s, lss, a.inv_t, K < V, sh_sum);
  // d/dx of (1 - w) * CE + w * T^2 * KL at a column of student logit xv: T * w * (p_s - target),
  // target q on the K tokens (top) and p_s * q_r / s_r elsewhere.
  const auto grad = [&](float xv, bool is_label, bool top, float q) {
    const float ps = expf((xv - s.m) * a.inv_t - lss);
    const float p1 = unit ? ps : expf(xv - s.m) * inv_s1;
    const float gt = top ? ps - q : ps * (1.f - r.ratio);
    return (1.f - a.w) * (p1 - (is_label ? 1.f : 0.f)) + a.w * a.t * gt;
  };
  if (a.want_grad) {
    // Outside the K: T * p_s * (1 - ratio); the K columns are left as they are (a 16-byte store
    // writes them back unchanged) and written after the barrier from x_ids.
    write_row<T, kVec>(x, static_cast<const T*>(nullptr), V, [&](int64_t col, float xv, float) {
      if ((mask[col >> 5] >> (col & 31)) & 1u) return xv;
      return grad(xv, col == label, false, 0.f);
    });
    __syncthreads();
    for (int k = threadIdx.x; k < K; k += kThreads) {
      x[id[k]] = from_float<T>(grad(x_ids[k], id[k] == label, true, expf(lq[k])));
    }
  }
  if (threadIdx.x == 0) {
    ce_rows[row] = (s.m - label_logit) + logf(s.s1);
    term_rows[row] = a.t * a.t * r.kl;
  }
}

LossArgs loss_args(int64_t V, double temperature, double weight, bool want_grad) {
  return {V, static_cast<float>(1.0 / temperature), static_cast<float>(temperature),
          static_cast<float>(weight), want_grad};
}

}  // namespace

cudaError_t launch_distill_xent(void* logits, const void* teacher, const int64_t* labels,
                                float* ce_rows, float* term_rows, int64_t rows, int64_t V,
                                bool reverse, double temperature, double weight, bool want_grad,
                                DType dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const LossArgs a = loss_args(V, temperature, weight, want_grad);
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    T* x = static_cast<T*>(logits);
    const T* y = static_cast<const T*>(teacher);
    const auto grid = static_cast<unsigned>(rows);
    if (V % Pack<T>::kVec == 0 && aligned16(logits) && aligned16(teacher)) {
      distill_xent_kernel<T, true>
          <<<grid, kThreads, 0, stream>>>(x, y, labels, ce_rows, term_rows, a, reverse);
    } else {
      distill_xent_kernel<T, false>
          <<<grid, kThreads, 0, stream>>>(x, y, labels, ce_rows, term_rows, a, reverse);
    }
    return cudaGetLastError();
  });
}

size_t topk_distill_smem_bytes(int64_t V, int64_t K) {
  return static_cast<size_t>((V + 31) / 32) * sizeof(uint32_t) +
         static_cast<size_t>(K) * sizeof(float);
}

cudaError_t launch_topk_distill_xent(void* logits, const int64_t* ids, const float* logprobs,
                                     const int64_t* labels, float* ce_rows, float* term_rows,
                                     int64_t rows, int64_t V, int64_t K, double temperature,
                                     double weight, bool want_grad, DType dt, cudaStream_t stream) {
  if (rows == 0) return cudaSuccess;
  const LossArgs a = loss_args(V, temperature, weight, want_grad);
  const size_t smem = topk_distill_smem_bytes(V, K);
  if (smem > kTopkSmemLimit) return cudaErrorInvalidValue;
  return dispatch_dtype(dt, cudaErrorInvalidValue, [&](auto tag) {
    using T = decltype(tag);
    T* x = static_cast<T*>(logits);
    const auto grid = static_cast<unsigned>(rows);
    const int k = static_cast<int>(K);
    if (V % Pack<T>::kVec == 0 && aligned16(logits)) {
      topk_distill_xent_kernel<T, true>
          <<<grid, kThreads, smem, stream>>>(x, ids, logprobs, labels, ce_rows, term_rows, a, k);
    } else {
      topk_distill_xent_kernel<T, false>
          <<<grid, kThreads, smem, stream>>>(x, ids, logprobs, labels, ce_rows, term_rows, a, k);
    }
    return cudaGetLastError();
  });
}

}  // namespace q4::model::cuda
