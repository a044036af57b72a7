// --profile-trace: a Kineto (PyTorch profiler) trace of a few training steps, CPU ops and CUDA
// kernels, saved as Chrome-trace JSON for chrome://tracing, Perfetto or a script that sums
// kernel time by name (scripts/bench/kernel_table.py). LibTorch 2.x only.
#include "q4/trainer/runtime/profile.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/version.h>

#if TORCH_VERSION_MAJOR >= 2
#include <torch/csrc/autograd/profiler_kineto.h>
#endif

namespace q4::trainer {

#if TORCH_VERSION_MAJOR >= 2
namespace {
namespace prof = torch::profiler::impl;
prof::ProfilerConfig trace_config() {
  return prof::ProfilerConfig(prof::ProfilerState::KINETO, /*report_input_shapes=*/false,
                              /*profile_memory=*/false);
}
std::set<prof::ActivityType> trace_activities(bool cuda) {
  std::set<prof::ActivityType> a{prof::ActivityType::CPU};
  if (cuda) a.insert(prof::ActivityType::CUDA);
  return a;
}
}  // namespace

bool profiler_available() { return true; }

void profiler_start(bool cuda) {
  torch::autograd::profiler::prepareProfiler(trace_config(), trace_activities(cuda));
  torch::autograd::profiler::enableProfiler(trace_config(), trace_activities(cuda));
}

void profiler_stop_and_save(const std::string& path) {
  auto result = torch::autograd::profiler::disableProfiler();
  TORCH_CHECK(result != nullptr, "profiler: no result");
  result->save(path);
}
#else
bool profiler_available() { return false; }
void profiler_start(bool) { TORCH_CHECK(false, "--profile-trace needs LibTorch 2.x"); }
void profiler_stop_and_save(const std::string&) {}
#endif

}  // namespace q4::trainer
