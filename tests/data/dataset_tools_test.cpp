// Conversations with reasoning, tool calls and tool definitions in the data files: OpenAI's
// {"messages", "tools"} and TRL's conversational {"prompt", "completion", "tools"}, read with the
// chat template of DatasetOptions::chat; what is supervised (docs/data.md "What is trained");
// malformed tool data as one-line errors naming file, line and key.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include "q4/data/chat_json.h"
#include "q4/data/dataset.h"
#include "test_util.h"

namespace q4::data {
namespace {

DatasetOptions hybrid() {
  DatasetOptions o;
  o.format = DataFormat::kJsonl;
  o.chat.chat_template = ChatTemplate::kQwen3;
  return o;
}

// Decoded runs of supervised tokens.
std::vector<std::string> trained(const Example& e) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  std::vector<std::string> runs;
  std::vector<TokenId> cur;
  for (size_t k = 0; k <= e.labels.size(); ++k) {
    if (k < e.labels.size() && e.labels[k] != kIgnoreIndex) {
      cur.push_back(e.labels[k]);
    } else if (!cur.empty()) {
      runs.push_back(tok.decode(cur));
      cur.clear();
    }
  }
  return runs;
}

constexpr const char* kTools =
    R"("tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])";
constexpr const char* kCall =
    R"({"role": "assistant", "content": null, "reasoning_content": "Look it up.", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]})";

TEST(DatasetTools, OpenAiMessagesWithToolsTrainCallsNotDefinitionsOrResponses) {
  const std::string line =
      std::string("{") + kTools +
      R"(, "messages": [{"role": "user", "content": "Weather in Oslo?"}, )" + kCall +
      R"(, {"role": "tool", "content": "-2 C"}, {"role": "assistant", "reasoning_content": "Cold.", "content": "It is -2 C."}]})";
  const Dataset ds =
      load_dataset_from_string(line + "\n", "f.jsonl", test::qwen3_tokenizer(), hybrid());
  ASSERT_EQ(ds.examples.size(), 1u);
  const ordered_json j = ordered_json::parse(line);
  const ChatTokens want =
      tokenize_chat(test::qwen3_tokenizer(), messages_from_json(j["messages"], "messages"), false,
                    hybrid().chat, tools_from_json(j));
  EXPECT_EQ(ds.examples[0].input_ids, want.input_ids);
  EXPECT_EQ(ds.examples[0].labels, want.labels);
  EXPECT_EQ(trained(ds.examples[0]),
            (std::vector<std::string>{
                "<think>\nLook it up.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>",
                "<think>\nCold.\n</think>\n\nIt is -2 C.<|im_end|>"}));
  EXPECT_EQ(ds.summary.reasoning_dropped, 0);
}

TEST(DatasetTools, TrlConversationalWithToolsSupervisesOnlyTheCompletion) {
  const std::string line =
      std::string("{") + kTools +
      R"(, "prompt": [{"role": "user", "content": "Weather in Oslo?"}], "completion": [)" + kCall +
      R"(]})";
  const Dataset ds =
      load_dataset_from_string(line + "\n", "f.jsonl", test::qwen3_tokenizer(), hybrid());
  ASSERT_EQ(ds.examples.size(), 1u);
  EXPECT_EQ(ds.summary.format_name(), "jsonl (trl prompt/completion)");
  const std::string text = test::qwen3_tokenizer().decode(ds.examples[0].input_ids);
  EXPECT_NE(text.find("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""),
            std::string::npos)
      << text;
  EXPECT_EQ(trained(ds.examples[0]),
            std::vector<std::string>{
                "<think>\nLook it up.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call><|im_end|>"});
  // An earlier assistant turn inside the prompt is context, not trained.
  const std::string two =
      std::string("{") + kTools + R"(, "prompt": [{"role": "user", "content": "Q"}, )" + kCall +
      R"(, {"role": "tool", "content": "-2"}], "completion": [{"role": "assistant", "content": "Cold."}]})";
  const Dataset d2 =
      load_dataset_from_string(two + "\n", "f.jsonl", test::qwen3_tokenizer(), hybrid());
  ASSERT_EQ(d2.examples.size(), 1u);
  EXPECT_EQ(trained(d2.examples[0]),
            std::vector<std::string>{"<think>\n\n</think>\n\nCold.<|im_end|>"});
}

TEST(DatasetTools, PreferenceImplicitPromptComparesWholeMessages) {
  // Same role and content, different tool calls: not shared, so the implicit prompt is the user
  // turn only and each answer keeps its own call.
  const std::string c =
      R"({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 1}}]})";
  const std::string r =
      R"({"role": "assistant", "content": "", "tool_calls": [{"name": "f", "arguments": {"x": 2}}]})";
  const std::string line = R"({"chosen": [{"role": "user", "content": "Q"}, )" + c +
                           R"(], "rejected": [{"role": "user", "content": "Q"}, )" + r + "]}";
  const PreferenceDataset ds = load_preference_dataset_from_string(
      line + "\n", "p.jsonl", test::qwen3_tokenizer(), hybrid());
  ASSERT_EQ(ds.pairs.size(), 1u);
  EXPECT_NE(trained(ds.pairs[0].chosen)[0].find("{\"x\": 1}"), std::string::npos);
  EXPECT_NE(trained(ds.pairs[0].rejected)[0].find("{\"x\": 2}"), std::string::npos);
}

std::string load_error(const std::string& line) {
  try {
    load_dataset_from_string("\n" + line + "\n", "f.jsonl", test::qwen3_tokenizer(), hybrid());
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "no error";
}

TEST(DatasetTools, MalformedToolDataNamesFileLineAndKey) {
  const std::string user = R"({"role": "user", "content": "Q"})";
  EXPECT_EQ(
      load_error(R"({"tools": "get_weather", "messages": [)" + user +
                 R"(, {"role": "assistant", "content": "A"}]})")
          .rfind("f.jsonl:2: \"tools\": expected a list of tool definitions, found string", 0),
      0u);
  EXPECT_EQ(load_error(R"({"messages": [)" + user +
                       R"(, {"role": "assistant", "tool_calls": [{"arguments": {}}]}]})")
                .rfind("f.jsonl:2: messages[1].tool_calls[0]: a tool call without a \"name\"", 0),
            0u);
  EXPECT_EQ(
      load_error(R"({"prompt": [)" + user +
                 R"(], "completion": [{"role": "assistant", "content": [{"type": "text"}]}]})")
          .rfind("f.jsonl:2: completion[0].content: expected a string or null, found array", 0),
      0u);
  // Nothing at all in an assistant turn is still an error; a tool call alone is not.
  EXPECT_EQ(load_error(R"({"messages": [)" + user + R"(, {"role": "assistant", "content": null}]})")
                .rfind("f.jsonl:2: messages[1]: empty \"content\" of an assistant turn", 0),
            0u);
  EXPECT_EQ(load_error(R"({"messages": [)" + user + ", " + kCall + "]}"), "no error");
}

}  // namespace
}  // namespace q4::data
