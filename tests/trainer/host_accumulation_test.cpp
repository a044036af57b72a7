// Gradients summed in pinned host memory equal a device buffer's sums, bit for bit: over several
// micro-batches and steps, with keys missing from some micro-batches, the order of the keys
// changing, gradients freed as soon as they are handed over, and (CUDA) a ring small enough that
// every span is reused, some gradients too large for it, and the norm parts of the last
// micro-batch equal to those of the reference sum.
#include "q4/trainer/host_accumulation.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <map>
#include <vector>

#include "q4/optim/adamw.h"

using q4::trainer::HostGradientAccumulator;

namespace {

// Sizes (elements) of the keys: with a 64 KiB ring of bf16, 20,000 elements (40 KB) are over
// half the ring and go through their own staging copy; the others share the ring.
const std::vector<int64_t> kSizes = {1000, 5000, 15000, 20000, 3, 7000, 12000, 2048, 16384, 900};

// Micro-batch `m` of step `step`: which keys get a gradient, in which order. Key 4 is missing
// from the second micro-batch and key 7 from the first (its sum starts in the second); the third
// reverses the order.
std::vector<int> keys_of(int step, int m) {
  std::vector<int> k;
  for (int i = 0; i < static_cast<int>(kSizes.size()); ++i) {
    if ((m == 1 && i == 4) || (m == 0 && i == 7)) continue;
    if (step == 1 && i == 9) continue;  // a key no micro-batch of step 1 reaches: zeros
    k.push_back(i);
  }
  if (m == 2) std::reverse(k.begin(), k.end());
  return k;
}

at::Tensor gradient(int step, int m, int key, const at::Device& device) {
  const auto gen = at::detail::createCPUGenerator(1000 * step + 100 * m + key);
  return at::randn({kSizes[static_cast<size_t>(key)]}, gen, at::kFloat)
      .to(at::kBFloat16)
      .to(device);
}

void run_steps(const at::Device& device, int64_t ring_bytes) {
  HostGradientAccumulator acc(at::kBFloat16, device, ring_bytes);
  const int micro = 4;
  std::vector<int> ids(kSizes.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
  const auto key = [&](int i) { return static_cast<const void*>(&ids[static_cast<size_t>(i)]); };
  for (int step = 0; step < 2; ++step) {
    std::map<int, at::Tensor> ref;  // the device buffer's sums
    for (int m = 0; m < micro; ++m) {
      acc.begin_micro_batch(m == 0, m + 1 == micro);
      for (const int i : keys_of(step, m)) {
        {
          at::Tensor g = gradient(step, m, i, device);
          auto it = ref.find(i);
          if (it == ref.end()) {
            ref.emplace(i, g.clone());
          } else {
            it->second.add_(g);
          }
          acc.add(key(i), g);
        }  // freed: the allocator may hand its memory to the next gradient at once
        at::empty({1 << 16}, at::TensorOptions().dtype(at::kFloat).device(device)).fill_(NAN);
      }
    }
    acc.finish();
    if (device.is_cuda()) torch::cuda::synchronize();
    for (int i = 0; i < static_cast<int>(kSizes.size()); ++i) {
      ASSERT_TRUE(acc.holds(key(i))) << i;
      const at::Tensor& sum = acc.sum(key(i));
      const auto it = ref.find(i);
      const at::Tensor want = it == ref.end() ? at::zeros_like(sum) : it->second.cpu();
      EXPECT_TRUE(at::equal(sum, want)) << "step " << step << " key " << i;
      const at::Tensor parts = acc.take_sumsq_parts(key(i));
      // Norm parts: CUDA, for keys the last micro-batch added to an existing sum.
      const bool added_last = device.is_cuda() && it != ref.end();
      ASSERT_EQ(parts.defined(), added_last) << "step " << step << " key " << i;
      if (added_last) {
        EXPECT_TRUE(at::equal(parts.cpu(), q4::optim::gradient_sumsq_parts(it->second).cpu()))
            << "step " << step << " key " << i;
      }
    }
  }
}

}  // namespace

TEST(HostAccumulation, SumsEqualAnInPlaceBuffer) { run_steps(at::kCPU, int64_t{64} << 10); }

TEST(HostAccumulationCuda, SumsEqualADeviceBufferBitExact) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  for (const int64_t ring : {int64_t{64} << 10, int64_t{1} << 20}) {
    SCOPED_TRACE("ring " + std::to_string(ring));
    run_steps(at::Device(at::kCUDA, 0), ring);
  }
}
