// Helpers shared by the end-to-end tests (each .cpp here is its own test binary): the paths of
// the source tree and of q4train, whole-file I/O, a per-user scratch folder, metrics.jsonl, and
// the config.json of the tiny random Qwen3 they train (real vocabulary: the tokenizer has
// 151669 ids, so the tests tokenize real text).
#pragma once

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace q4::e2e {

inline const std::string kSource = Q4_SOURCE_DIR;
inline const std::string kQ4train = std::string(Q4_BIN_DIR) + "/q4train";

inline std::string read_text(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

inline void write_text(const std::filesystem::path& p, const std::string& s) {
  std::ofstream out(p, std::ios::binary);
  out << s;
}

// temp_directory_path()/q4_<tag>_<uid>, created if missing: one folder per test binary and user
// (tests of one binary run in parallel processes under ctest and share it, with file locks where
// they share a run).
inline std::filesystem::path work_root(const std::string& tag) {
  const std::filesystem::path p =
      std::filesystem::temp_directory_path() / ("q4_" + tag + "_" + std::to_string(::getuid()));
  std::filesystem::create_directories(p);
  return p;
}

// The records of a metrics.jsonl (blank lines skipped).
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p) {
  std::vector<nlohmann::json> out;
  std::ifstream in(p);
  std::string line;
  while (std::getline(in, line)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

inline bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// A finished command: its exit code (-1 when it did not exit normally) and what it printed.
struct Result {
  int code = -1;
  std::string out, err;
};

// " 'a' 'b'": `args` single-quoted for sh (arguments hold no single quote).
inline std::string quoted(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += " '" + a + "'";
  return s;
}

// The shell command line `cmd` with stdout and stderr captured in `out` and `err` (kept for
// debugging a failure) and read back.
inline Result run_captured(const std::string& cmd, const std::filesystem::path& out,
                           const std::filesystem::path& err) {
  const std::string full = cmd + " >'" + out.string() + "' 2>'" + err.string() + "'";
  const int status = std::system(full.c_str());
  Result r;
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

// Several CPU ranks need the trainer's Gloo process group (built only when libgloo-dev was found,
// e.g. not on a GPU host whose LibTorch comes from a wheel): tests of them skip without it.
#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
inline constexpr bool kCpuRanks = true;
#else
inline constexpr bool kCpuRanks = false;
#endif

// Starts `exe` with `args` in a child process, its stdout and stderr both into `log`; returns the
// child's pid (the caller signals and waits for it).
inline pid_t spawn_logged(const std::string& exe, const std::vector<std::string>& args,
                          const std::filesystem::path& log) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  const int fd = ::open(log.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  std::vector<char*> argv = {const_cast<char*>(exe.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(exe.c_str(), argv.data());
  ::_exit(127);
}

// Hidden 32, `layers` decoder layers, untied lm_head, the real Qwen3 vocabulary.
inline std::string tiny_model_config(int layers) {
  return R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": )" +
         std::to_string(layers) + R"(,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
  "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": false,
  "hidden_act": "silu", "attention_bias": false})";
}

}  // namespace q4::e2e
