// report.html rendering (see report.h). Plots are plain SVG polylines with min/max axis labels
// and a legend; everything the page shows is escaped text, so answers cannot inject markup.
#include "q4/trainer/report/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>

#include "q4/trainer/rundir/run_dir.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd"};

std::string escape(const std::string& s) {
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

std::string num(double v) {
  if (v == 0) return "0";
  const double a = std::fabs(v);
  if (a >= 1e5 || a < 1e-3) return fmt::format("{:.3g}", v);
  return fmt::format("{:.4g}", v);
}

constexpr size_t kMaxPlotPoints = 2000;

// About 5 round ticks (1, 2 or 5 x 10^k apart) inside [lo, hi]; whole numbers only when
// `integers` (steps).
std::vector<double> nice_ticks(double lo, double hi, bool integers = false) {
  std::vector<double> t;
  if (!(hi > lo)) return t;
  const double raw = (hi - lo) / 5;
  const double mag = std::pow(10.0, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0}) {
    step = m * mag;
    if (step >= raw) break;
  }
  if (integers) step = std::max(1.0, std::round(step));
  for (double v = std::ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) {
    t.push_back(std::fabs(v) < step * 1e-9 ? 0.0 : v);
  }
  return t;
}

// Ticks of a log axis over [lo, hi] (lo > 0): 1, 2, 5 x 10^k; when fewer than three fall inside
// (a range under a decade) the linear round ticks, placed on the log axis.
std::vector<double> log_ticks(double lo, double hi) {
  std::vector<double> t;
  for (int e = static_cast<int>(std::floor(std::log10(lo)));
       e <= static_cast<int>(std::ceil(std::log10(hi))); ++e) {
    for (double m : {1.0, 2.0, 5.0}) {
      const double v = m * std::pow(10.0, e);
      if (v >= lo * (1 - 1e-9) && v <= hi * (1 + 1e-9)) t.push_back(v);
    }
  }
  return t.size() >= 3 ? t : nice_ticks(lo, hi);
}

// (step, value) of `key` over the records that have a finite number for it.
std::vector<std::pair<double, double>> series_of(const std::vector<nlohmann::json>& recs,
                                                 const std::string& key, double scale = 1.0) {
  std::vector<std::pair<double, double>> pts;
  for (const auto& r : recs) {
    if (!r.is_object() || !r.contains("step") || !r.contains(key)) continue;
    const auto& v = r[key];
    if (!v.is_number() || !r["step"].is_number()) continue;
    const double y = v.get<double>() * scale;
    if (std::isfinite(y)) pts.emplace_back(r["step"].get<double>(), y);
  }
  return pts;
}

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_object()) out.push_back(std::move(j));
  }
  return out;
}

}  // namespace

