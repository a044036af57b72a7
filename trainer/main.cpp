// q4train: the command line. Parses flags (CLI11), resolves the config (--config or the positional
// path; built-in default: configs/demo.yaml, found through the source tree or next to the
// executable), applies --set, prints one line naming config and run directory (the trainer
// prints the run summary; the full resolved config goes to <output.dir>/config.yaml), and
// dispatches to training, --export-only, --dry-run or --probe. The only place
// that maps failures to exit codes: 0 ok, 1 runtime, 2 usage/config/input, 3 guard stop; every
// error is one line on stderr. SIGPIPE is ignored: a closed stdout (`q4train ... | head`) fails
// only the writes to it (the streams turn bad, silently), never the run.
#include <c10/util/Exception.h>
#include <torch/version.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "q4/io/process_exit.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/distributed/distributed.h"
#include "q4/trainer/objectives/distill.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/fault.h"
#include "q4/trainer/runtime/profile.h"

namespace fs = std::filesystem;
using namespace q4::trainer;

namespace {

std::string executable_dir() {
  std::error_code ec;
  const auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string() : p.parent_path().string();
}

// configs/demo.yaml: the source tree this binary was built from, then relative to the binary
// (build/bin/q4train -> ../../configs, an install prefix's share/q4train/configs).
std::string default_config_path() {
  std::vector<fs::path> candidates = {fs::path(Q4_DEFAULT_CONFIG)};
  const std::string exe = executable_dir();
  if (!exe.empty()) {
    candidates.push_back(fs::path(exe) / ".." / ".." / "configs" / "demo.yaml");
    candidates.push_back(fs::path(exe) / ".." / "share" / "q4train" / "configs" / "demo.yaml");
    candidates.push_back(fs::path(exe) / "configs" / "demo.yaml");
  }
  for (const auto& c : candidates) {
    std::error_code ec;
    if (fs::is_regular_file(c, ec)) return fs::canonical(c).string();
  }
  throw ConfigError(
      "no --config given and the built-in default configs/demo.yaml was not found "
      "(looked in " +
      std::string(Q4_DEFAULT_CONFIG) + " and next to the binary)");
}

// "rank R: " in a data-parallel run (every rank prints its own errors), else "".
std::string rank_tag() {
  const char* rank = std::getenv("RANK");
  const char* world = std::getenv("WORLD_SIZE");
  if (rank == nullptr || world == nullptr || std::string(world) == "1") return "";
  return std::string("rank ") + rank + ": ";
}

int fail(int code, const std::string& msg) {
  std::string one = msg;
  for (auto& ch : one) {
    if (ch == '\n') ch = ' ';
  }
  std::cerr << "q4train: " << (code == kExitGuard ? "" : "error: ") << one << std::endl;
  return code;
}

// The command line as given.
struct Cli {
  std::string config_path, positional_config, resume, probe_report, profile_trace;
  std::string config_reference;
  std::vector<std::string> sets;
  bool probe = false, dry_run = false, version = false, write_teacher_topk = false;
  bool overwrite = false, export_only = false, allow_schedule_change = false;
  int probe_steps = 0;
  int nproc = 0;
  int dist_timeout_s = 600;
};

void add_options(CLI::App& app, Cli& o) {
  app.add_option("-c,--config", o.config_path, "YAML config (default: configs/demo.yaml)");
  // Named apart from --config: CLI11 2.4 refuses a positional that shares an option's name.
  app.add_option("config_file", o.positional_config, "YAML config (same as --config)");
  app.add_option("--set", o.sets, "override a config value: key.path=value (repeatable)")
      ->take_all();
  app.add_option("--resume", o.resume,
                 "continue from a checkpoint directory (step_XXXXXX) or a run directory");
  app.add_flag("--overwrite", o.overwrite,
               "a fresh run in a non-empty output.dir replaces the previous run's files; with "
               "--resume (and --export-only), replace an export it would refuse (newer, another "
               "run's, of unknown origin); with --probe, any --probe-report file");
  app.add_flag("--export-only", o.export_only,
               "with --resume: export the checkpoint's model (output.export_path) and exit");
  app.add_flag("--allow-schedule-change", o.allow_schedule_change,
               "with --resume: accept a changed LR schedule (train.steps, optim.lr, "
               "optim.schedule.*)");
  app.add_flag("--write-teacher-topk", o.write_teacher_topk,
               "run distill.teacher over the training data once and write its top-K "
               "log-probabilities to distill.topk_file (offline distillation), then exit");
  app.add_flag("--probe", o.probe, "run one instrumented step and print a JSON memory report");
  app.add_option("--probe-report", o.probe_report, "where --probe writes its JSON report");
  app.add_option("--probe-steps", o.probe_steps,
                 "with --probe: N more timed steady-state steps (median step time, tok/s)")
      ->check(CLI::Range(0, 1000000));
  app.add_option("--profile-trace", o.profile_trace,
                 "write a Kineto trace (Chrome JSON) of training steps 3-4 to this file "
                 "(LibTorch 2.x)");
  app.add_flag("--dry-run", o.dry_run,
               "validate, estimate memory per component and phase, load nothing");
  app.add_option("--nproc", o.nproc,
                 "data parallel on this host: run N ranks (one per GPU with model.device: cuda; "
                 "Gloo on CPU). Several hosts: launch with torchrun --no-python")
      ->check(CLI::Range(1, 1024));
  app.add_option("--dist-timeout", o.dist_timeout_s,
                 "data parallel: seconds a rank waits for the rendezvous or a collective before "
                 "failing (a dead or hung rank) (default 600)")
      ->check(CLI::Range(1, 86400));
  app.add_flag("--version", o.version, "print the version and exit");
  app.add_option("--config-reference", o.config_reference,
                 "regenerate the config field reference in FILE (configs/README.md) from the "
                 "field table; - prints it");
}

void print_version() {
  std::cout << "q4train " << Q4_VERSION << " (LibTorch " << TORCH_VERSION
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
            << ", CUDA kernels"
#else
            << ", CPU only"
#endif
            << ")" << std::endl;
}

// --config-reference FILE: regenerates the field reference in FILE ("-": prints it).
int update_config_reference(const std::string& path) {
  if (path == "-") {
    std::cout << config_reference_markdown();
    return kExitOk;
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("--config-reference: cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  std::string updated;
  try {
    updated = splice_config_reference(text.str());
  } catch (const ConfigError& e) {
    throw ConfigError("--config-reference " + path + ": " + e.what());
  }
  if (updated != text.str()) write_file_atomic(path, updated);
  std::cout << path << (updated == text.str() ? " is up to date" : " updated") << std::endl;
  return kExitOk;
}

// Refuses flags that exclude each other or need another, before anything loads (otherwise a
// --profile-trace error, say, would come at training step 3).
void check_flags(const Cli& o, const WorldInfo& world) {
  const bool ranks = o.nproc > 1 || world.distributed();
  if (o.probe && o.dry_run) throw ConfigError("--probe and --dry-run exclude each other");
  if (o.nproc > 1 && world.distributed()) {
    throw ConfigError("--nproc launches local ranks itself; under torchrun (WORLD_SIZE=" +
                      std::to_string(world.world_size) + ") leave it out");
  }
  if (ranks && (o.probe || o.dry_run || !o.profile_trace.empty())) {
    throw ConfigError(
        "--probe, --dry-run and --profile-trace run in one process; leave out "
        "--nproc / torchrun");
  }
  if (o.probe && !o.resume.empty()) throw ConfigError("--probe and --resume exclude each other");
  if (!o.positional_config.empty() && !o.config_path.empty()) {
    throw ConfigError("config given twice: " + o.positional_config + " and --config " +
                      o.config_path + "; pass one");
  }
  if (o.export_only && o.resume.empty()) {
    throw ConfigError("--export-only needs --resume DIR (a checkpoint or a run directory)");
  }
  if (o.export_only && (o.probe || o.dry_run || ranks)) {
    throw ConfigError(
        "--export-only runs in one process; it excludes --probe, --dry-run, "
        "--nproc and torchrun");
  }
  if (o.allow_schedule_change && o.resume.empty()) {
    throw ConfigError("--allow-schedule-change applies to --resume only");
  }
  if (o.probe_steps > 0 && !o.probe) throw ConfigError("--probe-steps needs --probe");
  if (o.write_teacher_topk && (o.probe || o.dry_run || o.export_only || !o.resume.empty() ||
                               ranks || !o.profile_trace.empty())) {
    throw ConfigError(
        "--write-teacher-topk runs alone: it excludes --probe, --dry-run, --export-only, "
        "--resume, --profile-trace, --nproc and torchrun");
  }
  if (!o.profile_trace.empty() && (o.probe || o.dry_run)) {
    throw ConfigError(
        "--profile-trace traces training steps; it does not apply to --probe or "
        "--dry-run");
  }
  if (!o.profile_trace.empty() && !profiler_available()) {
    throw ConfigError("--profile-trace needs a build against LibTorch 2.x (this q4train uses " +
                      std::string(TORCH_VERSION) + ")");
  }
}

// The config the run uses: the file named (or the resumed run's, or the built-in default) with
// the --set overrides. --resume DIR writes into DIR's run directory, whatever output.dir the
// config names (a copied or moved run must never write into the original); only
// --set output.dir=... sends the outputs elsewhere.
Config resolve_config(Cli& o, const WorldInfo& world) {
  if (!o.positional_config.empty()) o.config_path = o.positional_config;
  std::vector<Override> overrides;
  for (const auto& s : o.sets) overrides.push_back(parse_override(s));
  if (o.config_path.empty()) {
    o.config_path =
        o.resume.empty() ? default_config_path() : saved_config_path_for_resume(o.resume);
  }
  // The objectives' rules after the config's own (their errors name the file too).
  Config config = load_config(o.config_path, overrides, validate_objective_config);
  const bool prints = world.rank == 0 && o.nproc <= 1;
  if (!o.resume.empty()) {
    bool dir_set = false;
    for (const auto& ov : overrides) dir_set |= ov.key == "output.dir";
    if (!dir_set) {
      const std::string note = point_config_at_run_dir(config, resume_run_dir(o.resume));
      if (!note.empty() && prints) std::cout << note << std::endl;
    }
  }
  if (prints) {
    std::cout << "q4train " << Q4_VERSION << ": config " << o.config_path << ", run directory "
              << config.output.dir << std::endl;
  }
  return config;
}

RunOptions run_options(const Cli& o, const WorldInfo& world) {
  RunOptions options;
  options.overwrite = o.overwrite;
  options.export_only = o.export_only;
  options.allow_schedule_change = o.allow_schedule_change;
  if (!o.resume.empty()) options.resume = o.resume;
  options.probe_report = o.probe_report;
  options.probe_steps = o.probe_steps;
  options.profile_trace = o.profile_trace;
  options.world = world;
  options.dist_timeout = std::chrono::seconds(o.dist_timeout_s);
  return options;
}

// The command line each local rank gets: this one without --nproc.
std::vector<std::string> rank_args(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--nproc") {
      ++i;
      continue;
    }
    if (a.rfind("--nproc=", 0) == 0) continue;
    args.push_back(a);
  }
  return args;
}

int run(Cli& o, int argc, char** argv) {
  if (!o.config_reference.empty()) return update_config_reference(o.config_reference);
  const WorldInfo world = world_from_env();
  check_flags(o, world);
  const Config config = resolve_config(o, world);
  if (o.nproc > 1) {
    // The config was read and checked above: a bad one fails here, before any rank starts.
    check_inputs_before_launch(config.model);
    return launch_local_ranks(o.nproc, rank_args(argc, argv), std::chrono::seconds(5));
  }
  if (o.dry_run) return run_dry_run(config, std::cout, o.overwrite);
  const RunOptions options = run_options(o, world);
  if (o.probe) return run_probe(config, options, std::cout, std::cerr);
  if (o.write_teacher_topk) {
    return run_write_teacher_topk(config, o.overwrite, std::cout, std::cerr);
  }
  // The failure-handling tests' fault (runtime/fault.h): read once, here.
  install_fault_plan(FaultPlan::parse(std::getenv("Q4_FAULT")));
  return run_training(config, options, std::cout, std::cerr);
}


// q4train's exit code: the command line, then the run, each failure mapped to its code.
int exit_code(int argc, char** argv) {
  std::signal(SIGPIPE, SIG_IGN);
  CLI::App app{"q4train: fine-tune NVFP4-quantized Qwen3 models (one YAML config drives a run)"};
  Cli cli;
  add_options(app, cli);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);
    return rc == 0 ? kExitOk : kExitUsage;
  }
  if (cli.version) {
    print_version();
    return kExitOk;
  }
  try {
    return run(cli, argc, argv);
  } catch (const ConfigError& e) {
    return fail(kExitUsage, rank_tag() + e.what());
  } catch (const GuardStop& e) {
    return fail(kExitGuard, rank_tag() + e.what());
  } catch (const c10::OutOfMemoryError& e) {
    // The allocator's message, then where to find what fits (docs/gpu-guide.md).
    fail(kExitRuntime, rank_tag() + e.what_without_backtrace());
    std::cerr << "q4train: --dry-run with guard.max_gpu_gb set to the card's memory (GB) lists the "
                 "placements that fit (docs/gpu-guide.md#reading-an-out-of-memory-error)"
              << std::endl;
    return kExitRuntime;
  } catch (const c10::Error& e) {
    return fail(kExitRuntime, rank_tag() + e.what_without_backtrace());
  } catch (const std::exception& e) {
    return fail(kExitRuntime, rank_tag() + e.what());
  }
}

}  // namespace

int main(int argc, char** argv) { q4::io::end_process(exit_code(argc, argv)); }
