// Dataset loader tests: every format (TSV with header/comments/CRLF, JSONL messages and
// prompt/answer variants, plain text), system prompts, each malformed-line error with file and
// line, skip mode with its summary, and format detection. Expected examples are built through
// the chat path independently checked against the golden in chat_test.cpp.
#include "q4/data/dataset.h"

#include <gtest/gtest.h>

#include <functional>

#include "q4/test/error_of.h"
#include "test_util.h"

namespace q4::data {
namespace {

using test::expect_same;

using q4::test::error_of;

DatasetOptions with(DataFormat f, OnError e = OnError::kFail, std::string system = "") {
  DatasetOptions o;
  o.format = f;
  o.on_error = e;
  o.system_prompt = std::move(system);
  return o;
}

TEST(Dataset, TsvPairsHeaderCommentsCrlf) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string content =
      "prompt\tanswer\r\n"
      "# a comment\n"
      "\n"
      "   \n"
      "你是誰\t我是 F# 之神。\r\n"
      "q2\ta\tb with tab\n";
  const auto ds = load_dataset_from_string(content, "d.tsv", tok, with(DataFormat::kAuto));
  ASSERT_EQ(ds.examples.size(), 2u);
  expect_same(ds.examples[0], make_pair_example(tok, "你是誰", "我是 F# 之神。"));
  expect_same(ds.examples[1], make_pair_example(tok, "q2", "a\tb with tab"));  // first tab splits
  EXPECT_EQ(ds.examples[0].source_line, 5);
  EXPECT_EQ(ds.examples[1].source_line, 6);
  EXPECT_EQ(ds.summary.lines, 6);
  EXPECT_EQ(ds.summary.ignored, 4);
  EXPECT_EQ(ds.summary.examples, 2);
  EXPECT_EQ(ds.summary.skipped, 0);
  // Golden ids for the first pair (chat_template_golden.json case 0).
  const std::vector<TokenId> golden = {151644, 872,   198,  105043, 108908, 151645, 198,
                                       151644, 77091, 198,  104198, 434,    2,      220,
                                       53930,  99315, 1773, 151645, 198};
  EXPECT_EQ(ds.examples[0].input_ids, golden);
  EXPECT_EQ(ds.summary.tokens, static_cast<int64_t>(ds.examples[0].input_ids.size() +
                                                    ds.examples[1].input_ids.size()));
}

TEST(Dataset, TsvTargetHeaderAndSystemPrompt) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const auto ds = load_dataset_from_string("prompt\ttarget\nhi\tthere\n", "x.tsv", tok,
                                           with(DataFormat::kTsv, OnError::kFail, "Be brief."));
  ASSERT_EQ(ds.examples.size(), 1u);
  expect_same(ds.examples[0], make_pair_example(tok, "hi", "there", "Be brief."));
  EXPECT_EQ(
      tok.decode(ds.examples[0].input_ids).rfind("<|im_start|>system\nBe brief.<|im_end|>", 0), 0u);
}

