// Checkpoint save, restore, reshard and retention; see checkpointer.h.
#include "q4/trainer/output/checkpointer.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>
#include <iterator>
#include <mutex>
#include <nlohmann/json.hpp>
#include <set>

#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/nvtx.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

// The adapters' definition as a checkpoint records it (check_lora_unchanged compares it).
nlohmann::json lora_json(const LoraConfig& l) {
  return {
      {"rank", l.rank}, {"alpha", l.alpha}, {"targets", l.targets}, {"merge_aware", l.merge_aware}};
}

}  // namespace

std::string shard_file_name(int rank, int world) {
  return fmt::format("optim-{:05d}-of-{:05d}.state", rank, world);
}

std::vector<std::string> optimizer_files(const CheckpointDir& ck) {
  const fs::path dir(ck.path);
  if (fs::exists(dir / kOptimStateFile)) return {(dir / kOptimStateFile).string()};
  std::vector<std::string> shards;
  int64_t world = -1;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    int r = 0, w = 0;
    char tail = 0;
    if (std::sscanf(name.c_str(), "optim-%5d-of-%5d.stat%c", &r, &w, &tail) == 3 && tail == 'e' &&
        name == shard_file_name(r, w)) {
      if (world >= 0 && w != world) {
        throw ConfigError("--resume " + ck.path + ": optimizer shards of different world sizes" +
                          previous_checkpoint_hint(ck));
      }
      world = w;
      shards.push_back(e.path().string());
    }
  }
  std::sort(shards.begin(), shards.end());
  if (shards.empty() || static_cast<int64_t>(shards.size()) != world) {
    throw ConfigError(fmt::format("--resume {}: {} (found {} of {} optimizer shards){}", ck.path,
                                  shards.empty() ? "no optimizer state" : "incomplete checkpoint",
                                  shards.size(), std::max<int64_t>(world, 1),
                                  previous_checkpoint_hint(ck)));
  }
  return shards;
}

std::optional<int64_t> grad_accum_for_world(int64_t ck_world, int64_t ck_accum, int64_t ck_batch,
                                            int64_t world, int64_t batch_size,
                                            const std::string& ck_path) {
  if (ck_world == world) return std::nullopt;
  const int64_t global = ck_world * ck_accum * ck_batch;
  if (ck_batch == batch_size && (ck_world * ck_accum) % world == 0) {
    return ck_world * ck_accum / world;
  }
  throw ConfigError(fmt::format(
      "--resume {}: the checkpoint's global batch is {} sequences ({} rank(s) x batch_size {} x "
      "grad_accum {}); with {} rank(s) and train.batch_size {} no whole grad_accum gives it "
      "(keep batch_size {} and use a rank count dividing {})",
      ck_path, global, ck_world, ck_batch, ck_accum, world, batch_size, ck_batch,
      ck_world * ck_accum));
}

Checkpointer::Checkpointer(CheckpointPlan plan, std::ostream& out)
    : plan_(std::move(plan)), grad_accum_(plan_.grad_accum), out_(out) {}

void Checkpointer::attach(optim::PackedAdamW& optimizer,
                          const std::vector<model::Parameter*>& params, data::Batcher* batcher,
                          const optim::LrSchedule& schedule, DistComm* comm, GradSync* sync) {
  optimizer_ = &optimizer;
  params_ = &params;
  batcher_ = batcher;
  schedule_ = &schedule;
  sync_ = sync;
  comm_ = comm;
}

bool Checkpointer::leader() const { return !comm_ || comm_->rank() == 0; }

bool Checkpointer::time_due() const {
  const double minutes = plan_.checkpoint_minutes;
  if (minutes <= 0 || !leader()) return false;
  const auto ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - last_time_);
  return ms.count() / 60000.0 >= minutes;
}

void Checkpointer::save(int64_t step, int64_t tokens_seen) {
  const fs::path dir = fs::path(plan_.output_dir) / checkpoint_dir_name(step);
  try {
    write(step, tokens_seen, dir.string());
  } catch (...) {
    std::error_code ec;
    if (leader()) q4::io::remove_tree(dir, ec);
    throw;
  }
}

