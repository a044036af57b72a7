// The quality benchmark in small, on the CPU (docs/quality.md; label slow): a tiny Qwen3 teacher
// trained in plain precision on Moby-Dick (tools/fetch_datasets.sh), its NVFP4 post-training
// quantization (PTQ), and the same fine-tuning budget through the straight-through quantizer
// with cross-entropy (QAT) and with distillation from the teacher (QAD), scored on the held-out
// chapters. The tokenizer's ids are mapped onto the 1,023 most frequent tokens of the training
// text plus one "other" id, so that a 64-wide model trains at CPU speed (about two minutes on two
// cores).
//
// Measured (1,000 teacher steps, 60 fine-tune steps at lr 3e-4, fine-tune data order seeds
// 11-13) on two machines whose BLAS kernels differ: teacher 3.6191 / 3.6203, PTQ 3.6344 /
// 3.6342; QAT 3.6280-3.6294 / 3.6295-3.6305 (27-42% of the gap); QAD 3.6239-3.6243 /
// 3.6246-3.6248 (66-69%). The margins asserted: QAT at least 0.002 below PTQ (measured
// 0.0037-0.0064), QAD at least 0.002 below QAT (0.0037-0.0059). Earlier trees measured: with 1,500 teacher steps the
// teacher overfits and QAT and QAD recover 24-27% and 78-84%; with 400 it is undertrained and
// QAT, training on, passes it (200%).
// Q4_QUALITY_TEACHER_STEPS, Q4_QUALITY_TEACHER_LR, Q4_QUALITY_STEPS and Q4_QUALITY_LR override
// the settings for such experiments.
//
// Quality.FineTuneOnNewData is the fine-tune benchmark in small (docs/quality.md#the-cpu-version):
// the same plain base, a new domain (the first 24 State of the Union addresses; 4 held out), and
// per seed (a) a plain fine-tune then PTQ, (b) QAT from the NVFP4 base, (bd) the same from masters
// dithered inside their rounding cells (model.master_init: dither), (c) QAD from the NVFP4 base
// with (a) before PTQ as the teacher; fp32 masters and moments everywhere, 60 steps at lr 1e-3.
// Measured (seeds 11-13, held-out loss; base 3.7939, its PTQ 3.8060): (a) then PTQ
// 3.2389/3.2410/3.2370, (b) 3.2534/3.2588/3.2571, (bd) 3.2373/3.2368/3.2320, (c) 3.2961/3.2998/
// 3.2949; on a second machine (other BLAS kernels) base 3.7950, PTQ 3.8065, (a) then PTQ
// 3.2382/3.2422/3.2348, (b) 3.2541/3.2601/3.2573, (bd) 3.2336/3.2358/3.2333. Asserted per seed:
// (b) at least 0.007 above (a) then PTQ (measured 0.0145-0.0225) and (bd) at least 0.008 below
// (b) (0.016-0.025); over the seeds, (bd)'s mean below the peer path's (measured 0.0036 and
// 0.0042 below; per seed 0.0015-0.0064). (c) is printed, not asserted.

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

