// report.html from synthetic metrics/eval records: one SVG per available series, values and
// answers present (escaped), validation loss plotted when records carry it, and a page that
// needs nothing external (no URLs other than the SVG namespace, no scripts).
#include "q4/trainer/report/report.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "q4/io/remove_tree.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

std::vector<nlohmann::json> synthetic_metrics(bool with_val) {
  std::vector<nlohmann::json> m;
  for (int step = 1; step <= 20; ++step) {
    nlohmann::json j = {{"step", step},
                        {"total_steps", 20},
                        {"loss", 5.0 / step},
                        {"grad_norm", 1.0 + 0.1 * step},
                        {"lr", 1e-3},
                        {"tokens_per_s", 1000.0 + step},
                        {"mfu", nullptr},
                        {"gpu_reserved_bytes", nullptr},
                        {"gpu_peak_bytes", nullptr},
                        {"rss_bytes", 1073741824LL * 2},
                        {"skipped", false}};
    if (with_val && step % 5 == 0) j["val_loss"] = 6.0 / step;
    m.push_back(j);
  }
  return m;
}

TEST(Report, PlotsValuesAndAnswersWithoutExternalResources) {
  ReportInput in;
  in.title = "runs/demo";
  in.metrics = synthetic_metrics(/*with_val=*/true);
  in.evals = {
      {{"step", 20},
       {"when", "end"},
       {"prompt", "Who are you?"},
       {"answer", "我是 <b>F#</b> 之神。"},
       {"stopped", true}},
      {{"step", 0}, {"when", "start"}, {"prompt", "2+2?"}, {"answer", "x"}, {"stopped", false}}};
  const std::string html = render_report_html(in);
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("</html>"), std::string::npos);
  // loss(+val), lr, grad norm, tokens/s, memory (RSS only); no MFU plot (all null).
  EXPECT_EQ(count(html, "<svg"), 5u);
  EXPECT_EQ(count(html, "</svg>"), 5u);
  EXPECT_NE(html.find("validation loss"), std::string::npos);
  EXPECT_EQ(html.find("MFU"), std::string::npos);
  EXPECT_GE(count(html, "<polyline"), 5u);
  EXPECT_NE(html.find("(last 0.25)"), std::string::npos);  // final train loss 5/20
  EXPECT_NE(html.find("(last 0.3)"), std::string::npos);   // final val loss 6/20
  EXPECT_NE(html.find("(last 1020)"), std::string::npos);  // tokens/s
  EXPECT_NE(html.find("(last 2)"), std::string::npos);     // RSS GiB
  // Answers are present and escaped; the one without a stop token is marked.
  EXPECT_NE(html.find("我是 &lt;b&gt;F#&lt;/b&gt; 之神。"), std::string::npos);
  EXPECT_EQ(html.find("<b>F#"), std::string::npos);
  EXPECT_EQ(count(html, "[no stop token]"), 1u);
  // Self-contained: no scripts, no links, the only URL is the SVG namespace.
  EXPECT_EQ(html.find("<script"), std::string::npos);
  EXPECT_EQ(html.find("<link"), std::string::npos);
  EXPECT_EQ(html.find("src="), std::string::npos);
  const std::regex url("https?://[^\" ]+");
  for (auto it = std::sregex_iterator(html.begin(), html.end(), url); it != std::sregex_iterator();
       ++it) {
    EXPECT_EQ(it->str(), "http://www.w3.org/2000/svg");
  }
}

TEST(Report, EmptyAndSinglePointSeries) {
  EXPECT_NE(render_svg_plot("x", {}).find("no data"), std::string::npos);
  const std::string one = render_svg_plot("loss", {{"loss", {{1, 2.5}}}});
  EXPECT_NE(one.find("<circle"), std::string::npos);
  EXPECT_NE(one.find("(last 2.5)"), std::string::npos);
  ReportInput in;
  const std::string html = render_report_html(in);
  EXPECT_NE(html.find("no metrics recorded yet"), std::string::npos);
  EXPECT_EQ(count(html, "<svg"), 0u);
}

