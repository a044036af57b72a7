// JSONL shapes detected per line (issue 14): TRL prompt/completion (strings and message lists,
// completion-only supervision), ShareGPT, alpaca and {"text"}, each compared with the example
// the equivalent messages/text input gives, their errors, and the detected format named in the
// load summary.
#include <gtest/gtest.h>

#include <functional>

#include "q4/data/dataset.h"
#include "test_util.h"

namespace q4::data {
namespace {

Dataset load(const std::string& content, const std::string& system = "") {
  DatasetOptions o;
  o.format = DataFormat::kJsonl;
  o.system_prompt = system;
  return load_dataset_from_string(content, "f.jsonl", test::qwen3_tokenizer(), o);
}

void expect_same(const Example& a, const Example& b) {
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.labels, b.labels);
}

TEST(DatasetFormats, TrlPromptCompletionStrings) {
  const Dataset ds = load(R"({"prompt": "Who are you?", "completion": "A model."})"
                          "\n");
  ASSERT_EQ(ds.examples.size(), 1u);
  expect_same(ds.examples[0],
              make_pair_example(test::qwen3_tokenizer(), "Who are you?", "A model."));
  EXPECT_EQ(ds.summary.format_name(), "jsonl (trl prompt/completion)");
  EXPECT_NE(ds.summary.to_string().find("format jsonl (trl prompt/completion)"), std::string::npos);
}

TEST(DatasetFormats, TrlConversationalSupervisesOnlyTheCompletion) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const Dataset ds = load(
      R"({"prompt": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},)"
      R"( {"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]})"
      "\n");
  ASSERT_EQ(ds.examples.size(), 1u);
  const std::vector<Message> all = {
      {"user", "hi"}, {"assistant", "hello"}, {"user", "2+2?"}, {"assistant", "4"}};
  const ChatTokens full = tokenize_chat(tok, all);
  EXPECT_EQ(ds.examples[0].input_ids, full.input_ids);
  // Supervised: "4" and its <|im_end|> only (the earlier "hello" turn is context).
  std::vector<TokenId> supervised;
  for (TokenId l : ds.examples[0].labels) {
    if (l != kIgnoreIndex) supervised.push_back(l);
  }
  std::vector<TokenId> expect = tok.encode("4");
  expect.push_back(tok.im_end_id());
  EXPECT_EQ(supervised, expect);
}

TEST(DatasetFormats, ShareGptAlpacaAndText) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const Dataset ds = load(
      R"({"conversations": [{"from": "system", "value": "S"}, {"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})"
      "\n"
      R"({"instruction": "Translate.", "input": "chat", "output": "cat"})"
      "\n"
      R"({"instruction": "Say hi.", "input": "", "output": "hi"})"
      "\n"
      R"({"text": "plain words"})"
      "\n");
  ASSERT_EQ(ds.examples.size(), 4u);
  expect_same(
      ds.examples[0],
      Example{tokenize_chat(tok, {{"system", "S"}, {"user", "Q"}, {"assistant", "A"}}).input_ids,
              tokenize_chat(tok, {{"system", "S"}, {"user", "Q"}, {"assistant", "A"}}).labels});
  expect_same(ds.examples[1], make_pair_example(tok, "Translate.\n\nchat", "cat"));
  expect_same(ds.examples[2], make_pair_example(tok, "Say hi.", "hi"));
  std::vector<TokenId> text = tok.encode("plain words");
  text.push_back(tok.endoftext_id());
  EXPECT_EQ(ds.examples[3].input_ids, text);
  EXPECT_EQ(ds.examples[3].labels, text);
  EXPECT_EQ(ds.summary.format_name(), "jsonl (mixed: alpaca 2, sharegpt 1, text 1)");
  EXPECT_EQ(ds.examples[1].source_line, 2);
}

TEST(DatasetFormats, SystemPromptAppliesToNewShapes) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const Dataset ds =
      load(R"({"conversations": [{"from": "human", "value": "Q"}, {"from": "gpt", "value": "A"}]})"
           "\n"
           R"({"instruction": "I", "output": "O"})"
           "\n",
           "SYS");
  ASSERT_EQ(ds.examples.size(), 2u);
  expect_same(ds.examples[0], make_pair_example(tok, "Q", "A", "SYS"));
  expect_same(ds.examples[1], make_pair_example(tok, "I", "O", "SYS"));
}

TEST(DatasetFormats, ErrorsNameLineAndField) {
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {R"({"conversations": [{"from": "alien", "value": "x"}]})", "unknown speaker \"alien\""},
      {R"({"conversations": [{"from": "human", "value": "x"}]})", "no gpt turn"},
      {R"({"conversations": [{"from": "human"}]})", "conversations[0]"},
      {R"({"conversations": 3})", "\"conversations\": expected an array"},
      {R"({"instruction": "x", "output": ""})", "empty \"output\""},
      {R"({"instruction": 1, "output": "y"})", "\"instruction\": expected a string"},
      {R"({"text": "  "})", "empty \"text\""},
      {R"({"prompt": "a", "completion": ""})", "empty \"completion\""},
      {R"({"prompt": [{"role": "user", "content": "a"}], "completion": [{"role": "user", "content": "b"}]})",
       "starting with an assistant message"},
      {R"({"prompt": 5, "completion": "x"})", "\"prompt\": expected a string or a list"},
  };
  for (const auto& c : cases) {
    std::string msg = "<no error>";
    try {
      load(R"({"text": "ok"})"
           "\n" +
           c.line + "\n");
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    EXPECT_NE(msg.find("f.jsonl:2: "), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.line << " -> " << msg;
  }
}

}  // namespace
}  // namespace q4::data
