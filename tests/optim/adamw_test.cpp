// PackedAdamW on CPU: the fp32 mode against a scalar per-element reference (bit-exact, the
// arithmetic order of docs/optim.md), every packed mode against the fp32 mode (quadratic problem,
// random gradient streams), the failure modes packed moments are prone to (lost small updates,
// zero second moments), stochastic rounding, chunk invariance, scratch bounds, the non-finite guard,
// clipping, weight-decay flags, and save/load (bit-identical resume, corrupt-file errors).
#include "q4/optim/adamw.h"

#include <gtest/gtest.h>
#include <ATen/ATen.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>

#include "../../optim/src/optim_math.h"  // sr_bits/sr_stream_key: the reference uses the same hash
#include "optim_test_util.h"
#include "q4/optim/state_codec.h"

namespace q4::optim {
namespace {

using test::bit_equal;
using test::gen;
using test::kAllModes;
using test::kPacked;

std::string tmp_path(const std::string& name) {
  return std::string(::testing::TempDir()) + "/q4optim_" + name + "_" + std::to_string(::getpid());
}


// ---------------------------------------------------------------- scalar reference

// One AdamW step per element with fp32 arithmetic in the documented order.
template <typename M>
struct RefAdamW {
  AdamWOptions o;
  std::vector<float> m, v;
  int64_t t = 0;
  void step(std::vector<M>& w, const std::vector<float>& g, double lr, int64_t param_index,
            bool decay_flag) {
    if (m.empty()) {
      m.assign(w.size(), 0.0f);
      v.assign(w.size(), 0.0f);
    }
    ++t;
    const float b1 = static_cast<float>(o.beta1), omb1 = static_cast<float>(1.0 - o.beta1);
    const float b2 = static_cast<float>(o.beta2), omb2 = static_cast<float>(1.0 - o.beta2);
    const float ibc2 =
        static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(o.beta2, static_cast<double>(t))));
    const float step_size =
        static_cast<float>(lr / (1.0 - std::pow(o.beta1, static_cast<double>(t))));
    const float decay = static_cast<float>(1.0 - lr * o.weight_decay);
    const float eps = static_cast<float>(o.eps);
    const uint32_t key = detail::sr_stream_key(o.seed, t, param_index);
    for (size_t i = 0; i < w.size(); ++i) {
      const float gi = g[i] * 1.0f;
      m[i] = b1 * m[i] + omb1 * gi;
      v[i] = b2 * v[i] + omb2 * (gi * gi);
      float u = m[i] / (std::sqrt(v[i]) * ibc2 + eps);
      u = u * step_size;
      float p = static_cast<float>(w[i]);
      if (decay_flag && o.weight_decay > 0) p = p * decay;
      p = p - u;
      w[i] = write(p, key, static_cast<int64_t>(i));
    }
  }
  M write(float p, uint32_t key, int64_t idx) {
    if constexpr (std::is_same_v<M, float>) {
      return p;
    } else {
      const bool is_half = std::is_same_v<M, c10::Half>;
      const float maxf = is_half ? 65504.0f : 3.3895313892515355e38f;
      float x = std::min(std::max(p, -maxf), maxf);
      if (o.rounding == MasterRounding::kNearest) return M(x);
      // docs/optim.md, written as a choice between neighbours: fp16 below 2^-14 first moves by
      // c = copysign(2^-14, x); lo/hi = the neighbours of x toward/away from zero; hi when
      // u < |x - lo| / |hi - lo|, u = (2^k - 1 - (h mod 2^k)) / 2^k, k = 13 (fp16) or 16 (bf16).
      const float c = is_half && std::fabs(x) < 6.103515625e-05f
                          ? std::copysign(6.103515625e-05f, x)
                          : 0.0f;
      if (c != 0.0f) x = x + c;  // (-0 + 0 would be +0)
      M lo(x);  // nearest, then toward zero if it lies further out
      if (std::fabs(static_cast<float>(lo)) > std::fabs(x)) lo.x = static_cast<uint16_t>(lo.x - 1);
      M hi;
      hi.x = static_cast<uint16_t>(lo.x + 1);
      const float lof = static_cast<float>(lo);
      const float prob = std::fabs(x - lof) / std::fabs(static_cast<float>(hi) - lof);
      const int k = is_half ? 13 : 16;
      const uint32_t h = detail::sr_bits(key, idx) & ((1u << k) - 1);
      const float u = static_cast<float>(((1u << k) - 1) - h) / static_cast<float>(1u << k);
      const float r = static_cast<float>(u < prob ? hi : lo);
      return M(c != 0.0f ? r - c : r);
    }
  }
};

