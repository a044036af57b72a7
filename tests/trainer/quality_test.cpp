// The quality benchmark in small, on the CPU (docs/quality.md; label slow): a tiny Qwen3 teacher
// trained in plain precision on Moby-Dick (tools/fetch_datasets.sh), its NVFP4 post-training
// quantization (PTQ), and the same fine-tuning budget through the straight-through quantizer
// with cross-entropy (QAT) and with distillation from the teacher (QAD), scored on the held-out
// chapters. The tokenizer's ids are mapped onto the 1,023 most frequent tokens of the training
// text plus one "other" id, so that a 64-wide model trains at CPU speed (about two minutes on two
// cores).
//
// Measured (1,000 teacher steps, 60 fine-tune steps at lr 3e-4, fine-tune data order seeds
// 11-13): teacher 3.6256, PTQ 3.6420; QAT 3.6333-3.6334 (53-54% of the gap); QAD 3.6288-3.6293
// (77-81%). The seeds move QAT by 1e-4 and QAD by 5e-4, so the margins asserted (QAT at least
// 0.004 below PTQ, QAD at least 0.002 below QAT: about half of each measured difference) are
// 40x and 4x that spread. With 1,500 teacher steps the teacher overfits (3.6631) and QAT and QAD
// recover 24-27% and 78-84%; with 400 it is undertrained and QAT, training on, passes it (200%).
// Q4_QUALITY_TEACHER_STEPS, Q4_QUALITY_TEACHER_LR, Q4_QUALITY_STEPS and Q4_QUALITY_LR override
// the settings for such experiments.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <unordered_map>

#include "component_fixtures.h"
#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/dat_file.h"
#include "q4/trainer/objectives/distill.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/setup.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace {

const std::string kSource = Q4_SOURCE_DIR;
constexpr int64_t kVocab = 1024;

int64_t env_int(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoll(v) : fallback;
}
double env_double(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v ? std::atof(v) : fallback;
}

struct Corpus {
  std::vector<data::Example> train, heldout;
};

// The two Moby-Dick splits, tokenized, their ids mapped onto the kVocab - 1 most frequent
// training tokens (by count, then id) and one shared id for every other token.
Corpus load_corpus() {
  const auto tok = data::Tokenizer::from_file(kSource + "/assets/qwen3/tokenizer.json");
  const std::string dir = kSource + "/assets/datasets/";
  Corpus c;
  c.train = data::load_dataset(dir + "moby_dick_train.jsonl", tok, {}).examples;
  c.heldout = data::load_dataset(dir + "moby_dick_heldout.jsonl", tok, {}).examples;
  std::unordered_map<int64_t, int64_t> count;
  for (const auto& e : c.train) {
    for (auto t : e.input_ids) ++count[t];
  }
  std::vector<std::pair<int64_t, int64_t>> by_count(count.begin(), count.end());
  std::sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  std::unordered_map<int64_t, int64_t> id;
  for (size_t i = 0; i < by_count.size() && i + 1 < static_cast<size_t>(kVocab); ++i) {
    id[by_count[i].first] = static_cast<int64_t>(i);
  }
  const auto map = [&](std::vector<data::Example>& v) {
    for (auto& e : v) {
      for (size_t k = 0; k < e.input_ids.size(); ++k) {
        const auto it = id.find(e.input_ids[k]);
        const auto m = static_cast<data::TokenId>(it == id.end() ? kVocab - 1 : it->second);
        e.input_ids[k] = m;
        if (e.labels[k] != data::kIgnoreIndex) e.labels[k] = m;
      }
    }
  };
  map(c.train);
  map(c.heldout);
  return c;
}

model::Qwen3Config tiny_config(const std::string& dir) {
  const std::string path = dir + "/quality.config.json";
  std::ofstream(path) << R"({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "vocab_size": 1024, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-06,
    "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": false,
    "hidden_act": "silu", "attention_bias": false})";
  return model::Qwen3Config::from_json_file(path);
}

data::BatcherOptions batching(uint64_t seed, bool shuffle) {
  data::BatcherOptions bo;
  bo.batch_size = 16;
  bo.max_seq_len = 128;
  bo.seed = seed;
  bo.shuffle = shuffle;
  bo.pack = true;
  bo.truncation = data::Truncation::kSplit;
  return bo;
}

// `steps` AdamW steps of `objective` on `model` over `data`, cosine from `lr` to lr / 10.
void train(model::Qwen3Model& model, Objective& objective, data::Batcher& data, int64_t steps,
           double lr) {
  Config c = cpu_config("unused");
  c.train.max_grad_norm = 1.0;
  RunPlan plan = resolve_plan(c, RunOptions{});
  optim::AdamWOptions ao;
  ao.lr = lr;
  optim::PackedAdamW optimizer(ao);
  optim::LrScheduleOptions so;
  so.kind = optim::LrScheduleKind::kCosine;
  so.peak_lr = lr;
  so.warmup_steps = std::max<int64_t>(1, steps / 20);
  so.total_steps = steps;
  so.min_lr = lr / 10;
  optim::LrSchedule schedule(so);
  GradSync sync(nullptr, model, model.trainable_parameters());
  const auto index = sync.add_owned_params(optimizer);
  TrainStep step(plan, model, optimizer, schedule, objective, sync, nullptr, false, index);
  for (int64_t s = 0; s < steps; ++s) step.run(s, data);
}