// Data parallel: rank 0 makes the directory, every rank writes its optimizer shard (its masters
// and moments), then rank 0 writes the run state, the checksums of every file and the DONE
// marker last, so a checkpoint counts only when all shards are complete.
void Checkpointer::write(int64_t step, int64_t tokens_seen, const std::string& dir_name) {
  NvtxRange r("checkpoint");
  // The optimizer's masters bypass the model's accessors (and their master fence): every
  // broadcast in flight is waited for here, so a checkpoint sees one settled state.
  if (sync_) sync_->wait_masters();
  const fs::path dir(dir_name);
  if (leader()) {
    q4::io::remove_tree(dir);
    fs::create_directories(dir);
  }
  std::vector<std::string> files;
  if (comm_) {
    comm_->barrier();
    optimizer_->save((dir / shard_file_name(comm_->rank(), comm_->world_size())).string(),
                     /*include_masters=*/true);
    comm_->barrier();
    for (int k = 0; k < comm_->world_size(); ++k) {
      files.push_back(shard_file_name(k, comm_->world_size()));
    }
    if (!leader()) {
      last_step_ = step;
      return;
    }
  } else {
    optimizer_->save((dir / kOptimStateFile).string(), /*include_masters=*/true);
    files.push_back(kOptimStateFile);
  }
  {
    model::DatWriter w((dir / kRngFile).string(), 1);
    w.add("cpu_generator", at::detail::getDefaultCPUGenerator().get_state());
    w.commit();
  }
  nlohmann::json st;
  st["step"] = step;
  st["tokens_seen"] = tokens_seen;
  st["optimizer_steps"] = optimizer_->step_count();
  st["skipped_steps"] = optimizer_->skipped_total();
  // In-backward updates clip with the previous step's norm: part of the exact resume state.
  if (std::isfinite(optimizer_->previous_grad_norm())) {
    st["previous_grad_norm"] = optimizer_->previous_grad_norm();
  }
  st["seed"] = plan_.seed;
  // The trained set: a resume that trains other tensors is refused (check_trainable_unchanged).
  st["trainable"] = nlohmann::json::array();
  for (const auto* p : *params_) st["trainable"].push_back(p->name);
  // The adapters' definition: a resume that changes it is refused (check_lora_unchanged).
  if (plan_.lora) st["lora"] = lora_json(plan_.lora_config);
  st["world_size"] = comm_ ? comm_->world_size() : 1;
  st["batch_size"] = plan_.batch_size;
  st["grad_accum"] = grad_accum_;
  st["schedule"] = {{"kind", to_string(plan_.schedule.kind)},
                    {"peak_lr", plan_.lr},
                    {"warmup_steps", plan_.schedule.warmup_steps},
                    {"total_steps", plan_.steps},
                    {"min_lr_ratio", plan_.schedule.min_lr_ratio},
                    {"next_lr", step < plan_.steps ? schedule_->lr_at(step) : 0.0}};
  if (batcher_) st["batcher"] = nlohmann::json::parse(batcher_->state().to_json());
  write_file_atomic((dir / kTrainStateFile).string(), st.dump(2) + "\n");
  files.push_back(kRngFile);
  files.push_back(kTrainStateFile);
  write_checkpoint_checksums(dir.string(), files);
  mark_checkpoint_done(dir.string(), step);
  last_step_ = step;
  last_time_ = std::chrono::steady_clock::now();
  const auto removed = rotate_checkpoints(plan_.output_dir, plan_.keep);
  out_ << "checkpoint " << dir.string() << (removed.empty() ? "" : " (rotated ")
       << (removed.empty() ? "" : std::to_string(removed.size()) + " old)") << "\n";
}

void Checkpointer::check_schedule_unchanged(const CheckpointDir& ck) const {
  const std::string state_path = (fs::path(ck.path) / kTrainStateFile).string();
  const auto state = nlohmann::json::parse(read_file(state_path), nullptr, false);
  try {
    if (state.is_object()) check_schedule(ck, state);
  } catch (const nlohmann::json::exception& e) {
    throw ConfigError("--resume: " + state_path + ": " + e.what() + previous_checkpoint_hint(ck));
  }
}

