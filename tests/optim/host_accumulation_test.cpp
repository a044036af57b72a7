// Gradients summed in pinned host memory equal a device buffer's sums, bit for bit: over several
// micro-batches and steps, with keys missing from some micro-batches, the order of the keys
// changing, gradients freed as soon as they are handed over, and (CUDA) a ring small enough that
// every span is reused, some gradients too large for it, and the norm parts of the last
// micro-batch equal to those of the reference sum. Sums handed over in the last micro-batch
// (updates inside its backward) are the same bits.
#include "q4/optim/host_accumulation.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <algorithm>
#include <map>
#include <vector>

#include "q4/optim/adamw.h"

using q4::optim::HostGradientAccumulator;

namespace {

// Sizes (elements) of the keys: with a 64 KiB ring of bf16, 20,000 elements (40 KB) are over
// half the ring and go through their own staging copy; the others share the ring.
const std::vector<int64_t> kSizes = {1000, 5000, 15000, 20000, 3, 7000, 12000, 2048, 16384, 900};

// Micro-batch `m` of step `step`: which keys get a gradient, in which order. Key 4 is missing
// from the second micro-batch, key 7 from the first (its sum starts in the second) and key 5
// from the last; the third reverses the order.
constexpr int kMicro = 4;
std::vector<int> keys_of(int step, int m) {
  std::vector<int> k;
  for (int i = 0; i < static_cast<int>(kSizes.size()); ++i) {
    if ((m == 1 && i == 4) || (m == 0 && i == 7) || (m == kMicro - 1 && i == 5)) continue;
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

// `apply_last`: the last micro-batch hands each sum over (updates inside its backward) instead of
// writing it back.
void run_steps(const at::Device& device, int64_t ring_bytes, bool apply_last) {
  HostGradientAccumulator acc(at::kBFloat16, device, ring_bytes);
  const int micro = kMicro;
  std::vector<int> ids(kSizes.size());
  for (size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<int>(i);
  const auto key = [&](int i) { return static_cast<const void*>(&ids[static_cast<size_t>(i)]); };
  for (int step = 0; step < 2; ++step) {
    std::map<int, at::Tensor> ref;      // the device buffer's sums
    std::map<int, at::Tensor> applied;  // what the last micro-batch handed over
    for (int m = 0; m < micro; ++m) {
      const bool last = m + 1 == micro;
      acc.begin_micro_batch(m == 0, last);
      for (const int i : keys_of(step, m)) {
        {
          at::Tensor g = gradient(step, m, i, device);
          auto it = ref.find(i);
          if (it == ref.end()) {
            ref.emplace(i, g.clone());
          } else {
            it->second.add_(g);
          }
          if (apply_last && last) {
            acc.add(key(i), g, [&](const at::Tensor& sum) {
              EXPECT_EQ(sum.sizes(), g.sizes());
              applied[i] = sum.clone();  // read in the current stream's order, as allowed
            });
          } else {
            acc.add(key(i), g);
          }
        }  // freed: the allocator may hand its memory to the next gradient at once
        at::empty({1 << 16}, at::TensorOptions().dtype(at::kFloat).device(device)).fill_(NAN);
      }
    }
    acc.finish();
    if (device.is_cuda()) torch::cuda::synchronize();
    const std::vector<int> last_keys = keys_of(step, micro - 1);
    const auto in_last = [&](int i) {
      return std::find(last_keys.begin(), last_keys.end(), i) != last_keys.end();
    };
    if (apply_last) {
      // Key 5, missing from the last micro-batch, is the one sum never handed over.
      const std::vector<const void*> rest = acc.unapplied();
      ASSERT_EQ(rest.size(), 1u);
      EXPECT_EQ(rest[0], key(5));
    }
    for (int i = 0; i < static_cast<int>(kSizes.size()); ++i) {
      ASSERT_TRUE(acc.holds(key(i))) << i;
      const auto it = ref.find(i);
      if (apply_last && in_last(i)) {
        ASSERT_EQ(applied.count(i), 1u) << "step " << step << " key " << i;
        EXPECT_TRUE(at::equal(applied[i].cpu(), it->second.cpu()))
            << "step " << step << " key " << i;
        EXPECT_FALSE(acc.take_sumsq_parts(key(i)).defined());
        continue;
      }
      const at::Tensor& sum = acc.sum(key(i));
      const at::Tensor want = it == ref.end() ? at::zeros_like(sum) : it->second.cpu();
      EXPECT_TRUE(at::equal(sum, want)) << "step " << step << " key " << i;
      const at::Tensor parts = acc.take_sumsq_parts(key(i));
      // Norm parts: CUDA, for keys the last micro-batch added to an existing sum.
      const bool added_last = device.is_cuda() && it != ref.end() && in_last(i);
      ASSERT_EQ(parts.defined(), added_last) << "step " << step << " key " << i;
      if (added_last) {
        EXPECT_TRUE(at::equal(parts.cpu(), q4::optim::gradient_sumsq_parts(it->second).cpu()))
            << "step " << step << " key " << i;
      }
    }
  }
}

}  // namespace

TEST(HostAccumulation, SumsEqualAnInPlaceBuffer) {
  for (const bool apply_last : {false, true}) {
    SCOPED_TRACE(apply_last ? "applied in the last micro-batch" : "written back");
    run_steps(at::kCPU, int64_t{64} << 10, apply_last);
  }
}

TEST(HostAccumulationCuda, SumsEqualADeviceBufferBitExact) {
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU";
  for (const int64_t ring : {int64_t{64} << 10, int64_t{1} << 20}) {
    for (const bool apply_last : {false, true}) {
      SCOPED_TRACE("ring " + std::to_string(ring) + (apply_last ? ", applied" : ""));
      run_steps(at::Device(at::kCUDA, 0), ring, apply_last);
    }
  }
}
