// Config parsing and validation: defaults, --set, unknown keys with did-you-mean (across sections
// and aliases), type, range and choice errors from the field table naming the key (and line),
// typed enums, cross-field rules, path resolution, YAML round trip, the shipped recipes, and
// configs/README.md matching the reference generated from the table.
#include "q4/trainer/config/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "q4/io/remove_tree.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/options.h"

namespace fs = std::filesystem;
using namespace q4::trainer;

namespace {

// The smallest valid config: everything else keeps its default.
const char* kMinimal = R"(
model:
  config: m/config.json
  tokenizer: m/tokenizer.json
  weights: m/model.dat
data:
  files: [train.tsv]
)";

// As q4train reads a config: the config's rules, then the objectives' (registry.h).
Config parse(const std::string& text, const std::vector<Override>& ov = {}) {
  return parse_config(text, "test.yaml", "/base", ov, validate_objective_config);
}

// The run's warning about settings that do not apply, for the objective the config names.
std::string ignored_of(const Config& c) { return ignored_settings_warning(c, objective_needs(c)); }

// The ConfigError message of parsing `text`, or "" when it parses.
std::string error_of(const std::string& text, const std::vector<Override>& ov = {}) {
  try {
    parse(text, ov);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Passes when parsing `text` (with `ov`) fails with a message naming each of `parts`; else says
// which part the message lacks.
::testing::AssertionResult error_names(const std::string& text,
                                       const std::vector<std::string>& parts,
                                       const std::vector<Override>& ov = {}) {
  const std::string msg = error_of(text, ov);
  for (const std::string& part : parts) {
    if (!contains(msg, part)) {
      return ::testing::AssertionFailure() << "no \"" << part << "\" in: " << msg;
    }
  }
  return ::testing::AssertionSuccess();
}

// did_you_mean over the config's keys for each (misspelled key, the key it suggests; "": none).
void expect_suggestions(const std::vector<std::pair<std::string, std::string>>& cases) {
  const auto keys = config_keys();
  for (const auto& [typo, want] : cases) EXPECT_EQ(did_you_mean(typo, keys), want) << typo;
}

}  // namespace

TEST(Config, MinimalGetsDefaultsAndResolvesPaths) {
  const Config c = parse(kMinimal);
  EXPECT_EQ(c.model.config, "/base/m/config.json");
  EXPECT_EQ(c.model.weights, "/base/m/model.dat");
  ASSERT_EQ(c.data.files.size(), 1u);
  EXPECT_EQ(c.data.files[0], "/base/train.tsv");
  EXPECT_EQ(c.train.steps, 100);
  EXPECT_EQ(c.model.master_dtype, Dtype::kFp16);
  EXPECT_EQ(c.optim.state, q4::optim::StateMode::kInt8);
  EXPECT_EQ(resolved_compute_dtype(c), Dtype::kFp32);  // auto on CPU
  EXPECT_TRUE(fs::path(c.output.dir).is_absolute());
  EXPECT_EQ(resolved_export_path(c), (fs::path(c.output.dir) / "model.dat").string());
}

TEST(Config, ModelDirSuppliesConfigAndTokenizer) {
  const Config c = parse("model: {dir: /models/q, weights: w.dat}\n");
  EXPECT_EQ(c.model.config, "/models/q/config.json");
  EXPECT_EQ(c.model.tokenizer, "/models/q/tokenizer.json");
  EXPECT_EQ(c.model.weights, "/base/w.dat");
}

TEST(Config, UnknownKeyNamesItWithSuggestion) {
  EXPECT_TRUE(error_names(std::string(kMinimal) + "train:\n  setps: 3\n",
                          {"train.setps", "did you mean train.steps", "line 9"}));

  EXPECT_TRUE(
      error_names(std::string(kMinimal) + "train:\n  lr: 0.1\n", {"did you mean optim.lr"}));

  EXPECT_TRUE(error_names(std::string(kMinimal) + "optimizer:\n  lr: 0.1\n",
                          {"unknown config key optimizer", "did you mean optim"}));

  std::string msg = error_of(std::string(kMinimal) + "zzzzzz: 1\n");
  EXPECT_TRUE(contains(msg, "zzzzzz")) << msg;
  EXPECT_FALSE(contains(msg, "did you mean")) << msg;
}

TEST(Config, WrongTypesNameKeyAndLine) {
  EXPECT_TRUE(error_names(std::string(kMinimal) + "train:\n  steps: many\n",
                          {"train.steps", "expected an integer", "'many'", "line 9"}));

  EXPECT_TRUE(
      error_names(std::string(kMinimal) + "train:\n  steps: 1.5\n", {"expected an integer"}));
  EXPECT_TRUE(
      error_names(std::string(kMinimal) + "optim:\n  lr: fast\n", {"optim.lr", "a number"}));
  EXPECT_TRUE(error_names(kMinimal, {"data.shuffle"}, {parse_override("data.shuffle=maybe")}));
  EXPECT_TRUE(error_names(std::string(kMinimal) + "optim:\n  state: int3\n",
                          {"optim.state", "fp32, int8, 4bit, nvfp4"}));
  EXPECT_TRUE(error_names(std::string(kMinimal) + "train: 5\n", {"config section train"}));
  EXPECT_TRUE(error_names(std::string(kMinimal) + "eval:\n  prompts: {a: 1}\n", {"eval.prompts"}));
}

TEST(Config, InvalidYamlNamesLine) {
  EXPECT_TRUE(error_names("model:\n  config: [unclosed\n", {"test.yaml line", "invalid YAML"}));
}

TEST(Config, RangesAndContradictions) {
  const std::string base = kMinimal;
  EXPECT_TRUE(contains(error_of(base + "train: {batch_size: 0}\n"), "train.batch_size"));
  EXPECT_TRUE(contains(error_of(base + "train: {grad_accum: -1}\n"), "train.grad_accum"));
  EXPECT_TRUE(contains(error_of(base + "optim: {lr: 0}\n"), "optim.lr"));
  EXPECT_TRUE(contains(error_of(base + "optim: {beta2: 1.0}\n"), "optim.beta2"));
  EXPECT_TRUE(contains(error_of(base + "optim: {lr: .nan}\n"), "optim.lr"));
  EXPECT_TRUE(contains(error_of(base + "train: {max_grad_norm: -1}\n"), "train.max_grad_norm"));
  EXPECT_TRUE(contains(error_of(base + "output: {keep: 0}\n"), "output.keep"));
  EXPECT_TRUE(contains(error_of(base + "log: {every: 0}\n"), "log.every"));
  // The guard watches GPU memory: on CPU it is a contradiction.
  EXPECT_TRUE(contains(error_of(base + "guard: {max_gpu_gb: 10}\n"), "guard.max_gpu_gb"));
  EXPECT_EQ(error_of(base + "guard: {max_gpu_gb: 10}\n", {parse_override("model.device=cuda")}),
            "");
  EXPECT_TRUE(contains(error_of(base, {parse_override("model.device=tpu")}), "model.device"));
  EXPECT_TRUE(contains(error_of(base, {parse_override("model.compute_dtype=fp16")}),
                       "model.compute_dtype"));
  // A key given twice is an error, not a silent override.
  const std::string dup = error_of(base + "model: {device: cpu}\n");
  EXPECT_TRUE(contains(dup, "duplicate config key model")) << dup;
  // Warmup longer than the run is not an error: the trainer clips it (clip_warmup_to_run).
  EXPECT_EQ(error_of(base + "train: {steps: 10}\noptim: {schedule: {warmup_steps: 20}}\n"), "");
  EXPECT_TRUE(contains(error_of(base + "output: {export_path: none, export_every: 5}\n"),
                       "output.export_every"));
  // The optimizer's own invariant, caught at parse time with the key that fixes it.
  EXPECT_TRUE(contains(error_of(base + "optim: {lr: 0.5, weight_decay: 2}\n"),
                       "config key optim.weight_decay: optim.lr * optim.weight_decay must be < 1"));
  // Nothing trainable.
  EXPECT_TRUE(contains(error_of(base + "train:\n  trainable: {layers: none, norms: false}\n"),
                       "nothing is trainable"));
  EXPECT_EQ(error_of(base + "train:\n  trainable: {layers: none, norms: false, lm_head: true}\n"),
            "");
  // init file needs weights; random needs a config.
  EXPECT_TRUE(contains(error_of("model: {config: c.json, tokenizer: t.json}\n"), "model.weights"));
  EXPECT_EQ(error_of("model: {config: c.json, tokenizer: t.json, init: random}\n"), "");
  EXPECT_TRUE(contains(error_of("model: {weights: w.dat, tokenizer: t.json}\n"), "model.config"));
  EXPECT_TRUE(contains(error_of("model: {config: c.json, weights: w.dat}\n"), "model.tokenizer"));
}

TEST(Config, LoraKeys) {
  const std::string base = std::string(kMinimal) + "train: {method: lora}\n";
  const Config c = parse(base);
  EXPECT_EQ(c.train.method, TrainMethod::kLora);
  EXPECT_EQ(c.lora.rank, 16);
  EXPECT_EQ(c.lora.targets.size(), 7u);
  EXPECT_TRUE(c.lora.merge_aware);
  EXPECT_TRUE(contains(error_of(base + "lora: {rank: 0}\n"), "lora.rank"));
  EXPECT_TRUE(contains(error_of(base + "lora: {dropout: 0.1}\n"), "lora.dropout"));
  EXPECT_TRUE(contains(error_of(base + "lora: {targets: [q_proj, qkv]}\n"), "'qkv'"));
  EXPECT_TRUE(contains(error_of(base + "lora: {targets: []}\n"), "lora.targets"));
  EXPECT_TRUE(contains(error_of(base + "lora: {targets: [lm_head], merge_aware: false}\n"),
                       "merge-aware adapter only"));
  EXPECT_EQ(error_of(base + "lora: {targets: [lm_head, q_proj]}\n"), "");
  EXPECT_TRUE(contains(error_of(base, {parse_override("model.fake_quant=false")}), "train.method"));
  // PEFT's spellings point to ours.
  EXPECT_TRUE(contains(error_of(base + "lora: {r: 8}\n"), "did you mean lora.rank"));
  EXPECT_TRUE(
      contains(error_of(base + "lora: {target_modules: [v_proj]}\n"), "did you mean lora.targets"));
  const Config some = parse(base + "lora: {rank: 8, alpha: 16, targets: [v_proj]}\n");
  EXPECT_EQ(some.lora.rank, 8);
  EXPECT_EQ(some.lora.alpha, 16.0);
  EXPECT_EQ(some.lora.targets, std::vector<std::string>{"v_proj"});
  // The adapted projections are frozen: full fine-tuning's trainable spec is not.
  EXPECT_FALSE(trainable_spec(c).projections);
  EXPECT_TRUE(trainable_spec(parse(kMinimal)).projections);
  const auto mo = model_options(c);
  EXPECT_EQ(mo.lora.rank, 16);
  EXPECT_DOUBLE_EQ(mo.lora.scale(), 2.0);
  // Plain adapters keep their frozen weights dequantized when no layer recomputes (auto), or
  // when told; merge-aware adapters never.
  EXPECT_FALSE(mo.cache_adapted_weights);
  const std::string plain = base + "lora: {merge_aware: false}\n";
  EXPECT_EQ(parse(plain).lora.cache_base_weights, AutoBool::kAuto);
  auto cached = [&](const std::string& recompute, const std::string& cache) {
    Config k = parse(plain);
    k.train.gradient_checkpointing = *io::enum_from_name<AutoBool>(recompute);
    k.lora.cache_base_weights = *io::enum_from_name<AutoBool>(cache);
    return model_options(k).cache_adapted_weights;
  };
  EXPECT_TRUE(cached("false", "auto"));
  EXPECT_FALSE(cached("true", "auto"));
  EXPECT_TRUE(cached("true", "true"));
  EXPECT_FALSE(cached("false", "false"));
  EXPECT_TRUE(cached("auto", "auto"));  // the CPU's auto: no recompute
  EXPECT_TRUE(contains(error_of(base + "lora: {merge_aware: false, cache_base_weights: maybe}\n"),
                       "lora.cache_base_weights"));
}

TEST(Config, LayerSelection) {
  const std::string base = kMinimal;
  Config c = parse(base + "train:\n  trainable: {layers: last:2}\n");
  EXPECT_EQ(c.train.trainable.layers.kind, LayerSelection::Kind::kLast);
  EXPECT_EQ(c.train.trainable.layers.resolve(5), (std::vector<int64_t>{3, 4}));
  c = parse(base + "train:\n  trainable: {layers: [4, 1]}\n");
  EXPECT_EQ(c.train.trainable.layers.resolve(5), (std::vector<int64_t>{1, 4}));
  EXPECT_THROW(c.train.trainable.layers.resolve(3), ConfigError);  // layer 4 of 3
  c = parse(base + "train:\n  trainable: {layers: all}\n");
  EXPECT_EQ(c.train.trainable.layers.resolve(3), (std::vector<int64_t>{0, 1, 2}));
  c = parse(base + "train:\n  trainable: {layers: none, lm_head: true}\n");
  EXPECT_TRUE(c.train.trainable.layers.resolve(3).empty());
  EXPECT_TRUE(contains(error_of(base + "train:\n  trainable: {layers: last:0}\n"),
                       "train.trainable.layers"));
  EXPECT_TRUE(contains(error_of(base + "train:\n  trainable: {layers: [1, 1]}\n"), "twice"));
  EXPECT_TRUE(contains(error_of(base + "train:\n  trainable: {layers: [-1]}\n"), ">= 0"));
  EXPECT_TRUE(
      contains(error_of(base + "train:\n  trainable: {layers: some}\n"), "train.trainable.layers"));
  EXPECT_EQ(LayerSelection::parse("0, 2,5", "k").to_string(), "0,2,5");
  EXPECT_EQ(LayerSelection::parse("last:3", "k").to_string(), "last:3");
  EXPECT_THROW(LayerSelection::parse("last:2", "k").resolve(1), ConfigError);
}

TEST(Config, SetOverridesBeforeValidation) {
  Config c = parse(kMinimal, {parse_override("train.steps=7"), parse_override("optim.lr=3e-4"),
                              parse_override("eval.prompts=[hi, \"a b\"]"),
                              parse_override("train.trainable.layers=last:1"),
                              parse_override("data.shuffle=false")});
  EXPECT_EQ(c.train.steps, 7);
  EXPECT_DOUBLE_EQ(c.optim.lr, 3e-4);
  EXPECT_EQ(c.eval.prompts, (std::vector<std::string>{"hi", "a b"}));
  EXPECT_EQ(c.train.trainable.layers.last_n, 1);
  EXPECT_FALSE(c.data.shuffle);
  // Sections that the file lacks are created.
  c = parse(kMinimal, {parse_override("optim.schedule.kind=linear")});
  EXPECT_EQ(c.optim.schedule.kind, q4::optim::LrScheduleKind::kLinear);
  // The override goes through the same checks.
  EXPECT_TRUE(contains(error_of(kMinimal, {parse_override("train.steps=x")}), "train.steps"));
  EXPECT_TRUE(contains(error_of(kMinimal, {parse_override("train.steps=x")}), "from --set"));
  EXPECT_TRUE(
      contains(error_of(kMinimal, {parse_override("train.batch_size=0")}), "train.batch_size"));
  EXPECT_TRUE(error_names(kMinimal, {"train.step", "did you mean train.steps"},
                          {parse_override("train.step=3")}));
  EXPECT_THROW(parse_override("novalue"), ConfigError);
  EXPECT_THROW(parse_override("=3"), ConfigError);
  EXPECT_THROW(parse_override("a..b=3"), ConfigError);
  // Path values given on the command line are relative to the CWD, not the config's directory.
  c = parse(kMinimal, {parse_override("model.weights=other.dat")});
  EXPECT_EQ(c.model.weights, (fs::current_path() / "other.dat").string());
  EXPECT_EQ(c.model.config, "/base/m/config.json");
}

TEST(Config, YamlRoundTrip) {
  Config c = parse(std::string(kMinimal) + R"(
train:
  trainable: {layers: [0, 2], lm_head: true}
  steps: 33
optim:
  lr: 0.00012345678901234
  schedule: {kind: cosine, warmup_steps: 3, min_lr_ratio: 0.1}
eval:
  prompts: ["你是谁？", "quote \" and: colon"]
)",
                   {parse_override("data.system_prompt=\"multi\\nline\"")});
  const std::string y1 = config_to_yaml(c);
  const Config back = parse_config(y1, "roundtrip.yaml", "/elsewhere");
  EXPECT_EQ(config_to_yaml(back), y1);
  EXPECT_EQ(back.optim.lr, c.optim.lr);  // 17 significant digits: exact
  EXPECT_EQ(back.eval.prompts, c.eval.prompts);
  EXPECT_EQ(back.data.system_prompt, "multi\nline");
  EXPECT_EQ(back.train.trainable.layers.layers, (std::vector<int64_t>{0, 2}));
  EXPECT_EQ(back.model.config, c.model.config);  // absolute paths stay put
  // Every field appears in the dump with its doc comment.
  for (const auto& key : config_keys()) {
    const auto leaf = key.substr(key.rfind('.') + 1);
    EXPECT_TRUE(contains(y1, leaf + ":")) << key;
  }
}