TEST(Dataset, TsvErrorsNameFileAndLine) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  struct Case {
    std::string content, expect;
  };
  const std::vector<Case> cases = {
      {"a\tb\nno tab here\n", "bad.tsv:2: expected prompt<TAB>answer, found no tab"},
      {"a\tb\n\nq\t  \n", "bad.tsv:3: empty answer"},
      {"a\tb\xFF\n", "bad.tsv:1: invalid UTF-8 at byte 3"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_of(
        [&] { load_dataset_from_string(c.content, "bad.tsv", tok, with(DataFormat::kTsv)); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
}

TEST(Dataset, SkipModeCountsMalformedLines) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string content = "a\tb\nnotab\nc\t\n\xC3(\tx\nd\te\n";
  const auto ds =
      load_dataset_from_string(content, "s.tsv", tok, with(DataFormat::kTsv, OnError::kSkip));
  EXPECT_EQ(ds.examples.size(), 2u);
  EXPECT_EQ(ds.summary.skipped, 3);
  ASSERT_EQ(ds.summary.first_skipped.size(), 3u);
  EXPECT_EQ(ds.summary.first_skipped[0].line, 2);
  EXPECT_EQ(ds.summary.first_skipped[1].line, 3);
  EXPECT_EQ(ds.summary.first_skipped[2].line, 4);
  EXPECT_NE(ds.summary.first_skipped[2].reason.find("invalid UTF-8"), std::string::npos);
  const std::string text = ds.summary.to_string();
  EXPECT_NE(text.find("3 skipped"), std::string::npos) << text;
  EXPECT_NE(text.find("skipped line 3: empty answer"), std::string::npos) << text;
}

TEST(Dataset, JsonlMessagesAndPairs) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string content =
      R"({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "continue."}, {"role": "assistant", "content": "Sure."}]})"
      "\n"
      R"({"prompt": "p1", "answer": "a1"})"
      "\n\n"
      R"({"prompt": "p2", "response": "a2"})"
      "\n"
      R"({"prompt": "p3", "target": "a3"})"
      "\n"
      R"({"messages": [{"role": "system", "content": "own"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": "v"}]})"
      "\n";
  const auto ds = load_dataset_from_string(content, "d.jsonl", tok,
                                           with(DataFormat::kAuto, OnError::kFail, "SYS"));
  ASSERT_EQ(ds.examples.size(), 5u);
  const auto multi = tokenize_chat(tok, {{"system", "SYS"},
                                         {"user", "hi"},
                                         {"assistant", "Hello!"},
                                         {"user", "continue."},
                                         {"assistant", "Sure."}});
  EXPECT_EQ(ds.examples[0].input_ids, multi.input_ids);
  EXPECT_EQ(ds.examples[0].labels, multi.labels);
  expect_same(ds.examples[1], make_pair_example(tok, "p1", "a1", "SYS"));
  expect_same(ds.examples[2], make_pair_example(tok, "p2", "a2", "SYS"));
  expect_same(ds.examples[3], make_pair_example(tok, "p3", "a3", "SYS"));
  // A conversation with its own system message keeps it and gets no second one.
  const auto own = tokenize_chat(tok, {{"system", "own"}, {"user", "u"}, {"assistant", "v"}});
  EXPECT_EQ(ds.examples[4].input_ids, own.input_ids);
  EXPECT_EQ(ds.examples[2].source_line, 4);
}

TEST(Dataset, JsonlErrors) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  struct Case {
    std::string line, expect;
  };
  const std::vector<Case> cases = {
      {R"({"prompt": "a", "answer": )", "bad JSON"},
      {R"([1, 2])", "expected a JSON object"},
      {R"({"messages": [{"role": "wizard", "content": "x"}]})", "unknown role \"wizard\""},
      {R"({"messages": [{"role": "user", "content": "x"}]})", "no assistant message"},
      {R"({"messages": [{"role": "user", "content": 5}]})", "messages[0]"},
      {R"({"prompt": "a"})", "without \"answer\""},
      {R"({"prompt": "a", "answer": ""})", "empty \"answer\""},
      {R"({"txt": "a"})", "expected {\"messages\""},  // {"text"} is a format now
      {"{\"prompt\": \"a\xFF\", \"answer\": \"b\"}", "invalid UTF-8 at byte 13"},
  };
  for (const auto& c : cases) {
    const std::string msg = error_of([&] {
      load_dataset_from_string("{\"prompt\": \"ok\", \"answer\": \"ok\"}\n" + c.line + "\n",
                               "e.jsonl", tok, with(DataFormat::kJsonl));
    });
    EXPECT_NE(msg.find("e.jsonl:2: "), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.expect), std::string::npos) << msg;
  }
}