std::string render_svg_plot(const std::string& title, const std::vector<PlotSeries>& series,
                            const std::string& unit, bool log_y) {
  constexpr double kW = 520, kL = 70, kR = 15, kB = 40;
  // The title on its own row (a long one spans the width), then one legend row per series, then
  // the unit's row: nothing above the plot area shares a row.
  constexpr double kTitleY = 18, kLegendY = 36, kRow = 14;
  const double top = kLegendY + 8 + kRow * static_cast<double>(std::max<size_t>(1, series.size()));
  const double height = 230 + top;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
      if (y <= 0) log_y = false;  // a log axis needs positive values
    }
  }
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" role=\"img\" aria-label=\"{2}\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"#fff\" stroke=\"#ccc\"/>\n"
      "<text x=\"{3}\" y=\"{4}\" font-size=\"14\" font-weight=\"bold\">{2}</text>\n",
      kW, height, escape(title), kL, kTitleY);
  if (!std::isfinite(x0)) {
    o += fmt::format(
        "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#888\">no data</text>\n</svg>\n", kL,
        height / 2);
    return o;
  }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    const double pad = y0 == 0 ? 1 : std::fabs(y0) * 0.05;
    y0 = log_y ? y0 / 1.05 : y0 - pad;
    y1 = log_y ? y1 * 1.05 : y1 + pad;
  }
  const double pw = kW - kL - kR, ph = height - top - kB;
  const auto ty = [&](double y) { return log_y ? std::log10(y) : y; };
  const double ty0 = ty(y0), ty1 = ty(y1);
  auto px = [&](double x) { return kL + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (ty(y) - ty0) / (ty1 - ty0)) * ph; };
  // Axes, light gridlines at the ticks, tick labels, the axis names.
  o += fmt::format(
      "<g font-size=\"11\" fill=\"#444\">"
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#888\"/>"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#888\"/>",
      kL, top, top + ph, kL + pw);
  for (double v : log_y ? log_ticks(y0, y1) : nice_ticks(y0, y1)) {
    const double y = py(v);
    o += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\" stroke=\"#e4e4e4\"/>"
        "<text x=\"{3}\" y=\"{1:.1f}\" text-anchor=\"end\" dominant-baseline=\"middle\">{4}</text>",
        kL + 1, y, kL + pw, kL - 4, num(v));
  }
  for (double v : nice_ticks(x0, x1, /*integers=*/true)) {
    const double x = px(v);
    o += fmt::format(
        "<line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" stroke=\"#e4e4e4\"/>"
        "<text x=\"{0:.1f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>",
        x, top, top + ph - 1, height - kB + 16, num(v));
  }
  o += fmt::format(
      "<text x=\"{0}\" y=\"{1}\" text-anchor=\"middle\">step</text>"
      "<text x=\"8\" y=\"{2}\" text-anchor=\"start\">{3}</text></g>\n",
      kL + pw / 2, height - 6, top - 6, escape(log_y ? unit + " (log scale)" : unit));
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    // At most ~kMaxPlotPoints vertices per line (every k-th point and the last): the page stays
    // small and quick to rewrite on long runs.
    const size_t stride = std::max<size_t>(1, s.points.size() / kMaxPlotPoints);
    std::string pts;
    for (size_t k = 0; k < s.points.size(); k += stride) {
      pts += fmt::format("{:.1f},{:.1f} ", px(s.points[k].first), py(s.points[k].second));
    }
    if (stride > 1 && (s.points.size() - 1) % stride != 0) {
      pts += fmt::format("{:.1f},{:.1f} ", px(s.points.back().first), py(s.points.back().second));
    }
    if (s.points.size() == 1) {
      o += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3\" fill=\"{}\"/>\n",
                       px(s.points[0].first), py(s.points[0].second), color);
    } else if (!s.points.empty()) {
      o += fmt::format(
          "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n", color,
          pts);
    }
    const std::string last = s.points.empty() ? "-" : num(s.points.back().second);
    o += fmt::format(
        "<text x=\"{:.0f}\" y=\"{:.0f}\" font-size=\"12\" fill=\"{}\" text-anchor=\"end\">{} "
        "(last {})</text>\n",
        kW - kR, kLegendY + kRow * static_cast<double>(i), color, escape(s.name), last);
  }
  o += "</svg>\n";
  return o;
}

