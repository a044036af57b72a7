// TRL prompt-only records for GRPO: a string prompt is one user turn and a message list a
// conversation, both rendered with the generation prompt exactly as render_chat renders them;
// the other fields are kept in their order for the rewards; JSON arrays; one-line errors naming
// the file and line, and skips with on_error: skip.
#include "q4/data/prompt_dataset.h"

#include <gtest/gtest.h>

#include <string>

#include "test_util.h"

namespace q4::data {
namespace prompt_dataset_test {

const Tokenizer& prompt_tok() { return test::qwen3_tokenizer(); }

std::string prompt_error_of(const std::string& content, const DatasetOptions& o = {}) {
  try {
    load_prompt_dataset_from_string(content, "prompts.jsonl", prompt_tok(), o);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(PromptData, StringAndConversationalPromptsWithTheirFields) {
  const std::string content =
      R"({"prompt": "What is 2+3?", "answer": "5", "level": 1})"
      "\n\n"
      R"({"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}], "solution": ["2", "3"]})"
      "\n";
  const PromptDataset d = load_prompt_dataset_from_string(content, "p.jsonl", prompt_tok());
  ASSERT_EQ(d.prompts.size(), 2u);
  EXPECT_EQ(d.summary.examples, 2);
  EXPECT_EQ(d.summary.ignored, 1);
  const PromptRecord& a = d.prompts[0];
  EXPECT_FALSE(a.conversational);
  EXPECT_EQ(a.source_line, 1);
  const std::string want_a = render_chat({Message{"user", "What is 2+3?"}}, true);
  EXPECT_EQ(a.prompt_text, want_a);
  EXPECT_EQ(a.prompt_text.substr(a.prompt_text.size() - 22), "<|im_start|>assistant\n");
  EXPECT_EQ(a.prompt_ids, prompt_tok().encode(want_a));
  EXPECT_EQ(a.prompt, "What is 2+3?");
  EXPECT_EQ(a.fields.dump(), R"({"answer":"5","level":1})");  // order kept, prompt left out
  const PromptRecord& b = d.prompts[1];
  EXPECT_TRUE(b.conversational);
  EXPECT_EQ(b.source_line, 3);
  EXPECT_EQ(b.prompt_text,
            render_chat({Message{"system", "Be brief."}, Message{"user", "Name a prime."}}, true));
  EXPECT_EQ(b.fields["solution"][1], "3");
  EXPECT_EQ(d.summary.tokens, static_cast<int64_t>(a.prompt_ids.size() + b.prompt_ids.size()));
}

TEST(PromptData, SystemPromptTemplateAndJsonArray) {
  DatasetOptions o;
  o.system_prompt = "You are terse.";
  o.chat.chat_template = ChatTemplate::kQwen3;
  o.chat.enable_thinking = false;
  const std::string content =
      "[\n  {\"prompt\": \"Hi\"},\n  {\"prompt\": \"Bye\", \"x\": null}\n]\n";
  const PromptDataset d = load_prompt_dataset_from_string(content, "p.json", prompt_tok(), o);
  ASSERT_EQ(d.prompts.size(), 2u);
  EXPECT_TRUE(d.summary.json_array);
  EXPECT_EQ(d.prompts[1].source_line, 3);
  EXPECT_EQ(
      d.prompts[0].prompt_text,
      render_chat({Message{"system", "You are terse."}, Message{"user", "Hi"}}, true, o.chat));
  // The hybrid template's generation prompt with thinking off: an empty think block.
  EXPECT_NE(d.prompts[0].prompt_text.find("<think>\n\n</think>"), std::string::npos);
  EXPECT_TRUE(d.prompts[1].fields.contains("x"));
}

TEST(PromptData, BadRecordsAreOneLineErrorsNamingFileAndLine) {
  for (const auto& [content, what] : std::vector<std::pair<std::string, std::string>>{
           {"{\"prompt\": \"ok\"}\n{\"question\": \"no prompt\"}\n", "prompts.jsonl:2: "},
           {"{\"prompt\": \"\"}\n", "empty \"prompt\""},
           {"{\"prompt\": 3}\n", "expected a string or a list of messages"},
           {"{\"prompt\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": \"assistant\", "
            "\"content\": \"a\"}]}\n",
            "ends with an assistant message"},
           {"{\"prompt\": [{\"role\": \"wizard\", \"content\": \"q\"}]}\n", "prompts.jsonl:1: "},
           {"{\"prompt\": \"a\"\n", "bad JSON"},
       }) {
    const std::string m = prompt_error_of(content);
    EXPECT_NE(m.find(what), std::string::npos) << m;
    EXPECT_NE(m.find("prompts.jsonl:"), std::string::npos) << m;
    EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  }
  DatasetOptions skip;
  skip.on_error = OnError::kSkip;
  const PromptDataset d = load_prompt_dataset_from_string(
      "{\"prompt\": \"ok\"}\n{\"q\": 1}\n{\"prompt\": \"fine\"}\n", "p.jsonl", prompt_tok(), skip);
  EXPECT_EQ(d.prompts.size(), 2u);
  EXPECT_EQ(d.summary.skipped, 1);
  ASSERT_EQ(d.summary.first_skipped.size(), 1u);
  EXPECT_EQ(d.summary.first_skipped[0].line, 2);
}

}  // namespace prompt_dataset_test
}  // namespace q4::data
