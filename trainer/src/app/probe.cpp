// JSON layout of the VRAM probe report (see probe.h); the probe run itself is in trainer.cpp.
#include "q4/trainer/app/probe.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace q4::trainer {

const std::vector<std::string>& probe_phase_names() {
  static const std::vector<std::string> kNames = {
      "start",        "model_loaded",  "optimizer_ready",     "batch_ready",
      "forward_done", "backward_done", "optimizer_step_done", "export_done"};
  return kNames;
}

namespace {
nlohmann::json opt(const std::optional<int64_t>& v) {
  return v ? nlohmann::json(*v) : nlohmann::json(nullptr);
}
}  // namespace

nlohmann::json memory_to_json(const MemorySnapshot& m) {
  return {{"allocated_bytes", opt(m.allocated_bytes)},
          {"reserved_bytes", opt(m.reserved_bytes)},
          {"peak_allocated_bytes", opt(m.peak_allocated_bytes)},
          {"peak_reserved_bytes", opt(m.peak_reserved_bytes)},
          {"device_used_bytes", opt(m.device_used_bytes)},
          {"device_total_bytes", opt(m.device_total_bytes)},
          {"rss_bytes", m.rss_bytes}};
}

nlohmann::json probe_report_json(const std::string& device, const std::vector<ProbePhase>& phases,
                                 const nlohmann::json& budget, const nlohmann::json& info) {
  nlohmann::json j;
  j["device"] = device;
  j["phases"] = nlohmann::json::array();
  std::optional<int64_t> peak;
  std::optional<int64_t> peak_reserved;
  int64_t rss = 0;
  for (const auto& p : phases) {
    nlohmann::json ph = memory_to_json(p.memory);
    ph["name"] = p.name;
    ph["elapsed_ms"] = p.elapsed_ms;
    ph["phase_ms"] = p.phase_ms;
    j["phases"].push_back(ph);
    if (p.memory.peak_allocated_bytes) {
      peak = std::max(peak.value_or(0), *p.memory.peak_allocated_bytes);
    }
    if (p.memory.peak_reserved_bytes) {
      peak_reserved = std::max(peak_reserved.value_or(0), *p.memory.peak_reserved_bytes);
    }
    rss = std::max(rss, p.memory.rss_bytes);
  }
  j["budget"] = budget;
  j["measured"] = {{"peak_allocated_bytes", opt(peak)},
                   {"peak_reserved_bytes", opt(peak_reserved)},
                   {"max_rss_bytes", rss}};
  j["info"] = info;
  return j;
}

}  // namespace q4::trainer
