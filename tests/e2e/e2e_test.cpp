// End-to-end tests of build/bin/q4train on a shrunk demo (tiny random Qwen3 with the real
// tokenizer, a handful of whoami lines, CPU). Results are checked independently of the trainer's
// own printing: the exported model's loss is recomputed with the model library, the export's
// logits are compared with the checkpointed masters, and a resumed run must reproduce the
// uninterrupted run's metrics and export bit for bit. One base run is shared by the tests (it is
// built once under a file lock, since ctest runs every test in its own process).
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/io/remove_tree.h"
#include "q4/io/safetensors.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/plan/estimate.h"
#include "shrunk_demo.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::e2e_test {
using namespace q4::test;

TEST(E2E, VersionAndHelp) {
  const fs::path dir = work_root("e2e") / "version";
  fs::create_directories(dir);
  auto r = run_q4train({"--version"}, dir / "v");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("q4train"), std::string::npos);
  r = run_q4train({"--help"}, dir / "h");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("--config"), std::string::npos);
  r = run_q4train({"--no-such-flag"}, dir / "bad");
  EXPECT_EQ(r.code, 2);
}

TEST(E2E, TrainsExportsAndMemorizes) {
  const fs::path dir = base_dir();
  ASSERT_TRUE(fs::exists(dir / "COMPLETE")) << read_text(dir / "base.err");
  const auto c = load_cfg(dir);
  const fs::path run = dir / "run";
  ASSERT_TRUE(fs::exists(run / "model.dat"));
  ASSERT_TRUE(fs::exists(run / "init.dat"));
  // The loss on the memorized set, recomputed from the files: at least 5x lower after training.
  const double before = dataset_loss(c, (run / "init.dat").string());
  const double after = dataset_loss(c, (run / "model.dat").string());
  EXPECT_GT(before, 5.0 * after) << "before " << before << " after " << after;
  // metrics.jsonl: one line per step with the documented fields.
  const auto metrics = read_jsonl(run / "metrics.jsonl");
  ASSERT_EQ(static_cast<int64_t>(metrics.size()), kBaseSteps);
  for (const char* k : {"step", "loss", "grad_norm", "lr", "step_ms", "tokens_per_s", "mfu",
                        "gpu_reserved_bytes", "eta_s"}) {
    EXPECT_TRUE(metrics.back().contains(k)) << k;
  }
  EXPECT_EQ(metrics.back()["step"], kBaseSteps);
  // eval.jsonl holds the start and end answers of both prompts.
  const auto evals = read_jsonl(run / "eval.jsonl");
  ASSERT_EQ(evals.size(), 4u);
  EXPECT_EQ(evals[2]["when"], "end");
  // Checkpoints every 10 steps, complete.
  for (const char* step : {"step_000010", "step_000020", "step_000030", "step_000040"}) {
    EXPECT_TRUE(fs::exists(run / step / "DONE")) << step;
  }
}

TEST(E2E, ExportReloadsToTheSameLogits) {
  const fs::path dir = base_dir();
  ASSERT_TRUE(fs::exists(dir / "COMPLETE")) << read_text(dir / "base.err");
  const auto c = load_cfg(dir);
  const fs::path run = dir / "run";
  const auto mc = q4::model::Qwen3Config::from_json_file(c.model.config);
  // A: the trained masters, rebuilt from init.dat plus the final checkpoint's optimizer state.
  q4::model::DatReader init((run / "init.dat").string());
  auto a = q4::model::Qwen3Model::load(mc, init, q4::trainer::model_options(c));
  q4::optim::PackedAdamW opt(q4::trainer::adamw_options(c));
  for (auto* p : a.trainable_parameters()) opt.add_param(p->name, p->master, p->master.dim() >= 2);
  opt.load((run / "step_000040" / "optim.state").string(), /*restore_masters=*/true);
  // B: the exported file, loaded frozen as inference would.
  auto frozen = q4::trainer::model_options(c);
  frozen.trainable = q4::model::TrainableSpec::nothing();
  q4::model::DatReader exported((run / "model.dat").string());
  auto b = q4::model::Qwen3Model::load(mc, exported, frozen);
  // The export requantizes exactly what A's forward uses (fake_quant(master)); fp16 raw tensors
  // are stored as they are. B re-applies fake-quant to the dequantized weights at load, which
  // moves about 0.5% of NVFP4 blocks by one code: a small, bounded difference.
  const auto tok = q4::data::Tokenizer::from_file(c.model.tokenizer);
  const auto ids = tok.encode("<|im_start|>user\n你是谁？<|im_end|>\n<|im_start|>assistant\n");
  q4::model::ModelInputs in;
  in.input_ids = at::tensor(std::vector<int64_t>(ids.begin(), ids.end())).unsqueeze(0);
  at::NoGradGuard ng;
  const auto la = a.forward(in).to(at::kFloat);  // (1, T, V)
  const auto lb = b.forward(in).to(at::kFloat);
  const double scale = la.abs().max().item<double>();
  const double diff = (la - lb).abs().max().item<double>();
  EXPECT_LT(diff, 0.05 * scale) << "max |diff| " << diff << " of logits up to " << scale;
  EXPECT_TRUE(at::equal(la.argmax(-1), lb.argmax(-1)));
}

