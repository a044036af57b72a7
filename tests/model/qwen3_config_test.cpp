// Qwen3Config: the shipped fixtures parse to the values written in them, every feature this code
// cannot honour is rejected with a message naming the source and the key, head_dim is derived
// when absent, and parameter counts match sizes computed by hand from the shapes (Qwen3-4B:
// the published 4.02 B with tied embeddings, plus 0.389 B for the shipped separate lm_head).
#include "q4/model/qwen3_config.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <ostream>
#include <string>
#include <tuple>

namespace q4::model {
namespace {

const std::string kTiny = std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.config.json";
const std::string k4b = std::string(Q4_FIXTURES_DIR) + "/qwen3_4b.config.json";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

// The shape fields of a config, compared as one value so that a mismatch prints both.
struct Shape {
  int64_t vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_positions;
  double rope_theta;
  bool tied;
  bool operator==(const Shape& o) const {
    return std::tie(vocab, hidden, intermediate, layers, heads, kv_heads, head_dim, max_positions,
                    rope_theta, tied) == std::tie(o.vocab, o.hidden, o.intermediate, o.layers,
                                                  o.heads, o.kv_heads, o.head_dim, o.max_positions,
                                                  o.rope_theta, o.tied);
  }
};
std::ostream& operator<<(std::ostream& os, const Shape& s) {
  return os << "vocab " << s.vocab << " hidden " << s.hidden << " intermediate " << s.intermediate
            << " layers " << s.layers << " heads " << s.heads << "/" << s.kv_heads << " head_dim "
            << s.head_dim << " max_positions " << s.max_positions << " rope_theta " << s.rope_theta
            << " tied " << s.tied;
}
Shape shape_of(const Qwen3Config& c) {
  return {
      c.vocab_size,          c.hidden_size,         c.intermediate_size, c.num_hidden_layers,
      c.num_attention_heads, c.num_key_value_heads, c.head_dim,          c.max_position_embeddings,
      c.rope_theta,          c.tie_word_embeddings};
}

// Expects from_json(j) to throw c10::Error whose message contains every needle.
void expect_rejected(const nlohmann::json& j, std::initializer_list<const char*> needles) {
  try {
    Qwen3Config::from_json(j, "cfg.json");
    ADD_FAILURE() << "accepted: " << j.dump();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("cfg.json"), std::string::npos) << msg;
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << n << " / " << msg;
  }
}

TEST(Qwen3ConfigTest, TinyFixture) {
  const Qwen3Config c = Qwen3Config::from_json_file(kTiny);
  EXPECT_EQ(shape_of(c), (Shape{384, 64, 192, 2, 4, 2, 16, 128, 1e6, false}));
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_FALSE(c.bos_token_id.has_value());
  EXPECT_FALSE(c.eos_token_id.has_value());
  EXPECT_EQ(c.source, kTiny);
  EXPECT_EQ(c.q_dim(), 64);
  EXPECT_EQ(c.kv_dim(), 32);
  // Per layer: q 64*64, k 64*32, v 64*32, o 64*64, gate/up/down 3*64*192, norms 2*64 + 2*16.
  const int64_t layer = 4096 + 2048 + 2048 + 4096 + 3 * 12288 + 128 + 32;
  EXPECT_EQ(c.layer_num_parameters(), layer);
  EXPECT_EQ(c.num_parameters(false), 384 * 64 + 2 * layer + 64);
  EXPECT_EQ(c.num_parameters(true), 2 * 384 * 64 + 2 * layer + 64);
  EXPECT_EQ(c.num_linear_parameters(false), 2 * (layer - 160));
  EXPECT_EQ(c.num_linear_parameters(true), 2 * (layer - 160) + 384 * 64);
}

TEST(Qwen3ConfigTest, Qwen3_4bFixture) {
  const Qwen3Config c = Qwen3Config::from_json_file(k4b);
  // rope_theta 5e6: read from the file, not a hard-coded 1e6.
  EXPECT_EQ(shape_of(c), (Shape{151936, 2560, 9728, 36, 32, 8, 128, 262144, 5e6, true}));
  ASSERT_TRUE(c.bos_token_id.has_value());
  EXPECT_EQ(*c.bos_token_id, 151643);
  ASSERT_TRUE(c.eos_token_id.has_value());
  EXPECT_EQ(*c.eos_token_id, 151645);
  EXPECT_EQ(c.q_dim(), 4096);  // q_dim != hidden_size in Qwen3-4B
  EXPECT_EQ(c.kv_dim(), 1024);
  // Qwen3-4B is published as 4.02 B parameters (tied); the separate lm_head adds 0.389 B.
  EXPECT_EQ(c.num_parameters(false), 4022468096);
  EXPECT_EQ(c.num_parameters(true), 4022468096 + 151936LL * 2560);
}

TEST(Qwen3ConfigTest, RoundTripsThroughToJson) {
  for (const std::string& path : {kTiny, k4b}) {
    const Qwen3Config a = Qwen3Config::from_json_file(path);
    const Qwen3Config b = Qwen3Config::from_json(a.to_json(), "roundtrip");
    EXPECT_EQ(a.to_json(), b.to_json()) << path;
    EXPECT_EQ(b.rope_theta, a.rope_theta);
    EXPECT_EQ(b.eos_token_id, a.eos_token_id);
  }
}

TEST(Qwen3ConfigTest, DerivesHeadDimWhenAbsent) {
  nlohmann::json j = read_json(kTiny);
  j.erase("head_dim");
  EXPECT_EQ(Qwen3Config::from_json(j, "cfg.json").head_dim, 64 / 4);
  j["head_dim"] = nullptr;
  EXPECT_EQ(Qwen3Config::from_json(j, "cfg.json").head_dim, 16);
  j["num_attention_heads"] = 6;
  j["num_key_value_heads"] = 3;
  expect_rejected(j, {"head_dim", "not divisible"});
}

TEST(Qwen3ConfigTest, AcceptsInertAndOptionalKeys) {
  nlohmann::json j = read_json(kTiny);
  j["sliding_window"] = 4096;  // inert while use_sliding_window is false
  j["use_sliding_window"] = false;
  j["eos_token_id"] = {151645, 151643};
  j.erase("tie_word_embeddings");
  const Qwen3Config c = Qwen3Config::from_json(j, "cfg.json");
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_EQ(*c.eos_token_id, 151645);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int64_t>{151645, 151643}));
  // transformers 5 style RoPE block.
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 5000000.0}};
  EXPECT_DOUBLE_EQ(Qwen3Config::from_json(j, "cfg.json").rope_theta, 5e6);
}