TEST(Config, DidYouMean) {
  expect_suggestions({{"train.stpes", "train.steps"},
                      {"optim.weightdecay", "optim.weight_decay"},
                      {"train.lr", "optim.lr"},
                      {"output.checkpoint_evry", "output.checkpoint_every"},
                      {"completely.unrelated_thing", ""}});
}

TEST(Config, ShippedRecipesParse) {
  for (const char* name : {"demo.yaml", "whoami.yaml", "probe-4b.yaml"}) {
    const std::string path = std::string(Q4_SOURCE_DIR) + "/configs/" + name;
    ASSERT_TRUE(fs::exists(path)) << path;
    EXPECT_NO_THROW(load_config(path)) << name;
  }
  const Config demo = load_config(std::string(Q4_SOURCE_DIR) + "/configs/demo.yaml");
  EXPECT_EQ(demo.model.device, "cpu");
  EXPECT_EQ(demo.model.init, InitKind::kRandom);
  EXPECT_TRUE(fs::exists(demo.model.config)) << demo.model.config;
  ASSERT_FALSE(demo.data.files.empty());
  EXPECT_TRUE(fs::exists(demo.data.files[0])) << demo.data.files[0];
  const Config probe = load_config(std::string(Q4_SOURCE_DIR) + "/configs/probe-4b.yaml");
  EXPECT_EQ(probe.train.gradient_checkpointing, Recompute::kTrue);
  EXPECT_EQ(probe.train.batch_size * probe.train.seq_len, 4 * 1024);
  EXPECT_EQ(probe.model.master_dtype, Dtype::kFp16);
  EXPECT_EQ(resolved_compute_dtype(probe), Dtype::kBf16);
}