TEST(Dataset, PlainTextSupervisesEverything) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  DatasetOptions lines = with(DataFormat::kAuto);
  lines.text_unit = TextUnit::kLine;
  const auto ds =
      load_dataset_from_string("Hello, world!\n\n# not a comment in text\n", "t.txt", tok, lines);
  ASSERT_EQ(ds.examples.size(), 2u);
  std::vector<TokenId> want = {9707, 11, 1879, 0, tok.endoftext_id()};
  EXPECT_EQ(ds.examples[0].input_ids, want);
  EXPECT_EQ(ds.examples[0].labels, want);
  EXPECT_TRUE(ds.examples[0].plain_text);
  EXPECT_EQ(ds.examples[1].source_line, 3);
  DatasetOptions o = with(DataFormat::kText);
  o.text_append_endoftext = false;
  const auto raw = load_dataset_from_string("Hello, world!\n", "t", tok, o);
  EXPECT_EQ(raw.examples[0].input_ids, (std::vector<TokenId>{9707, 11, 1879, 0}));
  // A {"text"} record is a plain-text document too; a conversation is not.
  const auto j = load_dataset_from_string(
      "{\"text\": \"Hello\"}\n{\"prompt\": \"q\", \"answer\": \"a\"}\n", "t.jsonl", tok);
  ASSERT_EQ(j.examples.size(), 2u);
  EXPECT_TRUE(j.examples[0].plain_text);
  EXPECT_FALSE(j.examples[1].plain_text);
}

// data.text_unit: a text file is one document (the default), its paragraphs (blank lines between
// them) or its lines. Line ends read as "\n"; blank lines at a document's ends go, those inside a
// file's document stay.
TEST(Dataset, TextUnitIsTheFileAParagraphOrALine) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string content = "\n\nOne.\r\nTwo.\n\n \nThree.\rFour.\n\n";
  auto text_of = [&](const Example& e) {
    return tok.decode({e.input_ids.begin(), e.input_ids.end() - 1});  // without <|endoftext|>
  };
  DatasetOptions o = with(DataFormat::kAuto);
  EXPECT_EQ(o.text_unit, TextUnit::kFile);
  const auto file = load_dataset_from_string(content, "t.txt", tok, o);
  ASSERT_EQ(file.examples.size(), 1u);
  EXPECT_EQ(text_of(file.examples[0]), "One.\nTwo.\n\n \nThree.\nFour.");
  EXPECT_EQ(file.examples[0].source_line, 3);
  EXPECT_TRUE(file.examples[0].plain_text);
  EXPECT_EQ(file.examples[0].input_ids.back(), tok.endoftext_id());
  EXPECT_EQ(file.summary.lines, 9);
  EXPECT_EQ(file.summary.ignored, 5);
  EXPECT_EQ(file.summary.tokens, static_cast<int64_t>(file.examples[0].input_ids.size()));
  EXPECT_EQ(file.summary.supervised_tokens, file.summary.tokens);
  o.text_unit = TextUnit::kParagraph;
  const auto para = load_dataset_from_string(content, "t.txt", tok, o);
  ASSERT_EQ(para.examples.size(), 2u);
  EXPECT_EQ(text_of(para.examples[0]), "One.\nTwo.");
  EXPECT_EQ(text_of(para.examples[1]), "Three.\nFour.");
  EXPECT_EQ(para.examples[1].source_line, 7);
  o.text_unit = TextUnit::kLine;
  const auto line = load_dataset_from_string(content, "t.txt", tok, o);
  ASSERT_EQ(line.examples.size(), 4u);
  EXPECT_EQ(text_of(line.examples[3]), "Four.");
  EXPECT_EQ(line.examples[3].source_line, 8);
  // Blank only: no document. Invalid UTF-8: the document's error names its line.
  o.text_unit = TextUnit::kFile;
  EXPECT_TRUE(load_dataset_from_string("\n \n", "t.txt", tok, o).examples.empty());
  const std::string msg =
      error_of([&] { load_dataset_from_string("ok\nbad \xFF\n", "t.txt", tok, o); });
  EXPECT_NE(msg.find("t.txt:2: invalid UTF-8"), std::string::npos) << msg;
  o.text_unit = TextUnit::kParagraph;
  o.on_error = OnError::kSkip;
  const auto skipped = load_dataset_from_string("bad \xFF\n\nok\n", "t.txt", tok, o);
  ASSERT_EQ(skipped.examples.size(), 1u);
  EXPECT_EQ(skipped.summary.skipped, 1);
  EXPECT_EQ(skipped.examples[0].source_line, 3);
  EXPECT_EQ(parse_text_unit("Paragraph"), TextUnit::kParagraph);
  EXPECT_THROW(parse_text_unit("page"), c10::Error);
}