namespace {

// The report's figures: loss (with validation), preference rewards, the routers of a
// mixture-of-experts model, lr, gradient norm, throughput, MFU and memory, each where its
// metrics exist.
std::string report_plots(const ReportInput& in) {
  const auto& m = in.metrics;
  std::string body;
  auto plot = [&](const std::string& title, std::vector<PlotSeries> s, const std::string& unit,
                  bool log_y = false) {
    s.erase(
        std::remove_if(s.begin(), s.end(), [](const PlotSeries& p) { return p.points.empty(); }),
        s.end());
    if (s.empty()) return;
    body += "<figure>" + render_svg_plot(title, s, unit, log_y) + "</figure>\n";
  };
  std::vector<PlotSeries> loss = {{"train loss", series_of(m, "loss")}};
  for (const char* k : {"val_loss", "validation_loss", "eval_loss"}) {
    auto pts = series_of(m, k);
    auto more = series_of(in.validation, k);
    pts.insert(pts.end(), more.begin(), more.end());
    if (!pts.empty()) loss.push_back({"validation loss", pts});
  }
  // Preference tuning (train.objective preference) logs TRL's reward names; its loss is per pair.
  const bool preference = !series_of(m, "rewards/accuracies").empty();
  plot("Loss", loss, preference ? "per pair" : "nats/token", /*log_y=*/true);
  if (preference) {
    plot("Rewards (beta x log-probability gain over the reference)",
         {{"chosen", series_of(m, "rewards/chosen")},
          {"rejected", series_of(m, "rewards/rejected")},
          {"margin", series_of(m, "rewards/margins")},
          {"held-out margin", series_of(m, "eval_rewards/margins")}},
         "");
    plot("Reward accuracy (chosen gained more than rejected)",
         {{"training pairs", series_of(m, "rewards/accuracies")},
          {"held-out pairs", series_of(m, "eval_rewards/accuracies")}},
         "");
  }
  // Mixture-of-experts models: the routers (docs/trainer.md#logs).
  plot("Router load-balancing loss (no coefficient)",
       {{"train", series_of(m, "moe_aux_loss")}, {"validation", series_of(m, "eval_moe_aux_loss")}},
       "");
  plot("Expert load (tokens over the mean per expert, over the MoE layers)",
       {{"busiest expert", series_of(m, "moe_max_load")},
        {"idlest expert", series_of(m, "moe_min_load")}},
       "");
  plot("Routing entropy (mean per token)", {{"entropy", series_of(m, "moe_router_entropy")}},
       "nats");
  plot("Learning rate", {{"lr", series_of(m, "lr")}}, "");
  plot("Gradient norm (before clipping)", {{"grad norm", series_of(m, "grad_norm")}}, "");
  plot("Throughput", {{"tokens/s", series_of(m, "tokens_per_s")}}, "tok/s");
  plot("MFU", {{"MFU %", series_of(m, "mfu", 100.0)}}, "%");
  constexpr double kGiB = 1.0 / (1024.0 * 1024.0 * 1024.0);
  plot("Memory",
       {{"GPU reserved", series_of(m, "gpu_reserved_bytes", kGiB)},
        {"GPU peak", series_of(m, "gpu_peak_bytes", kGiB)},
        {"process RSS", series_of(m, "rss_bytes", kGiB)}},
       "GiB");
  return body;
}

// The summary lines: the last step's values, a live page's reload, the validation loss.
std::string report_summary(const ReportInput& in) {
  const auto& m = in.metrics;
  // Step records carry "loss"; a validation record before the first step (step 0) does not.
  std::vector<const nlohmann::json*> steps;
  for (const auto& r : m) {
    if (r.is_object() && r.contains("loss")) steps.push_back(&r);
  }
  std::string summary;
  if (!steps.empty()) {
    const auto& last = *steps.back();
    auto field = [&](const char* k) {
      return last.contains(k) && last[k].is_number() ? num(last[k].get<double>()) : "-";
    };
    summary = fmt::format(
        "<p class=\"summary\">{} steps logged; last step {}: loss {}, lr {}, grad norm {}, "
        "{} tok/s</p>\n",
        steps.size(), field("step"), field("loss"), field("lr"), field("grad_norm"),
        field("tokens_per_s"));
  } else {
    summary = "<p class=\"summary\">no metrics recorded yet</p>\n";
  }
  if (in.refresh_s > 0) {
    summary += fmt::format(
        "<p class=\"summary\">the run is going: this page reloads every {} s</p>\n", in.refresh_s);
  }
  const auto val = series_of(m, "val_loss");
  if (!val.empty()) {
    const auto best = std::min_element(
        val.begin(), val.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
    summary += fmt::format(
        "<p class=\"summary\">validation loss {} at step {} (best {} at step {})</p>\n",
        num(val.back().second), num(val.back().first), num(best->second), num(best->first));
  }
  return summary;
}

// The table of answers to eval.prompts ("" when none).
std::string report_evals(const ReportInput& in) {
  if (in.evals.empty()) return "";
  std::string evals =
      "<h2>Eval answers</h2>\n<table>\n<tr><th>step</th><th>when</th><th>prompt</th>"
      "<th>answer</th></tr>\n";
  for (const auto& e : in.evals) {
    auto s = [&](const char* k) {
      if (!e.contains(k)) return std::string();
      return e[k].is_string() ? e[k].get<std::string>() : e[k].dump();
    };
    const bool stopped = !e.contains("stopped") || e["stopped"] == true;
    evals +=
        fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}{}</td></tr>\n", escape(s("step")),
                    escape(s("when")), escape(s("prompt")), escape(s("answer")),
                    stopped ? "" : " <span class=\"nostop\">[no stop token]</span>");
  }
  return evals + "</table>\n";
}

}  // namespace