template <typename M>
void check_against_reference(at::ScalarType dt, MasterRounding rounding) {
  AdamWOptions o;
  o.lr = 3e-3;
  o.weight_decay = 0.1;
  o.rounding = rounding;
  o.seed = 1234;
  o.chunk_rows = 3;  // several chunks, last one partial
  const int64_t rows = 10, cols = 37;
  at::Tensor w = (at::randn({rows, cols}, gen(1)) * 0.05).to(dt);
  PackedAdamW opt(o);
  opt.add_param("w", w);
  RefAdamW<M> ref;
  ref.o = o;
  std::vector<M> rw(w.numel());
  std::memcpy(rw.data(), w.data_ptr(), w.numel() * sizeof(M));
  for (int s = 0; s < 6; ++s) {
    at::Tensor g = at::randn({rows, cols}, gen(100 + s)) * 0.01;
    std::vector<float> gv(g.data_ptr<float>(), g.data_ptr<float>() + g.numel());
    const double lr = o.lr * (s + 1) / 6.0;
    StepArgs a;
    a.lr = lr;
    ASSERT_TRUE(opt.step({g}, a).applied);
    ref.step(rw, gv, lr, 0, true);
  }
  at::Tensor expect = at::empty({rows, cols}, dt);
  std::memcpy(expect.data_ptr(), rw.data(), rw.size() * sizeof(M));
  EXPECT_TRUE(bit_equal(w, expect))
      << "max diff " << (w.to(at::kFloat) - expect.to(at::kFloat)).abs().max();
  at::Tensor m_ref = at::from_blob(ref.m.data(), {rows * cols}, at::kFloat).clone();
  EXPECT_TRUE(bit_equal(opt.decoded_exp_avg(0), m_ref));
}

TEST(PackedAdamW, Fp32ModeMatchesScalarReferenceBitExact) {
  check_against_reference<float>(at::kFloat, MasterRounding::kNearest);
  check_against_reference<c10::Half>(at::kHalf, MasterRounding::kNearest);
  check_against_reference<c10::Half>(at::kHalf, MasterRounding::kStochastic);
  check_against_reference<c10::BFloat16>(at::kBFloat16, MasterRounding::kStochastic);
}

TEST(PackedAdamW, MatchesTextbookAdamWInDouble) {
  // Independent of the arithmetic order: torch.optim.AdamW's formulas in double. fp32 masters,
  // 20 steps; fp32 rounding of each op gives ~1e-7 relative error per step.
  AdamWOptions o;
  o.lr = 1e-2;
  o.weight_decay = 0.05;
  o.rounding = MasterRounding::kNearest;
  at::Tensor w = at::randn({8, 64}, gen(2));
  at::Tensor wd = w.to(at::kDouble);
  at::Tensor m = at::zeros_like(wd), v = at::zeros_like(wd);
  PackedAdamW opt(o);
  opt.add_param("w", w);
  for (int t = 1; t <= 20; ++t) {
    at::Tensor g = at::randn({8, 64}, gen(10 + t));
    opt.step({g});
    const at::Tensor gd = g.to(at::kDouble);
    wd.mul_(1 - o.lr * o.weight_decay);
    m = o.beta1 * m + (1 - o.beta1) * gd;
    v = o.beta2 * v + (1 - o.beta2) * gd * gd;
    const double bc1 = 1 - std::pow(o.beta1, t), bc2 = 1 - std::pow(o.beta2, t);
    wd -= (o.lr / bc1) * m / (v.sqrt() / std::sqrt(bc2) + o.eps);
  }
  EXPECT_LT((w.to(at::kDouble) - wd).abs().max().item<double>(), 1e-5);
}

// ---------------------------------------------------------------- packed modes vs fp32

struct QuadResult {
  at::Tensor w;
  double loss0, loss;
};

// f(w) = 0.5 * sum(a * (w - target)^2), 400 steps, cosine lr from 5e-2. Curvature a spreads over
// 3 decades either across rows (per-channel scales; blocks are homogeneous) or inside blocks.
QuadResult run_quadratic(StateMode mode, bool spread_in_block) {
  AdamWOptions o;
  o.lr = 5e-2;
  o.state_mode = mode;
  o.rounding = MasterRounding::kNearest;
  const at::Tensor a = spread_in_block ? at::pow(10.0, -3.0 * at::rand({64, 128}, gen(3)))
                                       : at::pow(10.0, -3.0 * at::rand({64, 1}, gen(3))) *
                                             (0.5 + 0.5 * at::rand({64, 128}, gen(33)));
  const at::Tensor target = at::randn({64, 128}, gen(4));
  at::Tensor w = at::zeros({64, 128});
  PackedAdamW opt(o);
  opt.add_param("w", w);
  auto loss = [&] { return 0.5 * (a * (w - target).pow(2)).sum().item<double>(); };
  QuadResult r;
  r.loss0 = loss();
  for (int s = 0; s < 400; ++s) {
    const double lr = o.lr * 0.5 * (1 + std::cos(M_PI * s / 400.0));
    StepArgs args;
    args.lr = lr;
    opt.step({a * (w - target)}, args);
  }
  r.loss = loss();
  r.w = w.clone();
  return r;
}

