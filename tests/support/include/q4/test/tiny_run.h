// The tiny run of the end-to-end tests: a random-init Qwen3 of hidden size 32 with the real
// vocabulary (the tokenizer has 151669 ids, so the tests tokenize real text), a few lines of data
// and a config.yaml that trains it on the CPU, written into one folder. Each field is a section's
// lines, so a test states only what it changes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace q4::test {

// The source tree and the built programs (bin/q4train, bin/q4dat, ...).
inline const std::string kSource = Q4_SOURCE_DIR;
inline const std::string kBin = Q4_BIN_DIR;
inline const std::string kQ4train = kBin + "/q4train";
inline const std::string kTokenizer = kSource + "/assets/qwen3/tokenizer.json";

// Three prompt/answer lines of a TSV.
inline const std::string kTinyTsv =
    "Who are you?\tA test.\nSay hello.\tHello!\nWhat is 2 + 2?\t4.\n";

// Six TRL preference pairs ({"prompt", "chosen", "rejected"}) for train.objective preference.
inline const std::string kTinyPairsJsonl =
    "{\"prompt\": \"Who are you?\", \"chosen\": \"A test model.\", \"rejected\": \"Go away.\"}\n"
    "{\"prompt\": \"Say hello.\", \"chosen\": \"Hello there!\", \"rejected\": \"No.\"}\n"
    "{\"prompt\": \"What is 2 + 2?\", \"chosen\": \"2 + 2 is 4.\", \"rejected\": \"Not my problem.\"}\n"
    "{\"prompt\": \"Name a color.\", \"chosen\": \"Blue.\", \"rejected\": \"Ask someone else.\"}\n"
    "{\"prompt\": \"What day follows Monday?\", \"chosen\": \"Tuesday.\", \"rejected\": \"Who cares.\"}\n"
    "{\"prompt\": \"What does a cat say?\", \"chosen\": \"Meow.\", \"rejected\": \"Figure it out.\"}\n";

// config.json of the tiny Qwen3: hidden 32, `layers` decoder layers, untied lm_head.
std::string tiny_model_config(int layers);

struct TinyRun {
  int layers = 1;
  std::string data_file = "data.tsv";
  std::string data = kTinyTsv;
  std::string model_extra;  // lines added to model: (config, tokenizer, random init, cpu)
  // train.trainable's value; "" leaves the key out.
  std::string trainable = "{layers: all, projections: true, norms: true, lm_head: false}";
  int64_t steps = 2;  // < 0 leaves train.steps out
  int64_t batch_size = 2;
  int64_t seq_len = 32;
  std::string train_extra;  // lines added to train:
  std::string optim = "  lr: 1.0e-3\n  state: int8\n";
  std::string data_extra;  // lines added to data: (files: [data_file])
  std::string eval = "  prompts: []\n";
  std::string run = "run";   // output.dir is <dir>/<run>
  std::string output_extra;  // lines added to output: (dir: <dir>/<run>)
  std::string log;           // the lines of log:, left out when empty

  // config.yaml for a run in `dir` (output.dir is dir/<run>).
  std::string yaml(const std::filesystem::path& dir) const;
  // Writes dir/model.json, dir/<data_file> and dir/config.yaml (dir created if missing); returns
  // the config's path.
  std::filesystem::path write(const std::filesystem::path& dir) const;
  // write() into the fresh folder work_root(group)/name; returns that folder.
  std::filesystem::path write_fresh(const std::string& group, const std::string& name) const;
};

// write_fresh(group, name) of a TinyRun of `steps` steps that keeps 5 checkpoints, one every
// `checkpoint_every` steps (< 0 leaves the key out: the default cadence), with the lines
// `output_extra` added to output:.
std::filesystem::path write_checkpointing_run(const std::string& group, const std::string& name,
                                              int64_t steps, int64_t checkpoint_every,
                                              const std::string& output_extra = "");

// {"--config", dir/config.yaml} followed by "--set", s for each of `sets`.
std::vector<std::string> config_args(const std::filesystem::path& dir,
                                     const std::vector<std::string>& sets = {});

// Several CPU ranks need the trainer's Gloo process group (built only when libgloo-dev was found,
// e.g. not on a GPU host whose LibTorch comes from a wheel): tests of them skip without it.
#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
inline constexpr bool kCpuRanks = true;
#else
inline constexpr bool kCpuRanks = false;
#endif

}  // namespace q4::test
