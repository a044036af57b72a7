// Run-directory layout, protection and checkpoints. A run directory holds config.yaml,
// metrics.jsonl, eval.jsonl, the export, step_XXXXXX/ checkpoints and a .lock file that a live
// run holds (flock) for its whole duration. A checkpoint counts only once its DONE marker exists
// (written last, fsynced): a crash mid-write leaves a directory without DONE, which resume
// ignores and rotation removes. checksums.json (CRC32C of every checkpoint file, written before
// DONE) is verified at resume. Every output path is checked before the first step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "q4/io/atomic_file.h"
#include "q4/trainer/config/config.h"

namespace q4::trainer {

inline constexpr const char* kDoneMarker = "DONE";
inline constexpr const char* kChecksumFile = "checksums.json";  // in each checkpoint
inline constexpr const char* kLockFile = ".lock";
inline constexpr const char* kConfigFile = "config.yaml";
inline constexpr const char* kEvalFile = "eval.jsonl";
inline constexpr const char* kInitFile = "init.dat";
inline constexpr const char* kProbeFile = "probe.json";
// train.objective preference: the reference's log-probabilities of every answer, computed once.
inline constexpr const char* kReferenceFile = "reference_logprobs.dat";

struct DistillConfig;

// The run directory's paths and the run's inputs as configured: what the output-path rules, the
// leftovers and the start-up cleaning read (plan/options.h run_paths makes it from a config).
struct RunPaths {
  std::string output_dir;     // output.dir
  std::string export_path;    // output.export_path resolved against output.dir ("" for none)
  std::string metrics;        // log.metrics (a name in output.dir, "" for none)
  bool report = true;         // log.report: <output.dir>/report.html
  bool hf_export = false;     // output.hf_export set: the HF folder next to the export
  bool lora = false;          // train.method lora: the adapter folder next to the export
  bool random_init = false;   // model.init random: <output.dir>/init.dat
  std::string config_source;  // the config file (Config::source)
  std::string model_config;   // model.config
  std::string tokenizer;      // model.tokenizer
  std::string weights;        // model.weights (an input only with model.init file)
  std::vector<std::string> data_files, eval_files;  // data.files, data.eval_files
};

struct CheckpointDir {
  std::string path;
  int64_t step = 0;
  bool done = false;  // DONE marker present
};

std::string checkpoint_dir_name(int64_t step);  // "step_000012"
// Every step_XXXXXX directory under run_dir, sorted by step (complete or not).
std::vector<CheckpointDir> list_checkpoints(const std::string& run_dir);
// Newest complete checkpoint, if any.
std::optional<CheckpointDir> latest_checkpoint(const std::string& run_dir);
// Writes the DONE marker (content: the step) with fsync, then fsyncs the directory.
void mark_checkpoint_done(const std::string& ckpt_dir, int64_t step);
// Keeps the newest `keep` complete checkpoints; removes older complete ones and every
// incomplete one. Returns the removed paths.
std::vector<std::string> rotate_checkpoints(const std::string& run_dir, int64_t keep);
// The run directory of `--resume DIR`: DIR itself, or its parent when DIR is a step_XXXXXX
// checkpoint. Absolute, normalized; nothing is checked.
std::string resume_run_dir(const std::string& dir);
// `--resume DIR`: DIR is a complete checkpoint or a run directory (its newest complete one).
// ConfigError naming DIR otherwise.
CheckpointDir resolve_resume_dir(const std::string& dir);
// Run files are written whole and atomically (q4::io::AtomicFile: temp file, fsync, rename).
using io::write_file_atomic;

// The names q4train itself writes directly in output.dir (config.yaml, init.dat, eval.jsonl,
// probe.json, .lock); step_XXXXXX and temp-file names are reserved too.
bool is_reserved_run_name(const std::string& file_name);

// output.hf_export's folder: next to the exported .dat, "<path minus .dat>-hf".
std::string hf_export_dir(const std::string& dat_path);
// train.method lora's PEFT adapter folder: next to the exported .dat, "<path minus .dat>-adapter".
std::string adapter_dir(const std::string& dat_path);

// Every file or folder a run reads, as (config key, path) pairs, paths as configured: the config
// file, model.config, model.tokenizer, model.weights (a .dat or an HF folder; model.init: file),
// data.files, data.eval_files, and what the objective loads (`needs.inputs`: distill.teacher and
// distill.teacher_config for online distillation and --write-teacher-topk, distill.topk_file
// offline, preference.reference and preference.reference_config for a reference-based loss).
// docs/reliability.md#inputs-and-outputs.
std::vector<std::pair<std::string, std::string>> run_inputs(const RunPaths& paths,
                                                            const ObjectiveNeeds& needs);

// Every output path, checked before anything is written or loaded (ConfigError naming the key):
// log.metrics is a plain file name that is not reserved; the export is not a directory, its
// directory exists and is writable, and it is not reserved; no two outputs share a path (the
// metrics file, the export, its record); no output (config.yaml, eval.jsonl, init.dat, the
// reference file, report.html, the metrics file, the export, its record, its HF and adapter
// folders) is, holds or lies inside an input (run_inputs; resolved, hard links included), and no
// input lies in a checkpoint folder or temp file of output.dir, whatever `overwrite` says;
// output.dir is a writable directory or can be created; no output file exists as anything but a
// regular file (the folders: a directory), so nothing is ever renamed over a device or a FIFO;
// output.hf_export's folder passes check_hf_export_folder and lora's adapter folder
// check_adapter_folder (`overwrite`: --overwrite). `needs`: the objective's inputs, and its
// reference file when it has a reference pass.
void check_output_paths(const RunPaths& paths, const ObjectiveNeeds& needs, bool overwrite = false);

// train.method lora's adapter folder (adapter_dir of the export): a new path, an empty folder, or
// the adapter of an earlier export of this run (the record beside the export names this run, or
// the export lies in output.dir); another folder with files only with `overwrite`.
void check_adapter_folder(const RunPaths& paths, bool overwrite);

// --write-teacher-topk's output, distill.topk_file (of `distill`), before anything loads: set
// (with distill.teacher); none of the inputs (run_inputs with `writer`: the teacher's files),
// whatever `overwrite` says; a regular file or a new path in a writable directory; and not an
// existing file unless `overwrite`.
void check_topk_output(const RunPaths& paths, const DistillConfig& distill,
                       const ObjectiveNeeds& writer, bool overwrite);

// The export record: `<export>.json` beside the export, {"step", "bytes", "run_dir"}, written
// after each export. It tells which step an existing export holds, so that an export never
// replaces a newer one (docs/trainer.md#export).
std::string export_record_path(const std::string& export_path);
void record_export_step(const std::string& export_path, int64_t step, const std::string& run_dir);
// The step the export at `export_path` holds: from its record when the record's size matches the
// file; nullopt when the file is absent, has no record or the record does not describe it.
std::optional<int64_t> existing_export_step(const std::string& export_path);
// Refuses (ConfigError naming the file, its step and the safe alternative) when writing the
// export of `step` would replace an export of a later step, or, with `unknown_is_error`, an
// existing file whose step is not known; --overwrite (`overwrite`) lifts both.
// It also refuses an export recorded as another run's (the record names its run directory), and
// a file at the record's path that is not a record. `run_dir` is this run's output.dir.
void check_export_not_newer(const std::string& export_path, int64_t step, bool overwrite,
                            bool unknown_is_error, const std::string& run_dir);
// Whether `path` lies inside the directory `dir` (both resolved; `dir` itself is not inside).
bool path_inside(const std::string& path, const std::string& dir);
// The export file name that never replaces the run's model: "model-step26.dat".
std::string step_export_name(int64_t step);

// --probe-report FILE (or <output.dir>/probe.json): refused before anything loads when it exists
// as anything but a regular file, or as a file that is not a previous probe report, unless
// `overwrite`.
void check_probe_report_path(const std::string& path, bool overwrite);

// With output.hf_export set: the folder is neither an input nor output.dir and holds none of
// them (run_inputs, output.dir and the folder model.tokenizer's files are copied from), and an
// existing non-empty folder is an earlier q4train export
// (model::check_hf_export_dir; q4train never replaces a foreign folder's files).
void check_hf_export_folder(const RunPaths& paths, const ObjectiveNeeds& needs);

// What a fresh run finds in output.dir that belongs to someone (a previous run's outputs, the
// user's files): every entry except the lock file, temp files and incomplete checkpoints of a
// killed writer (removed at start anyway), probe.json, and the run's own inputs and folders
// holding one (run_inputs: model.weights or a teacher kept in output.dir), which --overwrite
// therefore never removes. Names, sorted; empty when the directory is absent or empty.
std::vector<std::string> run_dir_leftovers(const RunPaths& paths, const ObjectiveNeeds& needs);

// An exclusive advisory lock (flock) on <dir>/.lock, held until destruction (or the process
// ends). A second run on the same directory fails at once with a ConfigError naming the
// directory and the holder's pid.
class RunDirLock {
 public:
  explicit RunDirLock(const std::string& dir);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Start-of-run cleanup (under the lock): temp files left by a killed writer in output.dir, in its
// checkpoints and next to the export, and checkpoint directories without DONE. Returns the paths
// removed.
std::vector<std::string> clean_stale_files(const RunPaths& paths);

// Writes checksums.json (CRC32C and size of each named file of the checkpoint) atomically.
void write_checkpoint_checksums(const std::string& ckpt_dir, const std::vector<std::string>& files);
// Checks the checkpoint's files against checksums.json, which every checkpoint has (a missing
// one is damage). ConfigError naming the file, with previous_checkpoint_hint().
void verify_checkpoint(const CheckpointDir& ck);
// " ; the previous complete checkpoint is <dir> (resume it with --resume <dir>)" or a note that
// there is none: appended to every error about a damaged checkpoint.
std::string previous_checkpoint_hint(const CheckpointDir& ck);
std::string read_file(const std::string& path);  // ConfigError naming path when unreadable

// A run directory as a model to load (q4chat/q4eval --model, distill.teacher,
// preference.reference): its export (model.dat beside config.yaml, so that a moved run directory
// still works, else the export path its config.yaml names) and the model.config, model.tokenizer,
// data.system_prompt, data.chat_template and data.enable_thinking it trained with. nullopt when
// `dir` is not a directory with config.yaml.
// A training checkpoint (step_XXXXXX, or a folder with optim.state), whose masters are no export,
// and a run without an export are refused (c10::Error naming `key` and `dir`).
struct RunDirModel {
  std::string weights, config;
  ChatSettings chat;
};
std::optional<RunDirModel> run_dir_model(const std::string& dir, const std::string& key);

}  // namespace q4::trainer