namespace q4::test::quality_test {

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


// The first `lines` records of a JSONL file (all when `lines` < 0), tokenized.
std::vector<data::Example> load_lines(const std::string& path, const data::Tokenizer& tok,
                                      int64_t lines) {
  if (lines < 0) return data::load_dataset(path, tok, {}).examples;
  std::ifstream in(path);
  std::string text, line;
  for (int64_t i = 0; i < lines && std::getline(in, line); ++i) text += line + "\n";
  return data::load_dataset_from_string(text, path, tok, {}).examples;
}

using Examples = std::vector<data::Example>;

// Maps every token id of `sets` onto the kVocab - 1 most frequent ids of `counted` (by count,
// then id) and one shared id for every other token.
void map_vocabulary(const std::vector<const Examples*>& counted, const std::vector<Examples*>& sets) {
  std::unordered_map<int64_t, int64_t> count;
  for (const auto* v : counted) {
    for (const auto& e : *v) {
      for (auto t : e.input_ids) ++count[t];
    }
  }
  std::vector<std::pair<int64_t, int64_t>> by_count(count.begin(), count.end());
  std::sort(by_count.begin(), by_count.end(), [](const auto& a, const auto& b) {
    return a.second != b.second ? a.second > b.second : a.first < b.first;
  });
  std::unordered_map<int64_t, int64_t> id;
  for (size_t i = 0; i < by_count.size() && i + 1 < static_cast<size_t>(kVocab); ++i) {
    id[by_count[i].first] = static_cast<int64_t>(i);
  }
  for (auto* v : sets) {
    for (auto& e : *v) {
      for (size_t k = 0; k < e.input_ids.size(); ++k) {
        const auto it = id.find(e.input_ids[k]);
        const auto m = static_cast<data::TokenId>(it == id.end() ? kVocab - 1 : it->second);
        e.input_ids[k] = m;
        if (e.labels[k] != data::kIgnoreIndex) e.labels[k] = m;
      }
    }
  }
}

data::Tokenizer qwen3_tokenizer() {
  return data::Tokenizer::from_file(kSource + "/assets/qwen3/tokenizer.json");
}

// The two Moby-Dick splits, tokenized, their ids mapped onto the training text's vocabulary.
Corpus load_corpus() {
  const auto tok = qwen3_tokenizer();
  const std::string dir = kSource + "/assets/datasets/";
  Corpus c;
  c.train = load_lines(dir + "moby_dick_train.jsonl", tok, -1);
  c.heldout = load_lines(dir + "moby_dick_heldout.jsonl", tok, -1);
  map_vocabulary({&c.train}, {&c.train, &c.heldout});
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

// The base both tests start from: the tiny Qwen3 trained in plain precision from a random init
// on `data`, written as `dense` (16/32-bit) and `ptq` (its linears and lm_head in NVFP4).
struct Base {
  model::Qwen3Model model;
  std::string dense, ptq;
};

Base pretrain_base(const model::Qwen3Config& cfg, const Examples& data,
                   const std::filesystem::path& dir) {
  Base b{model::Qwen3Model::random_init(
             cfg, cpu_options(false, model::TrainableSpec::everything()), 1, 0.02),
         (dir / "base.dat").string(), (dir / "base_ptq.dat").string()};
  data::Batcher batches(data, batching(1, true));
  SupervisedCrossEntropy ce;
  train(b.model, ce, batches, env_int("Q4_QUALITY_TEACHER_STEPS", 1000),
        env_double("Q4_QUALITY_TEACHER_LR", 3e-3));
  model::write_dat(b.model, b.dense, /*quantize_lm_head=*/false, /*quantize_linears=*/false);
  model::write_dat(b.model, b.ptq, /*quantize_lm_head=*/true);
  return b;
}

// The texts both tests read (tools/fetch_datasets.sh writes them; CI's slow job runs it first).
::testing::AssertionResult datasets_present() {
  for (const char* f : {"moby_dick_train.jsonl", "sotu_train.jsonl"}) {
    const std::string path = kSource + "/assets/datasets/" + f;
    if (!std::filesystem::exists(path)) {
      return ::testing::AssertionFailure() << path << " is missing: run tools/fetch_datasets.sh";
    }
  }
  return ::testing::AssertionSuccess();
}

// Seconds since construction, for the tests' progress lines.
struct Stopwatch {
  std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
};

// What both tests start with: the texts, a temporary folder, the stopwatch, the tiny config.
class Quality : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_TRUE(datasets_present()); }

  ComponentTempDir tmp;
  const Stopwatch clock{};
  const model::Qwen3Config cfg = tiny_config(tmp.path.string());
};

TEST_F(Quality, DistillationRecoversMoreOfThePtqGapThanQat) {
  const Corpus corpus = load_corpus();
  Base base = pretrain_base(cfg, corpus.train, tmp.path);
  auto& teacher = base.model;
  const std::string& dense = base.dense;
  const std::string& ptq = base.ptq;
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
              clock.seconds());
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
                clock.seconds());
    EXPECT_LT(l_qat, l_ptq - 0.002) << "seed " << seed << ": QAT does not beat PTQ";
    EXPECT_LT(l_qad, l_qat - 0.002) << "seed " << seed << ": QAD does not beat QAT";
  }
}


// The fine-tune benchmark's data in small: Moby-Dick to pretrain the base, the first State of the
// Union addresses as the new domain (train, held out), one vocabulary over both training texts.
struct FineTuneCorpus {
  Examples base, task, task_heldout;
};

