// ChatSession (template, cache kept across turns, streaming), Utf8Stream and --model resolution,
// with the real Qwen3 tokenizer (assets/qwen3/tokenizer.json; tools/fetch_tokenizer.sh) and a
// tiny random model over the full 151936-id vocabulary.
#include "session.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q4/data/chat.h"
#include "q4/io/remove_tree.h"
#include "q4/model/qwen3_config.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

namespace q4::chat {
namespace {

const char* kTokenizer = Q4_SOURCE_DIR "/assets/qwen3/tokenizer.json";

const std::string kTinyConfig = q4::test::tiny_model_config(1);

TEST(Utf8Stream, HoldsSplitCharactersAndReplacesInvalidBytes) {
  Utf8Stream s;
  EXPECT_EQ(s.push("a\xC3"), "a");
  EXPECT_EQ(s.push("\xA9"), "\xC3\xA9");  // é completed by the next token
  EXPECT_EQ(s.push("\xE4\xBD"), "");      // 你 (E4 BD A0) in two pieces
  EXPECT_EQ(s.push("\xA0!"), "\xE4\xBD\xA0!");
  EXPECT_EQ(s.push("\xFF"
                   "b"),
            "\xEF\xBF\xBD"
            "b");  // invalid lead byte -> U+FFFD
  EXPECT_EQ(s.push("\xF0\x9F"), "");
  EXPECT_EQ(s.finish(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // cut 4-byte sequence at the end
  EXPECT_EQ(s.push("\xC3"
                   "x"),
            "\xEF\xBF\xBDx");  // a lead byte without continuation
}

class SessionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kTokenizer))
        << "missing " << kTokenizer << ": run tools/fetch_tokenizer.sh";
    tok_ = std::make_unique<data::Tokenizer>(data::Tokenizer::from_file(kTokenizer));
    const auto cfg = model::Qwen3Config::from_json(nlohmann::json::parse(kTinyConfig), "tiny");
    model::ModelOptions opt;
    opt.trainable = model::TrainableSpec::nothing();
    opt.gradient_checkpointing = false;
    model_ = std::make_unique<model::Qwen3Model>(
        model::Qwen3Model::random_init(cfg, opt, /*seed=*/5, /*std=*/0.3));
  }
  std::unique_ptr<data::Tokenizer> tok_;
  std::unique_ptr<model::Qwen3Model> model_;
};

TEST_F(SessionTest, FirstTurnIsTheChatTemplateAndTurnsExtendTheCache) {
  model::SamplingParams o;
  o.temperature = 0;
  ChatSession s(*model_, *tok_, o, "Be brief.", /*max_new_tokens=*/6);
  std::string streamed;
  const auto r1 = s.turn("Hello!", [&](const std::string& t) { streamed += t; });
  EXPECT_EQ(streamed, r1.text);
  const auto expect =
      data::tokenize_chat(*tok_, {{"system", "Be brief."}, {"user", "Hello!"}}, true).input_ids;
  EXPECT_EQ(r1.prompt_tokens, static_cast<int64_t>(expect.size()));
  ASSERT_FALSE(r1.tokens.empty());
  std::vector<int64_t> prefix(s.history().begin(), s.history().begin() + expect.size());
  EXPECT_EQ(prefix, std::vector<int64_t>(expect.begin(), expect.end()));

  const int64_t cached_before = s.cached_tokens();
  const auto r2 = s.turn("And now?");
  ASSERT_FALSE(r2.tokens.empty());
  // Only the new turn was fed: the cache grew by that turn's tokens (and its reply).
  EXPECT_EQ(s.cached_tokens(),
            cached_before + r2.prompt_tokens + static_cast<int64_t>(r2.tokens.size()) - 1);
  // The second turn's input closes the first reply and renders the user turn.
  const std::vector<int64_t>& h = s.history();
  const size_t start = h.size() - r2.tokens.size() - r2.prompt_tokens;
  std::vector<data::TokenId> turn2(h.begin() + start, h.end() - r2.tokens.size());
  const std::string text = tok_->decode(turn2);
  EXPECT_NE(text.find("<|im_end|>\n<|im_start|>user\nAnd now?<|im_end|>\n<|im_start|>assistant\n"),
            std::string::npos)
      << text;
  // Greedy decoding on the kept cache equals a fresh generate() over the whole conversation.
  std::vector<int64_t> all(h.begin(), h.end() - r2.tokens.size());
  model::GenerateOptions g;
  g.max_new_tokens = 6;
  g.stop_ids = {tok_->im_end_id(), tok_->endoftext_id()};
  EXPECT_EQ(r2.tokens, model_->generate(all, g));
}

TEST(ResolveModelPaths, FilesBesideTheDatRunDirsAndCheckpoints) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("q4chat_resolve_" + std::to_string(::getpid()));
  q4::io::remove_tree(dir);
  fs::create_directories(dir / "step_000010");
  std::ofstream(dir / "model.dat") << "x";
  std::ofstream(dir / "config.json") << "{}";
  std::ofstream(dir / "tokenizer.json") << "{}";
  std::ofstream(dir / "step_000010" / "optim.state") << "x";
  const auto p = resolve_model_paths((dir / "model.dat").string(), "", "");
  EXPECT_EQ(p.config, (dir / "config.json").string());
  EXPECT_EQ(p.tokenizer, (dir / "tokenizer.json").string());
  const auto f = resolve_model_paths(dir.string(), "", "");  // folder with one .dat
  EXPECT_EQ(f.weights, (dir / "model.dat").string());
  try {
    resolve_model_paths((dir / "step_000010").string(), "", "");
    ADD_FAILURE() << "a checkpoint was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("export"), std::string::npos);
  }
  try {
    resolve_model_paths((dir / "model.dat").string(), (dir / "nope.json").string(), "");
    ADD_FAILURE() << "a missing config was accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("nope.json"), std::string::npos);
  }
  // A run directory: config.yaml names config and tokenizer; model.dat is the export.
  fs::create_directories(dir / "run");
  std::ofstream(dir / "run" / "model.dat") << "x";
  std::ofstream(dir / "run" / "config.yaml")
      << "model:\n  config: " << (dir / "config.json").string()
      << "\n  tokenizer: " << (dir / "tokenizer.json").string()
      << "\n  init: random\noutput:\n  dir: " << (dir / "run").string() << "\n";
  const auto r = resolve_model_paths((dir / "run").string(), "", "");
  EXPECT_EQ(r.weights, (dir / "run" / "model.dat").string());
  EXPECT_EQ(r.config, (dir / "config.json").string());
  q4::io::remove_tree(dir);
}

}  // namespace
}  // namespace q4::chat
