// Checkpoint directories (naming, listing, DONE markers, checksums, rotation, resume resolution)
// and the protection of a run directory (lock, output-path checks, stale-file cleanup).
#include "q4/trainer/rundir/run_dir.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/io/atomic_file.h"
#include "q4/io/crc32c.h"
#include "q4/io/output_path.h"
#include "q4/io/remove_tree.h"
#include "q4/model/hf_interop.h"
#include "q4/trainer/config/config.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

std::optional<int64_t> parse_step_name(const std::string& name) {
  const std::string prefix = "step_";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return std::nullopt;
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step_{:06d}", step); }

std::vector<CheckpointDir> list_checkpoints(const std::string& run_dir) {
  std::vector<CheckpointDir> out;
  std::error_code ec;
  if (!fs::is_directory(run_dir, ec)) return out;
  for (const auto& e : fs::directory_iterator(run_dir, ec)) {
    if (!e.is_directory()) continue;
    const auto step = parse_step_name(e.path().filename().string());
    if (!step) continue;
    out.push_back({e.path().string(), *step, fs::exists(e.path() / kDoneMarker)});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointDir& a, const CheckpointDir& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointDir> latest_checkpoint(const std::string& run_dir) {
  const auto all = list_checkpoints(run_dir);
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    if (it->done) return *it;
  }
  return std::nullopt;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void mark_checkpoint_done(const std::string& ckpt_dir, int64_t step) {
  write_file_atomic((fs::path(ckpt_dir) / kDoneMarker).string(), std::to_string(step) + "\n");
}

std::vector<std::string> rotate_checkpoints(const std::string& run_dir, int64_t keep) {
  std::vector<std::string> removed;
  const auto all = list_checkpoints(run_dir);
  int64_t complete_seen = 0;
  for (auto it = all.rbegin(); it != all.rend(); ++it) {
    bool remove = false;
    if (it->done) {
      remove = ++complete_seen > keep;
    } else {
      remove = true;  // a crashed write; never resumable
    }
    if (remove) {
      std::error_code ec;
      q4::io::remove_tree(it->path, ec);
      if (!ec) removed.push_back(it->path);
    }
  }
  return removed;
}

std::string resume_run_dir(const std::string& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  return parse_step_name(p.filename().string()) ? p.parent_path().string() : p.string();
}

CheckpointDir resolve_resume_dir(const std::string& dir) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw ConfigError("--resume " + dir + ": not a directory");
  const fs::path p = fs::absolute(dir).lexically_normal();
  const auto name = (p.filename().empty() ? p.parent_path().filename() : p.filename()).string();
  if (const auto step = parse_step_name(name)) {
    if (!fs::exists(p / kDoneMarker)) {
      throw ConfigError("--resume " + dir + ": checkpoint is incomplete (no " +
                        std::string(kDoneMarker) + " marker)");
    }
    return {p.string(), *step, true};
  }
  const auto latest = latest_checkpoint(p.string());
  if (!latest) {
    throw ConfigError("--resume " + dir + ": no complete checkpoint (step_XXXXXX/" +
                      std::string(kDoneMarker) + ") in this directory");
  }
  return *latest;
}

// ---------------------------------------------------------------------------------------------
// Run-directory protection

bool is_reserved_run_name(const std::string& name) {
  // Also the files the run writes next to these: the HF-folder import (hf_import.dat), the
  // report and the TensorBoard event files.
  for (const char* r : {kConfigFile, kInitFile, kEvalFile, kProbeFile, kLockFile, kDoneMarker,
                        kChecksumFile, kReferenceFile, "hf_import.dat", "report.html"}) {
    if (name == r) return true;
  }
  return parse_step_name(name).has_value() || io::is_temp_file_name(name) ||
         name.rfind("events.out.tfevents.", 0) == 0;
}

namespace {

fs::path canonical_or_self(const std::string& p) {
  std::error_code ec;
  fs::path c = fs::weakly_canonical(fs::absolute(p), ec);
  return ec ? fs::absolute(p).lexically_normal() : c;
}

// An output that exists as anything but a regular file (a device, FIFO, socket, directory, a
// link to one) is refused: the atomic rename would replace it (docs/reliability.md).
void check_regular_output(const std::string& key, const fs::path& p) {
  const std::string kind = io::non_regular_kind(p.string());
  if (!kind.empty()) {
    throw ConfigError("config key " + key + ": " + p.string() + " is " + kind +
                      "; an output must be a regular file or a new path");
  }
}

bool writable_dir(const fs::path& d) { return ::access(d.c_str(), W_OK | X_OK) == 0; }

using NamedPaths = std::vector<std::pair<std::string, fs::path>>;

// output.dir: a writable directory, or a new path whose nearest existing ancestor is one.
void check_output_dir(const RunPaths& c, const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec)) {
    throw ConfigError("config key output.dir: " + c.output_dir + " exists and is not a directory");
  }
  if (fs::is_directory(dir, ec) && !writable_dir(dir)) {
    throw ConfigError("config key output.dir: " + c.output_dir + " is not writable");
  }
  if (!fs::exists(dir, ec)) {
    // It will be created: the nearest existing ancestor must be a writable directory.
    fs::path a = dir.parent_path();
    while (!a.empty() && !fs::exists(a, ec)) a = a.parent_path();
    if (!a.empty() && (!fs::is_directory(a, ec) || !writable_dir(a))) {
      throw ConfigError("config key output.dir: cannot create " + c.output_dir + " (" + a.string() +
                        " is not a writable directory)");
    }
  }
}

// The run's inputs for the output checks: run_inputs() less <output.dir>/config.yaml, the run's
// own copy (a fresh run refuses a config there in check_fresh_output_dir; a resume rewrites it).
NamedPaths input_paths(const RunPaths& c, const ObjectiveNeeds& needs, const fs::path& dir) {
  NamedPaths inputs;
  for (const auto& [key, path] : run_inputs(c, needs)) {
    const fs::path p = canonical_or_self(path);
    if (key == "the config file" && p == dir / kConfigFile) continue;
    inputs.push_back({key, p});
  }
  return inputs;
}

// log.metrics: a file name inside output.dir that is not one of the run's own names.
void add_metrics_output(const RunPaths& c, const fs::path& dir, NamedPaths* outputs) {
  std::error_code ec;
  const std::string& m = c.metrics;
  if (!m.empty()) {
    if (m == "." || m == ".." || m.find('/') != std::string::npos) {
      throw ConfigError("config key log.metrics: expected a file name inside output.dir, found '" +
                        m + "'");
    }
    if (is_reserved_run_name(m)) {
      throw ConfigError("config key log.metrics: '" + m +
                        "' is a name q4train uses in output.dir (config.yaml, init.dat, "
                        "eval.jsonl, probe.json, .lock, step_XXXXXX, temp files); choose another");
    }
    if (fs::is_directory(dir / m, ec)) {
      throw ConfigError("config key log.metrics: " + (dir / m).string() + " is a directory");
    }
    outputs->push_back({"log.metrics", dir / m});
  }
}

// output.export_path and its record: new or regular files in a writable directory.
void add_export_output(const RunPaths& c, const fs::path& dir, NamedPaths* outputs) {
  std::error_code ec;
  const std::string& exp = c.export_path;
  if (exp.empty()) return;
  check_regular_output("output.export_path", fs::absolute(exp));  // before links resolve
  const fs::path e = canonical_or_self(exp);
  const std::string fname = fs::path(exp).filename().string();
  // output.dir itself is a directory once the run makes it.
  if (fname.empty() || fname == "." || fname == ".." || fs::is_directory(e, ec) || e == dir) {
    throw ConfigError("config key output.export_path: " + exp +
                      " is a directory; expected a .dat file path");
  }
  // The export record beside it is published the same way.
  check_regular_output("output.export_path (its record)", fs::absolute(export_record_path(exp)));
  const fs::path parent = e.parent_path();
  if (parent != dir) {
    if (!fs::is_directory(parent, ec)) {
      throw ConfigError("config key output.export_path: directory " + parent.string() +
                        " does not exist");
    }
    if (!writable_dir(parent)) {
      throw ConfigError("config key output.export_path: directory " + parent.string() +
                        " is not writable");
    }
  }
  if (parent == dir && is_reserved_run_name(fname)) {
    throw ConfigError("config key output.export_path: '" + fname +
                      "' is a name q4train uses in output.dir; choose another");
  }
  outputs->push_back({"output.export_path", e});
  outputs->push_back(
      {"output.export_path (its record)", canonical_or_self(export_record_path(exp))});
}

// The folders written next to the export: output.hf_export's and train.method lora's.
NamedPaths export_folders(const RunPaths& c) {
  NamedPaths folders;
  const std::string& exp = c.export_path;
  if (exp.empty()) return folders;
  if (c.hf_export) {
    folders.push_back({"output.hf_export", canonical_or_self(hf_export_dir(exp))});
  }
  if (c.lora) {
    folders.push_back(
        {"train.method (lora's adapter folder)", canonical_or_self(adapter_dir(exp))});
  }
  return folders;
}

ConfigError input_conflict(const std::string& key, const std::string& output,
                           const std::string& relation,
                           const std::pair<std::string, fs::path>& input) {
  return ConfigError("config key " + key + ": " + output + " " + relation + " the input " +
                     input.first + " (" + input.second.string() +
                     "); an output never replaces or writes into a file the run reads, choose "
                     "another path");
}

std::string output_key(const std::string& name) {
  return name.rfind("output.dir", 0) == 0 ? std::string("output.dir") : name;
}

// No output is, holds or lies inside an input, and no input lies where the run's checkpoints go
// (step_XXXXXX, rewritten and rotated away) or in a temp file that start-up cleaning removes.
void check_outputs_meet_no_input(const fs::path& dir, const NamedPaths& outputs,
                                 const NamedPaths& inputs) {
  for (const auto& o : outputs) {
    for (const auto& in : inputs) {
      const std::string rel = io::output_input_relation(o.second.string(), in.second.string());
      if (!rel.empty()) throw input_conflict(output_key(o.first), o.second.string(), rel, in);
    }
  }
  for (const auto& in : inputs) {
    const fs::path rel = in.second.lexically_relative(dir);
    if (rel.empty() || *rel.begin() == ".." || rel == ".") continue;
    const std::string top = rel.begin()->string();
    if (parse_step_name(top) || io::is_temp_file_name(top)) {
      throw input_conflict("output.dir", (dir / top).string(), "holds", in);
    }
  }
}

}  // namespace