TEST(Config, ReadmeReferenceMatchesTheFieldTable) {
  std::ifstream in(std::string(Q4_SOURCE_DIR) + "/configs/README.md");
  ASSERT_TRUE(in.is_open());
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string readme = ss.str();
  for (const auto& key : config_keys()) {
    EXPECT_TRUE(contains(readme, "`" + key + "`")) << key << " is not documented";
  }
  // The committed reference is exactly what the field table generates.
  const std::string want = splice_config_reference(readme);
  if (want != readme) {
    std::istringstream have_lines(readme), want_lines(want);
    std::string h, w;
    int line = 0;
    while (true) {
      ++line;
      const bool more_h = static_cast<bool>(std::getline(have_lines, h));
      const bool more_w = static_cast<bool>(std::getline(want_lines, w));
      if (h != w || more_h != more_w) break;
    }
    ADD_FAILURE() << "configs/README.md differs from the field table at line " << line
                  << ":\n  committed: " << h << "\n  generated: " << w
                  << "\nregenerate it with: build/bin/q4train --config-reference configs/README.md";
  }
}

TEST(Config, ReferenceHasOneRowPerFieldWithRangeAndChoices) {
  const std::string md = config_reference_markdown();
  for (const auto& key : config_keys()) EXPECT_TRUE(contains(md, "| `" + key + "` |")) << key;
  EXPECT_TRUE(contains(md, "### `optim`")) << md;
  EXPECT_TRUE(contains(md, "| `optim.beta1` | float | `0.9` | `[0, 1)` |")) << md;
  EXPECT_TRUE(contains(md, "| `train.batch_size` | int | `4` | `[1, 4096]` |")) << md;
  EXPECT_TRUE(contains(md, "| `data.eval_fraction` | float | `0.0` | `[0, 0.5)` |")) << md;
  EXPECT_TRUE(contains(md, "| `optim.state` | enum | `int8` | `fp32`, `int8`, `4bit`, `nvfp4` |"))
      << md;
  EXPECT_TRUE(contains(md, "| `data.eval_files` | list of paths | `[]` |")) << md;
  EXPECT_TRUE(contains(md, "default \\<dir\\>/config.json")) << md;  // not read as HTML
  EXPECT_THROW(splice_config_reference("# no markers\n"), ConfigError);
}