TEST(Dataset, FilesAndFormatDetection) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const test::TempFile tsv(".tsv", "q\ta\n");
  const auto ds = load_dataset(tsv.path(), tok);
  ASSERT_EQ(ds.examples.size(), 1u);
  EXPECT_EQ(ds.summary.path, tsv.path());
  const test::TempFile odd(".csv", "q,a\n");
  EXPECT_NE(error_of([&] { load_dataset(odd.path(), tok); }).find("cannot infer the data format"),
            std::string::npos);
  EXPECT_NE(error_of([&] { load_dataset("/nonexistent/d.tsv", tok); }).find("/nonexistent/d.tsv"),
            std::string::npos);
  EXPECT_EQ(parse_data_format("JSONL"), DataFormat::kJsonl);
  EXPECT_EQ(parse_on_error("skip"), OnError::kSkip);
  EXPECT_THROW(parse_on_error("ignore"), c10::Error);
  EXPECT_THROW(parse_data_format("csv"), c10::Error);
}

// A UTF-8 BOM was tokenized into the first prompt and hid the header row.
TEST(Dataset, Utf8BomIsIgnoredInEveryFormat) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string bom = "\xEF\xBB\xBF";
  const auto tsv = load_dataset_from_string(bom + "prompt\tanswer\nq\ta\n", "d.tsv", tok,
                                            with(DataFormat::kAuto));
  ASSERT_EQ(tsv.examples.size(), 1u);
  EXPECT_EQ(tsv.summary.ignored, 1);  // the header row is recognized
  expect_same(tsv.examples[0], make_pair_example(tok, "q", "a"));
  const auto jsonl = load_dataset_from_string(bom + "{\"prompt\": \"q\", \"answer\": \"a\"}\n",
                                              "d.jsonl", tok, with(DataFormat::kAuto));
  ASSERT_EQ(jsonl.examples.size(), 1u);
  expect_same(jsonl.examples[0], make_pair_example(tok, "q", "a"));
  const auto text =
      load_dataset_from_string(bom + "hello\n", "d.txt", tok, with(DataFormat::kAuto));
  ASSERT_EQ(text.examples.size(), 1u);
  auto ids = tok.encode("hello");
  ids.push_back(tok.endoftext_id());
  EXPECT_EQ(text.examples[0].input_ids, ids);
}

// Found by fuzz_dataset: a JSON number out of double range made nlohmann throw out_of_range,
// which escaped the loader (an uncaught exception instead of "file:line: bad JSON").
TEST(Dataset, JsonlNumberOverflowIsABadLine) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string content = "{\"prompt\": \"p\", \"answer\": \"a\"}\n{\"prompt\": 1e400}\n";
  const std::string err =
      error_of([&] { load_dataset_from_string(content, "d.jsonl", tok, with(DataFormat::kAuto)); });
  EXPECT_NE(err.find("d.jsonl:2: bad JSON"), std::string::npos) << err;
  const auto ds =
      load_dataset_from_string(content, "d.jsonl", tok, with(DataFormat::kAuto, OnError::kSkip));
  EXPECT_EQ(ds.examples.size(), 1u);
  EXPECT_EQ(ds.summary.skipped, 1);
}

}  // namespace
}  // namespace q4::data