void Checkpointer::check_schedule(const CheckpointDir& ck, const nlohmann::json& state) const {
  if (!state.contains("schedule") || !state["schedule"].is_object()) return;
  const auto& s = state["schedule"];
  std::vector<std::string> changed;
  auto number = [&](const char* saved, const char* key, const nlohmann::json& now) {
    if (s.contains(saved) && s[saved].is_number() && s[saved].get<double>() != now.get<double>()) {
      changed.push_back(fmt::format("{} {} -> {}", key, s[saved].dump(), now.dump()));
    }
  };
  const std::string kind = to_string(plan_.schedule.kind);
  if (s.contains("kind") && s["kind"].is_string() && s["kind"] != kind) {
    changed.push_back(
        fmt::format("optim.schedule.kind {} -> {}", s["kind"].get<std::string>(), kind));
  }
  number("peak_lr", "optim.lr", plan_.lr);
  number("warmup_steps", "optim.schedule.warmup_steps", plan_.schedule.warmup_steps);
  number("total_steps", "train.steps", plan_.steps);
  number("min_lr_ratio", "optim.schedule.min_lr_ratio", plan_.schedule.min_lr_ratio);
  if (changed.empty()) return;
  std::string list;
  for (const auto& x : changed) list += (list.empty() ? "" : ", ") + x;
  if (plan_.allow_schedule_change) {
    out_ << "note: the LR schedule changed since " << ck.path << " (" << list
         << "); continuing with the new one (--allow-schedule-change)\n";
    return;
  }
  throw ConfigError("--resume " + ck.path + ": the LR schedule differs from the checkpoint's (" +
                    list + "); pass --allow-schedule-change to continue with the new schedule");
}

// A resume trains exactly the tensors the checkpoint trained: a tensor dropped from
// train.trainable would silently fall back to its initial weights (its trained master is in the
// checkpoint only), an added one would have no optimizer state. Checkpoints written before the
// set was recorded are not checked.
void Checkpointer::check_trainable_unchanged(const CheckpointDir& ck,
                                             const nlohmann::json& state) const {
  if (!state.contains("trainable") || !state["trainable"].is_array()) return;
  std::set<std::string> saved, now;
  for (const auto& n : state["trainable"]) {
    if (n.is_string()) saved.insert(n.get<std::string>());
  }
  for (const auto* p : *params_) now.insert(p->name);
  if (saved == now) return;
  std::vector<std::string> dropped, added;
  std::set_difference(saved.begin(), saved.end(), now.begin(), now.end(),
                      std::back_inserter(dropped));
  std::set_difference(now.begin(), now.end(), saved.begin(), saved.end(),
                      std::back_inserter(added));
  std::string what;
  if (!dropped.empty()) {
    what += fmt::format("{} tensor(s) it trained are not trained now ({})", dropped.size(),
                        join_names(dropped, 3));
  }
  if (!added.empty()) {
    what += fmt::format("{}{} tensor(s) trained now were frozen in it ({})",
                        what.empty() ? "" : "; ", added.size(), join_names(added, 3));
  }
  throw ConfigError(fmt::format(
      "--resume {}: config key train.trainable differs from the checkpoint's: {}; resume with "
      "the checkpoint's train.trainable (its config.yaml), or start a new run from its export",
      ck.path, what));
}

// A resume continues the checkpoint's adapters: A and B trained at one alpha/rank mean another
// model at another (and a rank or target change reshapes or drops them), so every lora key the
// checkpoint recorded must be unchanged. Checkpoints written before it was recorded are not
// checked.
void Checkpointer::check_lora_unchanged(const CheckpointDir& ck,
                                        const nlohmann::json& state) const {
  if (!state.contains("lora") || !state["lora"].is_object()) return;
  const auto& saved = state["lora"];
  const nlohmann::json now = lora_json(plan_.lora_config);
  for (const auto& [key, value] : now.items()) {
    if (!saved.contains(key) || saved[key] == value) continue;
    throw ConfigError(fmt::format(
        "--resume {}: config key lora.{} is {} in the checkpoint but {} now; resume with the "
        "checkpoint's lora settings (its config.yaml), or start a new run from its export",
        ck.path, key, saved[key].dump(), value.dump()));
  }
}

