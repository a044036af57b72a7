// The step record: the log line keeps its fixed field order and units, metrics.jsonl carries
// the same values (null where unknown), and a resumed run drops the lines after its checkpoint.
#include "q4/trainer/runtime/metrics.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q4/trainer/runtime/memory.h"

namespace fs = std::filesystem;
using namespace q4::trainer;

namespace {
StepMetrics sample() {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 200;
  m.loss = 3.45212;
  m.grad_norm = 1.234;
  m.lr = 1e-3;
  m.step_ms = 123.44;
  m.tokens = 4096;
  m.tokens_per_s = 33181.9;
  m.rss_bytes = int64_t{3} << 30;
  m.eta_s = 83;
  return m;
}
}  // namespace

TEST(Metrics, LogLineFixedFormat) {
  StepMetrics m = sample();
  EXPECT_EQ(format_log_line(m),
            "step  12/200 | loss 3.4521 | gnorm 1.234e+00 | lr 1.00e-03 | 123.4 ms | 33182 tok/s "
            "| mfu - | mem rss 3.00 GiB | eta 1m23s");
  m.mfu = 0.4567;
  m.gpu_reserved_bytes = int64_t{40} << 30;
  m.skipped = true;
  EXPECT_EQ(format_log_line(m),
            "step  12/200 | loss 3.4521 | gnorm 1.234e+00 | lr 1.00e-03 | 123.4 ms | 33182 tok/s "
            "| mfu 45.7% | mem 40.00 GiB | eta 1m23s | skipped (non-finite)");
}

// Mixture-of-experts models: the routers after the losses in the line, moe_* keys in the record;
// none of them for a dense model.
TEST(Metrics, RouterFieldsInLineAndRecord) {
  StepMetrics m = sample();
  EXPECT_FALSE(metrics_to_json(m).contains("moe_aux_loss"));
  m.loss_avg = 3.9;
  m.router = StepMetrics::Router{8.0123, 1.934, 0.271, 2.05, 0};
  EXPECT_EQ(format_log_line(m),
            "step  12/200 | loss 3.4521 (avg 3.9000) | aux 8.012 load 1.93/0.27 | gnorm 1.234e+00 "
            "| lr 1.00e-03 | 123.4 ms | 33182 tok/s | mfu - | mem rss 3.00 GiB | eta 1m23s");
  const auto j = metrics_to_json(m);
  EXPECT_DOUBLE_EQ(j["moe_aux_loss"].get<double>(), 8.0123);
  EXPECT_DOUBLE_EQ(j["moe_max_load"].get<double>(), 1.934);
  EXPECT_DOUBLE_EQ(j["moe_min_load"].get<double>(), 0.271);
  EXPECT_DOUBLE_EQ(j["moe_router_entropy"].get<double>(), 2.05);
  EXPECT_EQ(j["moe_dropped_tokens"], 0);
}

TEST(Metrics, JsonHasSameFieldsAndNulls) {
  StepMetrics m = sample();
  auto j = metrics_to_json(m);
  EXPECT_EQ(j["step"], 12);
  EXPECT_EQ(j["total_steps"], 200);
  EXPECT_DOUBLE_EQ(j["loss"].get<double>(), 3.45212);
  EXPECT_DOUBLE_EQ(j["grad_norm"].get<double>(), 1.234);
  EXPECT_DOUBLE_EQ(j["lr"].get<double>(), 1e-3);
  EXPECT_DOUBLE_EQ(j["step_ms"].get<double>(), 123.44);
  EXPECT_EQ(j["tokens"], 4096);
  EXPECT_TRUE(j["mfu"].is_null());
  EXPECT_TRUE(j["gpu_reserved_bytes"].is_null());
  EXPECT_EQ(j["rss_bytes"], int64_t{3} << 30);
  m.loss = std::nan("");
  m.mfu = 0.5;
  j = metrics_to_json(m);
  EXPECT_TRUE(j["loss"].is_null());  // JSON has no NaN
  EXPECT_DOUBLE_EQ(j["mfu"].get<double>(), 0.5);
}

TEST(Metrics, Durations) {
  EXPECT_EQ(format_duration(0), "0s");
  EXPECT_EQ(format_duration(59.4), "59s");
  EXPECT_EQ(format_duration(187), "3m07s");
  EXPECT_EQ(format_duration(7500), "2h05m");
  EXPECT_EQ(format_duration(-1), "-");
  EXPECT_EQ(format_progress_bar(5, 10, 10), "[#####.....] 5/10");
  EXPECT_EQ(format_progress_bar(5, 10, 10, 2.345678, 187),
            "[#####.....] 5/10 loss 2.3457 eta 3m07s");
  EXPECT_EQ(format_progress_bar(5, 10, 10, std::nan(""), 0), "[#####.....] 5/10 eta 0s");
}

