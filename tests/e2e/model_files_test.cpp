// Model files, Hugging Face interop, checkpoint integrity and TensorBoard, through
// build/bin/q4train and build/bin/q4dat (tiny random Qwen3, real tokenizer, CPU): an HF export
// never replaces an input or a folder q4train did not write, an import never replaces its own
// input, a raw lm_head keeps its precision through .dat -> HF -> .dat, a config.json and weights
// that disagree on the layer count are an error, a checkpoint without checksums.json is damaged, a
// full disk under the TensorBoard file is an error, a negative block scale is refused at load, a
// weight that overflows in training is named, and --nproc 2 reports a truncated weights file in one
// line.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::model_files_test {

namespace {

using namespace q4::test;

const std::string kQ4dat = kBin + "/q4dat";

// `exe` with `args` (each quoted), stdout and stderr captured in dir/<tag>.out|err.
Result run_tool(const std::string& exe, const fs::path& dir, const std::vector<std::string>& args,
                const std::string& tag) {
  return run_in(dir, tag, exe + quoted(args));
}

// A fresh directory with model.json (`layers` layers), data.tsv and config.yaml (random init, raw
// fp16 lm_head, run in dir/run).
fs::path setup_dir(const std::string& name, int layers = 1) {
  TinyRun t;
  t.layers = layers;
  t.model_extra = "  quantize_lm_head: false\n";
  t.output_extra = "  checkpoint_every: 0\n  keep: 5\n";
  t.log = "  tensorboard: false\n";
  return t.write_fresh("mf", name);
}

Result q4train(const fs::path& dir, std::vector<std::string> sets, const std::string& tag,
               std::vector<std::string> extra = {}) {
  std::vector<std::string> a = config_args(dir, sets);
  a.insert(a.end(), extra.begin(), extra.end());
  return run_tool(kQ4train, dir, a, tag);
}

Result q4dat(const fs::path& dir, const std::vector<std::string>& args, const std::string& tag) {
  return run_tool(kQ4dat, dir, args, tag);
}

// dir/init.dat: the random init of dir's config (raw fp16 lm_head, NVFP4 linears), made by a
// zero-step run.
fs::path make_init(const fs::path& dir) {
  const Result r = q4train(dir, {"train.steps=0", "output.export_path=none"}, "init");
  EXPECT_EQ(r.code, 0) << r.err;
  fs::rename(dir / "run" / "init.dat", dir / "init.dat");
  q4::io::remove_tree(dir / "run");
  return dir / "init.dat";
}

// dir/m-hf: an HF folder (modelopt) of dir/init.dat, named as the README names one (an export
// path dir/m.dat puts q4train's HF export there).
fs::path make_hf(const fs::path& dir) {
  const fs::path init = make_init(dir);
  const Result r = q4dat(dir,
                         {"export-hf", init.string(), (dir / "m-hf").string(), "--config",
                          (dir / "model.json").string(), "--format", "modelopt"},
                         "hf");
  EXPECT_EQ(r.code, 0) << r.err;
  return dir / "m-hf";
}

std::string snapshot(const fs::path& folder) {  // names and bytes of every file, sorted
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(folder)) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  std::string s;
  for (const auto& f : files) s += f.filename().string() + "\n" + read_text(f) + "\n";
  return s;
}

// The trainer's HF export folder (<export minus .dat>-hf) is checked before the first step: it is
// no input (here the HF folder given as model.weights) and, when not empty, an earlier q4train
// export; nothing is written to either.
TEST(ModelFiles, TrainerHfExportNeverReplacesAnInputOrAForeignFolder) {
  const fs::path dir = setup_dir("hfout");
  const fs::path hf = make_hf(dir);
  const std::string before = snapshot(hf);
  fs::create_directories(dir / "mine-hf");
  write_text(dir / "mine-hf" / "config.json", "{\"mine\": true}\n");
  const std::string w = "model.weights=" + hf.string();
  struct Case {
    std::string export_path, names;
  };
  const Case cases[] = {{(dir / "m.dat").string(), "model.weights"},
                        {(dir / "mine.dat").string(), "not a q4train HF export"}};
  for (const Case& c : cases) {
    for (bool dry : {false, true}) {
      const Result r =
          q4train(dir,
                  {"model.init=file", w, "output.hf_export=modelopt",
                   "output.export_path=" + c.export_path},
                  "a", dry ? std::vector<std::string>{"--dry-run"} : std::vector<std::string>{});
      EXPECT_EQ(r.code, 2) << c.export_path << ": " << r.err;
      EXPECT_TRUE(contains(r.err, "output.hf_export")) << r.err;
      EXPECT_TRUE(contains(r.err, c.names)) << r.err;
      EXPECT_FALSE(contains(r.out, " 1/2 ")) << "trained before failing: " << c.export_path;
    }
  }
  EXPECT_TRUE(snapshot(hf) == before) << hf << " changed";
  EXPECT_EQ(read_text(dir / "mine-hf" / "config.json"), "{\"mine\": true}\n");
  // An earlier q4train export in that folder is replaced as before.
  q4::io::remove_tree(dir / "run");
  Result r = q4train(dir,
                     {"model.init=file", w, "output.hf_export=modelopt",
                      "output.export_path=" + (dir / "out.dat").string()},
                     "b");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(fs::exists(dir / "out-hf" / "model.safetensors"));
  r = q4train(dir,
              {"model.init=file", w, "output.hf_export=modelopt",
               "output.export_path=" + (dir / "out.dat").string()},
              "c", {"--dry-run"});
  EXPECT_EQ(r.code, 0) << r.err;
}