TEST(PackedAdamW, QuadraticProblemEveryModeAgainstFp32) {
  const QuadResult ref = run_quadratic(StateMode::kFp32, false);
  std::printf("[quadratic] fp32  loss %.4g -> %.4g\n", ref.loss0, ref.loss);
  EXPECT_LT(ref.loss, 1e-4 * ref.loss0);
  // int8 and 4-bit end within a few percent of the fp32 solution. Measured: int8 loss 1.31e-5,
  // distance 4.1e-4; 4-bit (stochastic codes) 1.00e-5, 1.2e-5 (with nearest 4-bit codes it
  // stalled at loss 0.107, distance 1.5e-2). NVFP4 is the weight format, kept for
  // comparison: its moments underflow to 0 (m / eps steps), so it is only printed.
  const double travelled = ref.w.norm().item<double>();
  for (StateMode mode : kPacked) {
    const QuadResult r = run_quadratic(mode, false);
    const double dist = (r.w - ref.w).norm().item<double>() / travelled;
    std::printf("[quadratic] %-5s final loss %.4g (fp32 %.4g), |w - w_fp32| / |w_fp32| = %.4g\n",
                to_string(mode).c_str(), r.loss, ref.loss, dist);
    if (mode == StateMode::kInt8) {
      EXPECT_LT(dist, 0.01);
      EXPECT_LT(r.loss, 1e-4 * ref.loss0);
    } else if (mode == StateMode::k4Bit) {
      EXPECT_LT(dist, 0.005);
      EXPECT_LT(r.loss, 1e-4 * ref.loss0);
    }
  }
}

TEST(PackedAdamW, QuadraticCurvatureSpreadInsideBlocks) {
  // The hard case for block-wise v: curvature varying 1000x inside one block. int8 still tracks
  // fp32; 4-bit's zero-free v map (linear on sqrt(v)) floors small v at absmax/256, so
  // low-curvature coordinates move slower (documented limitation; rank-1 normalization would
  // help further). Measured 400-step loss reduction: fp32 2.3e7x, int8 1.2e7x, 4-bit 1113x
  // with stochastic codes (nearest codes: 205x; torchao's k/16 map on v with nearest codes: 58x).
  const QuadResult ref = run_quadratic(StateMode::kFp32, true);
  const QuadResult i8 = run_quadratic(StateMode::kInt8, true);
  const QuadResult b4 = run_quadratic(StateMode::k4Bit, true);
  std::printf("[quadratic-in-block] loss %.4g -> fp32 %.4g int8 %.4g 4bit %.4g\n", ref.loss0,
              ref.loss, i8.loss, b4.loss);
  EXPECT_LT(ref.loss, 1e-6 * ref.loss0);
  EXPECT_LT(i8.loss, 1e-6 * ref.loss0);
  EXPECT_LT((i8.w - ref.w).norm().item<double>() / ref.w.norm().item<double>(), 0.01);
  EXPECT_LT(b4.loss, 0.005 * ref.loss0);
}

