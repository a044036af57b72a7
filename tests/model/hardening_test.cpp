// Regression tests for the model library and its tools: non-finite loaded weights are
// an input error naming file and entry (Qwen3Model::load, q4gen exit 2), and the tools reject
// numeric arguments that used to wrap, overflow or write Inf (q4gen --max-new-tokens, q4dat
// init --seed/--std) with a short message and exit code 2.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

// `cmd_line` with its stdout discarded and its stderr in dir/stderr.
q4::test::Result run_tool(const std::string& dir, const std::string& cmd_line) {
  return q4::test::run_captured(cmd_line, "/dev/null", dir + "/stderr");
}

// Copies the tiny fixture, with `edit` applied to a copy of the tensor `key`.
void copy_with(const std::string& dst, const std::string& key,
               const std::function<void(at::Tensor&)>& edit) {
  DatReader r(kWeights);
  DatWriter w(dst, r.entries().size());
  for (const auto& e : r.entries()) {
    if (e.key == key) {
      at::Tensor t = r.load(e).clone();
      edit(t);
      w.add(e.key, t, e.type);
    } else {
      w.copy_from(r, e);
    }
  }
  w.commit();
}

std::string load_error(const std::string& path) {
  DatReader r(path);
  try {
    Qwen3Model::load(Qwen3Config::from_json_file(kConfig), r, ModelOptions{});
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "<no error>";
}

// Expects each of `parts` in `msg`.
void expect_contains_all(const std::string& msg, const std::vector<std::string>& parts) {
  for (const auto& part : parts) {
    EXPECT_NE(msg.find(part), std::string::npos) << part << " in " << msg;
  }
}

TEST(ModelHardening, NanInRawWeightsIsALoadErrorNamingTheEntry) {
  test::ScopedTempDir tmp("q4_hard_");
  const std::string nan_norm = tmp.path("nan_norm.dat"), inf_embed = tmp.path("inf_embed.dat");
  copy_with(nan_norm, "model.norm.weight", [](at::Tensor& t) { t[3] = NAN; });
  copy_with(inf_embed, "model.embed_tokens.weight", [](at::Tensor& t) { t[5][2] = INFINITY; });
  expect_contains_all(load_error(nan_norm), {nan_norm, "'model.norm.weight'", "non-finite", "[3]"});
  expect_contains_all(load_error(inf_embed), {"'model.embed_tokens.weight'", "[5, 2]"});
}

TEST(ModelHardening, NanBlockScaleIsALoadErrorNamingTheEntry) {
  test::ScopedTempDir tmp("q4_hard_");
  const std::string path = tmp.path("nan_scale.dat");
  const std::string key = "model.layers.0.mlp.down_proj.weight.scale";
  copy_with(path, key, [](at::Tensor& t) {
    t[1][0] = 0x7F;  // E4M3FN NaN
  });
  const std::string msg = load_error(path);
  expect_contains_all(msg, {"'" + key + "'", "NaN"});
  EXPECT_EQ(msg.find("tensor 'tensor'"), std::string::npos) << msg;
}

// A block scale with the sign bit (NVFP4 scales are >= 0; the HF layouts cannot carry it) is a
// load error like the NaN code, not something only the HF export refuses after training.
TEST(ModelHardening, NegativeBlockScaleIsALoadErrorNamingTheEntry) {
  test::ScopedTempDir tmp("q4_hard_");
  const std::string path = tmp.path("neg_scale.dat");
  const std::string key = "model.layers.1.self_attn.o_proj.weight.scale";
  copy_with(path, key,
            [](at::Tensor& t) { t[2][1] = static_cast<uint8_t>(t[2][1].item<uint8_t>() | 0x80); });
  expect_contains_all(load_error(path), {path, "'" + key + "'", "negative", "[2, 1]"});
}

// config.json and the file disagree on the layer count: an error naming both and both counts
// (fewer in the config used to drop the file's extra layers silently).
TEST(ModelHardening, LayerCountMismatchIsALoadError) {
  DatReader r(kWeights);
  for (int layers : {1, 3}) {
    Qwen3Config c = Qwen3Config::from_json_file(kConfig);
    c.num_hidden_layers = layers;
    c.source = "tiny.json";
    try {
      Qwen3Model::load(c, r, ModelOptions{});
      ADD_FAILURE() << "loaded 2 layers with num_hidden_layers " << layers;
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      EXPECT_NE(msg.find(kWeights + " stores 2 decoder layers"), std::string::npos) << msg;
      EXPECT_NE(msg.find("tiny.json has num_hidden_layers " + std::to_string(layers)),
                std::string::npos)
          << msg;
    }
  }
}

TEST(ModelHardening, Q4genWithNanWeightsExits2) {
  test::ScopedTempDir tmp("q4_hard_");
  const std::string path = tmp.path("nan.dat");
  copy_with(path, "model.norm.weight", [](at::Tensor& t) { t[0] = NAN; });
  const q4::test::Result r =
      run_tool(tmp.dir(), std::string(Q4_BIN_DIR) + "/q4gen --config " + kConfig + " --weights " +
                              path + " --prompt-ids 1,2,3");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("model.norm.weight"), std::string::npos) << r.err;
}

TEST(ModelHardening, ToolNumericArgumentsAreRangeChecked) {
  test::ScopedTempDir tmp("q4_hard_");
  const std::string gen = std::string(Q4_BIN_DIR) + "/q4gen --config " + kConfig + " --weights " +
                          kWeights + " --prompt-ids 1,2";
  q4::test::Result r = run_tool(tmp.dir(), gen + " --max-new-tokens 99999999999999999999");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--max-new-tokens"), std::string::npos) << r.err;
  const std::string init =
      std::string(Q4_BIN_DIR) + "/q4dat init --config " + kConfig + " --out " + tmp.path("o.dat");
  r = run_tool(tmp.dir(), init + " --std 1e30");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--std"), std::string::npos) << r.err;
  r = run_tool(tmp.dir(), init + " --seed -5");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_NE(r.err.find("--seed"), std::string::npos) << r.err;
  r = run_tool(tmp.dir(), init + " --std 1e300");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_LT(r.err.size(), 200u) << r.err;  // no 300-digit number
  EXPECT_FALSE(std::ifstream(tmp.path("o.dat")).good());
  r = run_tool(tmp.dir(), std::string(Q4_BIN_DIR) + "/q4dat diff " + kWeights + " " + kWeights +
                              " --atol -1e300");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_LT(r.err.size(), 200u) << r.err;
  r = run_tool(tmp.dir(), init + " --seed 7 --std 0.5");
  EXPECT_EQ(r.code, 0) << r.err;
}

}  // namespace
}  // namespace q4::model