// Plain precision: the linears train as dense masters (no straight-through quantizer), the
// summary says so, and its loss differs from the same run with fake quantization. From an NVFP4
// .dat (the straight-through run's init) the export is the export quantizer's rounding of the
// trained masters (NVFP4 pairs), or with output.export_dense the masters themselves (fp16), both
// confirmed by the export check; from a random init the run starts and ends dense.
TEST(E2E, PlainPrecisionTrainsAndExportsItsQuantizationOrItself) {
  TinyRun t;
  t.steps = 3;
  t.log = "  tensorboard: false\n  report: false\n";
  const fs::path dir = t.write_fresh("e2e", "plain");
  const auto run = [&](const std::string& name, std::vector<std::string> sets) {
    sets.push_back("output.dir=" + (dir / name).string());
    const Result r = run_in(dir, name, kQ4train + quoted(config_args(dir, sets)));
    EXPECT_EQ(r.code, 0) << r.out << r.err;
    EXPECT_EQ(r.out.find("FAILED"), std::string::npos) << r.out;
    return r;
  };
  const auto pairs = [&](const std::string& name) {
    return q4::model::DatReader((dir / name / "model.dat").string()).nvfp4_pairs(true).size();
  };
  const auto last_loss = [&](const std::string& name) {
    const auto records = read_jsonl(dir / name / "metrics.jsonl");
    return records.empty() ? std::string() : records.back()["loss"].dump();
  };
  const Result qat = run("qat", {});
  EXPECT_EQ(qat.out.find("plain precision"), std::string::npos) << qat.out;
  const std::string nvfp4_init = (dir / "qat" / "init.dat").string();
  const Result ptq =
      run("ptq", {"model.fake_quant=false", "model.init=file", "model.weights=" + nvfp4_init});
  EXPECT_NE(ptq.out.find("plain precision"), std::string::npos) << ptq.out;
  // The start summary says what the export will be.
  EXPECT_TRUE(std::regex_search(ptq.out, std::regex("  export     .*model\\.dat: NVFP4, the \\d+ "
                                                    "trained linears quantized after training")))
      << ptq.out;
  EXPECT_NE(ptq.out.find("output.export_dense: true writes"), std::string::npos) << ptq.out;
  // Equal, or off by the re-quantization the check expects of any trained NVFP4 tensor.
  EXPECT_TRUE(std::regex_search(ptq.out, std::regex("export check: \\d+/\\d+ tensors"))) << ptq.out;
  EXPECT_GT(pairs("ptq"), 0u);
  EXPECT_NE(last_loss("ptq"), last_loss("qat"));  // the quantizer changes what trains
  const Result dense = run("dense", {"model.fake_quant=false", "model.init=file",
                                     "model.weights=" + nvfp4_init, "output.export_dense=true"});
  std::smatch m;
  ASSERT_TRUE(std::regex_search(dense.out, m, std::regex("export check: (\\d+)/(\\d+) tensors")))
      << dense.out;
  EXPECT_EQ(m[1].str(), m[2].str()) << "every tensor of a dense export is exact: " << dense.out;
  EXPECT_NE(dense.out.find("model.dat: dense, the trained masters of the"), std::string::npos)
      << dense.out;
  EXPECT_EQ(pairs("dense"), 1u);  // only the frozen lm_head stays the NVFP4 pair it was
  EXPECT_EQ(last_loss("dense"), last_loss("ptq"));  // the same training, another export
  const Result random = run("random", {"model.fake_quant=false"});
  EXPECT_NE(random.out.find("model.dat: dense, as the trained linears came"), std::string::npos)
      << random.out;
  EXPECT_EQ(pairs("random"), 0u);
  // A straight-through run has no dense export.
  const Result refused =
      run_in(dir, "refused", kQ4train + quoted(config_args(dir, {"output.export_dense=true"})));
  EXPECT_NE(refused.code, 0);
  EXPECT_NE(refused.err.find("output.export_dense"), std::string::npos) << refused.err;
}