TEST(PackedAdamW, RandomGradientStreamMomentErrors) {
  // Same gradient stream into fp32 and packed optimizers (lr 0: masters irrelevant). Gradient
  // magnitudes vary over 3 decades across rows. After 30 steps compare the stored moments and
  // the resulting update direction m / (sqrt(v) + eps) against the fp32 moments.
  const int64_t rows = 64, cols = 256;
  std::vector<PackedAdamW> opts;
  std::vector<at::Tensor> ws;
  for (StateMode mode : kAllModes) {
    AdamWOptions o;
    o.lr = 0.0;
    o.state_mode = mode;
    opts.emplace_back(o);
    ws.push_back(at::zeros({rows, cols}));
    opts.back().add_param("w", ws.back());
  }
  const at::Tensor row_scale = at::pow(10.0, -3.0 * at::rand({rows, 1}, gen(5)));
  for (int s = 0; s < 30; ++s) {
    const at::Tensor g = at::randn({rows, cols}, gen(200 + s)) * row_scale * 1e-2;
    for (auto& o : opts) o.step({g});
  }
  const at::Tensor m0 = opts[0].decoded_exp_avg(0), v0 = opts[0].decoded_exp_avg_sq(0);
  const at::Tensor u0 = m0 / (v0.sqrt() + 1e-8);
  // Measured relative L2 errors (docs/optim.md): int8 m 0.025, v 0.013, update 0.027; 4-bit
  // (stochastic codes, re-drawn every step) m 0.53, v 0.21, update 0.57. Bounds ~1.3-2x.
  // Bias (sum over elements): int8 m -0.07%, sqrt(v) -0.01%; 4-bit m -0.2% (seeds 0-7: -2.1% to
  // +1.2%, mean +0.1%, so the bound is 3%), sqrt(v) +0.4% (+0.25% to +0.55%). With nearest 4-bit
  // codes the errors were lower (m 0.33, v 0.14) but the bias was not: m -5.4%, sqrt(v) +2.0%
  // (small m flushed to 0, v sticking to its code); the bias bounds below fail for them.
  const double bound_m[] = {0, 0.05, 0.75, 0}, bound_v[] = {0, 0.03, 0.3, 0},
               bound_u[] = {0, 0.05, 0.75, 0}, bound_bias_m[] = {0, 0.01, 0.03, 0},
               bound_bias_v[] = {0, 0.005, 0.01, 0};
  for (size_t i = 1; i < opts.size(); ++i) {
    const StateMode mode = kAllModes[i];
    const at::Tensor m = opts[i].decoded_exp_avg(0), v = opts[i].decoded_exp_avg_sq(0);
    const double em = (m - m0).norm().item<double>() / m0.norm().item<double>();
    const double ev = (v - v0).norm().item<double>() / v0.norm().item<double>();
    const at::Tensor u = m / (v.sqrt() + 1e-8);
    const double eu = (u - u0).norm().item<double>() / u0.norm().item<double>();
    const int64_t zero_v = ((v <= 0) & (v0 > 0)).sum().item<int64_t>();
    // Bias: stored m along the fp32 m (1 = unbiased), and stored sqrt(v) (what the update
    // divides by) against the fp32 one, both summed over all elements.
    const double bias_m =
        (m * m0.sign()).sum().item<double>() / m0.abs().sum().item<double>() - 1.0;
    const double bias_v = v.sqrt().sum().item<double>() / v0.sqrt().sum().item<double>() - 1.0;
    std::printf(
        "[stream] %-5s rel err m %.4g v %.4g update %.4g; bias m %+.4f sqrt(v) %+.4f; v decoded 0 "
        "where fp32 > 0: %lld of %lld\n",
        to_string(mode).c_str(), em, ev, eu, bias_m, bias_v, static_cast<long long>(zero_v),
        static_cast<long long>(v.numel()));
    if (mode == StateMode::kNvfp4) continue;  // for comparison only (printed above)
    EXPECT_LT(em, bound_m[i]) << to_string(mode);
    EXPECT_LT(ev, bound_v[i]) << to_string(mode);
    EXPECT_LT(eu, bound_u[i]) << to_string(mode);
    EXPECT_LT(std::abs(bias_m), bound_bias_m[i]) << to_string(mode);
    EXPECT_LT(std::abs(bias_v), bound_bias_v[i]) << to_string(mode);
    EXPECT_EQ(zero_v, 0) << to_string(mode);
  }
}

// ---------------------------------------------------------------- replaced-system failures

TEST(PackedAdamW, SmallLrChangesAlmostEveryFp16Weight) {
  // Lost small updates would change only ~0.08% of weights at lr <= 3e-4. Here: lr 1e-5, fp16 masters
  // ~N(0, 0.02^2) (fp16 ulp 2^-24..2^-14 there), 10 steps, every mode. Gradients: a fixed
  // direction plus noise (a fine-tuning batch seen repeatedly), so each element drifts ~1e-4.
  for (StateMode mode : kAllModes) {
    AdamWOptions o;
    o.lr = 1e-5;
    o.state_mode = mode;
    PackedAdamW opt(o);
    at::Tensor w = (at::randn({64, 256}, gen(6)) * 0.02).to(at::kHalf);
    const at::Tensor w0 = w.clone();
    opt.add_param("w", w);
    const at::Tensor base = at::randn({64, 256}, gen(299));
    for (int s = 0; s < 10; ++s) {
      opt.step({(base + 0.5 * at::randn({64, 256}, gen(300 + s))) * 1e-3});
    }
    const double changed = (w != w0).to(at::kFloat).mean().item<double>();
    std::printf("[lr1e-5] %-5s changed %.2f%% of fp16 weights\n", to_string(mode).c_str(),
                100 * changed);
    EXPECT_GE(changed, 0.9) << to_string(mode);
  }
}

