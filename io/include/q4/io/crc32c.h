// CRC32C (Castagnoli, reflected polynomial 0x82F63B78), the checksum of checkpoint files.
// A table-driven software implementation (slicing by 8): checkpoints are written once per
// checkpoint_every steps, so ~1-2 GB/s is plenty; Debian 12 ships no libcrc32c. Checked against
// the published test vectors (RFC 3720 B.4, "123456789" -> 0xE3069283).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace q4::io {

// Continues `crc` (the value returned for the bytes before; 0 to start) over `data`.
uint32_t crc32c(const void* data, size_t nbytes, uint32_t crc = 0);

// CRC32C of a whole file; throws naming it when it cannot be read.
uint32_t crc32c_file(const std::string& path);

}  // namespace q4::io
