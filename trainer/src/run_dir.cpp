// Checkpoint directories: naming, listing, DONE markers, rotation, resume resolution.
#include "q4/trainer/run_dir.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "q4/trainer/config.h"

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

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), directory ? (O_RDONLY | O_DIRECTORY) : O_RDONLY);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
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

void write_file_atomic(const std::string& path, const std::string& text) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    TORCH_CHECK(out.is_open(), "cannot write ", tmp);
    out << text;
    out.flush();
    TORCH_CHECK(out.good(), "write failed: ", tmp);
  }
  fsync_path(tmp, false);
  std::error_code ec;
  fs::rename(tmp, path, ec);
  TORCH_CHECK(!ec, "cannot rename ", tmp, " to ", path, ": ", ec.message());
  fsync_path(fs::path(path).parent_path().string(), true);
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
      fs::remove_all(it->path, ec);
      if (!ec) removed.push_back(it->path);
    }
  }
  return removed;
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

}  // namespace q4::trainer
