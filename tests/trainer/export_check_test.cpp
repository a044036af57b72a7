// The export check's words: a few re-quantized elements of a trained NVFP4 tensor are expected
// and said to be; anything else that differs is a failure.
#include "q4/trainer/rundir/export_check.h"

#include <gtest/gtest.h>

namespace q4::trainer {
namespace {

std::string joined(const ExportCheckReport& r) {
  std::string s;
  for (const auto& l : r.lines) s += l + "\n";
  return s;
}

const auto kNvfp4 = [](const std::string& name) { return name.find("proj") != std::string::npos; };

TEST(ExportCheck, AllEqualIsOneLine) {
  const auto r = summarize_export_check({}, 14, kNvfp4, 0.1);
  ASSERT_EQ(r.lines.size(), 1u);
  EXPECT_EQ(r.lines[0],
            "export check: 14/14 tensors of the reloaded export give the trained model's forward "
            "weights bit for bit (0.1 s)");
  EXPECT_TRUE(r.failures.empty());
}

TEST(ExportCheck, FewRequantizedElementsAreExpected) {
  // 1M elements = 65536 blocks; 16 moved blocks of 16 elements is 0.02% of the blocks.
  const auto r = summarize_export_check(
      {"model.layers.0.mlp.up_proj.weight (256 of 1048576 elements)"}, 399, kNvfp4, 1.1);
  EXPECT_TRUE(r.failures.empty()) << joined(r);
  const std::string s = joined(r);
  EXPECT_NE(s.find("398/399 tensors"), std::string::npos) << s;
  EXPECT_NE(s.find("as expected"), std::string::npos) << s;
  EXPECT_NE(s.find("not idempotent"), std::string::npos) << s;
  EXPECT_EQ(s.find("differs:"), std::string::npos) << s;
  EXPECT_EQ(s.find("FAILED"), std::string::npos) << s;
}

TEST(ExportCheck, OtherDifferencesAreFailures) {
  const auto r = summarize_export_check(
      {"model.layers.0.mlp.up_proj.weight (900000 of 1048576 elements)",  // most of a tensor
       "model.norm.weight (3 of 32 elements)",                            // a raw tensor
       "model.layers.0.self_attn.q_proj.weight (shape)",
       "model.layers.0.self_attn.k_proj.weight (missing)"},
      14, kNvfp4, 0.1);
  EXPECT_EQ(r.failures.size(), 4u) << joined(r);
  const std::string s = joined(r);
  EXPECT_NE(s.find("FAILED: 4 tensor(s) differ beyond re-quantization"), std::string::npos) << s;
  EXPECT_NE(s.find("differs: model.norm.weight (3 of 32 elements)"), std::string::npos) << s;
}

// Tiny tensors: one moved block is several percent of 1024 elements, still expected; the bound
// grows with the tensor at 2% of its blocks.
TEST(ExportCheck, BoundScalesWithTheTensor) {
  EXPECT_EQ(expected_requantization_diff(1024), 64);              // 4 blocks at least
  EXPECT_EQ(expected_requantization_diff(16 * 10000), 16 * 200);  // 2% of 10000 blocks
  const auto r = summarize_export_check({"a_proj (48 of 1024 elements)"}, 3, kNvfp4, 0);
  EXPECT_TRUE(r.failures.empty()) << joined(r);
}

}  // namespace
}  // namespace q4::trainer
