// bench_quant: NVFP4 fake-quant throughput for Qwen3-4B-like weight shapes. Reports GB/s of
// bytes read + written, the ratio to a plain device copy (at::Tensor::copy_) of the same bytes
// measured in the same run, and (on CUDA) the fraction of 3.35 TB/s (H100 SXM HBM3 peak). Also
// times quantize and dequantize. Runs on CUDA when available, otherwise on CPU (smaller default
// shapes unless --full). Usage: bench_quant [--cpu] [--full] [--iters N]
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/Parallel.h>
#include <torch/cuda.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "q4/quant/nvfp4.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace {

constexpr double kHbmPeakBytesPerS = 3.35e12;  // H100 SXM

struct Shape {
  int64_t rows, cols;
};

// Mean over `iters` runs after `warmup` runs; synchronizes around timing.
double time_ms(const std::function<void()>& fn, bool cuda, int warmup, int iters) {
  for (int i = 0; i < warmup; ++i) fn();
  if (cuda) torch::cuda::synchronize();
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) fn();
  if (cuda) torch::cuda::synchronize();
  const auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::milli>(t1 - t0).count() / iters;
}

std::string device_name(bool cuda) {
  if (!cuda) return "CPU (" + std::to_string(at::get_num_threads()) + " threads)";
#if Q4_WITH_CUDA
  return std::string("CUDA ") + at::cuda::getCurrentDeviceProperties()->name;
#else
  return "CUDA";
#endif
}

}  // namespace

int main(int argc, char** argv) {
  bool force_cpu = false, full = false;
  int iters = 0;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--cpu")) {
      force_cpu = true;
    } else if (!std::strcmp(argv[i], "--full")) {
      full = true;
    } else if (!std::strcmp(argv[i], "--iters") && i + 1 < argc) {
      iters = std::atoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: bench_quant [--cpu] [--full] [--iters N]\n");
      return 2;
    }
  }
  const bool cuda = !force_cpu && torch::cuda::is_available();
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  if (iters <= 0) iters = cuda ? 50 : 3;
  const int warmup = cuda ? 5 : 1;
  std::vector<Shape> shapes = {{9728, 2560}, {2560, 9728}};
  if (!cuda && !full) shapes = {{1216, 2560}, {2560, 1216}};  // 1/8 of the rows/cols on CPU
  const std::string name = device_name(cuda);
  at::NoGradGuard no_grad;
  try {
    for (at::ScalarType dt : {at::kBFloat16, at::kHalf, at::kFloat}) {
      for (const Shape& sh : shapes) {
        const at::Tensor w = (at::randn({sh.rows, sh.cols}, at::kFloat) * 0.02).to(dev, dt);
        at::Tensor dst = at::empty_like(w);
        const double bytes = 2.0 * static_cast<double>(w.numel()) * w.element_size();
        const double copy_ms = time_ms([&] { dst.copy_(w); }, cuda, warmup, iters);
        const double fq_ms = time_ms([&] { dst = q4::quant::fake_quant_nvfp4_forward(w, "w"); },
                                     cuda, warmup, iters);
        const double fq_gbs = bytes / (fq_ms * 1e-3) / 1e9;
        // Without the NaN/Inf check (no device->host sync per call).
        const double fqu_ms = time_ms(
            [&] { dst = q4::quant::fake_quant_nvfp4_forward_unchecked(w); }, cuda, warmup, iters);
        const double fqu_gbs = bytes / (fqu_ms * 1e-3) / 1e9;
        const double copy_gbs = bytes / (copy_ms * 1e-3) / 1e9;
        std::printf(
            "[%s] fake_quant %-8s %5lldx%-5lld %8.3f ms %8.1f GB/s | copy_ %8.3f ms %8.1f GB/s | "
            "fq/copy %.2f",
            name.c_str(), c10::toString(dt), static_cast<long long>(sh.rows),
            static_cast<long long>(sh.cols), fq_ms, fq_gbs, copy_ms, copy_gbs, fq_gbs / copy_gbs);
        if (cuda) std::printf(" | of 3.35 TB/s %.2f", fq_gbs * 1e9 / kHbmPeakBytesPerS);
        std::printf("\n");
        std::printf("[%s] fq_nocheck %-8s %5lldx%-5lld %8.3f ms %8.1f GB/s | fq/copy %.2f",
                    name.c_str(), c10::toString(dt), static_cast<long long>(sh.rows),
                    static_cast<long long>(sh.cols), fqu_ms, fqu_gbs, fqu_gbs / copy_gbs);
        if (cuda) std::printf(" | of 3.35 TB/s %.2f", fqu_gbs * 1e9 / kHbmPeakBytesPerS);
        std::printf("\n");
        // Quantize (reads w, writes 0.5625 B/elem) and dequantize (reads that, writes w's dtype).
        q4::quant::Nvfp4Tensor q;
        const double q_ms =
            time_ms([&] { q = q4::quant::quantize_nvfp4(w, "w"); }, cuda, warmup, iters);
        const double packed_bytes = static_cast<double>(q.qdata.numel() + q.scale.numel());
        const double dq_ms = time_ms(
            [&] { dst = q4::quant::dequantize_nvfp4(q.qdata, q.scale, dt); }, cuda, warmup, iters);
        const double half_bytes = bytes / 2;
        std::printf(
            "[%s] quantize   %-8s %5lldx%-5lld %8.3f ms %8.1f GB/s | dequantize %8.3f ms "
            "%8.1f GB/s\n",
            name.c_str(), c10::toString(dt), static_cast<long long>(sh.rows),
            static_cast<long long>(sh.cols), q_ms,
            (half_bytes + packed_bytes) / (q_ms * 1e-3) / 1e9, dq_ms,
            (half_bytes + packed_bytes) / (dq_ms * 1e-3) / 1e9);
      }
    }
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_quant: %s\n", e.what_without_backtrace());
    return 1;
  }
  return 0;
}
