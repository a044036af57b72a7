// Hand-assembled .dat bytes for the container tests: the encoding of docs/design.md written out
// independently of io/src/dat_file.cpp, so the reader is tested against bytes it did not write
// (and can be given bytes no writer would produce: the corrupt-file tests).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace q4::io::dat_bytes {

using Bytes = std::vector<uint8_t>;

inline void put_uleb(Bytes& b, uint64_t v) {
  do {
    uint8_t c = v & 0x7F;
    v >>= 7;
    if (v) c |= 0x80;
    b.push_back(c);
  } while (v);
}

inline void put_header(Bytes& b, const std::string& key, uint64_t type,
                       const std::vector<uint64_t>& dims) {
  put_uleb(b, key.size());
  b.insert(b.end(), key.begin(), key.end());
  put_uleb(b, type);
  put_uleb(b, dims.size());
  for (uint64_t d : dims) put_uleb(b, d);
}

}  // namespace q4::io::dat_bytes
