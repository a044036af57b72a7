// The golden fixtures (tests/fixtures/*.dat) for the quant tests, read through the real .dat
// reader (q4_io's DatReader), and bitwise tensor equality.
#pragma once

#include <ATen/ATen.h>

#include <cstring>
#include <map>
#include <string>

#include "q4/io/dat_file.h"

namespace q4::quant::testing {

// All entries of a small .dat file, keyed by name; tensors are CPU, contiguous, of the entries'
// storage dtypes (fp32 for elem 6, uint8 for elem 0/100/101).
inline std::map<std::string, at::Tensor> read_small_dat(const std::string& path) {
  return q4::io::DatReader(path).load_all();
}

// Bitwise equality of two tensors of one dtype (distinguishes -0.0 from +0.0).
inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.numel() * ac.element_size()) == 0;
}

}  // namespace q4::quant::testing