std::vector<std::pair<std::string, std::string>> run_inputs(const RunPaths& c,
                                                            const ObjectiveNeeds& needs) {
  std::vector<std::pair<std::string, std::string>> in;
  std::error_code ec;
  if (fs::is_regular_file(c.config_source, ec)) in.push_back({"the config file", c.config_source});
  if (!c.model_config.empty()) in.push_back({"model.config", c.model_config});
  if (!c.tokenizer.empty()) in.push_back({"model.tokenizer", c.tokenizer});
  if (!c.random_init && !c.weights.empty()) in.push_back({"model.weights", c.weights});
  for (const auto& f : c.data_files) in.push_back({"data.files", f});
  for (const auto& f : c.eval_files) in.push_back({"data.eval_files", f});
  in.insert(in.end(), needs.inputs.begin(), needs.inputs.end());
  return in;
}

void check_output_paths(const RunPaths& c, const ObjectiveNeeds& needs, bool overwrite) {
  const fs::path dir = canonical_or_self(c.output_dir);
  check_output_dir(c, dir);
  const NamedPaths inputs = input_paths(c, needs, dir);
  // Outputs the run writes, by key.
  NamedPaths outputs = {{"output.dir (" + std::string(kConfigFile) + ")", dir / kConfigFile},
                        {"output.dir (" + std::string(kEvalFile) + ")", dir / kEvalFile}};
  if (c.random_init) {
    outputs.push_back({"output.dir (" + std::string(kInitFile) + ")", dir / kInitFile});
  }
  if (needs.reference_pass) {
    outputs.push_back({"output.dir (" + std::string(kReferenceFile) + ")", dir / kReferenceFile});
  }
  add_metrics_output(c, dir, &outputs);
  add_export_output(c, dir, &outputs);
  // Two outputs at one path: the later write would replace the earlier (the metrics log named
  // like the export's record, say).
  for (size_t i = 0; i < outputs.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      if (outputs[i].second == outputs[j].second) {
        throw ConfigError("config key " + output_key(outputs[i].first) + ": " +
                          outputs[i].second.string() + " is also " + outputs[j].first +
                          "; choose another");
      }
    }
  }
  for (const auto& o : outputs) {
    // The metrics file is appended to, never renamed over: a device there (a link to /dev/full
    // or /dev/null) is written into, as io::AppendFile does; a FIFO or a directory is refused.
    if (o.first == "log.metrics" &&
        io::non_regular_kind(o.second.string()).find("device") != std::string::npos) {
      continue;
    }
    check_regular_output(output_key(o.first), o.second);
  }
  if (c.report) {
    check_regular_output("log.report", dir / "report.html");
    outputs.push_back({"log.report", dir / "report.html"});
  }
  NamedPaths all = outputs;
  for (const auto& f : export_folders(c)) all.push_back(f);
  check_outputs_meet_no_input(dir, all, inputs);
  const std::string& exp = c.export_path;
  if (!exp.empty()) {
    std::error_code ec;
    if (c.hf_export) {
      const fs::path hf = canonical_or_self(hf_export_dir(exp));
      if (fs::exists(fs::symlink_status(hf, ec)) && !fs::is_directory(hf, ec)) {
        const std::string kind = io::non_regular_kind(hf.string());
        throw ConfigError("config key output.hf_export: " + hf.string() + " is " +
                          (kind.empty() ? std::string("a file") : kind) +
                          "; the HF folder must be a directory or a new path");
      }
    }
    check_hf_export_folder(c, needs);
    if (c.lora) check_adapter_folder(c, overwrite);
  }
}