// q4dat export-hf refuses a folder holding its inputs and a foreign non-empty folder (unless
// --overwrite); import-hf refuses an output that is one of the folder's files.
TEST(ModelFiles, Q4datHfCommandsNeverReplaceTheirInputs) {
  const fs::path dir = setup_dir("q4dathf");
  const fs::path hf = make_hf(dir);
  const std::string before = snapshot(hf);
  const std::string init = (dir / "init.dat").string();
  // README naming: export back into the folder the config comes from.
  Result r = q4dat(dir,
                   {"export-hf", init, hf.string(), "--config", (hf / "config.json").string(),
                    "--tokenizer-dir", hf.string()},
                   "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--config")) << r.err;
  for (const char* f : {"model.safetensors", "config.json", "model.safetensors.index.json"}) {
    r = q4dat(dir, {"import-hf", hf.string(), (hf / f).string()}, "b");
    EXPECT_EQ(r.code, 2) << f << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "the output is the input") || contains(r.err, "is also the input"))
        << r.err;
  }
  EXPECT_TRUE(snapshot(hf) == before) << hf << " changed";
  // A foreign folder: refused, then replaced with --overwrite; a q4train export is replaced.
  fs::create_directories(dir / "mine");
  write_text(dir / "mine" / "config.json", "{}\n");
  const std::vector<std::string> exp = {"export-hf", init, (dir / "mine").string(), "--config",
                                        (dir / "model.json").string()};
  r = q4dat(dir, exp, "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--overwrite")) << r.err;
  EXPECT_EQ(read_text(dir / "mine" / "config.json"), "{}\n");
  auto with_overwrite = exp;
  with_overwrite.push_back("--overwrite");
  r = q4dat(dir, with_overwrite, "d");
  EXPECT_EQ(r.code, 0) << r.err;
  r = q4dat(dir, exp, "e");
  EXPECT_EQ(r.code, 0) << r.err;
}

// A raw fp16 lm_head (quantize_lm_head: false, the demo's) comes back raw and byte-identical
// through .dat -> HF -> .dat, so the model's logits are unchanged.
TEST(ModelFiles, RawLmHeadKeepsItsPrecisionThroughHf) {
  const fs::path dir = setup_dir("lmhead");
  const fs::path hf = make_hf(dir);
  const fs::path back = dir / "back.dat";
  const Result r = q4dat(dir, {"import-hf", hf.string(), back.string()}, "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const q4::model::DatReader a((dir / "init.dat").string()), b(back.string());
  const q4::model::DatEntry* la = a.find("lm_head.weight");
  const q4::model::DatEntry* lb = b.find("lm_head.weight");
  ASSERT_NE(la, nullptr);
  ASSERT_NE(lb, nullptr) << "lm_head came back quantized";
  EXPECT_EQ(lb->type, la->type);
  EXPECT_TRUE(at::equal(a.load(*la), b.load(*lb)));
  EXPECT_EQ(read_text(dir / "init.dat"), read_text(back)) << "round trip not byte-identical";
  const auto mc = q4::model::Qwen3Config::from_json_file((dir / "model.json").string());
  q4::model::ModelOptions o;
  o.trainable = q4::model::TrainableSpec::nothing();
  auto ma = q4::model::Qwen3Model::load(mc, a, o);
  auto mb = q4::model::Qwen3Model::load(mc, b, o);
  q4::model::ModelInputs in;
  in.input_ids = at::arange(1000, 1016, at::kLong).unsqueeze(0);
  at::NoGradGuard ng;
  EXPECT_TRUE(at::equal(ma.forward(in), mb.forward(in)));
}

// config.json with fewer (or more) layers than the weights: an error naming both files and both
// counts, for a .dat and for an HF folder.
TEST(ModelFiles, LayerCountMismatchIsAnError) {
  const fs::path dir = setup_dir("layers", 2);
  const fs::path hf = make_hf(dir);
  const std::string w = "model.weights=" + (dir / "init.dat").string();
  for (int layers : {1, 3}) {
    write_text(dir / "other.json", tiny_model_config(layers));
    const Result r =
        q4train(dir, {"model.init=file", w, "model.config=" + (dir / "other.json").string()},
                "a" + std::to_string(layers));
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "init.dat stores 2 decoder layers")) << r.err;
    EXPECT_TRUE(contains(r.err, "other.json has num_hidden_layers " + std::to_string(layers)))
        << r.err;
    EXPECT_FALSE(fs::exists(dir / "run" / "metrics.jsonl"));
  }
  auto conf = nlohmann::json::parse(read_text(hf / "config.json"));
  conf["num_hidden_layers"] = 1;
  write_text(hf / "config.json", conf.dump());
  const Result r = q4dat(dir, {"import-hf", hf.string(), (dir / "x.dat").string()}, "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "stores 2 decoder layers")) << r.err;
  EXPECT_TRUE(contains(r.err, "config.json has num_hidden_layers 1")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "x.dat"));
}

