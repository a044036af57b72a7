// The CUDA fast paths against the paths they replace, on the tiny HF fixture model with the
// training configuration (fp16 masters, bf16 compute, bf16 grads, checkpointing): FlashAttention
// varlen on packed rows vs the [B,1,T,T] masked SDPA, and the fused RMSNorm/RoPE kernels vs the
// ATen ops. Both are also measured against an fp32 CUDA reference of the same packed batch, so
// a fast path must be about as close to it as the slow one (bf16 rounding of different
// reduction orders is all that may differ). Skips without a GPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/cuda.h>

#include <map>
#include <string>
#include <vector>

#include "../tiny_fixture.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace q4::model {
namespace {

#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// Two rows of T = 32: row 0 packs examples of 9, 13 and 6 tokens plus 4 pads, row 1 packs 20
// and 12. Labels are the ids (first token of each example ignored), padding -100.
ModelInputs packed_batch(int64_t vocab) {
  const int64_t T = 32;
  const std::vector<std::vector<int64_t>> rows = {{9, 13, 6}, {20, 12}};
  at::Generator gen = at::detail::createCPUGenerator(11);
  ModelInputs in;
  in.input_ids = at::randint(0, vocab, {2, T}, gen, at::TensorOptions().dtype(at::kLong));
  in.labels = at::full({2, T}, -100, at::kLong);
  in.segment_ids = at::zeros({2, T}, at::kLong);
  in.position_ids = at::zeros({2, T}, at::kLong);
  std::vector<int32_t> cu{0};
  int64_t max_len = 0;
  for (int64_t r = 0; r < 2; ++r) {
    int64_t at = 0, seg = 0;
    for (int64_t len : rows[r]) {
      ++seg;
      for (int64_t k = 0; k < len; ++k, ++at) {
        in.segment_ids[r][at] = seg;
        in.position_ids[r][at] = k;
        if (k > 0) in.labels[r][at] = in.input_ids[r][at];
      }
      cu.push_back(static_cast<int32_t>(r * T + at));
      max_len = std::max(max_len, len);
    }
    if (at < T) {
      cu.push_back(static_cast<int32_t>((r + 1) * T));
      max_len = std::max(max_len, T - at);
    }
  }
  in.attention_mask = in.segment_ids.ne(0).to(at::kLong);
  in.cu_seqlens = at::tensor(cu, at::kInt);
  in.max_seqlen = max_len;
  return in;
}

std::map<std::string, at::Tensor> run(at::ScalarType master, at::ScalarType compute,
                                      at::ScalarType grad, const ModelInputs& in, bool varlen,
                                      bool fused) {
  auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_tiny.config.json");
  DatReader w(kFixtures + "/qwen3_tiny.weights.dat");
  ModelOptions o;
  o.master_dtype = master;
  o.compute_dtype = compute;
  o.grad_dtype = grad;
  o.device = at::Device(at::kCUDA, 0);
  o.trainable = TrainableSpec::everything();
  o.fused_cuda_kernels = fused;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  ModelInputs x = in;
  if (!varlen) x.cu_seqlens = at::Tensor();
  EXPECT_EQ(m.uses_varlen_attention(x), varlen && compute != at::kFloat);
  LossOutput lo = m.loss(x);
  lo.loss_sum.backward();
  std::map<std::string, at::Tensor> g;
  for (const auto& p : m.parameters()) g[p.name] = p.grad.to(at::kFloat).cpu();
  g["loss_sum"] = lo.loss_sum.detach().to(at::kFloat).cpu().reshape({1});
  return g;
}

// max over tensors of rel_err(a[k], ref[k])
double worst(const std::map<std::string, at::Tensor>& a,
             const std::map<std::string, at::Tensor>& ref, std::string* which) {
  double w = 0;
  for (const auto& [k, t] : ref) {
    const double e = rel_err(a.at(k), t);
    if (e > w) {
      w = e;
      *which = k;
    }
  }
  return w;
}

TEST(VarlenFusedCuda, VarlenAndFusedTrackTheMaskedReference) {
  SKIP_WITHOUT_CUDA();
  const ModelInputs in = packed_batch(/*vocab=*/384);  // the fixture's vocabulary
  // fp32 reference: masked SDPA, ATen ops.
  const auto ref = run(at::kFloat, at::kFloat, at::kFloat, in, false, false);
  const auto masked = run(at::kHalf, at::kBFloat16, at::kBFloat16, in, false, false);
  const auto varlen = run(at::kHalf, at::kBFloat16, at::kBFloat16, in, true, false);
  const auto fast = run(at::kHalf, at::kBFloat16, at::kBFloat16, in, true, true);
  std::string wm, wv, wf;
  const double em = worst(masked, ref, &wm), ev = worst(varlen, ref, &wv),
               ef = worst(fast, ref, &wf);
  std::cout << "rel err vs fp32: masked " << em << " (" << wm << "), varlen " << ev << " (" << wv
            << "), varlen+fused " << ef << " (" << wf << ")\n";
  // bf16 activations: the slow path itself is ~1e-2 off the fp32 reference; the fast paths may
  // differ in rounding order but not be meaningfully worse.
  EXPECT_LT(em, 0.05);
  EXPECT_LE(ev, std::max(1.5 * em, 0.02)) << wv;
  EXPECT_LE(ef, std::max(1.5 * em, 0.02)) << wf;
  EXPECT_LT(rel_err(varlen.at("loss_sum"), masked.at("loss_sum")), 5e-3);
  EXPECT_LT(rel_err(fast.at("loss_sum"), masked.at("loss_sum")), 5e-3);
}

TEST(VarlenFusedCuda, FusedKernelsMatchAtenInFp32) {
  SKIP_WITHOUT_CUDA();
  // fp32 end to end (masked path: flash needs 16-bit): fused RMSNorm (and its weight gradient)
  // equals the ATen chain up to fp32 summation order.
  const ModelInputs in = packed_batch(384);
  const auto aten = run(at::kFloat, at::kFloat, at::kFloat, in, false, false);
  const auto fused = run(at::kFloat, at::kFloat, at::kFloat, in, false, true);
  std::string which;
  EXPECT_LT(worst(fused, aten, &which), 1e-4) << which;
}

// The loss's fused softmax cross-entropy kernel against the ATen chain it replaces, through
// chunked_cross_entropy_sum (several chunks, unlabelled rows): the vector path (V a multiple of
// the 16-byte width) and the element path, fp32 and bf16.
TEST(VarlenFusedCuda, FusedCrossEntropyMatchesAten) {
  SKIP_WITHOUT_CUDA();
  const at::Device dev(at::kCUDA, 0);
  for (at::ScalarType dt : {at::kFloat, at::kBFloat16}) {
    for (int64_t V : {int64_t{4096}, int64_t{1001}}) {
      at::Generator gen = at::detail::createCPUGenerator(5);
      const at::Tensor h0 = (at::randn({37, 64}, gen) * 2).to(dt).to(dev);
      const at::Tensor w0 = (at::randn({V, 64}, gen) * 0.5).to(dt).to(dev);
      at::Tensor y = at::randint(0, V, {37}, gen, at::TensorOptions().dtype(at::kLong));
      y[3] = -100;
      y[20] = -100;
      y = y.to(dev);
      std::map<bool, std::vector<at::Tensor>> got;
      for (bool fused : {false, true}) {
        at::Tensor h = h0.clone().requires_grad_(true), w = w0.clone().requires_grad_(true);
        auto [sum, count] = chunked_cross_entropy_sum(h, w, y, 16, fused);
        (sum * 0.25).backward();
        got[fused] = {sum.detach().reshape({1}), h.grad(), w.grad()};
        EXPECT_EQ(count.item<int64_t>(), 35);
      }
      const std::string what = std::string(c10::toString(dt)) + " V=" + std::to_string(V);
      // Same fp32 math on the same logits; the sums are reduced in another order, and the
      // gradient (rounded to dt) may differ by one rounding of dt.
      const double tol = dt == at::kFloat ? 1e-5 : 1e-2;
      EXPECT_LT(rel_err(got[true][0], got[false][0]), 1e-5) << what;
      EXPECT_LT(rel_err(got[true][1], got[false][1]), tol) << what << " hidden grad";
      EXPECT_LT(rel_err(got[true][2], got[false][2]), tol) << what << " weight grad";
    }
  }
}

}  // namespace
}  // namespace q4::model