void check_hf_export_folder(const RunPaths& c, const ObjectiveNeeds& needs) {
  const std::string& exp = c.export_path;
  if (!c.hf_export || exp.empty()) return;
  std::vector<std::pair<std::string, std::string>> inputs = run_inputs(c, needs);
  inputs.push_back({"output.dir", c.output_dir});
  if (!c.tokenizer.empty()) {
    inputs.push_back(
        {"the folder of model.tokenizer", canonical_or_self(c.tokenizer).parent_path().string()});
  }
  try {
    model::check_hf_export_dir(hf_export_dir(exp), inputs, /*overwrite=*/false);
  } catch (const c10::Error& e) {
    throw ConfigError("config key output.hf_export (folder next to output.export_path): " +
                      std::string(e.what_without_backtrace()));
  }
}

void check_topk_output(const RunPaths& c, const DistillConfig& distill,
                       const ObjectiveNeeds& writer, bool overwrite) {
  const std::string& path = distill.topk_file;
  if (path.empty() || distill.teacher.empty()) {
    throw ConfigError(
        "--write-teacher-topk: set distill.teacher (the model to run) and distill.topk_file "
        "(the file to write)");
  }
  for (const auto& [key, in] : run_inputs(c, writer)) {
    const std::string rel = io::output_input_relation(path, in);
    if (!rel.empty()) throw input_conflict("distill.topk_file", path, rel, {key, fs::path(in)});
  }
  if (const std::string why = io::output_file_problem(path); !why.empty()) {
    throw ConfigError("config key distill.topk_file: " + path + " " + why +
                      "; --write-teacher-topk writes a regular file there");
  }
  std::error_code ec;
  if (fs::exists(path, ec) && !overwrite) {
    throw ConfigError("config key distill.topk_file: " + path +
                      " exists; remove it, or pass --overwrite to replace it");
  }
}