// Plain precision from a dense Hugging Face folder (a first run's BF16 export): the import keeps
// the linears dense, the run's .dat export stores them as 16-bit tensors (no NVFP4 pair), and its
// BF16 folder holds exactly those weights.
TEST(E2E, PlainPrecisionFromADenseFolderExportsDenseWeights) {
  TinyRun t;
  t.steps = 1;
  t.log = "  tensorboard: false\n  report: false\n";
  t.output_extra = "  hf_export: bf16\n";
  const fs::path dir = t.write_fresh("e2e", "plain_hf");
  const Result first =
      run_in(dir, "first",
             kQ4train + quoted(config_args(dir, {"output.dir=" + (dir / "first").string()})));
  ASSERT_EQ(first.code, 0) << first.out << first.err;
  const Result r = run_in(
      dir, "plain",
      kQ4train + quoted(config_args(dir, {"model.init=file",
                                          "model.weights=" + (dir / "first" / "model-hf").string(),
                                          "model.fake_quant=false", "train.steps=2"})));
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_EQ(r.out.find("FAILED"), std::string::npos) << r.out;
  const q4::model::DatReader imported((dir / "run" / "hf_import.dat").string());
  const q4::model::DatReader exported((dir / "run" / "model.dat").string());
  EXPECT_TRUE(imported.nvfp4_pairs(/*strict=*/true).empty());
  EXPECT_TRUE(exported.nvfp4_pairs(/*strict=*/true).empty());
  const q4::io::SafetensorsModel hf((dir / "run" / "model-hf").string());
  int64_t changed = 0;
  for (const auto& e : exported.entries()) {
    const at::Tensor want = exported.load(e);
    const auto got = hf.at(e.key);
    EXPECT_TRUE(at::equal(got.file->load(*got.tensor).to(at::kFloat), want.to(at::kFloat)))
        << e.key;
    changed += !at::equal(want, imported.load(e.key));
  }
  EXPECT_GT(changed, 0);  // training moved the dense weights
}