// A directory given as --config was read as an empty YAML document.
TEST(Config, DirectoryAsConfigIsAnError) {
  const fs::path dir = fs::temp_directory_path() / ("q4_cfgdir_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  try {
    load_config(dir.string());
    ADD_FAILURE() << "a directory was accepted as a config file";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("is a directory"), std::string::npos) << e.what();
  }
  q4::io::remove_tree(dir);
}

// data.truncation auto reaches the batcher as auto (plain text split, the rest cut_left: the
// batcher decides per example); data.text_unit reaches the loader, file by default.
TEST(Config, TruncationAutoAndTextUnitReachTheLibrary) {
  EXPECT_EQ(parse(kMinimal).data.truncation, Truncation::kAuto);
  EXPECT_EQ(batcher_options(parse(kMinimal), 0, true, 1).truncation, Truncation::kAuto);
  EXPECT_EQ(batcher_options(parse(kMinimal, {parse_override("data.truncation=drop")}), 0, true, 1)
                .truncation,
            Truncation::kDrop);
  EXPECT_NE(error_of(kMinimal, {parse_override("data.truncation=middle")}), "");
  EXPECT_EQ(dataset_options(parse(kMinimal)).text_unit, q4::data::TextUnit::kFile);
  EXPECT_EQ(
      dataset_options(parse(kMinimal, {parse_override("data.text_unit=paragraph")})).text_unit,
      q4::data::TextUnit::kParagraph);
  EXPECT_NE(error_of(kMinimal, {parse_override("data.text_unit=page")}).find("data.text_unit"),
            std::string::npos);
}

// Each numeric field's range lives in the table; the parser names key, value, range and line.
TEST(Config, RangesComeFromTheTable) {
  const std::string base = kMinimal;
  std::string msg = error_of(base + "train:\n  batch_size: 0\n");
  EXPECT_TRUE(contains(msg,
                       "config key train.batch_size (test.yaml line 9): expected a value in "
                       "[1, 4096], found 0"))
      << msg;
  EXPECT_TRUE(error_names(base + "optim:\n  beta1: 1\n", {"optim.beta1", "[0, 1)", "found 1"}));
  EXPECT_TRUE(error_names(base, {"optim.eps (from --set): expected a finite value > 0, found 0"},
                          {parse_override("optim.eps=0")}));
  EXPECT_TRUE(
      error_names(base, {"model.init_std", "finite"}, {parse_override("model.init_std=.inf")}));
  EXPECT_EQ(error_of(base, {parse_override("optim.schedule.min_lr_ratio=1")}), "");  // closed
  EXPECT_TRUE(
      contains(error_of(base, {parse_override("optim.schedule.min_lr_ratio=1.5")}), "[0, 1]"));
  // data.eval_fraction: 0 <= x < 0.5.
  EXPECT_DOUBLE_EQ(parse(base, {parse_override("data.eval_fraction=0.25")}).data.eval_fraction,
                   0.25);
  EXPECT_EQ(error_of(base, {parse_override("data.eval_fraction=0")}), "");
  msg = error_of(base, {parse_override("data.eval_fraction=0.5")});
  EXPECT_TRUE(contains(msg,
                       "config key data.eval_fraction (from --set): expected a finite value "
                       "in [0, 0.5), found 0.5"))
      << msg;
  EXPECT_NE(error_of(base, {parse_override("data.eval_fraction=-0.1")}), "");
  EXPECT_NE(error_of(base, {parse_override("data.eval_fraction=.nan")}), "");
  // Configs built in code get the same checks from validate_config.
  Config c = parse(base);
  c.train.seq_len = 1;
  try {
    validate_config(c);
    ADD_FAILURE() << "seq_len 1 accepted";
  } catch (const ConfigError& e) {
    EXPECT_TRUE(contains(e.what(), "train.seq_len: expected a value in [2, 262144], found 1"))
        << e.what();
  }
}