std::vector<std::string> run_dir_leftovers(const RunPaths& c, const ObjectiveNeeds& needs) {
  std::vector<std::string> out;
  std::error_code ec;
  if (!fs::is_directory(c.output_dir, ec)) return out;
  const auto inputs = run_inputs(c, needs);
  for (const auto& e : fs::directory_iterator(c.output_dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name == kLockFile || name == kProbeFile || io::is_temp_file_name(name)) continue;
    if (parse_step_name(name) && !fs::exists(e.path() / kDoneMarker)) continue;
    // The run's inputs, and folders holding one (a teacher's HF folder), are never leftovers.
    const bool input = std::any_of(inputs.begin(), inputs.end(), [&](const auto& in) {
      const std::string rel = io::output_input_relation(e.path().string(), in.second);
      return rel == "is" || rel == "holds";
    });
    if (!input) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

RunDirLock::RunDirLock(const std::string& dir) {
  const std::string path = (fs::path(dir) / kLockFile).string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) {
    throw ConfigError("output.dir " + dir + ": cannot open " + path + ": " + std::strerror(errno));
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[32] = {};
    const ssize_t n = ::pread(fd_, buf, sizeof(buf) - 1, 0);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    ::close(fd_);
    fd_ = -1;
    if (err == EWOULDBLOCK) {
      throw ConfigError("output.dir " + dir + " is in use by another q4train run" +
                        (holder.empty() ? std::string() : " (pid " + holder + ")") +
                        "; wait for it to finish or choose another output.dir");
    }
    throw ConfigError("output.dir " + dir + ": cannot lock " + path + ": " + std::strerror(err));
  }
  const std::string pid = std::to_string(::getpid()) + "\n";
  if (::ftruncate(fd_, 0) == 0) {
    // The pid is only informational (for the message above); a failed write changes nothing.
    [[maybe_unused]] const ssize_t w = ::pwrite(fd_, pid.data(), pid.size(), 0);
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);  // releases the flock
}

std::vector<std::string> clean_stale_files(const RunPaths& c) {
  std::vector<std::string> removed;
  auto add = [&](std::vector<std::string> v) { removed.insert(removed.end(), v.begin(), v.end()); };
  add(io::remove_stale_temp_files(c.output_dir));
  for (const auto& ck : list_checkpoints(c.output_dir)) {
    if (!ck.done) {
      std::error_code ec;
      q4::io::remove_tree(ck.path, ec);
      if (!ec) removed.push_back(ck.path);
      continue;
    }
    add(io::remove_stale_temp_files(ck.path));
  }
  const std::string& exp = c.export_path;
  if (!exp.empty()) {
    const fs::path e = fs::absolute(exp);
    add(io::remove_stale_temp_files(e.parent_path().string(), e.filename().string()));
    const fs::path record = fs::absolute(export_record_path(exp));
    add(io::remove_stale_temp_files(record.parent_path().string(), record.filename().string()));
  }
  return removed;
}

// ---------------------------------------------------------------------------------------------
// Exports and the probe report

std::string hf_export_dir(const std::string& dat_path) {
  fs::path p(dat_path);
  if (p.extension() == ".dat") p.replace_extension();
  return p.string() + "-hf";
}

std::string adapter_dir(const std::string& dat_path) {
  fs::path p(dat_path);
  if (p.extension() == ".dat") p.replace_extension();
  return p.string() + "-adapter";
}

std::string export_record_path(const std::string& export_path) { return export_path + ".json"; }

namespace {

// The run directory as recorded and compared: absolute, links resolved.
std::string run_dir_key(const std::string& run_dir) { return canonical_or_self(run_dir).string(); }

}  // namespace

bool path_inside(const std::string& path, const std::string& dir) {
  if (path.empty()) return false;
  const fs::path rel = canonical_or_self(path).lexically_relative(canonical_or_self(dir));
  return !rel.empty() && *rel.begin() != ".." && rel != ".";
}

namespace {

// The record beside `export_path` parsed (null when absent, unreadable or not a record object).
nlohmann::json read_export_record(const std::string& export_path) {
  std::error_code ec;
  const std::string rec = export_record_path(export_path);
  if (!fs::is_regular_file(rec, ec) || fs::file_size(rec, ec) > 4096) return nullptr;
  std::ifstream in(rec);
  std::stringstream text;
  text << in.rdbuf();
  auto j = nlohmann::json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("step") || !j["step"].is_number_integer() ||
      !j.contains("bytes")) {
    return nullptr;
  }
  return j;
}

}  // namespace

