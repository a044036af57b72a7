// Memory measurements for logs, the guard and the VRAM probe: process RSS from /proc/self/statm,
// the CUDA caching allocator's allocated/reserved/peak bytes (c10::cuda::CUDACachingAllocator)
// and the device's used/total bytes (cudaMemGetInfo). CUDA fields are empty on CPU devices and in
// builds without CUDA, so a CPU probe reports them as null.
#pragma once

#include <c10/core/Device.h>

#include <cstdint>
#include <optional>
#include <string>

namespace q4::trainer {

struct MemorySnapshot {
  int64_t rss_bytes = 0;                        // resident set of this process
  std::optional<int64_t> allocated_bytes;       // live tensors (allocator)
  std::optional<int64_t> reserved_bytes;        // held by the caching allocator
  std::optional<int64_t> peak_allocated_bytes;  // since the last reset_peak_memory()
  std::optional<int64_t> peak_reserved_bytes;   // since the last reset_peak_memory()
  std::optional<int64_t> device_used_bytes;     // whole device, all processes
  std::optional<int64_t> device_total_bytes;
};

int64_t process_rss_bytes();  // 0 when /proc is unavailable
MemorySnapshot memory_snapshot(const c10::Device& device);
void reset_peak_memory(const c10::Device& device);  // no-op on CPU
// "NVIDIA H100 80GB HBM3" etc.; "cpu" for CPU devices.
std::string device_name(const c10::Device& device);
// Dense bf16 peak of known devices (H100 SXM / H200: 989 TFLOP/s); empty when unknown.
std::optional<double> device_peak_flops(const std::string& name);
// Waits for queued device work (so wall times are real); no-op on CPU.
void synchronize_device(const c10::Device& device);
// Waits for the work queued on the device's current stream only (what this thread asked of it),
// not for collectives still running on the communication stream; no-op on CPU.
void synchronize_stream(const c10::Device& device);

inline double to_gib(int64_t bytes) { return static_cast<double>(bytes) / (1024.0 * 1024 * 1024); }
inline double to_gb(int64_t bytes) { return static_cast<double>(bytes) / 1e9; }

}  // namespace q4::trainer