TEST(Config, TableIsConsistent) {
  Config c;
  std::set<std::string> keys, aliases;
  std::set<std::string> leaves;
  for (const auto& f : config_fields(c)) leaves.insert(f.key.substr(f.key.rfind('.') + 1));
  for (const auto& f : config_fields(c)) {
    EXPECT_TRUE(keys.insert(f.key).second) << "duplicate key " << f.key;
    EXPECT_FALSE(f.doc.empty()) << f.key;
    const bool numeric = std::holds_alternative<int64_t*>(f.ptr) ||
                         std::holds_alternative<double*>(f.ptr) ||
                         std::holds_alternative<IntOrAuto*>(f.ptr) ||
                         std::holds_alternative<FloatOrAuto*>(f.ptr);
    if (!numeric) {
      EXPECT_TRUE(f.range.empty()) << f.key << ": a range on a non-numeric field";
    }
    const bool is_enum = f.type_name() == "enum";
    EXPECT_EQ(is_enum, !f.choices().empty()) << f.key;
    for (const auto& a : f.aliases) {
      EXPECT_TRUE(aliases.insert(a).second) << "alias " << a << " names two fields";
      EXPECT_EQ(leaves.count(a), 0u) << "alias " << a << " of " << f.key << " is a field name";
    }
    if (f.is_path) {
      EXPECT_TRUE(std::holds_alternative<std::string*>(f.ptr) ||
                  std::holds_alternative<std::vector<std::string>*>(f.ptr))
          << f.key;
    }
  }
  // Every default lies inside its own range.
  Config d;
  for (const auto& f : config_fields(d)) {
    if (const auto* p = std::get_if<int64_t*>(&f.ptr)) {
      EXPECT_TRUE(f.range.contains(static_cast<double>(**p))) << f.key;
    }
    if (const auto* p = std::get_if<double*>(&f.ptr)) {
      EXPECT_TRUE(f.range.contains(**p)) << f.key;
    }
    if (const auto* p = std::get_if<IntOrAuto*>(&f.ptr); p && (*p)->value) {
      EXPECT_TRUE(f.range.contains(static_cast<double>(*(*p)->value))) << f.key;
    }
  }
}

// train.mlp_chunk_tokens: auto or an integer >= 0; auto chunks by 8192 tokens only past 16,384
// tokens a micro-batch.
TEST(Config, MlpChunkTokensIsAnIntegerOrAuto) {
  const std::string base = kMinimal;
  Config c = parse(base);
  EXPECT_TRUE(c.train.mlp_chunk_tokens.is_auto());
  EXPECT_EQ(resolved_mlp_chunk_tokens(c), 0);  // 4 x 256 tokens
  c = parse(base, {parse_override("train.batch_size=1"), parse_override("train.seq_len=131072")});
  EXPECT_EQ(resolved_mlp_chunk_tokens(c), kAutoMlpChunkTokens);
  c = parse(base, {parse_override("train.batch_size=16"), parse_override("train.seq_len=1024")});
  EXPECT_EQ(resolved_mlp_chunk_tokens(c), 0);  // exactly 16,384: one pass
  c = parse(base, {parse_override("train.mlp_chunk_tokens=4096")});
  EXPECT_EQ(c.train.mlp_chunk_tokens.value, std::optional<int64_t>(4096));
  EXPECT_EQ(resolved_mlp_chunk_tokens(c), 4096);
  c = parse(base + "train: {mlp_chunk_tokens: 0}\n",
            {parse_override("train.batch_size=1"), parse_override("train.seq_len=131072")});
  EXPECT_EQ(resolved_mlp_chunk_tokens(c), 0);
  EXPECT_EQ(parse(config_to_yaml(c)).train.mlp_chunk_tokens.value, std::optional<int64_t>(0));
  EXPECT_TRUE(contains(config_to_yaml(parse(base)), "mlp_chunk_tokens: auto"));
  std::string msg = error_of(base + "train: {mlp_chunk_tokens: -1}\n");
  EXPECT_TRUE(contains(msg,
                       "config key train.mlp_chunk_tokens (test.yaml line 8): expected >= 0, "
                       "found -1"))
      << msg;
  msg = error_of(base, {parse_override("train.mlp_chunk_tokens=some")});
  EXPECT_TRUE(contains(msg, "train.mlp_chunk_tokens (from --set): expected an integer or auto"))
      << msg;
  // Without recomputed layers it has nothing to chunk (auto may resolve to no recompute).
  EXPECT_EQ(error_of(base, {parse_override("train.mlp_chunk_tokens=512"),
                            parse_override("train.gradient_checkpointing=false")}),
            "");
  // Configs built in code get the range check from validate_config.
  c = parse(base);
  c.train.mlp_chunk_tokens.value = -5;
  EXPECT_THROW(validate_config(c), ConfigError);
}