// Mean token loss over every held-out window.
double heldout_loss(model::Qwen3Model& model, const std::vector<data::Example>& heldout) {
  data::Batcher b(heldout, batching(0, /*shuffle=*/false));
  at::NoGradGuard no_grad;
  double sum = 0;
  int64_t n = 0;
  for (int64_t i = 0; i < b.batches_per_epoch(); ++i) {
    const auto lo = model.loss(to_inputs(b.next(), model, at::kCPU));
    sum += lo.loss_sum.item<double>();
    n += lo.num_tokens.item<int64_t>();
  }
  return sum / static_cast<double>(n);
}

model::ModelOptions cpu_options(bool fake_quant, model::TrainableSpec trainable) {
  model::ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.grad_dtype = at::kFloat;
  o.gradient_checkpointing = false;
  o.fake_quant = fake_quant;
  o.trainable = trainable;
  return o;
}

TEST(Quality, DistillationRecoversMoreOfThePtqGapThanQat) {
  const std::string train_file = kSource + "/assets/datasets/moby_dick_train.jsonl";
  ASSERT_TRUE(std::filesystem::exists(train_file))
      << train_file << " is missing: run tools/fetch_datasets.sh";
  ComponentTempDir tmp;
  const auto t0 = std::chrono::steady_clock::now();
  const Corpus corpus = load_corpus();
  const auto cfg = tiny_config(tmp.path.string());
  // Teacher: plain precision from a random init.
  auto teacher = model::Qwen3Model::random_init(
      cfg, cpu_options(false, model::TrainableSpec::everything()), 1, 0.02);
  {
    data::Batcher data(corpus.train, batching(1, true));
    SupervisedCrossEntropy ce;
    train(teacher, ce, data, env_int("Q4_QUALITY_TEACHER_STEPS", 1000),
          env_double("Q4_QUALITY_TEACHER_LR", 3e-3));
  }
  const std::string dense = (tmp.path / "teacher.dat").string();
  const std::string ptq = (tmp.path / "ptq.dat").string();
  model::write_dat(teacher, dense, /*quantize_lm_head=*/false, /*quantize_linears=*/false);
  model::write_dat(teacher, ptq, /*quantize_lm_head=*/true);
  model::TrainableSpec ft = model::TrainableSpec::everything();
  ft.embeddings = false;
  const auto student = [&] {
    return model::Qwen3Model::load(cfg, model::DatReader(ptq), cpu_options(true, ft));
  };
  const auto frozen_teacher = [&] {
    return std::make_unique<model::Qwen3Model>(model::Qwen3Model::load(
        cfg, model::DatReader(dense), cpu_options(false, model::TrainableSpec::nothing())));
  };
  auto ptq_model = student();
  const double l_teacher = heldout_loss(teacher, corpus.heldout);
  const double l_ptq = heldout_loss(ptq_model, corpus.heldout);
  std::printf("teacher %.4f, PTQ %.4f (gap %.4f) after %.0f s\n", l_teacher, l_ptq,
              l_ptq - l_teacher,
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  const int64_t steps = env_int("Q4_QUALITY_STEPS", 60);
  const double lr = env_double("Q4_QUALITY_LR", 3e-4);
  for (uint64_t seed : {11u, 12u, 13u}) {
    auto qat = student(), qad = student();
    data::Batcher d1(corpus.train, batching(seed, true)), d2(corpus.train, batching(seed, true));
    SupervisedCrossEntropy ce;
    train(qat, ce, d1, steps, lr);
    DistillConfig dc;
    Distillation kd(dc, frozen_teacher());
    train(qad, kd, d2, steps, lr);
    const double l_qat = heldout_loss(qat, corpus.heldout);
    const double l_qad = heldout_loss(qad, corpus.heldout);
    std::printf("seed %lu: QAT %.4f (%.0f%%), QAD %.4f (%.0f%%) after %.0f s\n",
                static_cast<unsigned long>(seed), l_qat,
                100 * (l_ptq - l_qat) / (l_ptq - l_teacher), l_qad,
                100 * (l_ptq - l_qad) / (l_ptq - l_teacher),
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    EXPECT_LT(l_qat, l_ptq - 0.004) << "seed " << seed << ": QAT does not beat PTQ";
    EXPECT_LT(l_qad, l_qat - 0.002) << "seed " << seed << ": QAD does not beat QAT";
  }
}

}  // namespace