TEST(PackedAdamW, StochasticRoundingTracksFp32DriftAtTinyLr) {
  // lr 1e-7, 200 steps, constant positive gradient: each step moves an element by ~1e-7, about
  // 1/76 of the fp16 ulp at |w| in [2^-7, 2^-6). The fp32-master run drifts by ~2e-5; stochastic
  // rounding must match its mean drift within 5% (65536 elements: sampling error ~0.1%), nearest
  // rounding stays put.
  const at::Tensor init = (at::rand({256, 256}, gen(7)) * 0.0078 + 0.0079).to(at::kHalf);
  const at::Tensor g = at::rand({256, 256}, gen(8)) + 0.5;
  auto drift = [&](at::ScalarType dt, MasterRounding r) {
    AdamWOptions o;
    o.lr = 1e-7;
    o.rounding = r;
    o.state_mode = StateMode::kFp32;
    PackedAdamW opt(o);
    at::Tensor w = init.to(dt).clone();
    opt.add_param("w", w);
    for (int s = 0; s < 200; ++s) opt.step({g});
    return (w.to(at::kDouble) - init.to(at::kDouble)).mean().item<double>();
  };
  const double ref = drift(at::kFloat, MasterRounding::kNearest);
  const double sr = drift(at::kHalf, MasterRounding::kStochastic);
  const double nearest = drift(at::kHalf, MasterRounding::kNearest);
  std::printf("[drift] fp32 %.6g  fp16+stochastic %.6g  fp16+nearest %.6g\n", ref, sr, nearest);
  EXPECT_NEAR(ref, -200 * 1e-7, 0.02 * 200 * 1e-7);
  EXPECT_NEAR(sr / ref, 1.0, 0.05);
  EXPECT_LT(std::fabs(nearest), 0.05 * std::fabs(ref));
}

// ---------------------------------------------------------------- chunking and memory

TEST(PackedAdamW, ResultsDoNotDependOnChunkRows) {
  for (StateMode mode : kAllModes) {
    std::vector<at::Tensor> finals;
    for (int64_t chunk : {int64_t{1}, int64_t{7}, int64_t{1000}}) {
      AdamWOptions o;
      o.lr = 1e-3;
      o.state_mode = mode;
      o.chunk_rows = chunk;
      o.weight_decay = 0.01;
      PackedAdamW opt(o);
      at::Tensor w = (at::randn({40, 100}, gen(9)) * 0.02).to(at::kHalf);  // 4000 < 4096: fp32
      at::Tensor w2 = (at::randn({33, 300}, gen(10)) * 0.02).to(at::kBFloat16);
      opt.add_param("small", w);
      opt.add_param("big", w2);
      for (int s = 0; s < 4; ++s) {
        opt.step({at::randn({40, 100}, gen(400 + s)), at::randn({33, 300}, gen(500 + s))});
      }
      EXPECT_EQ(opt.params()[0].mode, StateMode::kFp32);
      EXPECT_EQ(opt.params()[1].mode, mode);
      finals.push_back(at::cat({w.to(at::kFloat).view(-1), w2.to(at::kFloat).view(-1),
                                opt.decoded_exp_avg(1), opt.decoded_exp_avg_sq(1)}));
    }
    EXPECT_TRUE(bit_equal(finals[0], finals[1])) << to_string(mode);
    EXPECT_TRUE(bit_equal(finals[0], finals[2])) << to_string(mode);
  }
}

TEST(PackedAdamW, ScratchIsBoundedByChunkNotTensorSize) {
  // A (4096, 256) fp16 master (4 MiB of fp32) stepped 16 rows at a time: every temporary of the
  // step comes from the arena, whose high-water mark must stay under 16 x chunk_rows x cols x 4
  // bytes (docs/optim.md lists the slots: ~13 x in the worst mode) plus per-block scale slots.
  for (StateMode mode : kAllModes) {
    AdamWOptions o;
    o.state_mode = mode;
    o.chunk_rows = 16;
    PackedAdamW opt(o);
    at::Tensor w = at::zeros({4096, 256}, at::kHalf);
    opt.add_param("w", w);
    opt.step({at::randn({4096, 256}, gen(11))});
    const int64_t unit = 16 * 256 * 4;
    std::printf("[scratch] %-5s peak %lld bytes = %.2f x chunk_rows*cols*4\n",
                to_string(mode).c_str(), static_cast<long long>(opt.scratch_peak_bytes()),
                static_cast<double>(opt.scratch_peak_bytes()) / unit);
    EXPECT_GT(opt.scratch_peak_bytes(), 0);
    EXPECT_LE(opt.scratch_peak_bytes(), 16 * unit) << to_string(mode);
  }
}

TEST(PackedAdamW, StateBytesPerMode) {
  const int64_t n = 1024 * 512;
  const int64_t expect[] = {8 * n, 2 * (n + n / 256 * 4), 2 * (n / 2 + n / 128 * 4),
                            2 * (n / 2 + n / 16)};
  for (int i = 0; i < 4; ++i) {
    AdamWOptions o;
    o.state_mode = kAllModes[i];
    PackedAdamW opt(o);
    opt.add_param("w", at::zeros({1024, 512}, at::kHalf));
    opt.add_param("norm", at::zeros({512}, at::kHalf));  // small: fp32, 8 bytes/element
    EXPECT_EQ(opt.state_bytes(), expect[i] + 8 * 512) << to_string(kAllModes[i]);
    const StepTraffic t = opt.step_traffic(at::kBFloat16);
    EXPECT_EQ(t.norm_read_bytes, 2 * (n + 512));
    EXPECT_EQ(t.step_read_bytes, 4 * (n + 512) + opt.state_bytes());
    EXPECT_EQ(t.step_write_bytes, 2 * (n + 512) + opt.state_bytes());
  }
}