// Enumerated strings become enums once; to_string gives the YAML spelling back.
TEST(Config, EnumsParseOnceAndPrintBack) {
  Config c = parse(
      kMinimal,
      {parse_override("model.init=random"), parse_override("model.master_dtype=bf16"),
       parse_override("model.compute_dtype=bf16"), parse_override("model.grad_dtype=fp32"),
       parse_override("optim.state=4bit"), parse_override("optim.master_rounding=nearest"),
       parse_override("optim.in_backward=false"), parse_override("optim.schedule.kind=cosine"),
       parse_override("data.format=jsonl"), parse_override("data.on_error=skip"),
       parse_override("data.truncation=cut_right"), parse_override("log.progress=line"),
       parse_override("output.hf_export=compressed-tensors")});
  EXPECT_EQ(c.model.init, InitKind::kRandom);
  EXPECT_EQ(c.model.master_dtype, Dtype::kBf16);
  EXPECT_EQ(c.model.compute_dtype, DtypeOrAuto::kBf16);
  EXPECT_EQ(c.model.grad_dtype, DtypeOrAuto::kFp32);
  EXPECT_EQ(c.optim.state, q4::optim::StateMode::k4Bit);
  EXPECT_EQ(c.optim.master_rounding, q4::optim::MasterRounding::kNearest);
  EXPECT_EQ(c.optim.in_backward, InBackward::kFalse);
  EXPECT_FALSE(in_backward_updates(c));
  EXPECT_EQ(c.optim.schedule.kind, q4::optim::LrScheduleKind::kCosine);
  EXPECT_EQ(c.data.format, q4::data::DataFormat::kJsonl);
  EXPECT_EQ(c.data.on_error, q4::data::OnError::kSkip);
  EXPECT_EQ(c.data.truncation, Truncation::kCutRight);
  EXPECT_EQ(c.log.progress, ProgressStyle::kLine);
  EXPECT_EQ(c.output.hf_export, HfExport::kCompressedTensors);
  EXPECT_EQ(to_string(c.optim.state), "4bit");
  EXPECT_EQ(to_string(c.output.hf_export), "compressed-tensors");
  EXPECT_EQ(to_string(q4::optim::StateMode::kNvfp4), "nvfp4");
  EXPECT_EQ(to_string(InBackward::kTrue), "true");
  // YAML booleans given to auto|true|false are its spellings.
  EXPECT_EQ(parse(kMinimal, {parse_override("optim.in_backward=true")}).optim.in_backward,
            InBackward::kTrue);
  // With several micro-batches a step, true updates inside the last one's backward; auto keeps
  // buffered updates then.
  EXPECT_TRUE(in_backward_updates(parse(
      kMinimal, {parse_override("optim.in_backward=true"), parse_override("train.grad_accum=4")})));
  EXPECT_FALSE(in_backward_updates(parse(kMinimal, {parse_override("train.grad_accum=4")})));
  // On CUDA auto updates inside the backward with one micro-batch a step, and with several when
  // the masters are in host memory (their sums then skip a round trip over PCIe).
  const auto cuda = [&](std::vector<std::string> sets) {
    std::vector<Override> o{parse_override("model.device=cuda")};
    for (const auto& set : sets) o.push_back(parse_override(set));
    return in_backward_updates(parse(kMinimal, o));
  };
  EXPECT_TRUE(cuda({}));
  EXPECT_FALSE(cuda({"train.grad_accum=4"}));
  EXPECT_FALSE(cuda({"train.grad_accum=4", "optim.offload=moments"}));
  EXPECT_TRUE(cuda({"train.grad_accum=4", "optim.offload=all"}));
  EXPECT_FALSE(cuda({"optim.offload=all", "optim.in_backward=false"}));
  const Config back = parse_config(config_to_yaml(c), "back.yaml", "/x");
  EXPECT_EQ(config_to_yaml(back), config_to_yaml(c));
  EXPECT_EQ(back.optim.state, q4::optim::StateMode::k4Bit);
  EXPECT_EQ(back.output.hf_export, HfExport::kCompressedTensors);
  // Wrong spellings list the choices, from the enum.
  std::string msg = error_of(kMinimal, {parse_override("log.progress=fancy")});
  EXPECT_TRUE(contains(msg,
                       "config key log.progress (from --set): expected one of auto, bar, "
                       "line, found 'fancy'"))
      << msg;
  msg = error_of(std::string(kMinimal) + "model:\n  init: [file]\n");
  EXPECT_NE(msg, "");
  EXPECT_TRUE(error_names(std::string(kMinimal) + "optim:\n  master_rounding: {a: 1}\n",
                          {"optim.master_rounding", "stochastic, nearest"}));
}

// Did-you-mean across sections and for other common names of a field.
TEST(Config, DidYouMeanAcrossSections) {
  const std::string base = kMinimal;
  EXPECT_TRUE(error_names(base + "optim:\n  learning_rate: 0.1\n",
                          {"unknown config key optim.learning_rate", "did you mean optim.lr?"}));
  EXPECT_TRUE(
      error_names(base, {"did you mean optim.lr?"}, {parse_override("optim.learning_rate=0.1")}));
  EXPECT_TRUE(error_names(base + "train:\n  lr: 0.1\n", {"did you mean optim.lr?"}));
  EXPECT_TRUE(error_names(
      base + "warmup_steps: 10\n",
      {"unknown config key warmup_steps", "did you mean optim.schedule.warmup_steps?"}));
  EXPECT_TRUE(error_names(base, {"did you mean optim.schedule.warmup_steps?"},
                          {parse_override("train.warmup_steps=3")}));
  EXPECT_TRUE(error_names(base + "steps: 10\n", {"did you mean train.steps?"}));

  expect_suggestions({{"learning_rate", "optim.lr"},
                      {"optim.learning_rate", "optim.lr"},
                      {"train.gradient_accumulation_steps", "train.grad_accum"},
                      {"data.max_seq_length", "train.seq_len"},
                      {"warmup_steps", "optim.schedule.warmup_steps"},
                      {"model.warmup_stpes", "optim.schedule.warmup_steps"},
                      {"data.seq_len", "train.seq_len"},
                      {"eval.lr", "optim.lr"},
                      {"wibble.wobble", ""}});
}

// The resolved config prints floats as the shortest text that reads back exactly.
TEST(Config, YamlFloatsAreShortAndExact) {
  const Config c = parse(kMinimal, {parse_override("optim.lr=0.00012345678901234567")});
  const std::string y = config_to_yaml(c);
  EXPECT_TRUE(contains(y, "beta1: 0.9\n") || contains(y, "beta1: 0.9 ")) << y;
  EXPECT_TRUE(contains(y, "weight_decay: 0.0")) << y;
  EXPECT_FALSE(contains(y, "0.90000000000000002")) << y;
  EXPECT_EQ(parse_config(y, "y.yaml", "/").optim.lr, c.optim.lr);
}

TEST(Config, EvalFilesAreInputPaths) {
  const Config c = parse(std::string(kMinimal) + "  eval_files: [held.tsv, /abs/x.jsonl]\n" +
                         "  eval_fraction: 0.1\n");  // appended to kMinimal's data section
  ASSERT_EQ(c.data.eval_files.size(), 2u);
  EXPECT_EQ(c.data.eval_files[0], "/base/held.tsv");
  EXPECT_EQ(c.data.eval_files[1], "/abs/x.jsonl");
  EXPECT_DOUBLE_EQ(c.data.eval_fraction, 0.1);
}

// Numbers that size an allocation have ranges, so that a typo is an error naming the key rather
// than a raw allocator failure (or a terabyte eval cache) later.
TEST(Config, AllocationSizesHaveRanges) {
  const std::string m = kMinimal;
  struct Case {
    std::string set, expect;
  };
  for (const Case& c : std::vector<Case>{
           {"train.batch_size=1000000000",
            "config key train.batch_size (from --set): expected "
            "a value in [1, 4096], found 1000000000"},
           {"train.seq_len=100000000",
            "config key train.seq_len (from --set): expected a value "
            "in [2, 262144]"},
           {"eval.max_new_tokens=100000000000", "config key eval.max_new_tokens (from --set)"},
           {"model.init_std=1e30",
            "config key model.init_std (from --set): expected a finite "
            "value in (0, 1]"},
       }) {
    const std::string msg = error_of(m, {parse_override(c.set)});
    EXPECT_TRUE(contains(msg, c.expect)) << c.set << " -> " << msg;
  }
  const std::string msg = error_of(
      m, {parse_override("train.batch_size=4096"), parse_override("train.seq_len=262144")});
  EXPECT_TRUE(contains(msg, "train.batch_size x train.seq_len")) << msg;
  EXPECT_TRUE(contains(msg, "train.grad_accum")) << msg;
  EXPECT_EQ(
      error_of(m,
               {parse_override("train.batch_size=64"), parse_override("train.seq_len=32768"),
                parse_override("eval.max_new_tokens=32768"), parse_override("model.init_std=1")}),
      "");
}