void record_export_step(const std::string& export_path, int64_t step, const std::string& run_dir) {
  const nlohmann::json j = {{"step", step},
                            {"bytes", static_cast<int64_t>(fs::file_size(export_path))},
                            {"run_dir", run_dir_key(run_dir)}};
  io::write_file_atomic(export_record_path(export_path), j.dump() + "\n");
}

std::optional<int64_t> existing_export_step(const std::string& export_path) {
  std::error_code ec;
  if (!fs::is_regular_file(export_path, ec)) return std::nullopt;
  const auto size = fs::file_size(export_path, ec);
  const auto j = read_export_record(export_path);
  if (ec || j.is_null() || j["bytes"] != static_cast<int64_t>(size)) return std::nullopt;
  return j["step"].get<int64_t>();
}

void check_adapter_folder(const RunPaths& c, bool overwrite) {
  const std::string& exp = c.export_path;
  if (exp.empty() || !c.lora) return;
  const std::string ad = adapter_dir(exp);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(ad, ec)) && !fs::is_directory(ad, ec)) {
    throw ConfigError("config key train.method: lora writes its PEFT adapter to " + ad +
                      ", which exists and is not a directory");
  }
  if (overwrite || !fs::is_directory(ad, ec) || fs::is_empty(ad, ec)) return;
  // A folder with files is replaced only as the adapter of this run's own export beside it: an
  // earlier export of this run (its record names this run), or one that moved with the run.
  const auto j = read_export_record(exp);
  const bool ours = existing_export_step(exp).has_value() &&
                    (path_inside(exp, c.output_dir) ||
                     (j.contains("run_dir") && j["run_dir"] == run_dir_key(c.output_dir)));
  if (!ours) {
    throw ConfigError("config key train.method: lora writes its PEFT adapter to " + ad +
                      ", a folder with files that is not the adapter of this run's export " + exp +
                      "; choose another output.export_path, or pass --overwrite to replace them");
  }
}