// Distillation end to end: a first run's export is the teacher of a second run (online); then
// --write-teacher-topk writes its top-K file once (and refuses to replace it), and a third run
// trains from the file alone (offline). Both log the divergence and the cross-entropy.
TEST(E2E, DistillationOnlineAndFromATopkFile) {
  TinyRun t;
  t.steps = 2;
  t.log = "  tensorboard: false\n  report: false\n";
  const fs::path dir = t.write_fresh("e2e", "distill");
  const std::string teacher = (dir / "teacher" / "model.dat").string();
  const std::string topk = (dir / "topk.dat").string();
  const Result first =
      run_in(dir, "teacher",
             kQ4train + quoted(config_args(dir, {"output.dir=" + (dir / "teacher").string()})));
  ASSERT_EQ(first.code, 0) << first.out << first.err;
  const auto distill_args = [&](const std::string& run, std::vector<std::string> extra) {
    std::vector<std::string> sets = {"output.dir=" + (dir / run).string(),
                                     "train.objective=distill", "distill.alpha=0.5"};
    for (auto& e : extra) sets.push_back(std::move(e));
    return config_args(dir, sets);
  };
  const Result online = run_in(
      dir, "online", kQ4train + quoted(distill_args("online", {"distill.teacher=" + teacher})));
  ASSERT_EQ(online.code, 0) << online.out << online.err;
  EXPECT_NE(online.out.find("teacher " + teacher), std::string::npos) << online.out;
  const auto rec = read_jsonl(dir / "online" / "metrics.jsonl");
  ASSERT_FALSE(rec.empty());
  EXPECT_TRUE(rec.front().contains("distill_divergence")) << rec.front().dump();
  EXPECT_TRUE(rec.front().contains("distill_ce")) << rec.front().dump();
  // The teacher named by its run directory, as q4chat and q4eval take it: its export, the same
  // run; a checkpoint of it is refused, naming the key.
  const Result by_dir = run_in(
      dir, "by_dir",
      kQ4train + quoted(distill_args("by_dir", {"distill.teacher=" + (dir / "teacher").string()})));
  ASSERT_EQ(by_dir.code, 0) << by_dir.out << by_dir.err;
  EXPECT_NE(by_dir.out.find("teacher " + teacher), std::string::npos) << by_dir.out;
  const auto rec_dir = read_jsonl(dir / "by_dir" / "metrics.jsonl");
  ASSERT_EQ(rec_dir.size(), rec.size());
  EXPECT_EQ(rec_dir.back()["loss"], rec.back()["loss"]);
  std::string checkpoint;
  for (const auto& e : fs::directory_iterator(dir / "teacher")) {
    if (e.path().filename().string().rfind("step_", 0) == 0) checkpoint = e.path().string();
  }
  ASSERT_FALSE(checkpoint.empty());
  const Result refused =
      run_in(dir, "refused",
             kQ4train + quoted(distill_args("refused", {"distill.teacher=" + checkpoint})));
  EXPECT_EQ(refused.code, 2) << refused.err;
  EXPECT_NE(refused.err.find("distill.teacher"), std::string::npos) << refused.err;
  EXPECT_NE(refused.err.find("training checkpoint"), std::string::npos) << refused.err;

  const auto topk_args = distill_args(
      "write", {"distill.teacher=" + teacher, "distill.topk_file=" + topk, "distill.topk=8"});
  std::vector<std::string> write_args = topk_args;
  write_args.push_back("--write-teacher-topk");
  const Result written = run_in(dir, "write", kQ4train + quoted(write_args));
  ASSERT_EQ(written.code, 0) << written.out << written.err;
  EXPECT_NE(written.out.find("teacher top-8 of"), std::string::npos) << written.out;
  const Result again = run_in(dir, "write_again", kQ4train + quoted(write_args));
  EXPECT_NE(again.code, 0);
  EXPECT_NE(again.err.find("exists"), std::string::npos) << again.err;

  const Result offline = run_in(
      dir, "offline", kQ4train + quoted(distill_args("offline", {"distill.topk_file=" + topk})));
  ASSERT_EQ(offline.code, 0) << offline.out << offline.err;
  EXPECT_NE(offline.out.find("(top 8,"), std::string::npos) << offline.out;
  const auto off = read_jsonl(dir / "offline" / "metrics.jsonl");
  ASSERT_FALSE(off.empty());
  EXPECT_TRUE(off.front().contains("distill_divergence")) << off.front().dump();
  // Other data (a shorter seq_len truncates differently): the file is refused, naming the key.
  const Result other = run_in(
      dir, "other",
      kQ4train + quoted(distill_args("other", {"distill.topk_file=" + topk, "train.seq_len=8"})));
  EXPECT_NE(other.code, 0);
  EXPECT_NE(other.err.find("distill.topk_file"), std::string::npos) << other.err;
}

TEST(E2E, ResumeEqualsUninterruptedRun) {
  const fs::path base = base_dir();
  ASSERT_TRUE(fs::exists(base / "COMPLETE")) << read_text(base / "base.err");
  // Copy the run directory and resume it from its next-to-last checkpoint.
  const fs::path dir = work_root("e2e") / "resume";
  copy_run(base, dir);
  q4::io::remove_tree(dir / "run" / "step_000040");
  fs::remove(dir / "run" / "model.dat");
  // The saved config names the base run's output.dir; point it at the copy.
  const auto r = run_q4train({"--resume", (dir / "run" / "step_000030").string(), "--set",
                              "output.dir=" + (dir / "run").string()},
                             dir / "resume");
  ASSERT_EQ(r.code, 0) << r.err;
  // CPU arithmetic is deterministic: bit-identical losses and gradient norms.
  ASSERT_NO_FATAL_FAILURE(expect_same_steps(base / "run" / "metrics.jsonl",
                                            dir / "run" / "metrics.jsonl",
                                            {"step", "loss", "grad_norm"}));
  EXPECT_EQ(read_text(dir / "run" / "model.dat"), read_text(base / "run" / "model.dat"));
}

