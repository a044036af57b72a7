// The backends a kernel test runs on, ggml test-backend-ops style: one parameterised body per op
// (TEST_P on a fixture derived from BackendTest), instantiated with Q4_INSTANTIATE_BACKENDS for
// every backend, named <Suite>.<Case>/cpu and <Suite>.<Case>/cuda. The CUDA instance skips
// without a GPU (ctest labels it cuda). Each suite states the tolerance of each op against its
// reference in one table, with the reason next to it.
#pragma once

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <ostream>
#include <string>

namespace q4::test {

enum class Backend { kCpu, kCuda };

inline at::Device device_of(Backend b) {
  return b == Backend::kCuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
}

// gtest prints a parameter as its backend name.
inline void PrintTo(Backend b, std::ostream* os) { *os << (b == Backend::kCuda ? "cuda" : "cpu"); }

inline std::string backend_name(const ::testing::TestParamInfo<Backend>& info) {
  return info.param == Backend::kCuda ? "cuda" : "cpu";
}

class BackendTest : public ::testing::TestWithParam<Backend> {
 protected:
  void SetUp() override {
    if (GetParam() == Backend::kCuda && !torch::cuda::is_available()) {
      GTEST_SKIP() << "no CUDA GPU";
    }
  }
  at::Device device() const { return device_of(GetParam()); }
  bool on_cuda() const { return GetParam() == Backend::kCuda; }
};

}  // namespace q4::test

// Instantiates the TEST_Ps of `suite` (a BackendTest) on every backend.
#define Q4_INSTANTIATE_BACKENDS(suite)                                                   \
  INSTANTIATE_TEST_SUITE_P(                                                              \
      , suite, ::testing::Values(::q4::test::Backend::kCpu, ::q4::test::Backend::kCuda), \
      ::q4::test::backend_name)
