// The q4train entry points: a training run (load masters from a .dat or a random init written
// to <dir>/init.dat, tokenize data, then train with gradient accumulation, clipping, schedule and
// the non-finite guard; eval, export, checkpoints, resume, graceful stop on SIGINT/SIGTERM and
// the GPU-memory guard), --dry-run (estimate only) and --probe (instrumented steps with a JSON
// report). The run is built from the components in docs/design.md#trainer-components. Output
// goes to the given streams; nothing calls exit().
#pragma once

#include <chrono>
#include <iosfwd>
#include <optional>
#include <stdexcept>
#include <string>

#include "q4/model/qwen3.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/distributed/distributed.h"
#include "q4/trainer/plan/run_plan.h"

namespace q4::trainer {

// Trains as configured. Returns kExitOk (also after a signal-triggered checkpoint); throws
// ConfigError for input problems (files, data, shapes), GuardStop, or c10::Error at runtime.
int run_training(const Config& config, const RunOptions& options, std::ostream& out,
                 std::ostream& err);

// Checks what a run checks before its first step without loading weights: inputs exist,
// config.json parses, the data loads (formats, counts, truncation, tokens with the real
// tokenizer, the batcher's packing), the run length resolves, the device is usable. Prints the
// memory estimate (whole-run terms, each phase of a step, the peak phase) and the resolved
// config. Output paths are checked as the run checks them (`overwrite`: --overwrite). Returns
// kExitOk or throws ConfigError.
int run_dry_run(const Config& config, std::ostream& out, bool overwrite = false);

// The training set-up and step function with instrumentation: one step with every phase marked
// (sync, time, memory), on the configured data or, without data.files, on synthetic random-token
// rows through the same batcher; prints the JSON report and writes it to options.probe_report.
// With options.probe_steps > 0, that many more steps follow, each phase timed with a device
// sync; their medians, tokens/s, slot fill and peak memory go to the report's info.steady.
int run_probe(const Config& config, const RunOptions& options, std::ostream& out,
              std::ostream& err);

// The config that a run directory saved (`<run_dir>/config.yaml`) for `--resume DIR` without
// --config; DIR may be the run directory or one of its checkpoints.
std::string saved_config_path_for_resume(const std::string& resume_dir);

}  // namespace q4::trainer
