// Minimal reader of the .dat container (DESIGN.md) for the quant tests: only what
// nvfp4_golden.dat needs (elem 6 fp32, 0/100 uint8, 101 uint8). q4_quant must not depend on
// q4_model (whose DatReader is the real one), so the tests carry this small local copy.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace q4::quant::testing {

// All entries of a small .dat file, keyed by name; tensors are CPU, contiguous.
inline std::map<std::string, at::Tensor> read_small_dat(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + path);
  const std::vector<uint8_t> buf((std::istreambuf_iterator<char>(in)),
                                 std::istreambuf_iterator<char>());
  size_t pos = 0;
  auto uleb = [&]() {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      if (pos >= buf.size() || shift > 63) throw std::runtime_error(path + ": truncated uleb128");
      const uint8_t b = buf[pos++];
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
  };
  std::map<std::string, at::Tensor> out;
  const uint64_t count = uleb();
  for (uint64_t e = 0; e < count; ++e) {
    const uint64_t keylen = uleb();
    if (pos + keylen > buf.size()) throw std::runtime_error(path + ": truncated key");
    const std::string key(reinterpret_cast<const char*>(buf.data() + pos), keylen);
    pos += keylen;
    const uint64_t elem = uleb();
    const uint64_t ndim = uleb();
    std::vector<int64_t> dims;
    int64_t numel = 1;
    for (uint64_t d = 0; d < ndim; ++d) {
      dims.push_back(static_cast<int64_t>(uleb()));
      numel *= dims.back();
    }
    at::ScalarType type;
    int64_t elem_bytes;
    if (elem == 6) {
      type = at::kFloat;
      elem_bytes = 4;
    } else if (elem == 0 || elem == 100 || elem == 101) {
      type = at::kByte;
      elem_bytes = 1;
    } else {
      throw std::runtime_error(path + ": entry " + key + " has unsupported elem type " +
                               std::to_string(elem));
    }
    const size_t bytes = static_cast<size_t>(numel * elem_bytes);
    if (pos + bytes > buf.size()) throw std::runtime_error(path + ": truncated payload of " + key);
    at::Tensor t = at::empty(dims, type);
    std::memcpy(t.data_ptr(), buf.data() + pos, bytes);  // little-endian host
    pos += bytes;
    out[key] = t;
  }
  return out;
}

// Bitwise equality of two tensors of one dtype (distinguishes -0.0 from +0.0).
inline bool bit_equal(const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() != b.scalar_type() || a.sizes() != b.sizes()) return false;
  const at::Tensor ac = a.cpu().contiguous(), bc = b.cpu().contiguous();
  return std::memcmp(ac.data_ptr(), bc.data_ptr(), ac.numel() * ac.element_size()) == 0;
}

}  // namespace q4::quant::testing
