// Log-line and metrics.jsonl formatting (fixed field order and widths so lines align and grep).
#include "q4/trainer/runtime/metrics.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

namespace q4::trainer {

double ms_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "-";
  const int64_t s = static_cast<int64_t>(std::llround(seconds));
  if (s < 60) return fmt::format("{}s", s);
  if (s < 3600) return fmt::format("{}m{:02d}s", s / 60, s % 60);
  return fmt::format("{}h{:02d}m", s / 3600, (s % 3600) / 60);
}

std::string format_log_line(const StepMetrics& m) {
  const int width = static_cast<int>(std::to_string(m.total_steps).size());
  std::string line = fmt::format(
      "step {:>{}}/{}{} | loss {:.4f}{}{}{} | gnorm {:.3e} | lr {:.2e} | "
      "{:.1f} ms | {:.0f} tok/s | mfu ",
      m.step, width, m.total_steps,
      m.epoch ? fmt::format(" | epoch {:.2f}", *m.epoch) : std::string(), m.loss,
      m.loss_avg ? fmt::format(" (avg {:.4f})", *m.loss_avg) : std::string(),
      m.val_loss ? fmt::format(" | val {:.4f}", *m.val_loss) : std::string(),
      m.router ? fmt::format(" | aux {:.3f} load {:.2f}/{:.2f}", m.router->aux_loss,
                             m.router->max_load, m.router->min_load)
               : std::string(),
      m.grad_norm, m.lr, m.step_ms, m.tokens_per_s);
  line += m.mfu ? fmt::format("{:.1f}%", *m.mfu * 100.0) : "-";
  line += " | mem ";
  line += m.gpu_reserved_bytes
              ? fmt::format("{:.2f} GiB", static_cast<double>(*m.gpu_reserved_bytes) / (1 << 30))
              : fmt::format("rss {:.2f} GiB", static_cast<double>(m.rss_bytes) / (1 << 30));
  line += " | eta " + format_duration(m.eta_s);
  if (m.skipped) line += " | skipped (non-finite)";
  return line;
}

nlohmann::json metrics_to_json(const StepMetrics& m) {
  nlohmann::json j;
  j["step"] = m.step;
  j["total_steps"] = m.total_steps;
  if (m.epoch) j["epoch"] = *m.epoch;
  j["loss"] = std::isfinite(m.loss) ? nlohmann::json(m.loss) : nlohmann::json(nullptr);
  j["grad_norm"] =
      std::isfinite(m.grad_norm) ? nlohmann::json(m.grad_norm) : nlohmann::json(nullptr);
  j["lr"] = m.lr;
  j["step_ms"] = m.step_ms;
  j["tokens"] = m.tokens;
  j["slots"] = m.slots;
  j["tokens_per_s"] = m.tokens_per_s;
  j["mfu"] = m.mfu ? nlohmann::json(*m.mfu) : nlohmann::json(nullptr);
  j["gpu_reserved_bytes"] =
      m.gpu_reserved_bytes ? nlohmann::json(*m.gpu_reserved_bytes) : nlohmann::json(nullptr);
  j["gpu_peak_bytes"] =
      m.gpu_peak_bytes ? nlohmann::json(*m.gpu_peak_bytes) : nlohmann::json(nullptr);
  j["rss_bytes"] = m.rss_bytes;
  j["eta_s"] = m.eta_s;
  j["skipped"] = m.skipped;
  auto finite = [](double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); };
  if (m.loss_avg) j["loss_avg"] = finite(*m.loss_avg);
  if (m.val_loss) {
    j["val_loss"] = finite(*m.val_loss);
    j["val_tokens"] = m.val_tokens;
  }
  if (m.router) {
    j["moe_aux_loss"] = finite(m.router->aux_loss);
    j["moe_max_load"] = finite(m.router->max_load);
    j["moe_min_load"] = finite(m.router->min_load);
    j["moe_router_entropy"] = finite(m.router->entropy);
    j["moe_dropped_tokens"] = m.router->dropped_tokens;
  }
  return j;
}

std::string format_progress_bar(int64_t step, int64_t total, int width, double loss, double eta_s) {
  const double frac = total > 0 ? static_cast<double>(step) / static_cast<double>(total) : 1.0;
  const int filled = static_cast<int>(std::lround(frac * width));
  std::string bar = "[";
  for (int i = 0; i < width; ++i) bar += i < filled ? '#' : '.';
  bar += fmt::format("] {}/{}", step, total);
  if (std::isfinite(loss)) bar += fmt::format(" loss {:.4f}", loss);
  if (eta_s >= 0) bar += " eta " + format_duration(eta_s);
  return bar;
}

void JsonlWriter::open(const std::string& path, std::optional<int64_t> keep_until_step) {
  path_ = path;
  if (keep_until_step && std::filesystem::is_regular_file(path)) {
    std::vector<std::string> kept;
    std::ifstream in(path);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
      if (!j.is_object()) continue;  // a line cut by a crash or a full disk
      if (j.contains("step") && j["step"].is_number_integer() &&
          j["step"].get<int64_t>() > *keep_until_step) {
        continue;
      }
      kept.push_back(line);
    }
    in.close();
    std::string text;
    for (const auto& l : kept) text += l + '\n';
    io::write_file_atomic(path, text);
  }
  out_.open(path, /*truncate=*/false);
}

// Every line reaches the kernel whole or the run fails naming the file (a full disk used to end
// the run with exit 0 and a last line cut mid-JSON).
void JsonlWriter::write(const nlohmann::json& j) { out_.write(j.dump() + '\n'); }

void JsonlWriter::close() {
  if (!out_.is_open()) return;
  out_.sync();
  out_.close();
}

}  // namespace q4::trainer