// train.method lora: a run killed after its first checkpoint and resumed gives the uninterrupted
// run's losses, merged export and PEFT adapter bit for bit (merge-aware and plain adapters).
TEST(E2E, LoraResumeEqualsUninterruptedRunAndExportsTheAdapter) {
  for (const bool merge_aware : {true, false}) {
    const fs::path dir = work_root("e2e") / (merge_aware ? "lora-merge" : "lora-plain");
    q4::io::remove_tree(dir);
    const auto cfg = write_config(dir, 8, 4);
    const std::vector<std::string> lora = {
        "--set", "train.method=lora",
        "--set", "lora.rank=4",
        "--set", std::string("lora.merge_aware=") + (merge_aware ? "true" : "false"),
        "--set", "eval.at_start=false",
        "--set", "eval.at_end=false"};
    auto args = [&](const std::string& run) {
      std::vector<std::string> a = {"--config", cfg.string(), "--set",
                                    "output.dir=" + (dir / run).string()};
      a.insert(a.end(), lora.begin(), lora.end());
      return a;
    };
    const auto full = run_q4train(args("full"), dir / "full");
    ASSERT_EQ(full.code, 0) << full.err;
    EXPECT_NE(full.out.find(merge_aware ? "LoRA (merge-aware): rank 4" : "LoRA (plain): rank 4"),
              std::string::npos)
        << full.out;
    EXPECT_NE(full.out.find("adapter (PEFT) -> "), std::string::npos) << full.out;
    EXPECT_EQ(merge_aware,
              full.out.find("plain LoRA: the merged NVFP4 export") == std::string::npos)
        << full.out;
    const fs::path adapter = dir / "full" / "model-adapter";
    ASSERT_TRUE(fs::exists(adapter / "adapter_model.safetensors"));
    const auto ac = nlohmann::json::parse(read_text(adapter / "adapter_config.json"));
    EXPECT_EQ(ac["r"], 4);
    EXPECT_EQ(ac["peft_type"], "LORA");
    // The same run interrupted after step 4: a copy of the run directory without what came
    // later, resumed from its step-4 checkpoint.
    fs::copy(dir / "full", dir / "cut", fs::copy_options::recursive);
    q4::io::remove_tree(dir / "cut" / "step_000008");
    fs::remove(dir / "cut" / "model.dat");
    fs::remove(dir / "cut" / "model.dat.json");
    q4::io::remove_tree(dir / "cut" / "model-adapter");
    if (merge_aware) {
      // Another alpha would continue other adapters: refused, naming the key and both values.
      const auto changed =
          run_q4train({"--resume", (dir / "cut" / "step_000004").string(), "--set",
                       "output.dir=" + (dir / "cut").string(), "--set", "lora.alpha=8"},
                      dir / "changed");
      EXPECT_EQ(changed.code, 2);
      EXPECT_NE(changed.err.find("config key lora.alpha is 32.0 in the checkpoint but 8.0 now"),
                std::string::npos)
          << changed.err;
      EXPECT_FALSE(fs::exists(dir / "cut" / "step_000008"));
    }
    const auto resumed = run_q4train({"--resume", (dir / "cut" / "step_000004").string(), "--set",
                                      "output.dir=" + (dir / "cut").string()},
                                     dir / "resumed");
    ASSERT_EQ(resumed.code, 0) << resumed.err;
    ASSERT_NO_FATAL_FAILURE(
        expect_same_steps(dir / "full" / "metrics.jsonl", dir / "cut" / "metrics.jsonl", {"loss"}));
    EXPECT_EQ(read_text(dir / "cut" / "model.dat"), read_text(dir / "full" / "model.dat"));
    EXPECT_EQ(read_text(dir / "cut" / "model-adapter" / "adapter_model.safetensors"),
              read_text(adapter / "adapter_model.safetensors"));
    // The adapters trained: the export differs from the initial weights.
    EXPECT_NE(read_text(dir / "full" / "model.dat"), read_text(dir / "full" / "init.dat"));
  }
}