// A second YAML document is an error naming the file and its line, not silently ignored; a
// leading "---" (one document) and a trailing one (an empty document) are fine.
TEST(Config, SecondYamlDocumentIsAnError) {
  const std::string two = std::string(kMinimal) + "---\ntrain:\n  steps: 5\n";
  EXPECT_TRUE(error_names(two, {"test.yaml line 9", "second YAML document"}));
  EXPECT_EQ(error_of(std::string("---\n") + kMinimal), "");
  EXPECT_EQ(error_of(std::string(kMinimal) + "---\n# the end\n"), "");
  EXPECT_EQ(error_of(std::string("%YAML 1.2\n---\n") + kMinimal + "...\n"), "");
  EXPECT_TRUE(contains(error_of(std::string(kMinimal) + "...\ntrain: {steps: 5}\n"),
                       "test.yaml line 9: a second YAML document"));
  EXPECT_TRUE(contains(error_of(std::string(kMinimal) + "--- {train: {steps: 5}}\n"),
                       "test.yaml line 8: a second YAML document"));
}

// A leading ~/ is the home directory in every path-typed field, from the file and from --set.
TEST(Config, TildeExpandsToHome) {
  const char* home = std::getenv("HOME");
  ASSERT_NE(home, nullptr);
  const Config c =
      parse(std::string(kMinimal) + "output:\n  dir: ~/runs/a\n  export_path: ~/m.dat\n",
            {parse_override("data.files=[~/d.tsv]"), parse_override("model.tokenizer=~/tok.json")});
  const std::string h = fs::path(home).lexically_normal().string();
  EXPECT_EQ(c.data.files.at(0), (fs::path(h) / "d.tsv").string());
  EXPECT_EQ(c.model.tokenizer, (fs::path(h) / "tok.json").string());
  EXPECT_EQ(c.output.dir, (fs::path(h) / "runs/a").string());
  EXPECT_EQ(c.output.export_path, (fs::path(h) / "m.dat").string());
  EXPECT_EQ(parse(std::string(kMinimal) + "  eval_files: [a~/b.tsv]\n").data.eval_files.at(0),
            "/base/a~/b.tsv");
}

// train.epochs replaces train.steps (exactly one of them); warmup_ratio replaces warmup_steps.
// The resolved YAML leaves train.steps out while epochs decide, so it parses back.
TEST(Config, EpochsAndWarmupRatioExcludeTheirCounterparts) {
  const std::string m = kMinimal;
  Config c = parse(m + "train:\n  epochs: 2.5\noptim:\n  schedule: {warmup_ratio: 0.1}\n");
  EXPECT_DOUBLE_EQ(c.train.epochs, 2.5);
  EXPECT_DOUBLE_EQ(c.optim.schedule.warmup_ratio, 0.1);
  const std::string y = config_to_yaml(c);
  EXPECT_FALSE(contains(y, "steps: 100")) << y;
  EXPECT_EQ(config_to_yaml(parse_config(y, "back.yaml", "/x")), y);
  EXPECT_TRUE(error_names(m + "train:\n  epochs: 2\n  steps: 10\n",
                          {"train.epochs", "train.steps (test.yaml line"}));
  EXPECT_TRUE(error_names(m, {"train.steps (from --set)"},
                          {parse_override("train.epochs=1"), parse_override("train.steps=3")}));
  // A --set of one overrides the other from the file (a smoke run: --set train.steps=3).
  c = parse(m + "train:\n  epochs: 2\n", {parse_override("train.steps=3")});
  EXPECT_EQ(c.train.steps, 3);
  EXPECT_EQ(c.train.epochs, 0);
  c = parse(m + "train:\n  steps: 50\n", {parse_override("train.epochs=1")});
  EXPECT_EQ(c.train.epochs, 1);
  EXPECT_FALSE(contains(config_to_yaml(c), "steps: 50")) << config_to_yaml(c);
  EXPECT_TRUE(error_names(m + "optim:\n  schedule: {warmup_ratio: 0.1, warmup_steps: 5}\n",
                          {"optim.schedule.warmup_ratio"}));
  c = parse(m + "optim:\n  schedule: {warmup_steps: 5}\n",
            {parse_override("optim.schedule.warmup_ratio=0.2")});
  EXPECT_EQ(c.optim.schedule.warmup_steps, 0);
  EXPECT_DOUBLE_EQ(c.optim.schedule.warmup_ratio, 0.2);
  EXPECT_TRUE(error_names(m, {"optim.schedule.warmup_ratio"},
                          {parse_override("optim.schedule.warmup_ratio=1")}));
  EXPECT_EQ(did_you_mean("num_train_epochs", config_keys()), "train.epochs");
}

// last:N past the model's layer count names the config key and the count, not model internals.
TEST(Config, LastLayersPastTheModelNamesTheKey) {
  const Config c = parse(kMinimal, {parse_override("train.trainable.layers=last:99")});
  try {
    (void)c.train.trainable.layers.resolve(2);
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_TRUE(contains(msg, "config key train.trainable.layers: last:99")) << msg;
    EXPECT_TRUE(contains(msg, "2 decoder layers")) << msg;
  }
}

