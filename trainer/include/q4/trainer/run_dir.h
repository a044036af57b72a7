// Run-directory layout and checkpoint rotation. A run directory holds config.yaml, metrics.jsonl,
// eval.jsonl, the export and step_XXXXXX/ checkpoints. A checkpoint counts only once its DONE
// marker exists (written last, fsynced): a crash mid-write leaves a directory without DONE,
// which resume ignores and rotation removes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace q4::trainer {

inline constexpr const char* kDoneMarker = "DONE";

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
// `--resume DIR`: DIR is a complete checkpoint or a run directory (its newest complete one).
// ConfigError naming DIR otherwise.
CheckpointDir resolve_resume_dir(const std::string& dir);
// Writes `text` to `path` atomically (temp file, fsync, rename).
void write_file_atomic(const std::string& path, const std::string& text);
std::string read_file(const std::string& path);  // ConfigError naming path when unreadable

}  // namespace q4::trainer
