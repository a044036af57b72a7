// The host heap of a process that computes on the CPU (docs/performance.md#cpu-runs). glibc serves
// a block above its mmap threshold (32 MiB at most by default) with a fresh mmap and unmaps it on
// free, so every step's logits chunk, its gradient and the optimizer's temporaries come back as
// new pages that the kernel faults in and zeroes, step after step: on a tiny model with the
// 151,936-token vocabulary that was three quarters of the step. keep_freed_host_blocks() raises
// both the mmap and the trim threshold so that blocks of up to kKeptHostBlockBytes are served
// from the heap and stay there for reuse once freed. The price is a resident set that stays at
// the run's peak, which a training process has anyway; GPU runs leave the heap as it is.
#pragma once

#include <cstddef>

namespace q4::io {

inline constexpr size_t kKeptHostBlockBytes = size_t{1} << 30;  // 1 GiB

// Sets the thresholds (idempotent). Returns whether the C library took them (false without
// glibc's mallopt, where nothing changes).
bool keep_freed_host_blocks();

}  // namespace q4::io