// train.epochs -> train.steps = max(1, ceil(epochs x micro-batches per epoch / (grad_accum x
// ranks))), then warmup_ratio -> round(ratio x steps), then the warmup clipped to the run; the
// config reads as the steps-based one it resolved to.
TEST(Config, RunLengthResolvesFromTheData) {
  Config c =
      parse(kMinimal, {parse_override("train.epochs=3"), parse_override("train.grad_accum=2"),
                       parse_override("optim.schedule.warmup_ratio=0.1")});
  std::string notes = resolve_run_length(c, /*micro_batches_per_epoch=*/10, /*ranks=*/2);
  EXPECT_EQ(c.train.steps, 8);                  // ceil(3 x 10 / 4) = ceil(7.5)
  EXPECT_EQ(c.optim.schedule.warmup_steps, 1);  // round(0.8)
  EXPECT_EQ(c.train.epochs, 0);
  EXPECT_EQ(c.optim.schedule.warmup_ratio, 0);
  EXPECT_TRUE(contains(notes,
                       "train.epochs 3 -> train.steps 8 (10 micro-batches per epoch, 4 per "
                       "step: train.grad_accum 2 x 2 ranks)"))
      << notes;
  c = parse(kMinimal, {parse_override("train.epochs=4"), parse_override("train.grad_accum=3")});
  resolve_run_length(c, 3, 1);
  EXPECT_EQ(c.train.steps, 4);  // exactly 12 / 3: no rounding up
  c = parse(kMinimal, {parse_override("train.epochs=0.01")});
  resolve_run_length(c, 5, 1);
  EXPECT_EQ(c.train.steps, 1);  // at least one step
  c = parse(kMinimal,
            {parse_override("train.steps=4"), parse_override("optim.schedule.warmup_steps=9")});
  notes = resolve_run_length(c, 5, 1);
  EXPECT_EQ(c.train.steps, 4);  // steps-based: unchanged, the warmup clipped
  EXPECT_EQ(c.optim.schedule.warmup_steps, 4);
  EXPECT_TRUE(contains(notes, "clipped")) << notes;
}

// Settings that do not apply to the run are named in one warning line, with why; the defaults,
// and settings that apply, are not (they used to be ignored without a word).
TEST(Config, SettingsThatDoNotApplyAreNamed) {
  EXPECT_EQ(ignored_of(parse(kMinimal)), "");
  const std::string w = ignored_of(
      parse(std::string(kMinimal) + "lora: {rank: 8, alpha: 4}\npreference: {beta: 0.5}\n"));
  EXPECT_EQ(w,
            "warning: settings that do not apply to this run are ignored: lora.rank, lora.alpha "
            "(train.method is full); preference.beta (train.objective is cross_entropy)");
  // Under lora and preference those keys apply; ipo has no label smoothing, merge-aware adapters
  // no cached base weights, sigmoid no simpo_gamma.
  const std::string pref = std::string(kMinimal) +
                           "train: {method: lora, objective: preference}\n"
                           "lora: {rank: 8, cache_base_weights: true}\n"
                           "preference: {loss: ipo, label_smoothing: 0.1, beta: 0.5}\n";
  EXPECT_EQ(ignored_of(parse(pref)),
            "warning: settings that do not apply to this run are ignored: lora.cache_base_weights "
            "(lora.merge_aware is true); preference.label_smoothing (preference.loss is ipo)");
  EXPECT_TRUE(
      contains(ignored_of(parse(std::string(kMinimal) + "preference: {simpo_gamma: 1.0}\n"
                                                        "train: {objective: preference}\n")),
               "preference.simpo_gamma (preference.loss is sigmoid)"));
  EXPECT_EQ(ignored_of(parse(
                std::string(kMinimal) +
                "train: {method: lora}\nlora: {merge_aware: false, cache_base_weights: true}\n")),
            "");
}

// Extremes inside the old ranges that ended in non-finite steps are refused, naming the key and
// its range.
TEST(Config, LossScalesAreBounded) {
  EXPECT_TRUE(contains(error_of(std::string(kMinimal) + "distill: {temperature: 1e-44}\n"),
                       "config key distill.temperature (test.yaml line"));
  EXPECT_TRUE(
      contains(error_of(std::string(kMinimal) + "distill: {temperature: 1e-44}\n"), "[0.01, 1e2]"));
  EXPECT_EQ(error_of(std::string(kMinimal) + "distill: {temperature: 0.01}\n"), "");
  EXPECT_TRUE(
      contains(error_of(std::string(kMinimal) + "preference: {beta: 1e30}\n"), "preference.beta"));
  EXPECT_TRUE(contains(error_of(std::string(kMinimal) + "preference: {simpo_gamma: 1e300}\n"),
                       "preference.simpo_gamma"));
  EXPECT_TRUE(contains(error_of(std::string(kMinimal) + "preference: {sft_weight: 1e300}\n"),
                       "preference.sft_weight"));
}

// A cross-field error names the config file, and says when it is empty (a resumed run's
// config.yaml that lost its contents used to say only "model.weights: required").
TEST(Config, CrossFieldErrorsNameTheFile) {
  const std::string empty = error_of("");
  EXPECT_TRUE(contains(empty, "(config file test.yaml, which is empty)")) << empty;
  const std::string m = error_of(std::string(kMinimal) + "train: {objective: distill}\n");
  EXPECT_TRUE(contains(m, "distill.teacher")) << m;
  EXPECT_TRUE(contains(m, "(config file test.yaml)")) << m;
}

// data.chat_template auto is resolved at parse time from the tokenizer's folder, so the saved
// config names the template the run used; an unknown folder template is a one-line error.
TEST(Config, ChatTemplateAutoResolvesFromTheTokenizerFolder) {
  EXPECT_EQ(parse(kMinimal).data.chat_template, q4::data::ChatTemplate::kQwen3_2507Instruct);
  const fs::path dir = fs::temp_directory_path() / ("q4_cfgchat_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_hybrid.tokenizer_config.json",
                dir / "tokenizer_config.json", fs::copy_options::overwrite_existing);
  const std::string cfg =
      "model:\n  dir: " + dir.string() + "\n  weights: m/model.dat\ndata:\n  files: [train.tsv]\n";
  const Config c = parse(cfg);
  EXPECT_EQ(c.data.chat_template, q4::data::ChatTemplate::kQwen3);
  EXPECT_TRUE(contains(config_to_yaml(c), "chat_template: \"qwen3\"")) << config_to_yaml(c);
  EXPECT_EQ(chat_options(c).chat_template, q4::data::ChatTemplate::kQwen3);
  EXPECT_FALSE(chat_options(c).enable_thinking.has_value());
  const Config off = parse(cfg, {parse_override("data.enable_thinking=false"),
                                 parse_override("data.chat_template=qwen3-2507-thinking")});
  EXPECT_EQ(off.data.chat_template, q4::data::ChatTemplate::kQwen3_2507Thinking);
  EXPECT_EQ(chat_options(off).enable_thinking, std::optional<bool>(false));
  std::ofstream(dir / "chat_template.jinja") << "{{ messages }}";
  const std::string msg = error_of(cfg);
  EXPECT_TRUE(contains(msg, "data.chat_template")) << msg;
  EXPECT_TRUE(contains(msg, (dir / "chat_template.jinja").string())) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_TRUE(contains(error_of(kMinimal, {parse_override("data.chat_template=chatml")}),
                       "qwen3-2507-thinking"));
  q4::io::remove_tree(dir);
}