Checkpointer::Restored Checkpointer::restore(
    const CheckpointDir& ck, RestoreFor what,
    const std::function<void(int64_t)>& on_grad_accum_change) {
  const bool export_only = what == RestoreFor::kExportOnly;
  const fs::path dir(ck.path);
  verify_checkpoint(ck);  // CRC32C of every file, naming the damaged one
  const std::string state_path = (dir / kTrainStateFile).string();
  const auto state = nlohmann::json::parse(read_file(state_path), nullptr, false);
  if (state.is_discarded() || !state.is_object() || !state.contains("step")) {
    throw ConfigError("--resume: " + state_path + " is not a valid checkpoint state" +
                      previous_checkpoint_hint(ck));
  }
  // A field of the wrong type or a batcher state that does not fit names the file too.
  const auto state_error = [&](const std::string& what) {
    return ConfigError("--resume: " + state_path + ": " + what + previous_checkpoint_hint(ck));
  };
  if (!state["step"].is_number_integer() || state["step"].get<int64_t>() < 0) {
    throw state_error("'step' is " + state["step"].dump() + ", expected a step number");
  }
  Restored r;
  r.step = state.at("step").get<int64_t>();
  if (!export_only && r.step > plan_.steps) {
    throw ConfigError(fmt::format("--resume {}: checkpoint step {} is past train.steps {}", ck.path,
                                  r.step, plan_.steps));
  }
  check_lora_unchanged(ck, state);
  check_trainable_unchanged(ck, state);
  if (!export_only) {
    try {
      const int64_t world = comm_ ? comm_->world_size() : 1;
      const int64_t ck_world = state.value("world_size", int64_t{1});
      const int64_t ck_accum = state.value("grad_accum", grad_accum_);
      const int64_t ck_batch = state.value("batch_size", plan_.batch_size);
      const auto accum =
          grad_accum_for_world(ck_world, ck_accum, ck_batch, world, plan_.batch_size, ck.path);
      if (accum && *accum != grad_accum_) {
        out_ << fmt::format(
            "resume: checkpoint of {} rank(s) x grad_accum {} continues on {} "
            "rank(s) with grad_accum {} (same global batch of {} sequences)\n",
            ck_world, ck_accum, world, *accum, ck_world * ck_accum * ck_batch);
        grad_accum_ = *accum;
        if (on_grad_accum_change) on_grad_accum_change(*accum);
      }
    } catch (const nlohmann::json::exception& e) {
      throw state_error(e.what());
    }
  }
  const std::vector<std::string> state_files = optimizer_files(ck);
  if (sync_) sync_->wait_masters();  // the load writes masters, which a broadcast may read
  as_input_error("--resume", [&] {
    try {
      optimizer_->load_shards(state_files, /*restore_masters=*/true);
    } catch (const c10::Error& e) {
      if (e.msg().rfind("INTERNAL ASSERT FAILED", 0) == 0) throw;
      TORCH_CHECK(false, e.what_without_backtrace(), previous_checkpoint_hint(ck));
    }
    return 0;
  });
  restore_run_state(ck, state, &r);
  // Each rank restored the masters it owns; the others come from their owners (launched here,
  // waited for by their first reader: GradSync).
  if (comm_ && sync_) sync_->broadcast_masters();
  out_ << (export_only ? "loaded " : "resumed from ") << ck.path << " at step " << r.step << "\n";
  return r;
}

// The batcher's position, the tokens seen, the in-backward clipping norm and the CPU RNG.
void Checkpointer::restore_run_state(const CheckpointDir& ck, const nlohmann::json& state,
                                     Restored* r) {
  const fs::path dir(ck.path);
  const std::string state_path = (dir / kTrainStateFile).string();
  const auto state_error = [&](const std::string& what) {
    return ConfigError("--resume: " + state_path + ": " + what + previous_checkpoint_hint(ck));
  };
  try {
    if (batcher_) {
      if (!state.contains("batcher")) throw state_error("no 'batcher' state");
      batcher_->restore(data::BatcherState::from_json(state.at("batcher").dump()));
    }
    r->tokens_seen = state.value("tokens_seen", int64_t{0});
  } catch (const ConfigError&) {
    throw;
  } catch (const nlohmann::json::exception& e) {
    throw state_error(e.what());
  } catch (const c10::Error& e) {
    throw state_error(e.what_without_backtrace());
  } catch (const std::exception& e) {
    throw state_error(e.what());
  }
  if (state.contains("previous_grad_norm") && state["previous_grad_norm"].is_number()) {
    optimizer_->set_previous_grad_norm(state["previous_grad_norm"].get<double>());
  }
  if (fs::exists(dir / kRngFile)) {
    try {
      model::DatReader rng((dir / kRngFile).string());
      auto gen = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(rng.load("cpu_generator"));
    } catch (const c10::Error& e) {
      throw ConfigError("--resume: " + (dir / kRngFile).string() + ": " +
                        e.what_without_backtrace() + previous_checkpoint_hint(ck));
    }
  }
}

}  // namespace q4::trainer
