// Learning-rate schedules: constant, or linear warmup followed by cosine or linear decay to a
// floor. Pure functions of the step index (0-based: the step about to be taken), so a resumed
// run gets the same rates without any schedule state to save.
#pragma once

#include <cstdint>
#include <string>

#include "q4/io/enum_names.h"

namespace q4::optim {

enum class LrScheduleKind {
  kConstant,  // peak_lr after warmup, forever
  kCosine,    // warmup, then peak_lr -> min_lr along half a cosine over the remaining steps
  kLinear,    // warmup, then peak_lr -> min_lr linearly over the remaining steps
};

// The spellings are the table below.
LrScheduleKind parse_lr_schedule_kind(const std::string& text);
std::string to_string(LrScheduleKind kind);

struct LrScheduleOptions {
  LrScheduleKind kind = LrScheduleKind::kCosine;
  double peak_lr = 1e-4;     // rate reached at the end of warmup, > 0
  int64_t warmup_steps = 0;  // steps 0..warmup-1 ramp linearly: peak * (step + 1) / warmup
  int64_t total_steps = 0;   // decay ends at step total_steps - 1 (== min_lr); required > warmup
                             // for cosine/linear, ignored for constant
  double min_lr = 0.0;       // floor of the decay, 0 <= min_lr <= peak_lr
  // The message names the field (schedule.<field>).
  void validate() const;
};

class LrSchedule {
 public:
  explicit LrSchedule(LrScheduleOptions options);  // validates
  // Learning rate for 0-based `step`; steps past the end stay at min_lr (constant: peak_lr).
  // step < 0 is an error.
  double lr_at(int64_t step) const;
  const LrScheduleOptions& options() const { return options_; }

 private:
  LrScheduleOptions options_;
};

}  // namespace q4::optim

Q4_ENUM_NAMES(q4::optim::LrScheduleKind, {"constant", q4::optim::LrScheduleKind::kConstant},
              {"linear", q4::optim::LrScheduleKind::kLinear},
              {"cosine", q4::optim::LrScheduleKind::kCosine});
