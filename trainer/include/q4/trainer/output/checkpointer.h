// Checkpoints of a run (docs/trainer.md#checkpoints, docs/design.md#trainer-components): save
// (every rank its optimizer shard of masters and moments, rank 0 the run state, the RNG, the
// checksums and the DONE marker last), restore (checksums verified, the schedule and trainable
// set checked, the batcher and RNG restored), reshard (a checkpoint of another world size
// continues with the same global batch) and retention (the newest output.keep kept).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <iosfwd>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/plan/component_plans.h"
#include "q4/trainer/rundir/run_dir.h"

namespace q4::trainer {

inline constexpr const char* kOptimStateFile = "optim.state";
inline constexpr const char* kTrainStateFile = "state.json";
inline constexpr const char* kRngFile = "rng.dat";

// The optimizer shard of `rank` in a checkpoint of `world` ranks: optim-RRRRR-of-WWWWW.state.
std::string shard_file_name(int rank, int world);

// The optimizer state files of a checkpoint: optim.state (one process) or the shards of a
// data-parallel run, all of them present (ConfigError naming the checkpoint otherwise).
std::vector<std::string> optimizer_files(const CheckpointDir& ck);

// Reshard: a checkpoint written by `ck_world` ranks with `ck_batch` rows x `ck_accum`
// micro-batches continues on `world` ranks with the same global batch: the grad_accum to use
// (nullopt when the world size is the same). grad_accum is rescaled when batch_size is
// unchanged and the product divides; otherwise ConfigError naming `ck_path` and the fix.
std::optional<int64_t> grad_accum_for_world(int64_t ck_world, int64_t ck_accum, int64_t ck_batch,
                                            int64_t world, int64_t batch_size,
                                            const std::string& ck_path);

class Checkpointer {
 public:
  // `plan`: the plan's slice once the run length is known (a resume's grad_accum may still
  // change in restore()).
  Checkpointer(CheckpointPlan plan, std::ostream& out);

  // What a checkpoint holds, borrowed: the optimizer (owned masters and moments), the trained
  // parameters' names, the training batcher (null: none), the schedule. `comm`: null for one
  // process; otherwise `sync` broadcasts the restored masters from their owners, and save and
  // restore wait for its broadcasts in flight before they touch a master.
  void attach(optim::PackedAdamW& optimizer, const std::vector<model::Parameter*>& params,
              data::Batcher* batcher, const optim::LrSchedule& schedule, DistComm* comm = nullptr,
              GradSync* sync = nullptr);

  // A failed checkpoint (full disk, I/O error) removes its directory: no partial files remain
  // and the previous complete checkpoint stays the newest. Rotates to output.keep.
  void save(int64_t step, int64_t tokens_seen);

  struct Restored {
    int64_t step = 0;
    int64_t tokens_seen = 0;
  };
  // kResume: the whole training state; kExportOnly: the masters only (no step or world checks).
  enum class RestoreFor { kResume, kExportOnly };
  // `on_grad_accum_change`: called when a resume on another world size changes grad_accum (its
  // new value); the plan's owner makes the plan with it (RunPlan::with_grad_accum), and the
  // checkpoints written from then on record it.
  Restored restore(const CheckpointDir& ck, RestoreFor what,
                   const std::function<void(int64_t)>& on_grad_accum_change = nullptr);

  // The LR schedule is a function of (kind, lr, warmup, steps, min_lr_ratio): resuming with any
  // of them changed would silently bend the curve, so it needs --allow-schedule-change. Reads
  // the checkpoint's state.json (ConfigError naming it when it is malformed).
  void check_schedule_unchanged(const CheckpointDir& ck) const;

  int64_t last_step() const { return last_step_; }
  // Timed checkpoints (output.checkpoint_minutes) count training time from here.
  void start_clock() { last_time_ = std::chrono::steady_clock::now(); }
  // Whether output.checkpoint_minutes have passed since the last checkpoint (or the start of
  // training) on rank 0's clock; the other ranks learn it from the step's closing allreduce.
  bool time_due() const;

 private:
  bool leader() const;
  void write(int64_t step, int64_t tokens_seen, const std::string& dir);
  void check_schedule(const CheckpointDir& ck, const nlohmann::json& state) const;
  void check_trainable_unchanged(const CheckpointDir& ck, const nlohmann::json& state) const;
  void check_lora_unchanged(const CheckpointDir& ck, const nlohmann::json& state) const;
  void restore_run_state(const CheckpointDir& ck, const nlohmann::json& state, Restored* r);

  const CheckpointPlan plan_;
  int64_t grad_accum_;  // plan_.grad_accum, or a resume's on another world size
  std::ostream& out_;
  optim::PackedAdamW* optimizer_ = nullptr;
  const std::vector<model::Parameter*>* params_ = nullptr;
  data::Batcher* batcher_ = nullptr;
  const optim::LrSchedule* schedule_ = nullptr;
  GradSync* sync_ = nullptr;
  DistComm* comm_ = nullptr;
  int64_t last_step_ = -1;
  std::chrono::steady_clock::time_point last_time_ = std::chrono::steady_clock::now();
};

}  // namespace q4::trainer
