// Pinned host memory a GPU addresses directly; see pinned.h.
#include "q4/io/pinned.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdint>

#if Q4_WITH_CUDA
#include <cuda_runtime_api.h>

#include "q4/quant/cuda_common.h"
#endif

namespace q4::io {

at::Tensor pinned_empty(at::IntArrayRef sizes, at::ScalarType dtype) {
#if Q4_WITH_CUDA
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const size_t bytes = static_cast<size_t>(numel) * c10::elementSize(dtype);
  void* ptr = nullptr;
  if (bytes > 0) {
    const cudaError_t e = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    TORCH_CHECK(e == cudaSuccess, "cannot pin ", bytes,
                " bytes of host memory: ", cudaGetErrorString(e));
  }
  return at::from_blob(
      ptr, sizes,
      [](void* p) {
        if (p != nullptr) cudaFreeHost(p);
      },
      at::TensorOptions().dtype(dtype).device(at::kCPU));
#else
  return at::empty(sizes, at::TensorOptions().dtype(dtype));
#endif
}

at::Tensor device_alias(const at::Tensor& pinned, const at::Device& device) {
  TORCH_CHECK(pinned.device().is_cpu() && pinned.is_contiguous(),
              "device_alias: expected a contiguous tensor in pinned host memory");
  TORCH_CHECK(device.is_cuda() && device.has_index(),
              "device_alias: expected a CUDA device with an index, got ", device);
#if Q4_WITH_CUDA
  void* dev_ptr = nullptr;
  if (pinned.numel() > 0) {
    const cudaError_t e = cudaHostGetDevicePointer(&dev_ptr, pinned.data_ptr(), 0);
    TORCH_CHECK(e == cudaSuccess, "device_alias: the tensor is not in pinned host memory (",
                cudaGetErrorString(e), ")");
  }
  at::Tensor keep = pinned;
  return at::for_blob(dev_ptr, pinned.sizes())
      .strides(pinned.strides())
      .deleter([keep](void*) mutable { keep = at::Tensor(); })
      .options(pinned.options().device(device))
      .target_device(device)
      .make_tensor();
#else
  TORCH_CHECK(false, "device_alias: q4 was built without CUDA");
#endif
}

}  // namespace q4::io
