// Learning-rate schedules (schedule.h): closed-form functions of the 0-based step index.
#include "q4/optim/schedule.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace q4::optim {

LrScheduleKind parse_lr_schedule_kind(const std::string& text) {
  return io::parse_enum<LrScheduleKind>(text, "schedule kind");
}

std::string to_string(LrScheduleKind kind) { return io::enum_name(kind); }

void LrScheduleOptions::validate() const {
  TORCH_CHECK(std::isfinite(peak_lr) && peak_lr > 0.0,
              "LrScheduleOptions.peak_lr: expected a finite value > 0, got ", peak_lr);
  TORCH_CHECK(warmup_steps >= 0, "LrScheduleOptions.warmup_steps: expected >= 0, got ",
              warmup_steps);
  TORCH_CHECK(std::isfinite(min_lr) && min_lr >= 0.0 && min_lr <= peak_lr,
              "LrScheduleOptions.min_lr: expected 0 <= min_lr <= peak_lr (", peak_lr, "), got ",
              min_lr);
  if (kind != LrScheduleKind::kConstant) {
    TORCH_CHECK(total_steps > warmup_steps, "LrScheduleOptions.total_steps: ", to_string(kind),
                " decay needs total_steps > warmup_steps (", warmup_steps, "), got ", total_steps);
  }
}

LrSchedule::LrSchedule(LrScheduleOptions options) : options_(options) { options_.validate(); }

double LrSchedule::lr_at(int64_t step) const {
  TORCH_CHECK(step >= 0, "LrSchedule::lr_at: step must be >= 0, got ", step);
  const LrScheduleOptions& o = options_;
  if (step < o.warmup_steps) {
    return o.peak_lr * static_cast<double>(step + 1) / static_cast<double>(o.warmup_steps);
  }
  if (o.kind == LrScheduleKind::kConstant) return o.peak_lr;
  // Decay over steps warmup .. total-1: progress 0 at the first, 1 at the last.
  const int64_t span = o.total_steps - 1 - o.warmup_steps;
  const double progress =
      span <= 0
          ? 1.0
          : std::min(1.0, static_cast<double>(step - o.warmup_steps) / static_cast<double>(span));
  double frac;  // 1 -> 0
  if (o.kind == LrScheduleKind::kCosine) {
    frac = 0.5 * (1.0 + std::cos(M_PI * progress));
  } else {
    frac = 1.0 - progress;
  }
  return o.min_lr + (o.peak_lr - o.min_lr) * frac;
}

}  // namespace q4::optim