std::string render_report_html(const ReportInput& in) {
  const std::string body = report_plots(in), summary = report_summary(in), evals = report_evals(in);
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n{4}"
      "<title>q4train report: {0}</title>\n<style>\n"
      "body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}\n"
      "figure {{ display: inline-block; margin: 0.5em; }}\n"
      "table {{ border-collapse: collapse; font-size: 13px; }}\n"
      "td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: left; "
      "vertical-align: top; white-space: pre-wrap; }}\n"
      ".nostop {{ color: #a00; }}\n</style>\n</head>\n<body>\n"
      "<h1>q4train report: {0}</h1>\n{1}{2}{3}</body>\n</html>\n",
      escape(in.title), summary, body, evals,
      in.refresh_s > 0 ? fmt::format("<meta http-equiv=\"refresh\" content=\"{}\">\n", in.refresh_s)
                       : std::string());
}

void ReportWriter::Tail::update() {
  std::ifstream in(path, std::ios::binary);
  if (!in) return;
  in.seekg(0, std::ios::end);
  const auto size = static_cast<uint64_t>(std::max<std::streamoff>(0, in.tellg()));
  if (size < offset) {  // rewritten shorter (a resume cuts records after its checkpoint)
    offset = 0;
    records.clear();
  }
  if (size == offset) return;
  in.seekg(static_cast<std::streamoff>(offset));
  std::string chunk(size - offset, '\0');
  in.read(chunk.data(), static_cast<std::streamsize>(chunk.size()));
  chunk.resize(static_cast<size_t>(in.gcount()));
  // Complete lines only: a record being appended is read at the next update.
  const size_t end = chunk.rfind('\n');
  if (end == std::string::npos) return;
  size_t from = 0;
  while (from <= end) {
    const size_t nl = chunk.find('\n', from);
    auto j = nlohmann::json::parse(chunk.begin() + static_cast<std::ptrdiff_t>(from),
                                   chunk.begin() + static_cast<std::ptrdiff_t>(nl), nullptr,
                                   /*allow_exceptions=*/false);
    if (j.is_object()) records.push_back(std::move(j));
    from = nl + 1;
  }
  offset += end + 1;
}

ReportWriter::ReportWriter(std::string run_dir, std::string metrics_file)
    : run_dir_(std::move(run_dir)) {
  if (!metrics_file.empty()) metrics_.path = (fs::path(run_dir_) / metrics_file).string();
  evals_.path = (fs::path(run_dir_) / "eval.jsonl").string();
}

bool ReportWriter::write(bool live, double min_interval_s) {
  const double now =
      std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  if (min_interval_s > 0 && now - last_write_s_ < min_interval_s) return false;
  last_write_s_ = now;
  if (!metrics_.path.empty()) metrics_.update();
  evals_.update();
  // The records are lent to the page (moved, not copied: a long run has one per step).
  ReportInput in;
  in.title = run_dir_;
  in.metrics = std::move(metrics_.records);
  in.evals = std::move(evals_.records);
  in.refresh_s = live ? kRefreshSeconds : 0;
  std::string html;
  try {
    html = render_report_html(in);
  } catch (...) {
    metrics_.records = std::move(in.metrics);
    evals_.records = std::move(in.evals);
    throw;
  }
  metrics_.records = std::move(in.metrics);
  evals_.records = std::move(in.evals);
  write_file_atomic((fs::path(run_dir_) / "report.html").string(), html);
  return true;
}

std::string write_run_report(const std::string& run_dir, const std::string& metrics_file) {
  ReportInput in;
  in.title = run_dir;
  if (!metrics_file.empty()) in.metrics = read_jsonl(fs::path(run_dir) / metrics_file);
  in.evals = read_jsonl(fs::path(run_dir) / "eval.jsonl");
  const std::string path = (fs::path(run_dir) / "report.html").string();
  write_file_atomic(path, render_report_html(in));
  return path;
}

}  // namespace q4::trainer
