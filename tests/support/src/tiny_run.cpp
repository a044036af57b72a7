// The tiny run of the end-to-end tests (see q4/test/tiny_run.h).
#include "q4/test/tiny_run.h"

#include <sstream>

#include "q4/test/files.h"
#include "q4/test/temp_dir.h"

namespace fs = std::filesystem;

namespace q4::test {

std::string tiny_model_config(int layers) {
  return R"({
  "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
  "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": )" +
         std::to_string(layers) + R"(,
  "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "rms_norm_eps": 1e-6,
  "rope_theta": 1000000.0, "max_position_embeddings": 256, "tie_word_embeddings": false,
  "hidden_act": "silu", "attention_bias": false})";
}

std::string TinyRun::yaml(const fs::path& dir) const {
  std::ostringstream y;
  y << "model:\n  config: model.json\n  tokenizer: " << kTokenizer
    << "\n  init: random\n  init_seed: 3\n  device: cpu\n"
    << model_extra << "train:\n";
  if (!trainable.empty()) y << "  trainable: " << trainable << "\n";
  if (steps >= 0) y << "  steps: " << steps << "\n";
  y << "  batch_size: " << batch_size << "\n  seq_len: " << seq_len << "\n  seed: 5\n"
    << train_extra << "optim:\n"
    << optim << "data:\n  files: [" << data_file << "]\n"
    << data_extra << "eval:\n"
    << eval << "output:\n  dir: " << (dir / run).string() << "\n"
    << output_extra;
  if (!log.empty()) y << "log:\n" << log;
  return y.str();
}

fs::path TinyRun::write(const fs::path& dir) const {
  fs::create_directories(dir);
  write_text(dir / "model.json", tiny_model_config(layers));
  write_text(dir / data_file, data);
  write_text(dir / "config.yaml", yaml(dir));
  return dir / "config.yaml";
}

fs::path TinyRun::write_fresh(const std::string& group, const std::string& name) const {
  const fs::path dir = fresh_dir(work_root(group) / name);
  write(dir);
  return dir;
}

fs::path write_checkpointing_run(const std::string& group, const std::string& name, int64_t steps,
                                 int64_t checkpoint_every, const std::string& output_extra) {
  TinyRun t;
  t.steps = steps;
  t.output_extra = "  keep: 5\n" + output_extra;
  if (checkpoint_every >= 0) {
    t.output_extra += "  checkpoint_every: " + std::to_string(checkpoint_every) + "\n";
  }
  return t.write_fresh(group, name);
}

std::vector<std::string> config_args(const fs::path& dir, const std::vector<std::string>& sets) {
  std::vector<std::string> a = {"--config", (dir / "config.yaml").string()};
  for (const auto& s : sets) {
    a.push_back("--set");
    a.push_back(s);
  }
  return a;
}

}  // namespace q4::test
