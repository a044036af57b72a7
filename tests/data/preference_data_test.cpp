// TRL preference records: strings, message lists, the implicit prompt (shared leading messages),
// JSON arrays, and one-line errors naming the file and line (or skips with on_error: skip). Each
// answer is an Example equal to the prompt/completion example the SFT loader makes of it.
#include <gtest/gtest.h>

#include <string>

#include "q4/data/dataset.h"
#include "test_util.h"

namespace q4::data {
namespace {

const Tokenizer& tok() { return test::qwen3_tokenizer(); }

int64_t supervised(const Example& e) {
  int64_t n = 0;
  for (TokenId l : e.labels) n += l != kIgnoreIndex;
  return n;
}

// The SFT loader's example of {"prompt": p, "completion": c}.
Example sft(const std::string& record) {
  const Dataset d = load_dataset_from_string(record + "\n", "x.jsonl", tok());
  EXPECT_EQ(d.examples.size(), 1u);
  return d.examples.at(0);
}

TEST(PreferenceData, StringsMessagesAndTheImplicitPrompt) {
  const std::string content =
      R"({"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."})"
      "\n\n"
      R"({"prompt": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello!"}], "rejected": [{"role": "assistant", "content": "Go away."}]})"
      "\n"
      R"({"chosen": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}], "rejected": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "5"}]})"
      "\n";
  const PreferenceDataset d = load_preference_dataset_from_string(content, "p.jsonl", tok());
  ASSERT_EQ(d.pairs.size(), 3u);
  EXPECT_EQ(d.summary.examples, 3);
  EXPECT_EQ(d.summary.ignored, 1);
  EXPECT_EQ(d.pairs[0].source_line, 1);
  EXPECT_EQ(d.pairs[2].source_line, 4);
  const Example c0 = sft(R"({"prompt": "Capital of France?", "completion": "Paris."})");
  EXPECT_EQ(d.pairs[0].chosen.input_ids, c0.input_ids);
  EXPECT_EQ(d.pairs[0].chosen.labels, c0.labels);
  const Example r1 = sft(
      R"({"prompt": [{"role": "user", "content": "Hi"}], "completion": [{"role": "assistant", "content": "Go away."}]})");
  EXPECT_EQ(d.pairs[1].rejected.input_ids, r1.input_ids);
  EXPECT_EQ(d.pairs[1].rejected.labels, r1.labels);
  // Implicit prompt: the user turn is context, only the answers are supervised.
  const Example c2 = sft(
      R"({"prompt": [{"role": "user", "content": "2+2?"}], "completion": [{"role": "assistant", "content": "4"}]})");
  EXPECT_EQ(d.pairs[2].chosen.input_ids, c2.input_ids);
  EXPECT_EQ(d.pairs[2].chosen.labels, c2.labels);
  for (const auto& p : d.pairs) {
    EXPECT_GT(supervised(p.chosen), 0);
    EXPECT_GT(supervised(p.rejected), 0);
    EXPECT_NE(p.chosen.input_ids, p.rejected.input_ids);
  }
  // The same records as one JSON array.
  const std::string array =
      "[\n" +
      std::string(R"({"prompt": "Capital of France?", "chosen": "Paris.", "rejected": "Lyon."})") +
      ",\n" + R"({"prompt": "x", "chosen": "y", "rejected": "z"})" + "\n]\n";
  const PreferenceDataset a = load_preference_dataset_from_string(array, "p.json", tok());
  ASSERT_EQ(a.pairs.size(), 2u);
  EXPECT_TRUE(a.summary.json_array);
  EXPECT_EQ(a.pairs[0].chosen.input_ids, c0.input_ids);
  EXPECT_EQ(a.pairs[1].source_line, 3);
}

TEST(PreferenceData, MistakesNameTheFileAndLine) {
  auto error = [](const std::string& record) {
    try {
      load_preference_dataset_from_string("\n" + record + "\n", "p.jsonl", tok());
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  EXPECT_NE(error(R"({"prompt": "a", "chosen": "b"})")
                .find("p.jsonl:2: a preference record needs \"rejected\""),
            std::string::npos);
  EXPECT_NE(error(R"({"prompt": "a", "chosen": "b", "rejected": "b"})").find("are the same answer"),
            std::string::npos);
  EXPECT_NE(error(R"({"prompt": "a", "chosen": "", "rejected": "b"})").find("empty \"chosen\""),
            std::string::npos);
  EXPECT_NE(
      error(
          R"({"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"})")
          .find("expected both strings or both lists of messages"),
      std::string::npos);
  EXPECT_NE(
      error(
          R"({"chosen": [{"role": "assistant", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]})")
          .find("share no leading message"),
      std::string::npos);
  EXPECT_NE(
      error(
          R"({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], "rejected": [{"role": "assistant", "content": "c"}]})")
          .find("\"chosen\": expected a list starting with an assistant message"),
      std::string::npos);
  // Each key is blamed for its own value: a number as "chosen" is not the prompt's fault, and
  // string answers without a prompt miss "prompt" (not a message list in "chosen").
  EXPECT_NE(
      error(R"({"prompt": "a", "chosen": 5, "rejected": "c"})")
          .find("p.jsonl:2: \"chosen\": expected a string or a list of messages, found number"),
      std::string::npos)
      << error(R"({"prompt": "a", "chosen": 5, "rejected": "c"})");
  EXPECT_NE(error(R"({"prompt": 7, "chosen": "b", "rejected": "c"})")
                .find("\"prompt\": expected a string or a list of messages, found number"),
            std::string::npos);
  EXPECT_NE(error(R"({"chosen": "b", "rejected": "c"})").find("p.jsonl:2: \"prompt\": missing"),
            std::string::npos)
      << error(R"({"chosen": "b", "rejected": "c"})");
  EXPECT_NE(error("[1, 2").find("p.jsonl"), std::string::npos);
  EXPECT_NE(error("not json").find("p.jsonl:2: bad JSON"), std::string::npos);
  // on_error: skip counts and reports instead.
  DatasetOptions skip;
  skip.on_error = OnError::kSkip;
  const PreferenceDataset d = load_preference_dataset_from_string(
      "{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\nnot json\n", "p.jsonl", tok(),
      skip);
  EXPECT_EQ(d.pairs.size(), 1u);
  EXPECT_EQ(d.summary.skipped, 1);
  ASSERT_EQ(d.summary.first_skipped.size(), 1u);
  EXPECT_EQ(d.summary.first_skipped[0].line, 2);
}

// A preference file read as training examples says what it is, with the caller's hint; the
// skip hint is the caller's too (none when it has no such setting).
TEST(PreferenceData, APreferenceFileReadAsExamplesIsNamed) {
  const std::string record = R"({"prompt": "a", "chosen": "b", "rejected": "c"})";
  auto error = [&](const DatasetOptions& o) {
    try {
      load_dataset_from_string(record + "\n", "p.jsonl", tok(), o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  DatasetOptions o;
  o.preference_hint = "pass --preference";
  o.skip_hint = "";
  const std::string m = error(o);
  EXPECT_NE(m.find("p.jsonl:1: a preference record"), std::string::npos) << m;
  EXPECT_NE(m.find("; pass --preference"), std::string::npos) << m;
  EXPECT_EQ(m.find("on_error"), std::string::npos) << m;
  o.skip_hint = "pass --on-error skip";
  EXPECT_NE(error(o).find("(pass --on-error skip to skip malformed lines)"), std::string::npos)
      << error(o);
}

}  // namespace
}  // namespace q4::data