FineTuneCorpus load_fine_tune_corpus() {
  const auto tok = qwen3_tokenizer();
  const std::string dir = kSource + "/assets/datasets/";
  FineTuneCorpus c;
  c.base = load_lines(dir + "moby_dick_train.jsonl", tok, -1);
  c.task = load_lines(dir + "sotu_train.jsonl", tok, env_int("Q4_QUALITY_TASK_DOCS", 24));
  c.task_heldout = load_lines(dir + "sotu_heldout.jsonl", tok, 4);
  map_vocabulary({&c.base, &c.task}, {&c.base, &c.task, &c.task_heldout});
  return c;
}

TEST_F(Quality, FineTuneOnNewData) {
  const FineTuneCorpus corpus = load_fine_tune_corpus();
  Base b = pretrain_base(cfg, corpus.base, tmp.path);
  model::TrainableSpec ft = model::TrainableSpec::everything();
  ft.embeddings = false;
  const auto load = [&](const std::string& path, bool fake_quant, model::TrainableSpec spec,
                        model::MasterInit init = model::MasterInit::kCodes, uint64_t seed = 0) {
    model::ModelOptions o = cpu_options(fake_quant, spec);
    o.master_init = init;
    o.master_init_seed = seed;
    return model::Qwen3Model::load(cfg, model::DatReader(path), o);
  };
  const auto score = [&](model::Qwen3Model& m) { return heldout_loss(m, corpus.task_heldout); };
  {
    auto base_ptq = load(b.ptq, true, ft);
    std::printf("base: task %.4f, PTQ %.4f after %.0f s\n", heldout_loss(b.model, corpus.task_heldout),
                score(base_ptq), clock.seconds());
  }
  const int64_t steps = env_int("Q4_QUALITY_STEPS", 60);
  const double lr = env_double("Q4_QUALITY_LR", 1e-3);
  // `m` fine-tuned by `objective` on the task, data order `seed`.
  const auto fine_tune = [&](model::Qwen3Model& m, Objective& objective, uint64_t seed) {
    data::Batcher data(corpus.task, batching(seed, true));
    train(m, objective, data, steps, lr);
  };
  SupervisedCrossEntropy ce;
  double sum_peer = 0, sum_dither = 0;
  for (uint64_t seed : {11u, 12u, 13u}) {
    // (a) plain fine-tune of the plain base, then PTQ (the export quantizer, as shipped).
    auto plain = load(b.dense, false, ft);
    fine_tune(plain, ce, seed);
    const std::string a_dense = (tmp.path / "a.dat").string();
    const std::string a_ptq = (tmp.path / "a_ptq.dat").string();
    model::write_dat(plain, a_dense, false, false);
    model::write_dat(plain, a_ptq, true);
    auto a_shipped = load(a_ptq, true, model::TrainableSpec::nothing());
    // From the NVFP4 base: (b) QAT, (bd) QAT from masters dithered inside their rounding cells,
    // (c) QAD with (a) before PTQ as the teacher.
    auto qat = load(b.ptq, true, ft);
    fine_tune(qat, ce, seed);
    auto qat_dither = load(b.ptq, true, ft, model::MasterInit::kDither, seed);
    fine_tune(qat_dither, ce, seed);
    auto qad = load(b.ptq, true, ft);
    Distillation kd(DistillConfig{}, std::make_unique<model::Qwen3Model>(
                                         load(a_dense, false, model::TrainableSpec::nothing())));
    fine_tune(qad, kd, seed);
    const double la = score(plain), la_ptq = score(a_shipped), lb = score(qat);
    const double lbd = score(qat_dither), lc = score(qad);
    std::printf("seed %lu: (a) %.4f, then PTQ %.4f; (b) QAT %.4f; (bd) dithered %.4f; (c) QAD "
                "%.4f after %.0f s\n",
                static_cast<unsigned long>(seed), la, la_ptq, lb, lbd, lc, clock.seconds());
    EXPECT_GT(lb, la_ptq + 0.007) << "seed " << seed << ": QAT from the masters on their codes "
                                  << "no longer trails the plain fine-tune and PTQ";
    EXPECT_LT(lbd, lb - 0.008) << "seed " << seed << ": dithered masters do not beat QAT";
    sum_peer += la_ptq;
    sum_dither += lbd;
  }
  EXPECT_LT(sum_dither / 3, sum_peer / 3)
      << "QAT from dithered masters does not ship a better NVFP4 model than the peer path";
}

}  // namespace q4::test::quality_test
