// 300 AdamW steps on the tiny fixture Qwen3 (HF layout, NVFP4 linears, fp16 masters, STE) that
// memorizes the fixture batch, once per moment storage mode. Evidence for the packed optimizer
// on a real model: int8 and 4bit must end at most 10% above the fp32 reference's loss (the
// bar; below is fine, see the check). nvfp4 (the weight format) is reported, not
// required. The curves are printed for docs/results.md. Measured with the two-hash sr_bits:
// fp32 0.0099, int8 0.0099, 4bit 0.0091 (-8%). Over
// optimizer seeds 1-6: fp32 0.0100-0.0103, 4bit 0.0087-0.0094 (7-13% below fp32: the stochastic
// 4-bit codes add noise that speeds this memorization up slightly). With nearest 4-bit codes
// 4bit ended at 0.0185 (1.87x fp32).
//
// The same bar holds with in-backward updates (optim.in_backward: each parameter updated from the
// model's grad-ready hook inside the backward, its gradient freed at once; device-agnostic, so it
// runs here on CPU): fp32, int8 and 4bit are trained both ways, int8/4bit must end at most 10%
// above fp32 under in-backward updates too, and each in-backward curve must track its buffered
// curve (tolerance below: clipping uses the previous step's global norm, so the runs differ
// slightly from step 2 on). Measured (this seed, bit-addition master
// rounding, moment uniforms from the element's one hash): buffered fp32 0.0101, int8 0.0099, 4bit
// 0.0089 (-12%); in-backward fp32 0.0098, int8 0.0095, 4bit 0.0089. (One-hash sr_bits
// and a second hash for the moments: buffered 0.0102 / 0.0096 / 0.0092.)
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <iterator>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"

