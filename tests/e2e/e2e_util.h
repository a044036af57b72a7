// Helpers shared by the end-to-end tests (each .cpp here is its own test binary): the paths of
// the source tree and of q4train, whole-file I/O, a per-user scratch folder, metrics.jsonl, and
// the config.json of the tiny random Qwen3 they train (real vocabulary: the tokenizer has
// 151669 ids, so the tests tokenize real text).
#pragma once

#include <unistd.h>

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
