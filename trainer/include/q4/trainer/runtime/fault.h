// Test faults for the failure-handling tests (docs/multi-gpu.md, docs/reliability.md): one fault
// a run injects on one rank at one step, set once before the run starts (q4train reads the
// environment variable Q4_FAULT once, in main). Nothing in the training loop reads the
// environment.
//
//   exit:R:S       rank R exits with code 9 at the start of step S
//   hang:R:S       rank R hangs there
//   endeval:R:S    the end-of-run eval after step S fails on rank R (an error, exit 1)
//   valsignal:R:S  rank R gets a stop signal as the validation after step S starts
//
// A spec that does not read KIND:RANK:STEP (KIND lowercase letters) injects nothing.
#pragma once

#include <cstdint>
#include <string>

namespace q4::trainer {

struct FaultPlan {
  enum class Kind { kNone, kExit, kHang, kEndEval, kValSignal };
  Kind kind = Kind::kNone;
  int rank = -1;
  int64_t step = -1;

  // From a spec as above; null or empty: none.
  static FaultPlan parse(const char* spec);
  // Whether fault `k` is due on `rank` at `step`.
  bool at(Kind k, int on_rank, int64_t at_step) const {
    return kind != Kind::kNone && kind == k && rank == on_rank && step == at_step;
  }
};

// The process's fault plan (none unless installed): q4train's main installs Q4_FAULT's, tests
// their own.
void install_fault_plan(const FaultPlan& plan);
const FaultPlan& installed_fault_plan();

}  // namespace q4::trainer
