// report.html: one self-contained page per run (inline SVG line plots, inline CSS, no scripts,
// no external resources) of loss (and validation loss when records carry it), learning rate,
// gradient norm, tokens/s and memory from metrics.jsonl records, plus the eval answers from
// eval.jsonl. The trainer rewrites it on the log cadence (ReportWriter: only appended records are
// read, at most every few seconds), at every evaluation and at the end of a run; while the run
// is live the page reloads itself (a meta refresh), the final page does not.
#pragma once

#include <cstdint>
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
  int refresh_s = 0;  // > 0: the page reloads itself every refresh_s seconds (a live run)
};

// The page as a string (UTF-8). Records without a number for a series are skipped.
std::string render_report_html(const ReportInput& input);

// One inline <svg> line plot of named series (x = step). Exposed for tests.
struct PlotSeries {
  std::string name;
  std::vector<std::pair<double, double>> points;  // (step, value)
};
// Gridlines and round tick labels on both axes; `log_y` plots y on a log10 axis (ignored when a
// value is <= 0).
std::string render_svg_plot(const std::string& title, const std::vector<PlotSeries>& series,
                            const std::string& unit = "", bool log_y = false);

// Reads <run_dir>/<metrics_file> and <run_dir>/eval.jsonl (missing files: no records; bad lines
// are skipped) and writes <run_dir>/report.html atomically. Returns the path written.
std::string write_run_report(const std::string& run_dir,
                             const std::string& metrics_file = "metrics.jsonl");

// report.html of a run that is still going: keeps the records it has read and reads only the
// complete lines appended since (a file that shrank, e.g. cut back at a resume, is read again),
// so a rewrite costs the new records and one render.
class ReportWriter {
 public:
  static constexpr int kRefreshSeconds = 10;  // the live page's reload period
  ReportWriter(std::string run_dir, std::string metrics_file);
  // Writes <run_dir>/report.html atomically. `live`: with the reload tag. `min_interval_s`: skip
  // the write when the last one is more recent (0: always write). Returns whether it wrote.
  bool write(bool live, double min_interval_s = 0);

 private:
  struct Tail {
    std::string path;
    uint64_t offset = 0;  // bytes consumed (complete lines)
    std::vector<nlohmann::json> records;
    void update();
  };
  std::string run_dir_;
  Tail metrics_, evals_;
  double last_write_s_ = -1e300;  // steady-clock seconds of the last write
};

}  // namespace q4::trainer
