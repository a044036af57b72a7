// The per-step record: one fixed-format log line for humans and one JSON object per line in
// metrics.jsonl with the same fields. Numbers that are unknown (MFU without a known device peak,
// GPU memory on CPU) are printed as "-" and written as null.
#pragma once

#include <chrono>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>

#include "q4/io/atomic_file.h"

namespace q4::trainer {

struct StepMetrics {
  int64_t step = 0;  // 1-based step just finished
  int64_t total_steps = 0;
  // Passes over the training data so far: completed epochs plus the fraction of the current one
  // (examples taken from its order / examples); unset when there is no training data.
  std::optional<double> epoch;
  double loss = 0;       // mean supervised-token cross-entropy of the step
  double grad_norm = 0;  // global L2 norm before clipping
  double lr = 0;         // learning rate used by this step
  double step_ms = 0;    // wall time of the step
  int64_t tokens = 0;    // supervised + context tokens processed by the step (no padding)
  int64_t slots = 0;     // token slots of the step's batches (tokens + padding)
  double tokens_per_s = 0;
  std::optional<double> mfu;                  // model FLOPs utilization in [0, 1]
  std::optional<int64_t> gpu_reserved_bytes;  // caching allocator reserved
  std::optional<int64_t> gpu_peak_bytes;      // allocator peak allocated during the step
  int64_t rss_bytes = 0;
  double eta_s = 0;      // remaining steps x mean step time
  bool skipped = false;  // non-finite gradients: update skipped
  // Logged steps: token-weighted mean loss of the steps since the previous log line (this one
  // included); unset on the other steps.
  std::optional<double> loss_avg;
  // Steps where the validation loss was computed: token-weighted mean CE over every held-out
  // example (no grad), and its supervised-token count.
  std::optional<double> val_loss;
  int64_t val_tokens = 0;
  // Mixture-of-experts models, logged steps: the routers (docs/trainer.md#logs). The loads and
  // the entropy are the step's last forward's (model::RouterStats).
  struct Router {
    double aux_loss = 0;         // load-balancing loss (no coefficient), mean over the log window
    double max_load = 0;         // busiest expert over the MoE layers: its tokens / the mean
    double min_load = 0;         // idlest expert
    double entropy = 0;          // mean routing entropy per token over the MoE layers, nats
    int64_t dropped_tokens = 0;  // routes not computed (dropless routing: 0)
  };
  std::optional<Router> router;
};

// "step   12/200 | loss 3.4521 (avg 3.9012) | gnorm 1.234e+00 | lr 1.00e-03 | 123.4 ms |
//  1234 tok/s | mfu 12.3% | mem 12.3 GiB | eta 1m23s" (one line; "(avg ...)" when loss_avg is
//  set, "| val 2.1234" after the loss when val_loss is, "| epoch 1.50" after the step when
//  epoch is, "| aux 8.012 load 1.93/0.27" after the losses when router is: the load-balancing
//  loss and the busiest/idlest expert's load).
std::string format_log_line(const StepMetrics& m);
nlohmann::json metrics_to_json(const StepMetrics& m);
std::string format_duration(double seconds);  // "45s", "3m07s", "2h05m"
// Milliseconds since `t0` on the steady clock (phase and step timings).
double ms_since(std::chrono::steady_clock::time_point t0);
// A text progress bar: "[#####.....] 12/200", then " loss 2.3456" when `loss` is finite and
// " eta 1m23s" when `eta_s` >= 0.
std::string format_progress_bar(int64_t step, int64_t total, int width = 30,
                                double loss = std::nan(""), double eta_s = -1);

// Appends JSON lines to a file, flushing each line (a killed run keeps what it logged).
class JsonlWriter {
 public:
  JsonlWriter() = default;
  // Opens `path` for appending; with `keep_until_step` set, first drops lines whose "step" is
  // greater (a resumed run rewrites the steps after its checkpoint).
  void open(const std::string& path, std::optional<int64_t> keep_until_step = std::nullopt);
  bool is_open() const { return out_.is_open(); }
  void write(const nlohmann::json& j);  // one line, checked (throws naming the file)
  void close();                         // fsync + checked close
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  io::AppendFile out_;
};

}  // namespace q4::trainer