// The preference report's long titles: the title, each legend line and the unit label each have
// a row of their own above the plot area (on one row a right-aligned legend ran into the title).
TEST(Report, LegendRowsBelowTheTitle) {
  const std::string svg = render_svg_plot(
      "Rewards (beta x log-probability gain over the reference)",
      {{"chosen", {{1, 0.5}, {2, 1.0}}}, {"rejected", {{1, -0.5}, {2, -1.0}}}}, "reward");
  const std::regex text("<text x=\"[0-9.]+\" y=\"([0-9.]+)\"[^>]*>([^<]*)</text>");
  double title = -1, unit = -1;
  std::vector<double> legend;
  for (auto it = std::sregex_iterator(svg.begin(), svg.end(), text); it != std::sregex_iterator();
       ++it) {
    const double y = std::stod((*it)[1].str());
    const std::string what = (*it)[2].str();
    if (what.rfind("Rewards", 0) == 0) title = y;
    if (what.find("(last ") != std::string::npos) legend.push_back(y);
    if (what == "reward") unit = y;
  }
  ASSERT_GT(title, 0) << svg;
  ASSERT_EQ(legend.size(), 2u) << svg;
  ASSERT_GT(unit, 0) << svg;
  // 14 px text: rows at least 14 apart.
  EXPECT_GE(legend[0], title + 14) << svg;
  EXPECT_GE(legend[1], legend[0] + 14) << svg;
  EXPECT_GE(unit, legend[1] + 14) << svg;
}

TEST(Report, WriteRunReportReadsTheRunFiles) {
  const fs::path dir = fs::path(::testing::TempDir()) / ("q4_report_" + std::to_string(::getpid()));
  q4::io::remove_tree(dir);
  fs::create_directories(dir);
  {
    std::ofstream m(dir / "metrics.jsonl");
    for (const auto& j : synthetic_metrics(false)) m << j.dump() << "\n";
    m << "not json\n";  // a torn last line (killed run) is skipped
    std::ofstream(dir / "eval.jsonl")
        << R"({"step": 20, "when": "end", "prompt": "p", "answer": "the answer", "stopped": true})"
        << "\n";
  }
  const std::string path = write_run_report(dir.string());
  EXPECT_EQ(path, (dir / "report.html").string());
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  EXPECT_EQ(count(ss.str(), "<svg"), 5u);
  EXPECT_NE(ss.str().find("the answer"), std::string::npos);
  EXPECT_EQ(ss.str().find("validation loss"), std::string::npos);
  q4::io::remove_tree(dir);
}

}  // namespace
// The summary counts step records only (a validation record of step 0 carries no loss) and
// names the last and the best validation loss.
TEST(Report, SummaryCountsStepsAndNamesBestValidationLoss) {
  ReportInput in;
  in.metrics = synthetic_metrics(/*with_val=*/true);  // val 1.2 at 5, 0.6 at 10, 0.4 at 15, 0.3
  in.metrics.insert(in.metrics.begin(), nlohmann::json{{"step", 0}, {"val_loss", 9.5}});
  in.metrics[15]["val_loss"] = 0.25;  // step 15 beats step 20's 0.3
  const std::string html = render_report_html(in);
  EXPECT_NE(html.find("20 steps logged; last step 20"), std::string::npos) << html;
  EXPECT_NE(html.find("validation loss 0.3 at step 20 (best 0.25 at step 15)"), std::string::npos)
      << html;
}

}  // namespace q4::trainer

