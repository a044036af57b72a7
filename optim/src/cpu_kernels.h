// Private CPU building blocks of the optimizer: the scratch arena every chunk-sized temporary
// comes from (its high-water mark is the step's temporary memory), and the vectorized ATen
// block codecs for packed moments. All arithmetic is element-wise fp32 with one rounding per
// operation, in the order the CUDA kernels use (docs/optim.md "Arithmetic").
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <cstdint>

#include "optim_math.h"
#include "q4/optim/adamw.h"
#include "q4/optim/state_codec.h"

namespace q4::optim::detail {

// out[i] = the number of entries of the ascending fp32 `sorted` below y[i] (right = false:
// #{j : !(sorted[j] >= y)}) or not above it (right = true: #{j : !(y < sorted[j])}), int32; equal
// to at::bucketize(y, sorted, out_int32, right) for every y, NaN and infinities included, in a
// branchless search (bucketize's branchy one was most of a CPU step's moment encoding).
// y, sorted and out are contiguous CPU tensors; out has y's size.
void count_sorted_below(const at::Tensor& y, const at::Tensor& sorted, at::Tensor& out, bool right);

// Named scratch slots; a slot keeps one 1-D buffer that grows to the largest request.
enum Slot : int {
  kSlotGrad = 0,   // fp32 g
  kSlotM,          // fp32 m (packed modes)
  kSlotV,          // fp32 v (packed modes)
  kSlotTmp,        // fp32 temporary
  kSlotTmp2,       // fp32 temporary
  kSlotMaster,     // fp32 master
  kSlotI32,        // int32 codes
  kSlotI32b,       // int32 codes / packing
  kSlotI64,        // int64 hash state
  kSlotI64b,       // int64 hash temporary
  kSlotHalf,       // 16-bit master candidate
  kSlotHalf2,      // 16-bit neighbour
  kSlotMask,       // bool
  kSlotBlockF,     // fp32 per-block scale
  kSlotBlockF2,    // fp32 per-block scale temporary
  kSlotBlockI,     // int32 per-block
  kSlotBlockI2,    // int32 per-block
  kSlotBlockMask,  // bool per-block
  kNumSlots,
};

class Scratch {
 public:
  // A contiguous 1-D tensor of n elements of `dtype` (contents unspecified).
  at::Tensor get(int slot, at::ScalarType dtype, int64_t n);
  int64_t peak_bytes() const { return peak_bytes_; }
  int64_t current_bytes() const { return current_bytes_; }
  void release();

 private:
  std::array<at::Tensor, kNumSlots> buf_;
  int64_t current_bytes_ = 0;
  int64_t peak_bytes_ = 0;
};

// Tables of one map on the CPU: values (size) and midpoints (size - 1), fp32.
struct MapTensors {
  at::Tensor value;
  at::Tensor mid;
  at::Tensor sr_value;  // (size) fp32, CodeMap::sr_value (stochastic maps)
  at::Tensor inv_gap;   // (size - 1) fp32, CodeMap::inv_gap (stochastic maps)
};
const MapTensors& cpu_map(StateMode mode, Moment moment);
const CodeMap& host_map(StateMode mode, Moment moment);
at::Tensor e4m3_decode_table_cpu();  // (256) fp32
at::Tensor e2m1_decode_table_cpu();  // (16) fp32

// Decodes elements [start, start + n) of a packed moment into x (npad fp32, npad = n rounded up
// to the block size; start a multiple of the block size). The padding tail of x is set to 0.
void decode_chunk_cpu(const at::Tensor& codes, const at::Tensor& scales, StateMode mode,
                      Moment moment, int64_t start, int64_t n, const at::Tensor& x, Scratch& s);
// Encodes x (npad fp32, tail beyond n zero) into elements [start, start + n) of a packed moment.
// Stochastic maps (CodeMap::stochastic) draw element i's uniform from
// moment_uniform(sr_bits(sr_key, start + i), moment).
// Uses the scratch slots kSlotTmp, kSlotTmp2, kSlotGrad, the code/packing and block slots, and
// (stochastic maps) kSlotMask and the two int64 hash slots.
void encode_chunk_cpu(const at::Tensor& x, StateMode mode, Moment moment, int64_t start, int64_t n,
                      const at::Tensor& codes, const at::Tensor& scales, uint32_t sr_key,
                      Scratch& s);

// u[i] = moment_uniform(sr_bits(key, first_index + i), moment) for i < n (u: at least n fp32).
// Uses the scratch slots kSlotI64 and kSlotI64b.
void moment_uniform_cpu(uint32_t key, int64_t first_index, int64_t n, int moment,
                        const at::Tensor& u, Scratch& s);

// Writes p (n fp32, clobbered) into out (n, fp16/bf16) with stochastic rounding keyed by `key`
// (sr_round_fp16/bf16 of optim_math.h); element i of p has flat index first_index + i. Same bits
// as the CUDA kernels. Uses the slots kSlotI64, kSlotI64b, kSlotI32, and for fp16 kSlotTmp,
// kSlotMask and kSlotHalf.
void stochastic_round_cpu(const at::Tensor& p, const at::Tensor& out, uint32_t key,
                          int64_t first_index, Scratch& s);

}  // namespace q4::optim::detail
