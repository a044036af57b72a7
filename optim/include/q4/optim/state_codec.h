// Block-wise codecs for the Adam moments (the packed storage of PackedAdamW), exposed for tests
// and diagnostics. A moment of n elements is treated as a flat sequence cut into blocks of
// `moment_block_size` consecutive elements (the last one may be partial); each block stores one
// scale (fp32 absmax, or an E4M3 byte for NVFP4) and one code per element (1 byte for int8, a
// nibble for 4-bit/NVFP4, element 2j in the low nibble). Code maps and their sources:
// state_codec.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

#include "q4/optim/adamw.h"

namespace q4::optim {

enum class Moment { kFirst, kSecond };  // m (signed) / v (non-negative)

// A packed moment of `numel` elements.
struct PackedMoment {
  at::Tensor codes;   // (ceil(n/2)) uint8 for 4-bit/NVFP4, (n) uint8 for int8
  at::Tensor scales;  // (ceil(n/block)) fp32 absmax (int8, 4-bit) or uint8 E4M3 bits (NVFP4)
  int64_t numel = 0;
};

// Elements per block: int8 256, 4-bit 128, NVFP4 16 (fp32: error).
int64_t moment_block_size(StateMode mode);
// Decoded value of each code, normalized to absmax 1 (int8: 256 entries, 4-bit: 16, sorted
// ascending). NVFP4: the 16 E2M1 values (bit 3 = sign). fp32: error.
std::vector<float> moment_code_map(StateMode mode, Moment moment);
// Bytes of storage for a packed moment of n elements.
int64_t packed_moment_bytes(StateMode mode, int64_t numel);

// x: 1-D fp32 (CPU or CUDA), finite. CPU: vectorized ATen; CUDA: the fused kernels' codec.
// The second-moment maps of int8/4-bit cannot decode a positive input to 0 (zero-free map).
// Codes are the nearest map entry, except for the 4-bit moments (moment_codes_stochastic): there
// element i is rounded to one of its two neighbouring entries, unbiased, with the random
// uniform moment_uniform(sr_bits(sr_key, i), moment) (optim/src/optim_math.h; the optimizer passes
// its master rounding key), so a pack is a function of (x, sr_key).
PackedMoment pack_moment(const at::Tensor& x, StateMode mode, Moment moment, uint32_t sr_key = 0);
// True where pack_moment rounds codes stochastically (4-bit first moment).
bool moment_codes_stochastic(StateMode mode, Moment moment);
// Back to 1-D fp32 on the device of the codes.
at::Tensor unpack_moment(const PackedMoment& packed, StateMode mode, Moment moment);

// Scalar references (per-element C++ loops; small inputs, tests only), same bits as the above.
PackedMoment pack_moment_ref(const at::Tensor& x, StateMode mode, Moment moment,
                             uint32_t sr_key = 0);
at::Tensor unpack_moment_ref(const PackedMoment& packed, StateMode mode, Moment moment);

}  // namespace q4::optim