namespace q4::trainer {
namespace {

// Readable axes: gridlines and round tick labels on both axes, the loss on a log axis (ticks at
// 1, 2, 5 x 10^k), a linear axis where a value is not positive.
TEST(Report, AxesHaveTicksGridlinesAndALogLossScale) {
  std::vector<std::pair<double, double>> pts;
  for (int step = 1; step <= 100; ++step) pts.emplace_back(step, 12.0 / step);  // 12 .. 0.12
  const std::string log_plot = render_svg_plot("Loss", {{"loss", pts}}, "nats/token", true);
  EXPECT_NE(log_plot.find("nats/token (log scale)"), std::string::npos);
  for (const char* tick : {">0.2<", ">0.5<", ">1<", ">2<", ">5<", ">10<"}) {
    EXPECT_NE(log_plot.find(tick), std::string::npos) << tick << "\n" << log_plot;
  }
  for (const char* tick : {">20<", ">40<", ">60<", ">80<", ">100<"}) {  // steps
    EXPECT_NE(log_plot.find(tick), std::string::npos) << tick;
  }
  EXPECT_GE(count(log_plot, "stroke=\"#e4e4e4\""), 10u);  // gridlines
  // A value <= 0 cannot go on a log axis: the plot falls back to linear.
  const std::string lin = render_svg_plot("Loss", {{"loss", {{1, -1.0}, {2, 3.0}}}}, "", true);
  EXPECT_EQ(lin.find("log scale"), std::string::npos);
  ReportInput in;
  in.metrics = {{{"step", 1}, {"loss", 5.0}}, {{"step", 2}, {"loss", 4.0}}};
  EXPECT_NE(render_report_html(in).find("(log scale)"), std::string::npos);
}

// A long run's lines are thinned to a bounded number of vertices, the last point kept.
TEST(Report, LongSeriesAreThinned) {
  std::vector<std::pair<double, double>> pts;
  for (int step = 1; step <= 100001; ++step) pts.emplace_back(step, 1.0 + 1.0 / step);
  const std::string svg = render_svg_plot("x", {{"x", pts}});
  EXPECT_LT(svg.size(), 100000u);
  EXPECT_NE(svg.find("(last 1)"), std::string::npos);
}

// ReportWriter: live pages reload themselves, the final one does not; records appended between
// writes appear; a torn last line waits; a file cut back (resume) is read again; the interval
// skips writes.
TEST(Report, ReportWriterReadsAppendedRecordsAndMarksLivePages) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("q4_report_live_" + std::to_string(::getpid()));
  q4::io::remove_tree(dir);
  fs::create_directories(dir);
  const auto page = [&] {
    std::ifstream in(dir / "report.html");
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  };
  ReportWriter w(dir.string(), "metrics.jsonl");
  EXPECT_TRUE(w.write(/*live=*/true));
  EXPECT_NE(page().find("no metrics recorded yet"), std::string::npos);
  EXPECT_NE(page().find("<meta http-equiv=\"refresh\" content=\"10\">"), std::string::npos);
  {
    std::ofstream m(dir / "metrics.jsonl", std::ios::app);
    m << R"({"step": 1, "loss": 4.0})"
      << "\n"
      << R"({"step": 2, "loss": 3.0})"
      << "\n"
      << R"({"step": 3, "lo)";  // being written
  }
  EXPECT_TRUE(w.write(true));
  EXPECT_NE(page().find("2 steps logged; last step 2"), std::string::npos) << page();
  {
    std::ofstream m(dir / "metrics.jsonl", std::ios::app);
    m << R"(ss": 2.5})"
      << "\n";
  }
  EXPECT_FALSE(w.write(true, /*min_interval_s=*/3600));  // too soon: skipped
  EXPECT_TRUE(w.write(/*live=*/false));
  EXPECT_NE(page().find("3 steps logged; last step 3"), std::string::npos) << page();
  EXPECT_EQ(page().find("http-equiv"), std::string::npos);
  std::ofstream(dir / "metrics.jsonl", std::ios::trunc) << R"({"step": 1, "loss": 4.0})"
                                                        << "\n";
  EXPECT_TRUE(w.write(false));
  EXPECT_NE(page().find("1 steps logged; last step 1"), std::string::npos) << page();
  q4::io::remove_tree(dir);
}

}  // namespace
}  // namespace q4::trainer
