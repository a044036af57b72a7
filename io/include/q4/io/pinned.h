// Pinned host memory that a GPU addresses directly. pinned_empty() returns a CPU tensor in
// page-locked memory of exactly the requested size (LibTorch's caching host allocator rounds every
// block up to a power of two, up to twice the memory for the tens of GB an offloaded optimizer
// holds); device_alias() returns a CUDA tensor over the same bytes, which kernels read and write
// over PCIe (zero-copy: with unified addressing a pinned host pointer is also a device pointer).
// Only kernels may touch an alias; copies to and from the host go through the pinned tensor.
#pragma once

#include <ATen/core/Tensor.h>

namespace q4::io {

// Uninitialised (sizes) tensor of `dtype` in pinned host memory, freed when the last tensor
// sharing its storage goes. Without CUDA: plain host memory.
at::Tensor pinned_empty(at::IntArrayRef sizes, at::ScalarType dtype);

// A CUDA tensor on `device` aliasing `pinned` (contiguous, in pinned host memory); it keeps
// `pinned`'s storage alive. CUDA builds only.
at::Tensor device_alias(const at::Tensor& pinned, const at::Device& device);

}  // namespace q4::io