// train.objective preference: the reference's log-probabilities are computed once, before step 1,
// and kept in the run; a run killed after its first checkpoint and resumed reads them back (the
// file untouched) and gives the uninterrupted run's losses, rewards and export bit for bit. The
// held-out pairs' reward accuracy is logged as eval_rewards/accuracies.
TEST(E2E, PreferenceResumeReadsTheReferenceAndEqualsUninterruptedRun) {
  const fs::path dir = work_root("e2e") / "preference";
  q4::io::remove_tree(dir);
  TinyRun t;
  t.data_file = "pairs.jsonl";
  t.data = kTinyPairsJsonl;
  t.trainable = "{layers: all, projections: true, norms: true, lm_head: true, embeddings: true}";
  t.steps = 8;
  t.batch_size = 4;
  t.seq_len = 32;
  t.train_extra = "  objective: preference\n";
  t.optim = "  lr: 1.0e-2\n  state: int8\n";
  t.data_extra = "  eval_fraction: 0.2\n";
  t.eval = "  prompts: []\n  every: 4\n  at_start: true\n";
  t.output_extra = "  checkpoint_every: 4\n";
  t.log = "  every: 1\n";
  const auto cfg = t.write(dir);
  const auto full = run_q4train({"--config", cfg.string()}, dir / "full");
  ASSERT_EQ(full.code, 0) << full.err << full.out;
  EXPECT_NE(full.out.find("preference: sigmoid loss, beta 0.1"), std::string::npos) << full.out;
  // 6 pairs: 2 held out (ceil(0.2 x 6)), 4 trained, each pair two sequences.
  EXPECT_NE(full.out.find("reference log-probabilities of 8 + 4 sequences by the starting model"),
            std::string::npos)
      << full.out;
  const fs::path ref = dir / "run" / "reference_logprobs.dat";
  ASSERT_TRUE(fs::exists(ref));
  const auto want = read_jsonl(dir / "run" / "metrics.jsonl");
  // Step 1 starts at the reference: DPO's log 2; the validation at step 0 has no preference yet.
  bool saw_start = false, saw_end = false;
  for (const auto& r : want) {
    if (!r.contains("eval_rewards/accuracies")) continue;
    if (r["step"] == 0) {
      saw_start = true;
      EXPECT_NEAR(r["eval_rewards/accuracies"].get<double>(), 0.5, 1e-9);
      EXPECT_NEAR(r["val_loss"].get<double>(), std::log(2.0), 1e-4);
    }
    if (r["step"] == 8) saw_end = true;
  }
  EXPECT_TRUE(saw_start && saw_end);
  ASSERT_TRUE(want[1].contains("loss"));
  EXPECT_NEAR(want[1]["loss"].get<double>(), std::log(2.0), 1e-4);
  EXPECT_TRUE(want.back().contains("rewards/margins"));
  EXPECT_GT(want.back()["rewards/margins"].get<double>(), 0.0);  // it learned the preference
  // Killed after step 4: the run directory without what came later, resumed.
  fs::copy(dir / "run", dir / "cut", fs::copy_options::recursive);
  q4::io::remove_tree(dir / "cut" / "step_000008");
  fs::remove(dir / "cut" / "model.dat");
  fs::remove(dir / "cut" / "model.dat.json");
  const auto before = fs::last_write_time(dir / "cut" / "reference_logprobs.dat");
  const std::string ref_bytes = read_text(ref);
  const auto resumed = run_q4train({"--resume", (dir / "cut" / "step_000004").string(), "--set",
                                    "output.dir=" + (dir / "cut").string()},
                                   dir / "resumed");
  ASSERT_EQ(resumed.code, 0) << resumed.err << resumed.out;
  EXPECT_NE(resumed.out.find("reference log-probabilities: read from"), std::string::npos)
      << resumed.out;
  EXPECT_EQ(resumed.out.find("by the starting model in"), std::string::npos) << resumed.out;
  EXPECT_EQ(fs::last_write_time(dir / "cut" / "reference_logprobs.dat"), before);
  EXPECT_EQ(read_text(dir / "cut" / "reference_logprobs.dat"), ref_bytes);
  const auto got = read_jsonl(dir / "cut" / "metrics.jsonl");
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    for (const char* k : {"loss", "rewards/margins", "eval_rewards/accuracies"}) {
      if (want[i].contains(k)) EXPECT_EQ(got[i][k], want[i][k]) << k << " at record " << i;
    }
  }
  EXPECT_EQ(read_text(dir / "cut" / "model.dat"), read_text(dir / "run" / "model.dat"));
  // A batch that would split a pair is refused before anything loads.
  const auto odd = run_q4train({"--config", cfg.string(), "--set", "train.batch_size=3", "--set",
                                "output.dir=" + (dir / "odd").string()},
                               dir / "odd");
  EXPECT_EQ(odd.code, 2);
  EXPECT_NE(odd.err.find("train.batch_size"), std::string::npos) << odd.err;
}

TEST(E2E, BadConfigKeyExits2NamingIt) {
  const fs::path dir = work_root("e2e") / "badkey";
  const auto cfg = write_config(dir, 4, 0);
  auto r = run_q4train({"--config", cfg.string(), "--set", "train.setps=3"}, dir / "a");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("train.setps"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("did you mean train.steps"), std::string::npos) << r.err;
  // A typo inside the file: same, with the line.
  write_text(dir / "typo.yaml", read_text(cfg) + "optim2:\n  lr: 1\n");
  r = run_q4train({"--config", (dir / "typo.yaml").string()}, dir / "b");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("optim2"), std::string::npos) << r.err;
  // A contradiction: the memory guard on a CPU run.
  r = run_q4train({"--config", cfg.string(), "--set", "guard.max_gpu_gb=1"}, dir / "c");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("guard.max_gpu_gb"), std::string::npos) << r.err;
  // One line on stderr.
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

