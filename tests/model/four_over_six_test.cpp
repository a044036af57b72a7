// ModelOptions::block_rule = 4-over-6 end to end on the tiny fixture: the training forward
// fake-quantizes with the rule, the export writes the rule's codes (also for masters that never
// moved, whose max6 file codes the rule may re-scale, and from the device codes of offloaded
// masters), and the exported model, loaded frozen, computes the training forward's logits
// exactly. The max6 export of the same masters differs (the rule reaches the file).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

TEST(FourOverSixModel, ExportReloadsToTheTrainingForward) {
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  const ModelInputs in = fixture_inputs(e);
  for (const bool moved : {false, true}) {
    for (const bool offload : {false, true}) {
      SCOPED_TRACE(std::string(moved ? "moved masters" : "file masters") +
                   (offload ? ", offloaded" : ""));
      ModelOptions o = fp32_all();
      o.master_dtype = at::kHalf;  // raw masters as the file stores them: the export is exact
      o.block_rule = q4::quant::BlockRule::kFourOverSix;
      o.offload_masters = offload;
      Qwen3Model m = Qwen3Model::load(cfg, w, o);
      if (moved) {
        at::NoGradGuard ng;
        at::Generator gen = at::detail::createCPUGenerator(3);
        for (Parameter* p : m.trainable_parameters()) {
          p->master.add_(at::randn(p->master.sizes(), gen) * 2e-3);
        }
        m.refresh_forward_weights();
      }
      at::Tensor trained;
      {
        at::NoGradGuard ng;
        trained = m.forward(in);
      }
      const std::string out = temp_path("four_over_six.dat");
      m.export_to(w, out);
      EXPECT_TRUE(m.compare_forward_weights(DatReader(out)).empty());
      ModelOptions frozen = fp32_all();
      frozen.trainable = TrainableSpec::nothing();
      Qwen3Model re = Qwen3Model::load(cfg, DatReader(out), frozen);
      at::NoGradGuard ng;
      const at::Tensor back = re.forward(in);
      EXPECT_TRUE(at::equal(back, trained))
          << "reloaded logits differ by " << (back - trained).abs().max().item<double>();
      // The same masters under max6: the file's own values are max6's fixed points with zero
      // error, which 4-over-6 keeps (ties go to max6); moved masters compute differently.
      ModelOptions o6 = fp32_all();
      o6.master_dtype = at::kHalf;
      Qwen3Model m6 = Qwen3Model::load(cfg, w, o6);
      for (Parameter* p : m.trainable_parameters()) m6.parameter(p->name).master.copy_(p->master);
      EXPECT_EQ(at::equal(m6.forward(in), trained), !moved);
      std::remove(out.c_str());
    }
  }
}

}  // namespace
}  // namespace q4::model
