// The probe (--probe): the training set-up and the one step function with every phase marked
// (device sync, time, allocator and RSS), then --probe-steps more steps timed per phase, an
// export to a temporary file, and the JSON report (probe.h). Nothing is written to output.dir
// but the report.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "q4/model/dat_file.h"
#include "q4/trainer/app/probe.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/metrics.h"
#include "q4/trainer/runtime/nvtx.h"
#include "q4/trainer/step/step.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Steady state: `steps` more steps of the same function, timed per phase with a device sync at
// each boundary (the syncs cost a little; the step time is their sum). The report's
// info.steady.
nlohmann::json steady_state(TrainStep& step, data::Batcher& batcher, const at::Device& device,
                            int steps, std::ostream& err) {
  NvtxRange rs("steady");
  std::vector<double> fwd_ms, bwd_ms, opt_ms, step_ms;
  double last_loss = 0.0;
  int64_t tokens = 0, slots = 0;
  for (int s = 0; s < steps; ++s) {
    synchronize_device(device);
    auto tp = Clock::now();
    const auto t0 = tp;
    double f = 0, b = 0;
    const StepOutcome so = step.run(1 + s, batcher, [&](const char* phase) {
      synchronize_device(device);
      const double ms = ms_since(tp);
      tp = Clock::now();
      if (std::string(phase) == "forward_done") f += ms;
      if (std::string(phase) == "backward_done") b += ms;
      if (std::string(phase) == "optimizer_step_done") opt_ms.push_back(ms);
    });
    fwd_ms.push_back(f);
    bwd_ms.push_back(b);
    step_ms.push_back(ms_since(t0));
    last_loss = so.loss;
    tokens += so.real_tokens;
    slots += so.slots;
  }
  const double step_med = median(step_ms);
  const double tok_per_step = static_cast<double>(tokens) / steps;
  const auto mem = memory_snapshot(device);
  nlohmann::json steady = {
      {"steps", steps},
      {"step_ms_median", step_med},
      {"forward_ms_median", median(fwd_ms)},
      {"backward_ms_median", median(bwd_ms)},
      {"optimizer_ms_median", median(opt_ms)},
      {"tokens_per_step", tok_per_step},
      {"slot_fill", slots > 0 ? static_cast<double>(tokens) / slots : 0.0},
      {"tokens_per_s", tok_per_step / (step_med / 1e3)},
      {"peak_allocated_bytes", mem.peak_allocated_bytes ? nlohmann::json(*mem.peak_allocated_bytes)
                                                        : nlohmann::json(nullptr)},
      {"last_loss", last_loss}};
  err << fmt::format(
      "probe: steady state, median of {} steps: step {:.1f} ms (forward {:.1f}, backward "
      "{:.1f}, optimizer {:.1f}), {:.0f} tok/s{}\n",
      steps, step_med, median(fwd_ms), median(bwd_ms), median(opt_ms),
      tok_per_step / (step_med / 1e3),
      mem.peak_allocated_bytes ? fmt::format(", peak {:.2f} GiB", to_gib(*mem.peak_allocated_bytes))
                               : std::string());
  reset_peak_memory(device);
  return steady;
}

// The export's cost, to a temporary file that is then removed.
void probe_export(RunSetup& setup, bool quantize_lm_head) {
  NvtxRange r("export");
  const fs::path tmp = fs::temp_directory_path() /
                       fmt::format("q4train-probe-{}.dat", static_cast<int64_t>(::getpid()));
  if (setup.source_path().empty()) {
    model::write_dat(setup.model(), tmp.string(), quantize_lm_head);
  } else {
    model::DatReader source(setup.source_path());
    setup.model().export_to(source, tmp.string());
  }
  fs::remove(tmp);
}

}  // namespace

int run_probe(const Config& config, const RunOptions& options, std::ostream& out,
              std::ostream& err) {
  check_device_available(config);
  RunPlan plan = resolve_plan(config, options, /*probe=*/true);
  const ProbePlan pp = plan.probe_plan();
  const at::Device& device = plan.device();
  std::vector<ProbePhase> phases;
  const auto t_start = Clock::now();
  auto t_prev = t_start;
  auto mark = [&](const std::string& name) {
    synchronize_device(device);
    ProbePhase p;
    p.name = name;
    p.elapsed_ms = ms_since(t_start);
    p.phase_ms = std::chrono::duration<double, std::milli>(Clock::now() - t_prev).count();
    p.memory = memory_snapshot(device);
    phases.push_back(p);
    err << fmt::format("probe: {:<20} {:>9.1f} ms  rss {:.2f} GiB", name, p.phase_ms,
                       to_gib(p.memory.rss_bytes))
        << (p.memory.peak_allocated_bytes ? fmt::format("  peak {:.2f} GiB  reserved {:.2f} GiB",
                                                        to_gib(*p.memory.peak_allocated_bytes),
                                                        to_gib(*p.memory.reserved_bytes))
                                          : std::string())
        << "\n";
    reset_peak_memory(device);
    t_prev = Clock::now();
  };
  plan.check_inputs(/*need_data=*/false);
  for (const auto& f : pp.data_files) require_file(f, "data.files");
  const std::string path = options.probe_report.empty()
                               ? (fs::path(pp.output_dir) / kProbeFile).string()
                               : options.probe_report;
  check_probe_report_path(path, options.overwrite);  // before anything loads
  reset_peak_memory(device);
  mark("start");
  RunSetup setup(out, err, /*probe=*/true);
  plan = setup.load_model(plan, /*need_tokenizer=*/!pp.data_files.empty());
  mark("model_loaded");
  // The moments exist before the first forward, as in a training run from its second step on:
  // otherwise the backward's peak would miss them.
  GradSync sync(nullptr, setup.model(), setup.model().trainable_parameters());
  {
    NvtxRange r("optimizer_setup");
    setup.make_optimizer(plan, sync);
  }
  plan = setup.load_data(plan, 1);
  const auto objective =
      make_objective(plan.objective_plan(), setup.model(), setup.batcher(), nullptr,
                     /*leader=*/false, out);
  TrainStep step(plan, setup.model(), setup.optimizer(), setup.schedule(), *objective, sync,
                 nullptr, plan.step().in_backward, setup.optimizer_index());
  mark("optimizer_ready");
  const StepOutcome first = step.run(0, *setup.batcher(), [&](const char* phase) { mark(phase); });
  nlohmann::json steady = nullptr;
  if (options.probe_steps > 0) {
    steady = steady_state(step, *setup.batcher(), device, options.probe_steps, err);
    t_prev = Clock::now();
  }
  probe_export(setup, pp.quantize_lm_head);
  mark("export_done");

  const auto budget = plan.memory_estimate(setup.model_config(), setup.separate_lm_head());
  // The settings as resolved (the recompute chosen at load), then what the probe measured.
  nlohmann::json info = plan.probe_settings();
  info["tokens"] = first.real_tokens;
  info["slots"] = first.slots;
  info["in_backward"] = step.in_backward();
  info["loss"] = first.loss;
  info["grad_norm"] = first.res.grad_norm;
  info["step_applied"] = first.res.applied;
  info["trainable_elements"] = setup.model().num_trainable_elements();
  info["steady"] = steady;
  const auto report = probe_report_json(device_name(device), phases, budget.to_json(), info);
  if (!fs::path(path).parent_path().empty()) fs::create_directories(fs::path(path).parent_path());
  write_file_atomic(path, report.dump(2) + "\n");
  out << report.dump(2) << "\n";
  err << "probe report written to " << path << "\n";
  return kExitOk;
}

}  // namespace q4::trainer