TEST(Qwen3ConfigTest, RejectsUnsupportedFeatures) {
  const nlohmann::json base = read_json(kTiny);
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = base;
    j[key] = std::move(v);
    return j;
  };
  expect_rejected(with("architectures", {"LlamaForCausalLM"}), {"'architectures'"});
  expect_rejected(with("architectures", nlohmann::json::array()), {"'architectures'"});
  expect_rejected(with("model_type", "qwen2"), {"'model_type'", "qwen2"});
  expect_rejected(with("rope_scaling", {{"type", "yarn"}, {"factor", 4.0}}), {"'rope_scaling'"});
  expect_rejected(with("use_sliding_window", true), {"'use_sliding_window'"});
  expect_rejected(with("attention_bias", true), {"'attention_bias'"});
  expect_rejected(with("hidden_act", "gelu"), {"'hidden_act'", "gelu"});
  expect_rejected(with("layer_types", {"full_attention", "sliding_attention"}),
                  {"'layer_types[1]'"});
  expect_rejected(with("rope_parameters", {{"rope_type", "yarn"}, {"factor", 2.0}}),
                  {"rope_parameters"});
  expect_rejected(with("rope_parameters", {{"rope_type", "default"}, {"rope_theta", 5.0}}),
                  {"disagree"});
}

TEST(Qwen3ConfigTest, RejectsMissingAndIllTypedFields) {
  const nlohmann::json base = read_json(kTiny);
  for (const char* key : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                          "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                          "rope_theta", "max_position_embeddings"}) {
    nlohmann::json j = base;
    j.erase(key);
    expect_rejected(j, {"missing required key", key});
    j[key] = "12";
    expect_rejected(j, {key});
  }
  auto with = [&](const char* key, nlohmann::json v) {
    nlohmann::json j = base;
    j[key] = std::move(v);
    return j;
  };
  expect_rejected(with("hidden_size", 64.5), {"'hidden_size'", "integer"});
  expect_rejected(with("hidden_size", true), {"'hidden_size'"});
  expect_rejected(with("hidden_size", 0), {"'hidden_size'"});
  expect_rejected(with("vocab_size", -5), {"'vocab_size'"});
  expect_rejected(with("vocab_size", 18446744073709551615ULL), {"'vocab_size'"});
  expect_rejected(with("num_key_value_heads", 3), {"'num_key_value_heads'", "divide"});
  expect_rejected(with("head_dim", 15), {"'head_dim'", "even"});
  expect_rejected(with("rms_norm_eps", 0.0), {"'rms_norm_eps'"});
  expect_rejected(with("rope_theta", -1.0), {"'rope_theta'"});
  expect_rejected(with("tie_word_embeddings", 1), {"'tie_word_embeddings'"});
  expect_rejected(with("eos_token_id", "x"), {"'eos_token_id'"});
  expect_rejected(with("bos_token_id", {1, 2}), {"'bos_token_id'"});
  expect_rejected(nlohmann::json::array({1, 2}), {"object"});
}

TEST(Qwen3ConfigTest, FileErrorsNameTheFile) {
  const std::string dir = ::testing::TempDir();
  const std::string bad = dir + "/q4_bad_config.json";
  { std::ofstream(bad) << "{ \"vocab_size\": 12, "; }
  try {
    Qwen3Config::from_json_file(bad);
    ADD_FAILURE() << "truncated JSON accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(bad), std::string::npos);
  }
  const std::string missing = dir + "/q4_no_such_config.json";
  try {
    Qwen3Config::from_json_file(missing);
    ADD_FAILURE() << "missing file accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(missing), std::string::npos);
  }
  std::remove(bad.c_str());
  // A FIFO is refused without blocking, /dev/zero without reading forever.
  const std::string fifo = dir + "/q4_config_fifo.json";
  std::remove(fifo.c_str());
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  for (const std::string& p : {fifo, std::string("/dev/zero")}) {
    try {
      Qwen3Config::from_json_file(p);
      ADD_FAILURE() << p << " accepted";
    } catch (const c10::Error& e) {
      EXPECT_NE(std::string(e.what_without_backtrace()).find(p), std::string::npos);
      EXPECT_NE(std::string(e.what_without_backtrace()).find("expected a regular file"),
                std::string::npos)
          << e.what_without_backtrace();
    }
  }
  std::remove(fifo.c_str());
}

}  // namespace
}  // namespace q4::model