// ---------------------------------------------------------------- guard, clipping, decay

TEST(PackedAdamW, NonFiniteGradientSkipsStepAndErrorsWhenRepeated) {
  for (StateMode mode : kAllModes) {
    AdamWOptions o;
    o.state_mode = mode;
    o.max_consecutive_nonfinite = 2;
    PackedAdamW opt(o);
    at::Tensor w = (at::randn({32, 256}, gen(12)) * 0.02).to(at::kHalf);
    opt.add_param("w", w);
    opt.step({at::randn({32, 256}, gen(13))});
    const at::Tensor w1 = w.clone(), m1 = opt.decoded_exp_avg(0), v1 = opt.decoded_exp_avg_sq(0);
    at::Tensor bad = at::randn({32, 256}, gen(14));
    bad[3][7] = std::nan("");
    StepResult r = opt.step({bad});
    EXPECT_FALSE(r.applied);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    EXPECT_EQ(r.consecutive_nonfinite, 1);
    EXPECT_EQ(opt.step_count(), 1);
    EXPECT_TRUE(bit_equal(w, w1));
    EXPECT_TRUE(bit_equal(opt.decoded_exp_avg(0), m1));
    EXPECT_TRUE(bit_equal(opt.decoded_exp_avg_sq(0), v1));
    bad[3][7] = std::numeric_limits<float>::infinity();
    EXPECT_EQ(opt.step({bad}).consecutive_nonfinite, 2);
    try {
      opt.step({bad});
      ADD_FAILURE() << "third consecutive non-finite step must throw";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what()).find("max_consecutive_nonfinite"), std::string::npos);
    }
    EXPECT_EQ(opt.skipped_total(), 3);
    // A finite step resets the run and is applied as step 2.
    r = opt.step({at::randn({32, 256}, gen(15))});
    EXPECT_TRUE(r.applied);
    EXPECT_EQ(r.step, 2);
    EXPECT_EQ(opt.consecutive_nonfinite(), 0);
  }
}

TEST(PackedAdamW, GlobalNormAndClipping) {
  const at::Tensor g1 = at::randn({100, 50}, gen(16)).to(at::kBFloat16);
  const at::Tensor g2 = at::randn({3000}, gen(17)) * 3;
  const double expect = std::sqrt(g1.to(at::kDouble).pow(2).sum().item<double>() +
                                  g2.to(at::kDouble).pow(2).sum().item<double>());
  EXPECT_NEAR(global_grad_norm({g1, g2, at::Tensor()}, 777), expect, 1e-6 * expect);
  // Step with clipping == step with grad_scale = the clip coefficient (same fp32 arithmetic).
  auto run = [&](const StepArgs& a) {
    AdamWOptions o;
    o.lr = 1e-2;
    PackedAdamW opt(o);
    at::Tensor w1 = at::zeros({100, 50}), w2 = at::zeros({3000});
    opt.add_param("a", w1);
    opt.add_param("b", w2);
    const StepResult r = opt.step({g1, g2}, a);
    return std::make_tuple(r, at::cat({w1.view(-1), w2}));
  };
  StepArgs clip;
  clip.max_grad_norm = 1.0;
  const auto [rc, wc] = run(clip);
  EXPECT_NEAR(rc.grad_norm, expect, 1e-6 * expect);
  EXPECT_NEAR(rc.clip_coef, 1.0 / (expect + 1e-6), 1e-6 * rc.clip_coef);  // fp32 chunk sums
  StepArgs scaled;
  scaled.grad_scale = rc.clip_coef;
  const auto [rs, ws] = run(scaled);
  EXPECT_TRUE(bit_equal(wc, ws));
  // The in-place helper.
  at::Tensor a = g2.clone();
  const double n = clip_grad_norm_({a}, 2.0);
  EXPECT_NEAR(n, g2.norm().item<double>(), 1e-4 * n);
  EXPECT_NEAR(a.norm().item<double>(), 2.0, 1e-4);
}

TEST(PackedAdamW, WeightDecayOnlyOnFlaggedParams) {
  AdamWOptions o;
  o.lr = 0.1;
  o.weight_decay = 0.5;
  PackedAdamW opt(o);
  at::Tensor a = at::randn({64, 64}, gen(18)), b = at::randn({64, 64}, gen(19));
  const at::Tensor a0 = a.clone(), b0 = b.clone();
  opt.add_param("a", a, true);
  opt.add_param("b", b, false);
  opt.step({at::zeros({64, 64}), at::zeros({64, 64})});  // m = v = 0: update 0 / eps = 0
  EXPECT_TRUE(bit_equal(a, a0 * 0.95f));
  EXPECT_TRUE(bit_equal(b, b0));
}