namespace {

using q4::optim::StateMode;

constexpr int kSteps = 300;
const int kReportAt[] = {0, 25, 50, 75, 100, 150, 200, 250, 300};

struct Curve {
  std::map<int, double> loss_at;  // step -> loss before that step's update (300: after the last)
};

// in_backward: begin_step / grad-ready hook -> step_param / end_step instead of step(grads).
Curve train(StateMode mode, bool in_backward = false) {
  const std::string dir = Q4_FIXTURES_DIR;
  auto cfg = q4::model::Qwen3Config::from_json_file(dir + "/qwen3_tiny.config.json");
  q4::model::DatReader weights(dir + "/qwen3_tiny.weights.dat");
  q4::model::DatReader expected(dir + "/qwen3_tiny.expected.dat");

  q4::model::ModelOptions mo;
  mo.master_dtype = at::kHalf;
  mo.compute_dtype = at::kFloat;
  mo.trainable = q4::model::TrainableSpec::everything();
  mo.gradient_checkpointing = true;
  auto model = q4::model::Qwen3Model::load(cfg, weights, mo);

  q4::optim::AdamWOptions oo;
  oo.lr = 1e-3;
  oo.weight_decay = 0.0;
  oo.state_mode = mode;
  oo.seed = 1234;
  q4::optim::PackedAdamW opt(oo);
  std::vector<q4::model::Parameter*> params = model.trainable_parameters();
  for (auto* p : params) opt.add_param(p->name, p->master, /*weight_decay=*/false);

  q4::model::ModelInputs in;
  in.input_ids = expected.load("input_ids");  // (2, 24) int64
  in.labels = expected.load("labels");        // (2, 24) int64, -100 masked

  std::unordered_map<const q4::model::Parameter*, int64_t> index;
  for (size_t i = 0; i < params.size(); ++i) index[params[i]] = static_cast<int64_t>(i);
  if (in_backward) {
    model.set_grad_ready_hook(
        [&](q4::model::Parameter& p) { opt.step_param(index.at(&p), p.grad); });
  }

  Curve c;
  for (int step = 0; step <= kSteps; ++step) {
    model.zero_grad();
    q4::optim::StepArgs args;
    args.max_grad_norm = 1.0;
    if (in_backward && step < kSteps) {
      opt.begin_step(args);
      model.begin_grad_step();
    }
    auto out = model.loss(in);
    const double loss = out.loss.item<double>();
    for (int r : kReportAt) {
      if (r == step) c.loss_at[step] = loss;
    }
    if (step == kSteps) break;
    out.loss.backward();
    q4::optim::StepResult r;
    if (in_backward) {
      r = opt.end_step();
    } else {
      std::vector<at::Tensor> grads;
      for (auto* p : params) {
        grads.push_back(p->grad.defined() ? p->grad : at::zeros_like(p->master));
      }
      r = opt.step(grads, args);
    }
    EXPECT_TRUE(r.applied) << "step " << step;
  }
  return c;
}

void print_table(const std::map<std::string, Curve>& curves) {
  std::printf("| mode |");
  for (int r : kReportAt) std::printf(" %d |", r);
  std::printf("\n|---|");
  for (size_t i = 0; i < std::size(kReportAt); ++i) std::printf("---|");
  std::printf("\n");
  for (const auto& [name, c] : curves) {
    std::printf("| %s |", name.c_str());
    for (int r : kReportAt) std::printf(" %.4f |", c.loss_at.at(r));
    std::printf("\n");
  }
}

// One test (one process): the buffered curves serve both comparisons.
TEST(Convergence, PackedMomentsTrackFp32OnTinyModel) {
  const std::pair<const char*, StateMode> modes[] = {{"fp32", StateMode::kFp32},
                                                     {"int8", StateMode::kInt8},
                                                     {"4bit", StateMode::k4Bit},
                                                     {"nvfp4", StateMode::kNvfp4}};
  std::map<std::string, Curve> curves;
  for (const auto& [name, mode] : modes) curves[name] = train(mode);
  for (const auto& [name, mode] : modes) {
    if (mode != StateMode::kNvfp4) curves[std::string(name) + " in-backward"] = train(mode, true);
  }
  print_table(curves);

  for (const char* suffix : {"", " in-backward"}) {
    const std::string s = suffix;
    const double ref = curves["fp32" + s].loss_at.at(300);
    const double start = curves["fp32" + s].loss_at.at(0);
    // The fp32 reference must actually memorize, or the comparison below says nothing.
    EXPECT_LT(ref, 0.2 * start) << "fp32" << s;
    // Quality bar: at most 10% above the fp32 loss. Below it is fine: the stochastic 4-bit codes
    // add noise that speeds this memorization up by 7-13% over optimizer seeds (docs/optim.md);
    // 0.8x is a sanity bound (far below fp32 would mean the comparison is broken).
    for (const char* name : {"int8", "4bit"}) {
      const double loss = curves[name + s].loss_at.at(300);
      EXPECT_LE(loss, 1.10 * ref) << name << s << " final loss " << loss << " vs fp32 " << ref;
      EXPECT_GE(loss, 0.80 * ref) << name << s << " final loss " << loss << " vs fp32 " << ref;
    }
  }
  // In-backward vs buffered, same mode, at every reported step. Step 0 is the same forward and
  // the same first update (the in-backward first step, which has no previous norm, is applied
  // unclipped and its moments are then scaled to the clipped gradient's; Adam's first update is
  // sign(g) up to eps either way). From step 2 on an in-backward step is clipped with the previous
  // step's global norm instead of its own (its own is known only after every update): here the
  // norm changes by up to ~15% from one step to the next while the loss falls, so the two runs
  // take slightly different steps. Measured: at most 6% apart at any reported step (4bit at step
  // 100), 4% at step 300. Tolerance: 10% of the buffered loss + 0.001. (Before the first step's
  // moments were scaled, its unclipped v, (4.7 / 1.0)^2 = 22x the clipped one, slowed the next
  // ~100 steps: 37% above the buffered loss at step 50.)
  for (const char* name : {"fp32", "int8", "4bit"}) {
    const Curve& b = curves[name];
    const Curve& ib = curves[std::string(name) + " in-backward"];
    EXPECT_EQ(b.loss_at.at(0), ib.loss_at.at(0)) << name;
    for (int r : kReportAt) {
      EXPECT_LE(std::abs(ib.loss_at.at(r) - b.loss_at.at(r)), 0.10 * b.loss_at.at(r) + 0.001)
          << name << " step " << r << ": in-backward " << ib.loss_at.at(r) << " vs buffered "
          << b.loss_at.at(r);
    }
  }
}

}  // namespace
