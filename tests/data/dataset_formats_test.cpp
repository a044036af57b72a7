// JSONL shapes detected per line: TRL prompt/completion (strings and message lists,
// completion-only supervision), ShareGPT, alpaca and {"text"}, each compared with the example
// the equivalent messages/text input gives, their errors, and the detected format named in the
// load summary.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <utility>

#include "q4/data/dataset.h"
#include "test_util.h"

namespace q4::data {
namespace {

using test::expect_same;

Dataset load(const std::string& content, const std::string& system = "") {
  DatasetOptions o;
  o.format = DataFormat::kJsonl;
  o.system_prompt = system;
  return load_dataset_from_string(content, "f.jsonl", test::qwen3_tokenizer(), o);
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


std::string load_error(const std::string& content, const std::string& name) {
  try {
    load_dataset_from_string(content, name, test::qwen3_tokenizer(), {});
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

// An empty assistant turn is an error naming file and line in every format, as an empty answer
// is in TSV and alpaca.
TEST(DatasetFormats, EmptyAssistantTurnIsAnErrorInEveryFormat) {
  const std::string ok = R"({"prompt": "a", "answer": "b"})" "\n";
  const std::pair<std::string, std::string> cases[] = {
      {ok + R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]})",
       "f.jsonl:2: messages[1]: empty \"content\" of an assistant turn"},
      {ok + R"({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": ""}]})",
       "f.jsonl:2: conversations[1]: empty \"value\" of an assistant turn"},
      {R"({"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": ""}]})",
       "f.jsonl:1: completion[0]: empty \"content\""}};
  for (const auto& [text, want] : cases) {
    const std::string msg = load_error(text + "\n", "f.jsonl");
    EXPECT_NE(msg.find(want), std::string::npos) << msg;
  }
}

// "\r", "\n" and "\r\n" all end a line: a CR-only TSV (old Mac tools) gives one example per line.
TEST(DatasetFormats, CrOnlyLineEndsSplitRecords) {
  const Dataset cr = load_dataset_from_string("a\tb\rc\td\r\re\tf\r", "f.tsv",
                                              test::qwen3_tokenizer(), {});
  const Dataset lf = load_dataset_from_string("a\tb\nc\td\n\ne\tf\n", "f.tsv",
                                              test::qwen3_tokenizer(), {});
  ASSERT_EQ(cr.examples.size(), 3u);
  ASSERT_EQ(lf.examples.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    expect_same(cr.examples[i], lf.examples[i]);
    EXPECT_EQ(cr.examples[i].source_line, lf.examples[i].source_line);
  }
  EXPECT_EQ(cr.summary.lines, 4);
  const Dataset mixed = load_dataset_from_string("a\tb\r\nc\td\re\tf\n", "f.tsv",
                                                 test::qwen3_tokenizer(), {});
  ASSERT_EQ(mixed.examples.size(), 3u);
  EXPECT_EQ(mixed.examples[2].source_line, 3);
}

// A .json file holding one JSON array of records (alpaca_data.json) loads like the same records
// as JSONL; errors name the line where the bad record starts. A .jsonl file that is one array is
// read the same way.
TEST(DatasetFormats, JsonArrayFilesLoadLikeJsonl) {
  const std::string array =
      "[\n  {\"instruction\": \"Say hi\", \"input\": \"\", \"output\": \"Hi!\"},\n"
      "  {\"instruction\": \"Add\", \"input\": \"2 and [2]\", \"output\": \"4, \\\"four\\\"\"},\n"
      "  {\"text\": \"plain {text}\"}\n]\n";
  const std::string lines =
      "{\"instruction\": \"Say hi\", \"input\": \"\", \"output\": \"Hi!\"}\n"
      "{\"instruction\": \"Add\", \"input\": \"2 and [2]\", \"output\": \"4, \\\"four\\\"\"}\n"
      "{\"text\": \"plain {text}\"}\n";
  for (const char* name : {"alpaca_data.json", "alpaca_data.jsonl"}) {
    const Dataset a = load_dataset_from_string(array, name, test::qwen3_tokenizer(), {});
    const Dataset l = load_dataset_from_string(lines, "x.jsonl", test::qwen3_tokenizer(), {});
    ASSERT_EQ(a.examples.size(), 3u) << name;
    for (size_t i = 0; i < 3; ++i) expect_same(a.examples[i], l.examples[i]);
    EXPECT_EQ(a.examples[1].source_line, 3);
    EXPECT_EQ(a.summary.format_name(), "json array (mixed: alpaca 2, text 1)");
  }
  const std::string bad_record = load_error(
      "[\n {\"instruction\": \"x\", \"output\": \"y\"},\n {\"output\": 3}\n]", "d.json");
  EXPECT_NE(bad_record.find("d.json:3: expected"), std::string::npos) << bad_record;
  const std::string bad_json = load_error("[\n {\"a\": 1},\n {\"a\": }\n]", "d.json");
  EXPECT_NE(bad_json.find("d.json:3: bad JSON array"), std::string::npos) << bad_json;
  EXPECT_EQ(load_dataset_from_string("[]", "e.json", test::qwen3_tokenizer(), {}).examples.size(),
            0u);
  // Lines are counted as the line reader counts them (a lone CR ends one).
  const Dataset cr = load_dataset_from_string(
      "[\r{\"text\": \"a\"},\r{\"text\": \"b\"}\r]\r", "cr.json", test::qwen3_tokenizer(), {});
  ASSERT_EQ(cr.examples.size(), 2u);
  EXPECT_EQ(cr.examples[1].source_line, 3);
  EXPECT_EQ(cr.summary.lines, 4);
}

}  // namespace
}  // namespace q4::data
