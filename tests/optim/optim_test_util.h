// Small helpers shared by the optimizer tests (CPU and CUDA): exact tensor comparison, seeded
// CPU generators, and error_of from the support library.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <cstdint>
#include <cstring>
#include <string>

#include "q4/optim/adamw.h"
#include "q4/test/error_of.h"

namespace q4::optim::test {

// Same dtype, shape and bytes (CUDA tensors are copied to the host first).
inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.numel() * ac.element_size()) == 0;
}

inline at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// Every state mode, and the block-packed ones.
inline constexpr StateMode kAllModes[] = {StateMode::kFp32, StateMode::kInt8, StateMode::k4Bit,
                                          StateMode::kNvfp4};
inline constexpr StateMode kPacked[] = {StateMode::kInt8, StateMode::k4Bit, StateMode::kNvfp4};

using q4::test::error_of;

}  // namespace q4::optim::test
