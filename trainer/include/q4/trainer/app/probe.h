// The VRAM probe report: one step split into named phases, each with its wall time and memory
// (allocator allocated/reserved/peak, device used/total, process RSS), plus the analytic budget
// beside the measured values. CPU runs report the device fields as null.
#pragma once

#include <nlohmann/json_fwd.hpp>
#include <string>
#include <vector>

#include "q4/trainer/runtime/memory.h"

namespace q4::trainer {

// start, model_loaded, optimizer_ready, batch_ready, forward_done, backward_done,
// optimizer_step_done, export_done
const std::vector<std::string>& probe_phase_names();

struct ProbePhase {
  std::string name;
  double elapsed_ms = 0;  // since the start phase
  double phase_ms = 0;    // since the previous phase
  MemorySnapshot memory;  // peak fields: within this phase (the peak is reset after each one)
};

nlohmann::json memory_to_json(const MemorySnapshot& m);  // absent CUDA fields -> null

// {"device", "phases": [...], "budget": {...}, "measured": {...}, "info": info}; `budget` is
// MemoryBudget::to_json(). "measured" holds the largest peak over all phases (null on CPU) and
// the largest RSS.
nlohmann::json probe_report_json(const std::string& device, const std::vector<ProbePhase>& phases,
                                 const nlohmann::json& budget, const nlohmann::json& info);

}  // namespace q4::trainer