std::string step_export_name(int64_t step) { return fmt::format("model-step{}.dat", step); }

void check_export_not_newer(const std::string& export_path, int64_t step, bool overwrite,
                            bool unknown_is_error, const std::string& run_dir) {
  std::error_code ec;
  if (overwrite) return;
  const std::string safe =
      "; pass --overwrite to replace it, or export elsewhere (e.g. --set "
      "output.export_path=" +
      step_export_name(step) + ")";
  // The record beside the export is written too: a file of that name that is not a record is
  // someone else's.
  const std::string rec = export_record_path(export_path);
  if (fs::exists(fs::symlink_status(rec, ec)) && read_export_record(export_path).is_null()) {
    throw ConfigError("output.export_path " + export_path + ": " + rec +
                      " exists and is not q4train's export record (written beside each export)" +
                      safe);
  }
  if (!fs::exists(export_path, ec)) return;
  const auto held = existing_export_step(export_path);
  // Another run's export (a copied run resumed, two runs exporting to one path) is never replaced.
  // Inside the run directory the file moved with the run (a copied or moved run's own export).
  if (held && !path_inside(export_path, run_dir)) {
    const auto j = read_export_record(export_path);
    const std::string owner = j.contains("run_dir") && j["run_dir"].is_string()
                                  ? j["run_dir"].get<std::string>()
                                  : std::string();
    if (!owner.empty() && owner != run_dir_key(run_dir)) {
      throw ConfigError(fmt::format(
          "output.export_path {} holds step {} of the run in {}, not of this run ({}){}",
          export_path, *held, owner, run_dir_key(run_dir), safe));
    }
  }
  if (held && *held > step) {
    throw ConfigError(
        fmt::format("output.export_path {} holds step {}, newer than step {} that "
                    "this would export{}",
                    export_path, *held, step, safe));
  }
  if (!held && unknown_is_error) {
    throw ConfigError("output.export_path " + export_path + " exists and its step is unknown (no " +
                      fs::path(export_record_path(export_path)).filename().string() +
                      " beside it describes it)" + safe);
  }
}

