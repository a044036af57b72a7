// report.html rendering (see report.h). Plots are plain SVG polylines with min/max axis labels
// and a legend; everything the page shows is escaped text, so answers cannot inject markup.
#include "q4/trainer/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>

#include "q4/trainer/run_dir.h"

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
                            const std::string& unit) {
  constexpr double kW = 520, kL = 70, kR = 15, kB = 40;
  // Title and one legend line per series above the plot area.
  const double top = 24 + 14.0 * static_cast<double>(std::max<size_t>(1, series.size()));
  const double height = 230 + top;
  double x0 = std::numeric_limits<double>::infinity(), x1 = -x0, y0 = x0, y1 = -x0;
  for (const auto& s : series) {
    for (const auto& [x, y] : s.points) {
      x0 = std::min(x0, x);
      x1 = std::max(x1, x);
      y0 = std::min(y0, y);
      y1 = std::max(y1, y);
    }
  }
  std::string o = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" role=\"img\" aria-label=\"{2}\">\n"
      "<rect width=\"{0}\" height=\"{1}\" fill=\"#fff\" stroke=\"#ccc\"/>\n"
      "<text x=\"{3}\" y=\"18\" font-size=\"14\" font-weight=\"bold\">{2}</text>\n",
      kW, height, escape(title), kL);
  if (!std::isfinite(x0)) {
    o += fmt::format(
        "<text x=\"{}\" y=\"{}\" font-size=\"12\" fill=\"#888\">no data</text>\n</svg>\n", kL,
        height / 2);
    return o;
  }
  if (x1 == x0) x1 = x0 + 1;
  if (y1 == y0) {
    const double pad = y0 == 0 ? 1 : std::fabs(y0) * 0.05;
    y0 -= pad;
    y1 += pad;
  }
  const double pw = kW - kL - kR, ph = height - top - kB;
  auto px = [&](double x) { return kL + (x - x0) / (x1 - x0) * pw; };
  auto py = [&](double y) { return top + (1 - (y - y0) / (y1 - y0)) * ph; };
  o += fmt::format(
      "<g font-size=\"11\" fill=\"#444\">"
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#888\"/>"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#888\"/>"
      "<text x=\"{4}\" y=\"{1}\" text-anchor=\"end\" dominant-baseline=\"middle\">{5}</text>"
      "<text x=\"{4}\" y=\"{2}\" text-anchor=\"end\" dominant-baseline=\"middle\">{6}</text>"
      "<text x=\"{0}\" y=\"{7}\" text-anchor=\"middle\">{8}</text>"
      "<text x=\"{3}\" y=\"{7}\" text-anchor=\"middle\">{9}</text>"
      "<text x=\"{10}\" y=\"{7}\" text-anchor=\"middle\">step</text>"
      "<text x=\"8\" y=\"{11}\" text-anchor=\"start\">{12}</text></g>\n",
      kL, top, top + ph, kL + pw, kL - 4, num(y1), num(y0), height - kB + 16, num(x0), num(x1),
      kL + pw / 2, top + ph / 2, escape(unit));
  for (size_t i = 0; i < series.size(); ++i) {
    const auto& s = series[i];
    const char* color = kColors[i % (sizeof(kColors) / sizeof(kColors[0]))];
    std::string pts;
    for (const auto& [x, y] : s.points) pts += fmt::format("{:.1f},{:.1f} ", px(x), py(y));
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
        kW - kR, 18 + 14.0 * static_cast<double>(i), color, escape(s.name), last);
  }
  o += "</svg>\n";
  return o;
}

std::string render_report_html(const ReportInput& in) {
  const auto& m = in.metrics;
  std::string body;
  auto plot = [&](const std::string& title, std::vector<PlotSeries> s, const std::string& unit) {
    s.erase(
        std::remove_if(s.begin(), s.end(), [](const PlotSeries& p) { return p.points.empty(); }),
        s.end());
    if (s.empty()) return;
    body += "<figure>" + render_svg_plot(title, s, unit) + "</figure>\n";
  };
  std::vector<PlotSeries> loss = {{"train loss", series_of(m, "loss")}};
  for (const char* k : {"val_loss", "validation_loss", "eval_loss"}) {
    auto pts = series_of(m, k);
    auto more = series_of(in.validation, k);
    pts.insert(pts.end(), more.begin(), more.end());
    if (!pts.empty()) loss.push_back({"validation loss", pts});
  }
  plot("Loss", loss, "nats/token");
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
  const auto val = series_of(m, "val_loss");
  if (!val.empty()) {
    const auto best = std::min_element(val.begin(), val.end(), [](const auto& a, const auto& b) {
      return a.second < b.second;
    });
    summary += fmt::format(
        "<p class=\"summary\">validation loss {} at step {} (best {} at step {})</p>\n",
        num(val.back().second), num(val.back().first), num(best->second), num(best->first));
  }

  std::string evals;
  if (!in.evals.empty()) {
    evals =
        "<h2>Eval answers</h2>\n<table>\n<tr><th>step</th><th>when</th><th>prompt</th>"
        "<th>answer</th></tr>\n";
    for (const auto& e : in.evals) {
      auto s = [&](const char* k) {
        if (!e.contains(k)) return std::string();
        return e[k].is_string() ? e[k].get<std::string>() : e[k].dump();
      };
      const bool stopped = !e.contains("stopped") || e["stopped"] == true;
      evals += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{}{}</td></tr>\n",
                           escape(s("step")), escape(s("when")), escape(s("prompt")),
                           escape(s("answer")),
                           stopped ? "" : " <span class=\"nostop\">[no stop token]</span>");
    }
    evals += "</table>\n";
  }
  return fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
      "<title>q4train report: {0}</title>\n<style>\n"
      "body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}\n"
      "figure {{ display: inline-block; margin: 0.5em; }}\n"
      "table {{ border-collapse: collapse; font-size: 13px; }}\n"
      "td, th {{ border: 1px solid #ccc; padding: 3px 6px; text-align: left; "
      "vertical-align: top; white-space: pre-wrap; }}\n"
      ".nostop {{ color: #a00; }}\n</style>\n</head>\n<body>\n"
      "<h1>q4train report: {0}</h1>\n{1}{2}{3}</body>\n</html>\n",
      escape(in.title), summary, body, evals);
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