// Every checkpoint has checksums.json: without it the checkpoint is damaged, and --resume names
// it and the previous complete checkpoint.
TEST(ModelFiles, CheckpointWithoutChecksumsIsDamaged) {
  const fs::path dir = setup_dir("sums");
  Result r =
      q4train(dir, {"output.export_path=none", "train.steps=4", "output.checkpoint_every=2"}, "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path ck = dir / "run" / "step_000004";
  ASSERT_TRUE(fs::remove(ck / "checksums.json"));
  r = run_tool(
      kQ4train, dir,
      {"--resume", (dir / "run").string(), "--set", "train.steps=6", "--allow-schedule-change"},
      "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, (ck / "checksums.json").string() + " is missing")) << r.err;
  EXPECT_TRUE(contains(r.err, "step_000002")) << r.err;
}

// The TensorBoard event file on a full disk is an error naming it, as metrics.jsonl is.
TEST(ModelFiles, TensorBoardOnAFullDiskIsAnError) {
  const fs::path dir = setup_dir("tbfull");
  fs::create_directories(dir / "run");
  // The writer names its file events.out.tfevents.<unix seconds>.<host>: every name of the next
  // minutes points at /dev/full.
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const int64_t now = static_cast<int64_t>(::time(nullptr));
  for (int64_t t = now - 2; t < now + 300; ++t) {
    fs::create_symlink("/dev/full",
                       dir / "run" / ("events.out.tfevents." + std::to_string(t) + "." + host));
  }
  const Result r =
      q4train(dir, {"output.export_path=none", "log.tensorboard=true"}, "a", {"--overwrite"});
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "events.out.tfevents.")) << r.err;
  EXPECT_TRUE(contains(r.err, "No space left on device")) << r.err;
}

// A negative block scale (E4M3 sign bit) is refused at load, naming file, entry and element.
TEST(ModelFiles, NegativeBlockScaleIsRefusedAtLoad) {
  const fs::path dir = setup_dir("negscale");
  const fs::path init = make_init(dir);
  const std::string key = "model.layers.0.mlp.down_proj.weight.scale";
  uint64_t offset = 0;
  {
    const q4::model::DatReader r(init.string());
    const q4::model::DatEntry* e = r.find(key);
    ASSERT_NE(e, nullptr);
    offset = e->offset + 5;  // down_proj rows hold 64 / 16 = 4 blocks: row 1, block 1
  }
  {
    std::fstream f(init, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(static_cast<std::streamoff>(offset));
    char c = 0;
    f.get(c);
    f.seekp(static_cast<std::streamoff>(offset));
    f.put(static_cast<char>(c | 0x80));
  }
  const Result r = q4train(dir, {"model.init=file", "model.weights=" + init.string()}, "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, init.string())) << r.err;
  EXPECT_TRUE(contains(r.err, key)) << r.err;
  EXPECT_TRUE(contains(r.err, "negative")) << r.err;
  EXPECT_TRUE(contains(r.err, "[1, 1]")) << r.err;
}

// A weight that overflows in training (fp32 masters, an absurd learning rate) is named by its
// parameter, not as `tensor 'tensor'`.
TEST(ModelFiles, OverflowingWeightIsNamed) {
  const fs::path dir = setup_dir("overflow");
  const Result r = q4train(dir,
                           {"output.export_path=none", "optim.lr=3e38", "optim.state=fp32",
                            "model.master_dtype=fp32", "train.steps=4"},
                           "a");
  EXPECT_NE(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "non-finite")) << r.err;
  EXPECT_FALSE(contains(r.err, "'tensor'")) << r.err;
  EXPECT_TRUE(contains(r.err, "'model.layers.0.")) << r.err;
}

// --nproc 2 with a truncated weights file: one error line naming the file, exit 2, before any
// rank starts (it used to be a rank's barrier failure first, exit 1).
TEST(ModelFiles, NprocReportsATruncatedWeightsFileOnce) {
  const fs::path dir = setup_dir("nproc");
  const fs::path init = make_init(dir);
  fs::resize_file(init, fs::file_size(init) / 2);
  const Result r = run_tool(kQ4train, dir,
                            {"--nproc", "2", "--config", (dir / "config.yaml").string(), "--set",
                             "model.init=file", "--set", "model.weights=" + init.string()},
                            "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, init.string() + ": entry ")) << r.err;
  EXPECT_TRUE(contains(r.err, "truncated")) << r.err;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run"));
}

}  // namespace

}  // namespace q4::test::model_files_test
