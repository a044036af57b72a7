// Gradients summed over a step's micro-batches in pinned host memory (optim.offload: all with
// grad_accum > 1; docs/design.md#training-numerics, "Masters off the GPU"): the GPU never holds the
// whole buffer. Each micro-batch gradient is added once complete and may be freed right after.
// The additions are the ones a device buffer would do, in the same order (bit-identical sums).
//
// On CUDA the traffic is DMA through a device ring (held for the run) on two side streams, and
// no host wait:
//  - the first micro-batch copies each gradient into the ring and out to its buffer;
//  - every later one copies the buffers in ahead of their gradients (host-to-device stream), in
//    the order the previous micro-batch produced them and as far ahead as the ring allows, adds
//    each gradient on the compute stream once ready, and copies the sum out (device-to-host
//    stream), so both PCIe directions run at copy-engine speed beside the backward;
//  - the last also takes each sum's norm parts (optim::gradient_sumsq_parts), so the
//    optimizer's norm pass does not read the buffers again.
// Space in the ring is reused in stream order: the stream writing a span waits (on the device)
// for the copy that last read it. A gradient over half the ring (an NVFP4 lm_head) goes through
// it in slices; in the last micro-batch, whose norm parts (or update) need the whole sum, the
// slices are added into the gradient itself, which then holds the sum.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace q4::optim {

// Device memory of the ring (counted by the memory estimate: GradientLifetime).
inline constexpr int64_t kHostAccumulationRingBytes = int64_t{512} << 20;
// With in-backward updates the last micro-batch's backward both adds and updates, so that
// memory is split for the run: this much is the optimizer's staging arena
// (PackedAdamW::set_staging_arena) and the rest the ring. A staging arena taken for the step
// would come from memory the backward is using.
inline constexpr int64_t kSharedStagingBytes = kHostAccumulationRingBytes / 2;

class HostGradientAccumulator {
 public:
  // `dtype`: of the buffers (the gradients'); `device`: the gradients' (CUDA: the ring of
  // `ring_bytes` is allocated here and kept, and the copy streams taken).
  HostGradientAccumulator(at::ScalarType dtype, const at::Device& device,
                          int64_t ring_bytes = kHostAccumulationRingBytes);
  ~HostGradientAccumulator();
  HostGradientAccumulator(const HostGradientAccumulator&) = delete;
  HostGradientAccumulator& operator=(const HostGradientAccumulator&) = delete;

  // Before each micro-batch's forward, in order; `last`: the step's last one. A first
  // micro-batch starts a new sum for every key.
  void begin_micro_batch(bool first, bool last);
  // Called with a key's complete sum (grad's sizes, on grad's device) on the current stream; it
  // may read the sum only in that stream's order and until it returns (its memory is reused).
  using Apply = std::function<void(const at::Tensor&)>;
  // Adds `grad`, the complete gradient of `key` in this micro-batch (contiguous, on the device
  // given, on the current stream), into its buffer (created, pinned, with grad's sizes on first
  // use). The gradient may be freed when this returns; in the last micro-batch one over half the
  // ring is overwritten with the sum. With `apply` (the last micro-batch only:
  // updates inside its backward), the sum goes to `apply` instead of back to host memory.
  void add(const void* key, const at::Tensor& grad, const Apply& apply = nullptr);
  // After the last micro-batch: the current stream waits for every copy, so the buffers may be
  // read in its order.
  void finish();

  // Keys this step added to but the current micro-batch did not (after an applying last
  // micro-batch: sums `apply` never saw, which sum() gives).
  std::vector<const void*> unapplied() const;
  // Whether `key` has a buffer (it was added in some step).
  bool holds(const void* key) const { return buffers_.count(key) > 0; }
  // The step's sum of `key` in pinned host memory; zeroed when no micro-batch of this step
  // added to it. Valid until the next step's first add.
  const at::Tensor& sum(const void* key);
  // The norm parts of `key`'s sum taken in the last micro-batch (undefined where none were),
  // given once.
  at::Tensor take_sumsq_parts(const void* key);

 private:
  struct Buffer {
    at::Tensor pinned;                    // the running sum
    std::unique_ptr<c10::Event> written;  // the last copy into `pinned` (CUDA)
  };
  // Elements [offset, offset + numel) of a key's buffer: what one span of the ring holds.
  struct Piece {
    const void* key = nullptr;
    int64_t offset = 0, numel = 0;
  };
  // A span of the ring [begin, end): fetched (pieces_[piece] copied in, `event` marking the
  // copy) or released (piece -1; `event` marking the span's last reader).
  struct Span {
    int64_t piece = -1;
    int64_t begin = 0, end = 0;
    std::unique_ptr<c10::Event> event;
  };

  Buffer& buffer(const void* key, const at::Tensor& grad);  // created on first use
  // A key's pieces: the whole buffer, or slices of a quarter ring for one over half the ring.
  std::vector<Piece> pieces_of(const void* key, int64_t numel) const;
  // The next `bytes` of the ring for a writer on `writer` (which waits for the released spans
  // it overlaps), or -1 while fetched spans occupy them.
  int64_t place(int64_t bytes, const c10::Stream& writer);
  // place(), giving up what was fetched ahead when the ring is full of it.
  int64_t place_now(int64_t bytes, const c10::Stream& writer);
  at::Tensor ring_view(int64_t at, const at::Tensor& like) const;
  // Copies in pieces of this micro-batch's expected order while the ring has room.
  void prefetch();
  // The span holding `piece` of `b`, copied in now when it was not fetched ahead.
  Span fetch(const Piece& piece, const Buffer& b);
  void release(Span s);
  // Gives up every fetched span; their pieces are fetched again, in order.
  void release_fetched();
  // The last micro-batch's addition for a key over half the ring: its norm parts (or update)
  // need the whole sum on the device, added into `g` slice by slice.
  void add_whole(const void* key, Buffer& b, const at::Tensor& g, const Apply& apply);

  at::ScalarType dtype_;
  int64_t ring_bytes_;
  std::unordered_map<const void*, Buffer> buffers_;
  std::unordered_set<const void*> started_;   // added to in this step
  std::unordered_set<const void*> consumed_;  // added to in this micro-batch
  std::unordered_map<const void*, at::Tensor> sumsq_parts_;
  std::vector<const void*> next_order_;  // CUDA keys as this micro-batch added them
  bool last_ = false;
  // CUDA
  std::optional<c10::Stream> in_, out_;  // host-to-device and device-to-host copies
  at::Tensor ring_;                      // (ring_bytes_) uint8
  int64_t head_ = 0;                     // where the next span starts
  std::vector<Piece> pieces_;            // this micro-batch's expected ring uses, in order
  size_t next_fetch_ = 0;                // the next of pieces_ to copy in
  std::deque<Span> fetched_;             // in pieces_ order
  std::vector<Span> released_;
};

}  // namespace q4::optim