// The window average and the validation loss: in the log line after the loss, in the record
// only when set.
TEST(Metrics, WindowAverageAndValidationLoss) {
  StepMetrics m;
  m.step = 12;
  m.total_steps = 200;
  m.loss = 2.31;
  nlohmann::json j = metrics_to_json(m);
  EXPECT_FALSE(j.contains("loss_avg"));
  EXPECT_FALSE(j.contains("val_loss"));
  EXPECT_TRUE(format_log_line(m).rfind("step  12/200 | loss 2.3100 | gnorm", 0) == 0)
      << format_log_line(m);
  m.loss_avg = 2.87;
  m.val_loss = 2.5;
  m.val_tokens = 1234;
  EXPECT_TRUE(format_log_line(m).rfind("step  12/200 | loss 2.3100 (avg 2.8700) | val 2.5000 | "
                                       "gnorm",
                                       0) == 0)
      << format_log_line(m);
  j = metrics_to_json(m);
  EXPECT_DOUBLE_EQ(j["loss_avg"].get<double>(), 2.87);
  EXPECT_DOUBLE_EQ(j["val_loss"].get<double>(), 2.5);
  EXPECT_EQ(j["val_tokens"].get<int64_t>(), 1234);
  m.val_loss = std::nan("");
  EXPECT_TRUE(metrics_to_json(m)["val_loss"].is_null());
}

TEST(Metrics, JsonlResumeDropsLaterSteps) {
  const fs::path p = fs::temp_directory_path() / ("q4_metrics_" + std::to_string(::getpid()));
  {
    JsonlWriter w;
    w.open(p.string(), 0);  // fresh run: empty file
    for (int s = 1; s <= 6; ++s) w.write({{"step", s}});
  }
  {
    JsonlWriter w;
    w.open(p.string(), 4);  // resumed from step 4: steps 5, 6 are dropped
    w.write({{"step", 5}, {"again", true}});
  }
  std::ifstream in(p);
  std::vector<nlohmann::json> lines;
  std::string line;
  while (std::getline(in, line)) lines.push_back(nlohmann::json::parse(line));
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_EQ(lines[3]["step"], 4);
  EXPECT_EQ(lines[4]["step"], 5);
  EXPECT_TRUE(lines[4]["again"].get<bool>());
  fs::remove(p);
}

// A line cut by a crash or a full disk must not survive a resume (it used to be kept
// and broke every later reader of metrics.jsonl).
TEST(Metrics, JsonlResumeDropsACutLine) {
  const fs::path p = fs::temp_directory_path() / ("q4_metrics_cut_" + std::to_string(::getpid()));
  std::ofstream(p) << "{\"step\": 1}\n{\"step\": 2, \"lo";
  {
    JsonlWriter w;
    w.open(p.string(), 4);
    w.write({{"step", 5}});
    w.close();
  }
  std::ifstream in(p);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_EQ(nlohmann::json::parse(lines[0])["step"], 1);
  EXPECT_EQ(nlohmann::json::parse(lines[1])["step"], 5);
  fs::remove(p);
}

TEST(Memory, RssTracksTouchedPages) {
  const int64_t before = process_rss_bytes();
  EXPECT_GT(before, 0);
  std::vector<char> big(256 << 20, 1);  // 256 MiB touched
  const int64_t after = process_rss_bytes();
  EXPECT_GT(after - before, int64_t{200} << 20);  // page granularity and allocator slack
  EXPECT_EQ(big[12345], 1);
}

TEST(Memory, CpuSnapshotHasNoDeviceFields) {
  const auto s = memory_snapshot(c10::Device(c10::kCPU));
  EXPECT_GT(s.rss_bytes, 0);
  EXPECT_FALSE(s.allocated_bytes.has_value());
  EXPECT_FALSE(s.reserved_bytes.has_value());
  EXPECT_FALSE(s.device_used_bytes.has_value());
  EXPECT_FALSE(s.device_total_bytes.has_value());
  EXPECT_EQ(device_name(c10::Device(c10::kCPU)), "cpu");
}

TEST(Memory, KnownPeaks) {
  EXPECT_DOUBLE_EQ(*device_peak_flops("NVIDIA H100 80GB HBM3"), 989e12);
  EXPECT_DOUBLE_EQ(*device_peak_flops("NVIDIA H200"), 989e12);
  EXPECT_FALSE(device_peak_flops("NVIDIA H100 PCIe").has_value());
  EXPECT_FALSE(device_peak_flops("cpu").has_value());
}

// The epoch (completed passes plus the fraction of the current one) follows the step in the log
// line and is a field of the record; absent without training data.
TEST(Metrics, EpochInLogLineAndRecord) {
  StepMetrics m = sample();
  EXPECT_FALSE(metrics_to_json(m).contains("epoch"));
  m.epoch = 1.5;
  EXPECT_TRUE(format_log_line(m).rfind("step  12/200 | epoch 1.50 | loss 3.4521 | gnorm", 0) == 0)
      << format_log_line(m);
  EXPECT_DOUBLE_EQ(metrics_to_json(m)["epoch"].get<double>(), 1.5);
}