TEST(PackedAdamW, ReadsMasterGradAndZeroGrad) {
  AdamWOptions o;
  o.lr = 1e-2;
  PackedAdamW opt(o);
  at::Tensor w = at::zeros({8, 8}).set_requires_grad(true);
  opt.add_param("w", w);
  (w * at::arange(64, at::kFloat).view({8, 8})).sum().backward();
  ASSERT_TRUE(w.grad().defined());
  EXPECT_TRUE(opt.step().applied);
  // Adam's first step moves each element with a non-zero gradient by lr in the gradient's sign.
  EXPECT_NEAR(w[0][1].item<float>(), -1e-2f, 1e-6);
  EXPECT_EQ(w[0][0].item<float>(), 0.0f);
  opt.zero_grad();
  EXPECT_FALSE(w.grad().defined());
  // No gradients at all: a valid step with zero gradients (moments decay).
  EXPECT_TRUE(opt.step().applied);
}

TEST(PackedAdamW, ValidatesOptionsAndInputs) {
  auto msg = [](auto fn) { return test::error_of(fn); };
  AdamWOptions o;
  o.beta2 = 1.0;
  EXPECT_NE(msg([&] { PackedAdamW x(o); }).find("AdamWOptions.beta2"), std::string::npos);
  o = AdamWOptions();
  o.chunk_rows = 0;
  EXPECT_NE(msg([&] { PackedAdamW x(o); }).find("AdamWOptions.chunk_rows"), std::string::npos);
  EXPECT_NE(msg([] { parse_state_mode("8bit"); }).find("fp32, int8, 4bit, nvfp4"),
            std::string::npos);
  PackedAdamW opt{AdamWOptions()};
  EXPECT_NE(
      msg([&] { opt.add_param("x", at::zeros({4}, at::kDouble)); }).find("fp16, bf16 or fp32"),
      std::string::npos);
  opt.add_param("x", at::zeros({4}));
  EXPECT_NE(msg([&] { opt.add_param("x", at::zeros({4})); }).find("already registered"),
            std::string::npos);
  EXPECT_NE(msg([&] { opt.step({at::zeros({5})}); }).find("'x' has 5 elements"), std::string::npos);
  EXPECT_NE(msg([&] { opt.step(std::vector<at::Tensor>{}); }).find("expected 1 gradients"),
            std::string::npos);
  opt.step({at::zeros({4})});
  EXPECT_NE(msg([&] { opt.add_param("y", at::zeros({4})); }).find("before the first step"),
            std::string::npos);
}

// ---------------------------------------------------------------- save / load

struct TrainRun {
  std::unique_ptr<PackedAdamW> opt;
  at::Tensor w1, w2;
};

TrainRun make_run(StateMode mode, uint64_t seed = 42) {
  AdamWOptions o;
  o.lr = 1e-3;
  o.state_mode = mode;
  o.seed = seed;
  o.weight_decay = 0.1;
  TrainRun r;
  r.opt = std::make_unique<PackedAdamW>(o);
  r.w1 = (at::randn({48, 160}, gen(20)) * 0.02).to(at::kHalf);
  r.w2 = (at::randn({160}, gen(21))).to(at::kBFloat16);
  r.opt->add_param("layer.w", r.w1);
  r.opt->add_param("layer.norm", r.w2, false);
  return r;
}

void steps(TrainRun& r, int from, int to) {
  for (int s = from; s < to; ++s) {
    r.opt->step({at::randn({48, 160}, gen(600 + s)), at::randn({160}, gen(700 + s))});
  }
}

TEST(PackedAdamW, SaveLoadResumesBitIdentically) {
  for (StateMode mode : kAllModes) {
    TrainRun a = make_run(mode);
    steps(a, 0, 6);  // uninterrupted
    TrainRun b = make_run(mode);
    steps(b, 0, 3);
    const std::string path = tmp_path("resume_" + to_string(mode));
    b.opt->save(path);
    TrainRun c = make_run(mode);  // fresh process: initial masters, zero moments
    c.opt->load(path);
    EXPECT_EQ(c.opt->step_count(), 3);
    EXPECT_TRUE(bit_equal(c.w1, b.w1));
    steps(c, 3, 6);
    EXPECT_TRUE(bit_equal(c.w1, a.w1)) << to_string(mode);
    EXPECT_TRUE(bit_equal(c.w2, a.w2)) << to_string(mode);
    EXPECT_TRUE(bit_equal(c.opt->decoded_exp_avg_sq(0), a.opt->decoded_exp_avg_sq(0)));
    std::remove(path.c_str());
  }
}

