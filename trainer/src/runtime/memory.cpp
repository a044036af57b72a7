// /proc/self/statm for RSS; the CUDA queries compile only with Q4_WITH_CUDA (the allocator API
// lives in c10_cuda, present on GPU builds of LibTorch 1.13 and 2.x with the same shape: index 0
// of each stat array is the aggregate over pools).
#include "q4/trainer/runtime/memory.h"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>

#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace q4::trainer {

int64_t process_rss_bytes() {
  std::ifstream in("/proc/self/statm");
  int64_t size_pages = 0, resident_pages = 0;
  if (!(in >> size_pages >> resident_pages)) return 0;
  return resident_pages * static_cast<int64_t>(sysconf(_SC_PAGESIZE));
}

#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
namespace {
// The caching allocator's stats calls reject a device it has not initialized yet ("Invalid device
// argument"), e.g. at the probe's `start` phase: one tiny allocation initializes it.
int allocator_device_index(const c10::Device& device) {
  const int idx = device.has_index() ? device.index() : c10::cuda::current_device();
  static bool initialized = false;
  if (!initialized) {
    (void)at::empty({1}, at::TensorOptions().device(c10::Device(c10::kCUDA, idx)));
    initialized = true;
  }
  return idx;
}
}  // namespace
#endif

MemorySnapshot memory_snapshot(const c10::Device& device) {
  MemorySnapshot s;
  s.rss_bytes = process_rss_bytes();
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  if (device.is_cuda()) {
    const int idx = allocator_device_index(device);
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(idx);
    s.allocated_bytes = stats.allocated_bytes[0].current;
    s.reserved_bytes = stats.reserved_bytes[0].current;
    s.peak_allocated_bytes = stats.allocated_bytes[0].peak;
    s.peak_reserved_bytes = stats.reserved_bytes[0].peak;
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(idx));
    size_t free_b = 0, total_b = 0;
    if (cudaMemGetInfo(&free_b, &total_b) == cudaSuccess) {
      s.device_used_bytes = static_cast<int64_t>(total_b - free_b);
      s.device_total_bytes = static_cast<int64_t>(total_b);
    } else {
      (void)cudaGetLastError();
    }
  }
#else
  (void)device;
#endif
  return s;
}

void reset_peak_memory(const c10::Device& device) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(allocator_device_index(device));
  }
#else
  (void)device;
#endif
}

std::string device_name(const c10::Device& device) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  if (device.is_cuda()) {
    const int idx = device.has_index() ? device.index() : c10::cuda::current_device();
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, idx) == cudaSuccess) return prop.name;
    (void)cudaGetLastError();
    return "cuda";
  }
#endif
  return device.is_cuda() ? "cuda" : "cpu";
}

std::optional<double> device_peak_flops(const std::string& name) {
  std::string n = name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  // Dense bf16 tensor-core peaks from NVIDIA's data sheets (SXM parts; H200 has H100's SMs).
  if (n.find("h100") != std::string::npos && n.find("pcie") == std::string::npos) return 989e12;
  if (n.find("h200") != std::string::npos) return 989e12;
  return std::nullopt;
}

void synchronize_device(const c10::Device& device) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDAGuard guard(device);
    c10::cuda::device_synchronize();
  }
#else
  (void)device;
#endif
}

void synchronize_stream(const c10::Device& device) {
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  if (device.is_cuda()) {
    const int idx = device.has_index() ? device.index() : c10::cuda::current_device();
    c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(idx)).synchronize();
  }
#else
  (void)device;
#endif
}

}  // namespace q4::trainer
