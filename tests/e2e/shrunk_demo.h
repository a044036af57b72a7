// The shrunk demo the end-to-end tests of q4train share (e2e_test.cpp, e2e_ux_test.cpp): its
// config (tiny random Qwen3 with the real tokenizer, the memorized whoami lines, CPU), the base
// run built once per machine state under a file lock (ctest runs every test in its own process),
// and the loss of a model file over a dataset, recomputed with the model library.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <utility>

#include "e2e_util.h"
#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/test/files.h"
#include "q4/test/memorize_set.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/plan/options.h"

namespace fs = std::filesystem;

namespace q4::test {

// The shrunk demo config, in `dir` (with its model config and data next to it).
inline fs::path write_config(const fs::path& dir, int64_t steps, int64_t checkpoint_every) {
  TinyRun t;
  t.data = kMemorizeTsv;
  t.model_extra = "  master_dtype: fp16\n";
  t.trainable = "{layers: all, projections: true, norms: true, lm_head: true}";
  t.steps = steps;
  t.batch_size = 8;
  t.seq_len = 48;
  t.train_extra = "  max_grad_norm: 1.0\n";
  t.optim =
      "  lr: 1.0e-2\n  state: int8\n  schedule: {kind: cosine, warmup_steps: 3, min_lr_ratio: "
      "0.1}\n";
  t.eval = "  prompts: [你是谁？, 我是誰]\n  max_new_tokens: 16\n";
  t.output_extra = "  checkpoint_every: " + std::to_string(checkpoint_every) + "\n  keep: 5\n";
  t.log = "  every: 5\n";
  return t.write(dir);
}

inline constexpr int64_t kBaseSteps = 40;
// Checkpoints at 10, 20, 30 and 40 (keep 5 holds them all): E2E.ResumeEqualsUninterruptedRun
// resumes from step 30, so that it retrains 10 steps rather than 20.
inline constexpr int64_t kBaseCheckpointEvery = 10;

// The base run: built once per machine state (reused by every test process) under a lock.
inline fs::path base_dir() {
  const fs::path dir = work_root("e2e") / "base";
  const int lock = ::open((work_root("e2e") / "base.lock").c_str(), O_CREAT | O_RDWR, 0644);
  ::flock(lock, LOCK_EX);
  const fs::path complete = dir / "COMPLETE";
  const std::string stamp =
      std::to_string(fs::last_write_time(kQ4train).time_since_epoch().count());
  if (!fs::exists(complete) || read_text(complete) != stamp) {
    q4::io::remove_tree(dir);
    const auto cfg = write_config(dir, kBaseSteps, kBaseCheckpointEvery);
    const Result r = run_q4train({"--config", cfg.string()}, dir / "base");
    if (r.code == 0) write_text(complete, stamp);
  }
  ::flock(lock, LOCK_UN);
  ::close(lock);
  return dir;
}

inline q4::trainer::Config load_cfg(const fs::path& dir) {
  return q4::trainer::load_config((dir / "run" / "config.yaml").string());
}

// Mean supervised cross-entropy of a frozen model loaded from `weights` over `data_file` (default:
// the training file), all examples in one batch; with `adapter`, that PEFT folder applied to it
// (Qwen3Model::load_adapter).
inline double dataset_loss(const q4::trainer::Config& c, const std::string& weights,
                           const std::string& data_file = "", const std::string& adapter = "") {
  const auto mc = q4::model::Qwen3Config::from_json_file(c.model.config);
  auto opt = q4::trainer::model_options(c);
  opt.trainable = q4::model::TrainableSpec::nothing();
  if (!adapter.empty()) {
    opt = q4::model::with_adapter(opt, q4::model::read_adapter_config(adapter));
  }
  q4::model::DatReader reader(weights);
  auto model = q4::model::Qwen3Model::load(mc, reader, opt);
  if (!adapter.empty()) model.load_adapter(adapter);
  const auto tok = q4::data::Tokenizer::from_file(c.model.tokenizer);
  auto ds = q4::data::load_dataset(data_file.empty() ? c.data.files[0] : data_file, tok);
  q4::data::BatcherOptions bo;
  bo.batch_size = static_cast<int64_t>(ds.examples.size());
  bo.max_seq_len = c.train.seq_len;
  bo.shuffle = false;
  q4::data::Batcher batcher(std::move(ds.examples), bo);
  const auto b = batcher.next();
  q4::model::ModelInputs in;
  in.input_ids = b.input_ids;
  in.labels = b.labels;
  in.attention_mask = b.attention_mask;
  in.position_ids = b.position_ids;
  in.segment_ids = b.segment_ids;
  at::NoGradGuard ng;
  return model.loss(in).loss.item<double>();
}

}  // namespace q4::test