TEST(PackedAdamW, LoadRejectsMismatchesAndCorruptFiles) {
  TrainRun a = make_run(StateMode::k4Bit);
  steps(a, 0, 2);
  const std::string path = tmp_path("bad");
  a.opt->save(path);
  auto msg = [](auto fn) { return test::error_of(fn); };
  {
    TrainRun b = make_run(StateMode::kInt8);
    EXPECT_NE(msg([&] { b.opt->load(path); }).find("AdamWOptions.state_mode = 4bit"), std::string::npos);
  }
  {
    TrainRun b = make_run(StateMode::k4Bit, 7);
    EXPECT_NE(msg([&] { b.opt->load(path); }).find("AdamWOptions.seed"), std::string::npos);
  }
  {
    AdamWOptions o;
    o.state_mode = StateMode::k4Bit;
    o.seed = 42;
    PackedAdamW b(o);
    b.add_param("layer.w", at::zeros({48, 161}, at::kHalf));
    b.add_param("layer.norm", at::zeros({160}, at::kBFloat16), false);
    EXPECT_NE(msg([&] { b.load(path); }).find("has shape [48, 160]"), std::string::npos);
  }
  {
    AdamWOptions o;
    o.state_mode = StateMode::k4Bit;
    o.seed = 42;
    PackedAdamW b(o);
    b.add_param("other", at::zeros({48, 160}, at::kHalf));
    b.add_param("layer.norm", at::zeros({160}, at::kBFloat16), false);
    // Parameters are matched by name: the file's 'layer.w' is not registered here.
    EXPECT_NE(msg([&] { b.load(path); }).find("holds parameter 'layer.w', which this optimizer does not have"),
              std::string::npos);
  }
  {
    // Shards of a sharded optimizer: each registered parameter from the file that has it, the
    // others skipped; a registered parameter in no file is an error naming it.
    AdamWOptions o;
    o.state_mode = StateMode::k4Bit;
    o.seed = 42;
    PackedAdamW b(o);
    b.add_param("layer.norm", at::zeros({160}, at::kBFloat16), false);
    EXPECT_NO_THROW(b.load_shards({path}));
    PackedAdamW c(o);
    c.add_param("missing", at::zeros({48, 160}, at::kHalf));
    EXPECT_NE(msg([&] { c.load_shards({path}); }).find("'missing' is in none of the state files"),
              std::string::npos);
  }
  // Truncated and corrupted copies.
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string trunc = path + ".trunc";
  std::ofstream(trunc, std::ios::binary).write(bytes.data(), bytes.size() - 100);
  TrainRun b = make_run(StateMode::k4Bit);
  const at::Tensor w_before = b.w1.clone();
  EXPECT_NE(msg([&] { b.opt->load(trunc); }).find("truncated"), std::string::npos);
  EXPECT_TRUE(bit_equal(b.w1, w_before));  // nothing was changed by the failed load
  std::string bad = bytes;
  bad[0] = 'X';
  std::ofstream(trunc, std::ios::binary).write(bad.data(), bad.size());
  EXPECT_NE(msg([&] { b.opt->load(trunc); }).find("bad magic"), std::string::npos);
  EXPECT_NE(msg([&] { b.opt->load(path + ".missing"); }).find("cannot open"), std::string::npos);
  // Format versions: a version-2 4bit state used the previous m map and is refused; version 1
  // and unknown versions are refused; a version-2 int8 state means the same and loads.
  for (uint32_t v : {1u, 2u, 4u}) {
    std::string old_version = bytes;
    std::memcpy(&old_version[8], &v, 4);
    std::ofstream(trunc, std::ios::binary).write(old_version.data(), old_version.size());
    const std::string m = msg([&] { b.opt->load(trunc); });
    EXPECT_NE(m.find(v == 2 ? "version-2 4bit state" : "format version"), std::string::npos) << m;
  }
  {
    TrainRun i8 = make_run(StateMode::kInt8);
    steps(i8, 0, 2);
    i8.opt->save(trunc);
    std::ifstream in8(trunc, std::ios::binary);
    std::string b8((std::istreambuf_iterator<char>(in8)), std::istreambuf_iterator<char>());
    const uint32_t v2 = 2;
    std::memcpy(&b8[8], &v2, 4);
    std::ofstream(trunc, std::ios::binary).write(b8.data(), b8.size());
    TrainRun c = make_run(StateMode::kInt8);
    EXPECT_EQ(msg([&] { c.opt->load(trunc); }), "");
    EXPECT_TRUE(bit_equal(c.w1, i8.w1));
  }
  std::remove(trunc.c_str());
  std::remove(path.c_str());
}

}  // namespace
}  // namespace q4::optim
