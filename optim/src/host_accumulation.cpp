// Gradients summed in pinned host memory; see host_accumulation.h.
#include "q4/optim/host_accumulation.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>

#include "q4/io/pinned.h"
#include "q4/optim/adamw.h"

namespace q4::optim {
namespace {

constexpr int64_t kSpanAlign = 512;  // span alignment in the ring (any dtype's vector loads)

int64_t round_to_span(int64_t n) { return (n + kSpanAlign - 1) / kSpanAlign * kSpanAlign; }

std::unique_ptr<c10::Event> record_event_on(const c10::Stream& s) {
  auto e = std::make_unique<c10::Event>(s.device_type());
  e->record(s);
  return e;
}

c10::Stream compute_stream_of(const at::Tensor& t) {
  const c10::impl::VirtualGuardImpl impl(t.device().type());
  return impl.getStream(t.device());
}

}  // namespace

HostGradientAccumulator::HostGradientAccumulator(at::ScalarType dtype, const at::Device& device,
                                                 int64_t ring_bytes)
    : dtype_(dtype), ring_bytes_(ring_bytes) {
  TORCH_CHECK(ring_bytes_ >= 8 * kSpanAlign, "HostGradientAccumulator: ring of ", ring_bytes_,
              " bytes");
  if (!device.is_cuda()) return;
  const c10::impl::VirtualGuardImpl impl(device.type());
  in_ = impl.getStreamFromGlobalPool(device);
  out_ = impl.getStreamFromGlobalPool(device);
  // From the compute stream's pool; the copy streams start after what it did so far, which is
  // the last use of that memory.
  ring_ = at::empty({ring_bytes_}, at::TensorOptions().dtype(at::kByte).device(device));
  const auto ready = record_event_on(impl.getStream(device));
  ready->block(*in_);
  ready->block(*out_);
}

HostGradientAccumulator::~HostGradientAccumulator() = default;

std::vector<HostGradientAccumulator::Piece> HostGradientAccumulator::pieces_of(
    const void* key, int64_t numel) const {
  const auto size = static_cast<int64_t>(c10::elementSize(dtype_));
  if (numel * size <= ring_bytes_ / 2) return {Piece{key, 0, numel}};
  const int64_t slice = ring_bytes_ / 4 / kSpanAlign * kSpanAlign / size;
  std::vector<Piece> out;
  for (int64_t at = 0; at < numel; at += slice) {
    out.push_back(Piece{key, at, std::min(slice, numel - at)});
  }
  return out;
}

void HostGradientAccumulator::begin_micro_batch(bool first, bool last) {
  last_ = last;
  consumed_.clear();
  if (first) {
    started_.clear();
    sumsq_parts_.clear();
    next_order_.clear();
  }
  release_fetched();
  pieces_.clear();
  next_fetch_ = 0;
  // The previous micro-batch's order (none for a first one); the last micro-batch adds a key
  // over half the ring whole.
  for (const void* key : next_order_) {
    const int64_t n = buffers_.at(key).pinned.numel();
    if (last_ && pieces_of(key, n).size() > 1) continue;
    for (const Piece& pc : pieces_of(key, n)) pieces_.push_back(pc);
  }
  next_order_.clear();
  if (ring_.defined()) prefetch();  // overlaps this micro-batch's forward
}

HostGradientAccumulator::Buffer& HostGradientAccumulator::buffer(const void* key,
                                                                 const at::Tensor& grad) {
  auto it = buffers_.find(key);
  if (it == buffers_.end()) {
    Buffer b;
    b.pinned = io::pinned_empty(grad.sizes(), dtype_);
    it = buffers_.emplace(key, std::move(b)).first;
  }
  TORCH_CHECK(it->second.pinned.numel() == grad.numel(), "HostGradientAccumulator: a gradient of ",
              grad.numel(), " elements for a buffer of ", it->second.pinned.numel());
  return it->second;
}

at::Tensor HostGradientAccumulator::ring_view(int64_t at, const at::Tensor& like) const {
  return ring_.narrow(0, at, static_cast<int64_t>(like.nbytes()))
      .view(like.scalar_type())
      .view(like.sizes());
}

int64_t HostGradientAccumulator::place(int64_t bytes, const c10::Stream& writer) {
  bytes = round_to_span(bytes);
  const int64_t b = head_ + bytes > ring_bytes_ ? 0 : head_;
  const int64_t e = b + bytes;
  for (const Span& s : fetched_) {
    if (s.begin < e && b < s.end) return -1;
  }
  // Released spans under the new one: the writer waits for their last reader. A span only
  // partly covered stays listed, so that a later writer of its rest (maybe on another stream)
  // waits too; finished ones are dropped.
  for (auto it = released_.begin(); it != released_.end();) {
    if (it->begin < e && b < it->end) it->event->block(writer);
    const bool covered = b <= it->begin && it->end <= e;
    it = covered || it->event->query() ? released_.erase(it) : std::next(it);
  }
  head_ = e;
  return b;
}

int64_t HostGradientAccumulator::place_now(int64_t bytes, const c10::Stream& writer) {
  int64_t at = place(bytes, writer);
  if (at < 0) {  // a key out of the expected order: what was fetched ahead gives way
    release_fetched();
    at = place(bytes, writer);
  }
  return at;
}

void HostGradientAccumulator::release(Span s) {
  s.piece = -1;
  released_.push_back(std::move(s));
}

void HostGradientAccumulator::release_fetched() {
  if (fetched_.empty()) return;
  next_fetch_ = std::min(next_fetch_, static_cast<size_t>(fetched_.front().piece));
  for (Span& s : fetched_) release(std::move(s));
  fetched_.clear();
}

void HostGradientAccumulator::prefetch() {
  for (; next_fetch_ < pieces_.size(); ++next_fetch_) {
    const Piece& pc = pieces_[next_fetch_];
    if (consumed_.count(pc.key) > 0) continue;  // already added (out of order)
    const Buffer& b = buffers_.at(pc.key);
    const at::Tensor host = b.pinned.view({-1}).narrow(0, pc.offset, pc.numel);
    const int64_t at = place(static_cast<int64_t>(host.nbytes()), *in_);
    if (at < 0) return;      // the ring is full of fetched pieces: more after the next add
    b.written->block(*in_);  // the previous micro-batch's sum is out
    {
      const c10::StreamGuard on_in(*in_);
      ring_view(at, host).copy_(host, /*non_blocking=*/true);
    }
    fetched_.push_back(Span{static_cast<int64_t>(next_fetch_), at,
                            at + round_to_span(static_cast<int64_t>(host.nbytes())),
                            record_event_on(*in_)});
  }
}

HostGradientAccumulator::Span HostGradientAccumulator::fetch(const Piece& piece, const Buffer& b) {
  const auto it = std::find_if(fetched_.begin(), fetched_.end(), [&](const Span& s) {
    const Piece& q = pieces_[static_cast<size_t>(s.piece)];
    return q.key == piece.key && q.offset == piece.offset;
  });
  if (it != fetched_.end()) {
    // Fetched pieces ahead of it got no gradient this time: their space goes back.
    while (fetched_.begin() != it) {
      release(std::move(fetched_.front()));
      fetched_.pop_front();
    }
    Span s = std::move(fetched_.front());
    fetched_.pop_front();
    return s;
  }
  const at::Tensor host = b.pinned.view({-1}).narrow(0, piece.offset, piece.numel);
  const int64_t bytes = static_cast<int64_t>(host.nbytes());
  const int64_t at = place_now(bytes, *in_);
  b.written->block(*in_);
  {
    const c10::StreamGuard on_in(*in_);
    ring_view(at, host).copy_(host, /*non_blocking=*/true);
  }
  return Span{-1, at, at + round_to_span(bytes), record_event_on(*in_)};
}

void HostGradientAccumulator::add(const void* key, const at::Tensor& grad, const Apply& apply) {
  Buffer& b = buffer(key, grad);
  at::NoGradGuard no_grad;
  const bool first = started_.insert(key).second;
  if (apply && first) {  // nothing summed before: the gradient is the sum
    if (grad.is_cuda()) next_order_.push_back(key);
    consumed_.insert(key);
    apply(grad);
    return;
  }
  if (!grad.is_cuda()) {
    const at::Tensor g = grad.view(b.pinned.sizes());
    first ? b.pinned.copy_(g) : b.pinned.add_(g);
    consumed_.insert(key);
    if (apply) apply(b.pinned.view(grad.sizes()));
    return;
  }
  TORCH_CHECK(ring_.defined() && grad.device() == ring_.device(), "HostGradientAccumulator: a ",
              grad.device(), " gradient, set up for ", ring_.defined() ? ring_.device() : at::kCPU);
  TORCH_CHECK(grad.scalar_type() == dtype_, "HostGradientAccumulator: a ", grad.scalar_type(),
              " gradient for a ", dtype_, " buffer");
  next_order_.push_back(key);
  if (!b.written) b.written = std::make_unique<c10::Event>(grad.device().type());
  const at::Tensor g = grad.view({-1}), host = b.pinned.view({-1});
  const std::vector<Piece> pieces = pieces_of(key, g.numel());
  if (last_ && !first && pieces.size() > 1) {
    add_whole(key, b, g, apply);
    consumed_.insert(key);
    return;
  }
  TORCH_CHECK(!apply || last_,
              "HostGradientAccumulator: a sum applied before the last micro-batch");
  const c10::Stream compute = compute_stream_of(g);
  for (const Piece& pc : pieces) {
    const at::Tensor gs = g.narrow(0, pc.offset, pc.numel);
    Span s;
    if (first) {
      // Copied into the ring on the compute stream (device bandwidth), so the gradient's memory
      // is the compute stream's alone and free once this returns.
      const int64_t at = place_now(static_cast<int64_t>(gs.nbytes()), compute);
      s = Span{-1, at, at + round_to_span(static_cast<int64_t>(gs.nbytes())), nullptr};
      ring_view(at, gs).copy_(gs);
    } else {
      s = fetch(pc, b);
      s.event->block(compute);
      // The buffer as the previous micro-batch left it, plus this gradient: the same addition
      // a device buffer would do.
      const at::Tensor sum = ring_view(s.begin, gs);
      sum.add_(gs);
      if (apply) {  // one piece here: the sum is used where it is, not written out
        apply(sum.view(grad.sizes()));
        s.event = record_event_on(compute);
        release(std::move(s));
        prefetch();
        continue;
      }
      if (last_) sumsq_parts_[key] = gradient_sumsq_parts(sum);  // one piece here
    }
    record_event_on(compute)->block(*out_);
    {
      const c10::StreamGuard on_out(*out_);
      host.narrow(0, pc.offset, pc.numel).copy_(ring_view(s.begin, gs), /*non_blocking=*/true);
    }
    s.event = record_event_on(*out_);
    release(std::move(s));
    prefetch();
  }
  b.written->record(*out_);
  consumed_.insert(key);
}

void HostGradientAccumulator::add_whole(const void* key, Buffer& b, const at::Tensor& g,
                                        const Apply& apply) {
  // The buffer comes in through the ring, slice by slice as any other, and is added into the
  // gradient itself (the same sums: addition commutes), which is this micro-batch's own and is
  // freed after: the whole sum takes no device memory of its own.
  const c10::Stream compute = compute_stream_of(g);
  for (const Piece& pc : pieces_of(key, g.numel())) {
    Span s = fetch(pc, b);
    s.event->block(compute);
    const at::Tensor gs = g.narrow(0, pc.offset, pc.numel);
    gs.add_(ring_view(s.begin, gs));
    s.event = record_event_on(compute);
    release(std::move(s));
    prefetch();
  }
  if (apply) {  // used on the compute stream, then freed in its order
    apply(g.view(b.pinned.sizes()));
    return;
  }
  sumsq_parts_[key] = gradient_sumsq_parts(g);
  record_event_on(compute)->block(*out_);
  {
    const c10::StreamGuard on_out(*out_);
    b.pinned.view({-1}).copy_(g, /*non_blocking=*/true);
  }
  b.written->record(*out_);
  // The compute stream goes on once the sum is out, so the gradient's memory is free in its
  // order.
  record_event_on(*out_)->block(compute);
}

void HostGradientAccumulator::finish() {
  if (!in_) return;
  release_fetched();
  const c10::impl::VirtualGuardImpl impl(in_->device_type());
  const c10::Stream compute = impl.getStream(in_->device());
  for (const c10::Stream& s : {*in_, *out_}) record_event_on(s)->block(compute);
}

std::vector<const void*> HostGradientAccumulator::unapplied() const {
  std::vector<const void*> out;
  for (const void* key : started_) {
    if (consumed_.count(key) == 0) out.push_back(key);
  }
  return out;
}

const at::Tensor& HostGradientAccumulator::sum(const void* key) {
  Buffer& b = buffers_.at(key);
  if (started_.count(key) == 0) b.pinned.zero_();  // no micro-batch of this step reached it
  return b.pinned;
}

at::Tensor HostGradientAccumulator::take_sumsq_parts(const void* key) {
  const auto it = sumsq_parts_.find(key);
  if (it == sumsq_parts_.end()) return {};
  at::Tensor part = std::move(it->second);
  sumsq_parts_.erase(it);
  return part;
}

}  // namespace q4::optim