// lora.rank beyond the adapted linears' dimensions is refused as lora.rank, before anything is
// sized from it (it was blamed on model.weights when the adapters could not be allocated).
TEST(E2E, LoraRankBeyondTheLinearsIsRefusedAsLoraRank) {
  const fs::path dir = work_root("e2e") / "lora-rank";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 4, 0);
  const auto r = run_q4train(
      {"--config", cfg.string(), "--set", "train.method=lora", "--set", "lora.rank=1000000000"},
      dir / "a");
  EXPECT_EQ(r.code, 2);
  EXPECT_NE(r.err.find("config key lora.rank: expected at most"), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("model.weights"), std::string::npos) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
}

TEST(E2E, TruncatedWeightsExit2NamingTheFile) {
  const fs::path base = base_dir();
  ASSERT_TRUE(fs::exists(base / "COMPLETE"));
  const fs::path dir = work_root("e2e") / "truncated";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 4, 0);
  const std::string full = read_text(base / "run" / "init.dat");
  const fs::path bad = dir / "truncated.dat";
  write_text(bad, full.substr(0, full.size() / 2));
  const auto r = run_q4train({"--config", cfg.string(), "--set", "model.init=file", "--set",
                              "model.weights=" + bad.string()},
                             dir / "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find(bad.string()), std::string::npos) << r.err;
}

TEST(E2E, DryRunLoadsNothing) {
  const fs::path dir = work_root("e2e") / "dry";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 4, 0);
  const auto r = run_q4train({"--config", cfg.string(), "--dry-run"}, dir / "a");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_NE(r.out.find("memory estimate"), std::string::npos);
  EXPECT_NE(r.out.find("moments"), std::string::npos);
  // The run's plan, as a short block: the step, recompute and placements, the data.
  EXPECT_NE(r.out.find("\nplan: "), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("; updates after the backward"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan: recompute none; moments on the device"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("plan: data rows in groups of 1"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run" / "init.dat"));
}

// configs/models/: every Qwen3 preset parses, has the published size (Qwen's model cards: total
// parameters, the embedding counted once when tied) and dry-runs, on CUDA with a card's memory
// as the budget too (the estimate and the placement line, then the refusal for want of a GPU).
TEST(E2E, ModelPresetsParseAndDryRun) {
  const fs::path dir = work_root("e2e") / "presets";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 4, 0);
  const std::map<std::string, double> published = {{"Qwen3-0.6B", 0.596e9},
                                                   {"Qwen3-1.7B", 1.72e9},
                                                   {"Qwen3-4B", 4.02e9},
                                                   {"Qwen3-8B", 8.19e9},
                                                   {"Qwen3-14B", 14.77e9},
                                                   {"Qwen3-32B", 32.76e9},
                                                   {"Qwen3-4B-Instruct-2507", 4.02e9},
                                                   {"Qwen3-4B-Thinking-2507", 4.02e9}};
  std::set<std::string> seen;
  for (const auto& e : fs::directory_iterator(fs::path(kSource) / "configs" / "models")) {
    const std::string file = e.path().filename().string();
    const std::string name = file.substr(0, file.find(".config.json"));
    if (name.rfind("Qwen3-", 0) != 0) continue;
    seen.insert(name);
    ASSERT_TRUE(published.count(name)) << file;
    const auto mc = q4::model::Qwen3Config::from_json_file(e.path().string());
    const double n = static_cast<double>(mc.num_parameters(!mc.tie_word_embeddings));
    EXPECT_NEAR(n / published.at(name), 1.0, 0.01) << name << ": " << n;
    EXPECT_EQ(mc.head_dim, 128) << name;
    EXPECT_EQ(mc.vocab_size, 151936) << name;
    EXPECT_EQ(mc.tie_word_embeddings, n < 5e9) << name;
    const bool v2507 = name.find("2507") != std::string::npos;
    EXPECT_EQ(mc.rope_theta, v2507 ? 5e6 : 1e6) << name;
    EXPECT_EQ(mc.max_position_embeddings, v2507 ? 262144 : 40960) << name;
    const auto cpu = run_q4train(
        {"--config", cfg.string(), "--dry-run", "--set", "model.config=" + e.path().string(),
         "--set", "output.dir=" + (dir / name).string()},
        dir / (name + "_cpu"));
    EXPECT_EQ(cpu.code, 0) << name << cpu.err;
    EXPECT_NE(cpu.out.find(fmt::format("dry run: {} layers, hidden {}", mc.num_hidden_layers,
                                       mc.hidden_size)),
              std::string::npos)
        << cpu.out;
    const auto card = run_q4train(
        {"--config", cfg.string(), "--dry-run", "--set", "model.config=" + e.path().string(),
         "--set", "output.dir=" + (dir / name).string(), "--set", "model.device=cuda", "--set",
         "guard.max_gpu_gb=80"},
        dir / (name + "_cuda"));
    EXPECT_NE(card.out.find("gradient checkpointing auto: "), std::string::npos) << card.out;
    EXPECT_NE(card.out.find("usable of 74.5 GiB guard.max_gpu_gb"), std::string::npos) << card.out;
  }
  EXPECT_EQ(seen.size(), published.size());
}