void check_probe_report_path(const std::string& path, bool overwrite) {
  const std::string kind = io::non_regular_kind(path);
  if (!kind.empty()) {
    throw ConfigError("--probe-report " + path + " is " + kind +
                      "; the report must be a regular file or a new path");
  }
  std::error_code ec;
  if (overwrite || !fs::exists(path, ec)) return;
  std::ifstream in(path, std::ios::binary);
  std::string head(4096, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  std::string text = head;
  if (in) {  // larger than the head: read it all only when it starts like JSON
    if (head.find_first_not_of(" \t\r\n") == std::string::npos ||
        head[head.find_first_not_of(" \t\r\n")] != '{') {
      text.clear();
    } else {
      std::stringstream rest;
      rest << in.rdbuf();
      text += rest.str();
    }
  }
  const auto j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  const bool report = j.is_object() && j.contains("phases") && j["phases"].is_array() &&
                      j.contains("budget") && j.contains("measured");
  if (!report) {
    throw ConfigError("--probe-report " + path +
                      " exists and is not a previous probe report; choose another path or pass "
                      "--overwrite to replace it");
  }
}

// ---------------------------------------------------------------------------------------------
// Checksums

void write_checkpoint_checksums(const std::string& ckpt_dir,
                                const std::vector<std::string>& files) {
  nlohmann::json j;
  j["algorithm"] = "crc32c";
  for (const auto& f : files) {
    const std::string p = (fs::path(ckpt_dir) / f).string();
    j["files"][f] = {{"crc32c", fmt::format("{:08x}", io::crc32c_file(p))},
                     {"bytes", static_cast<int64_t>(fs::file_size(p))}};
  }
  io::write_file_atomic((fs::path(ckpt_dir) / kChecksumFile).string(), j.dump(2) + "\n");
}

std::string previous_checkpoint_hint(const CheckpointDir& ck) {
  const fs::path run_dir = fs::path(ck.path).parent_path();
  std::optional<CheckpointDir> prev;
  for (const auto& c : list_checkpoints(run_dir.string())) {
    if (c.done && c.step < ck.step) prev = c;
  }
  if (!prev) return "; there is no older complete checkpoint in " + run_dir.string();
  return "; the previous complete checkpoint is " + prev->path + " (resume it with --resume " +
         prev->path + ")";
}

void verify_checkpoint(const CheckpointDir& ck) {
  const fs::path dir(ck.path);
  const fs::path sums = dir / kChecksumFile;
  std::error_code ec;
  // Every checkpoint q4train writes has checksums.json (written before DONE), and state.json
  // carries no format version that could mark an older layout: a missing one is damage.
  if (!fs::exists(sums, ec)) {
    throw ConfigError("--resume: " + sums.string() + " is missing (every checkpoint has one): " +
                      ck.path + " is damaged" + previous_checkpoint_hint(ck));
  }
  nlohmann::json j = nlohmann::json::parse(read_file(sums.string()), nullptr, false);
  if (j.is_discarded() || !j.is_object() || !j.contains("files") || !j["files"].is_object()) {
    throw ConfigError("--resume: " + sums.string() + " is not a valid checksum file" +
                      previous_checkpoint_hint(ck));
  }
  for (const auto& [name, want] : j["files"].items()) {
    const fs::path p = dir / name;
    if (!fs::is_regular_file(p, ec)) {
      throw ConfigError("--resume: " + p.string() + " is missing" + previous_checkpoint_hint(ck));
    }
    const auto bytes = static_cast<int64_t>(fs::file_size(p, ec));
    if (!want.is_object() || !want.contains("bytes") || want["bytes"] != bytes) {
      throw ConfigError(fmt::format("--resume: {} has {} bytes, {} says {}: the file is damaged{}",
                                    p.string(), bytes, sums.string(),
                                    want.is_object() && want.contains("bytes")
                                        ? want["bytes"].dump()
                                        : std::string("nothing"),
                                    previous_checkpoint_hint(ck)));
    }
    const std::string got = fmt::format("{:08x}", io::crc32c_file(p.string()));
    if (!want.contains("crc32c") || want["crc32c"] != got) {
      throw ConfigError(fmt::format(
          "--resume: {}: CRC32C {} does not match {} in {}: the file is damaged{}", p.string(), got,
          want.contains("crc32c") ? want["crc32c"].dump() : std::string("nothing"), sums.string(),
          previous_checkpoint_hint(ck)));
    }
  }
}

std::optional<RunDirModel> run_dir_model(const std::string& dir, const std::string& key) {
  const fs::path p(dir);
  if (!fs::is_directory(p)) return std::nullopt;
  const std::string name =
      p.filename().empty() ? p.parent_path().filename().string() : p.filename().string();
  TORCH_CHECK(!fs::exists(p / "optim.state") && name.rfind("step_", 0) != 0, key, " ", dir,
              ": this is a training checkpoint (its masters live in optim.state), not a model; use "
              "the run's export instead (the run directory or its model.dat), or let q4train "
              "finish and export");
  if (!fs::exists(p / kConfigFile)) return std::nullopt;
  const Config c = load_config((p / kConfigFile).string());
  const fs::path beside = p / "model.dat";
  RunDirModel m;
  m.weights = fs::exists(beside) ? beside.string() : resolved_export_path(c);
  TORCH_CHECK(!m.weights.empty() && fs::exists(m.weights), key, " ", dir,
              ": run directory without an export (expected ", beside.string(),
              "); let the run finish, or name its .dat");
  m.config = c.model.config;
  m.chat = chat_settings(c);
  return m;
}

}  // namespace q4::trainer
