// Small helpers shared by the optimizer tests (CPU and CUDA): exact tensor comparison, seeded
// CPU generators, and the message of the c10::Error a call throws.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstring>
#include <string>

namespace q4::optim::test {

// Same dtype, shape and bytes (CUDA tensors are copied to the host first).
inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.numel() * ac.element_size()) == 0;
}

inline at::Generator gen(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

// The message of the c10::Error that fn() throws, or "" when it throws none.
template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  }
  return std::string();
}

}  // namespace q4::optim::test
