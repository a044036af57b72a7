// report.html: one self-contained page per run (inline SVG line plots, inline CSS, no scripts,
// no external resources) of loss (and validation loss when records carry it), learning rate,
// gradient norm, tokens/s and memory from metrics.jsonl records, plus the eval answers from
// eval.jsonl. The trainer rewrites it at every evaluation and at the end of a run.
#pragma once

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace q4::trainer {

struct ReportInput {
  std::string title;                       // e.g. the run directory
  std::vector<nlohmann::json> metrics;     // metrics.jsonl records (metrics_to_json); val_loss,
                                           // validation_loss or eval_loss keys are plotted too
  std::vector<nlohmann::json> evals;       // eval.jsonl records (step, when, prompt, answer, ...)
  std::vector<nlohmann::json> validation;  // optional {"step", "val_loss"} records
};

// The page as a string (UTF-8). Records without a number for a series are skipped.
std::string render_report_html(const ReportInput& input);

// One inline <svg> line plot of named series (x = step). Exposed for tests.
struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, value)
};
std::string render_svg_plot(const std::string& title, const std::vector<PlotSeries>& series,
                            const std::string& unit = "");

// Reads <run_dir>/<metrics_file> and <run_dir>/eval.jsonl (missing files: no records; bad lines
// are skipped) and writes <run_dir>/report.html atomically. Returns the path written.
std::string write_run_report(const std::string& run_dir,
                             const std::string& metrics_file = "metrics.jsonl");

}  // namespace q4::trainer
