// LR schedules against closed-form values: warmup ramp, cosine/linear decay endpoints and
// midpoints, the floor, constant, and validation messages naming the field.
#include "q4/optim/schedule.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <cmath>

#include "optim_test_util.h"

namespace q4::optim {
namespace {

LrSchedule make(LrScheduleKind k, double peak, int64_t warmup, int64_t total, double floor) {
  LrScheduleOptions o;
  o.kind = k;
  o.peak_lr = peak;
  o.warmup_steps = warmup;
  o.total_steps = total;
  o.min_lr = floor;
  return LrSchedule(o);
}

TEST(LrSchedule, WarmupThenCosineToFloor) {
  const LrSchedule s = make(LrScheduleKind::kCosine, 1e-3, 10, 110, 1e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(0), 1e-4);  // 1e-3 * 1/10
  EXPECT_DOUBLE_EQ(s.lr_at(4), 5e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(9), 1e-3);   // end of warmup: peak
  EXPECT_DOUBLE_EQ(s.lr_at(10), 1e-3);  // decay progress 0
  // Decay spans steps 10..109 (99 intervals): the midpoint of the cosine is half way.
  EXPECT_NEAR(s.lr_at(10) - s.lr_at(11), (1e-3 - 1e-4) * 0.5 * (1 - std::cos(M_PI / 99)), 1e-15);
  const double mid = 1e-4 + 0.9e-3 * 0.5 * (1 + std::cos(M_PI * 49.5 / 99));
  EXPECT_NEAR(0.5 * (s.lr_at(59) + s.lr_at(60)), mid, 1e-9);
  EXPECT_DOUBLE_EQ(s.lr_at(109), 1e-4);
  EXPECT_DOUBLE_EQ(s.lr_at(5000), 1e-4);
  for (int64_t t = 10; t < 109; ++t) EXPECT_GE(s.lr_at(t), s.lr_at(t + 1));
}

TEST(LrSchedule, LinearAndConstant) {
  const LrSchedule lin = make(LrScheduleKind::kLinear, 2e-4, 0, 11, 0.0);
  EXPECT_DOUBLE_EQ(lin.lr_at(0), 2e-4);
  EXPECT_NEAR(lin.lr_at(5), 1e-4, 1e-18);
  EXPECT_DOUBLE_EQ(lin.lr_at(10), 0.0);
  const LrSchedule c = make(LrScheduleKind::kConstant, 3e-4, 4, 0, 0.0);
  EXPECT_DOUBLE_EQ(c.lr_at(1), 1.5e-4);
  EXPECT_DOUBLE_EQ(c.lr_at(3), 3e-4);
  EXPECT_DOUBLE_EQ(c.lr_at(1000000), 3e-4);
}

TEST(LrSchedule, Validation) {
  auto msg = [](auto fn) { return test::error_of(fn); };
  EXPECT_NE(
      msg([] { make(LrScheduleKind::kCosine, 1e-3, 10, 10, 0); }).find("LrScheduleOptions.total_steps"),
      std::string::npos);
  EXPECT_NE(msg([] { make(LrScheduleKind::kCosine, 1e-3, 0, 10, 2e-3); }).find("LrScheduleOptions.min_lr"),
            std::string::npos);
  EXPECT_NE(msg([] { make(LrScheduleKind::kConstant, 0, 0, 0, 0); }).find("LrScheduleOptions.peak_lr"),
            std::string::npos);
  EXPECT_NE(msg([] { parse_lr_schedule_kind("step"); }).find("constant, linear, cosine"),
            std::string::npos);
  EXPECT_EQ(parse_lr_schedule_kind("cosine"), LrScheduleKind::kCosine);
  const LrSchedule s = make(LrScheduleKind::kConstant, 1e-3, 0, 0, 0);
  EXPECT_NE(msg([&] { s.lr_at(-1); }).find("step must be >= 0"), std::string::npos);
}

}  // namespace
}  // namespace q4::optim