TEST(E2E, SigintCheckpointsAndExits0) {
  const fs::path dir = work_root("e2e") / "sigint";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 100000, 0);
  const std::string out = (dir / "a.out").string();
  const pid_t pid = spawn_logged(
      kQ4train, {"--config", cfg.string(), "--set", "log.every=1", "--set", "eval.prompts=[]"},
      out);
  ASSERT_GE(pid, 0);
  // Wait until a few steps are logged, then interrupt.
  wait_for_text(out, " 3/100000 ", 120, /*poll_ms=*/100);
  EXPECT_EQ(signal_and_wait(pid, SIGINT), 0) << read_text(out);
  int64_t ckpts = 0;
  for (const auto& e : fs::directory_iterator(dir / "run")) {
    const auto name = e.path().filename().string();
    if (name.rfind("step_", 0) == 0) {
      ++ckpts;
      EXPECT_TRUE(fs::exists(e.path() / "DONE")) << name;
    }
  }
  EXPECT_EQ(ckpts, 1);
  EXPECT_FALSE(fs::exists(dir / "run" / "model.dat"));  // stopped early: no export
  // The stop message says how to resume.
  EXPECT_NE(read_text(out).find("resume with: "), std::string::npos) << read_text(out);
  EXPECT_NE(read_text(out).find("--resume " + (dir / "run").string()), std::string::npos);
}

// optim.in_backward (each parameter updated inside the backward, its gradient freed at once)
// against the buffered step on CPU: without clipping the runs are bit-identical (same update
// constants and rounding streams; the exported weights are equal byte for byte); with clipping
// (previous step's norm instead of this step's) the loss curve stays within a few percent.
TEST(E2E, InBackwardUpdatesTrackTheBufferedRun) {
  const fs::path dir = work_root("e2e") / "inbackward";
  q4::io::remove_tree(dir);
  const auto cfg = write_config(dir, 12, 0);
  auto run = [&](const std::string& tag, bool in_backward, double max_norm) {
    const fs::path out = dir / tag;
    const auto r =
        run_q4train({"--config", cfg.string(), "--set", "output.dir=" + out.string(), "--set",
                     std::string("optim.in_backward=") + (in_backward ? "true" : "false"), "--set",
                     "train.max_grad_norm=" + std::to_string(max_norm), "--set",
                     "eval.at_start=false", "--set", "eval.at_end=false"},
                    dir / tag);
    EXPECT_EQ(r.code, 0) << r.err;
    std::vector<double> losses;
    for (const auto& m : read_jsonl(out / "metrics.jsonl")) losses.push_back(m["loss"]);
    EXPECT_EQ(losses.size(), 12u);
    return std::make_pair(losses, read_text(out / "model.dat"));
  };
  const auto [lb, db] = run("buffered", false, 0.0);
  const auto [li, di] = run("inbackward", true, 0.0);
  EXPECT_EQ(lb, li);
  EXPECT_TRUE(db == di) << "exports differ";
  const auto [lbc, dbc] = run("buffered_clip", false, 1.0);
  const auto [lic, dic] = run("inbackward_clip", true, 1.0);
  ASSERT_EQ(lbc.size(), lic.size());
  EXPECT_NEAR(lic.back(), lbc.back(), 0.1 * lbc.back() + 0.05);
  EXPECT_LT(lic.back(), 0.8 * lic.front());  // it still learns
}

// ------------------------------------------------------------------------------------------
// Training signals, runs that explain themselves, fewer traps.

}  // namespace q4::test::e2e_test
