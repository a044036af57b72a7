// Test faults; see fault.h.
#include "q4/trainer/runtime/fault.h"

#include <cstdio>

namespace q4::trainer {

FaultPlan FaultPlan::parse(const char* spec) {
  FaultPlan f;
  if (spec == nullptr || *spec == '\0') return f;
  char kind[16] = {0};
  int rank = -1;
  long long step = -1;
  if (std::sscanf(spec, "%15[a-z]:%d:%lld", kind, &rank, &step) != 3) return f;
  const std::string k(kind);
  if (k == "exit") {
    f.kind = Kind::kExit;
  } else if (k == "hang") {
    f.kind = Kind::kHang;
  } else if (k == "endeval") {
    f.kind = Kind::kEndEval;
  } else if (k == "valsignal") {
    f.kind = Kind::kValSignal;
  } else {
    return f;  // an unknown kind injects nothing
  }
  f.rank = rank;
  f.step = step;
  return f;
}

namespace {
FaultPlan& fault_plan_slot() {
  static FaultPlan plan;
  return plan;
}
}  // namespace

void install_fault_plan(const FaultPlan& plan) { fault_plan_slot() = plan; }
const FaultPlan& installed_fault_plan() { return fault_plan_slot(); }

}  // namespace q4::trainer
