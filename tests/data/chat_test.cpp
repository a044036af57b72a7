// Chat template tests: byte-identical rendering and ids against chat_template_golden.json (made
// with transformers' apply_chat_template on the Qwen3-4B-Instruct-2507 template) and
// chat_templates_golden.json (the three Qwen3 templates, with thinking and tools; made by
// make_chat_template_fixture.py), and the supervision mask: only what an assistant turn says
// (its think block, content and tool calls) and its closing <|im_end|> are labelled.
#include "q4/data/chat.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "q4/data/chat_json.h"
#include "test_util.h"

namespace q4::data {
namespace {

using json = nlohmann::json;

std::vector<Message> messages_of(const json& j) {
  std::vector<Message> out;
  for (const auto& m : j) out.push_back({m["role"], m["content"]});
  return out;
}

// Decoded text of each maximal run of supervised tokens.
std::vector<std::string> supervised_runs(const Tokenizer& tok, const ChatTokens& t) {
  std::vector<std::string> runs;
  std::vector<TokenId> cur;
  for (size_t k = 0; k <= t.labels.size(); ++k) {
    if (k < t.labels.size() && t.labels[k] != kIgnoreIndex) {
      EXPECT_EQ(t.labels[k], t.input_ids[k]);
      cur.push_back(t.labels[k]);
    } else if (!cur.empty()) {
      runs.push_back(tok.decode(cur));
      cur.clear();
    }
  }
  return runs;
}

TEST(Chat, MatchesGoldenRenderingAndIds) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json gold = test::read_json(Q4_FIXTURES_DIR "/chat_template_golden.json");
  ASSERT_EQ(gold.size(), 4u);
  for (const auto& c : gold) {
    const auto msgs = messages_of(c["messages"]);
    EXPECT_EQ(render_chat(msgs, false), c["rendered"].get<std::string>());
    const auto t = tokenize_chat(tok, msgs, false);
    EXPECT_EQ(t.input_ids, c["ids"].get<std::vector<TokenId>>());
    // The golden generation prompt is the conversation without its final assistant turn.
    ASSERT_EQ(msgs.back().role, "assistant");
    const std::vector<Message> prompt(msgs.begin(), msgs.end() - 1);
    EXPECT_EQ(render_chat(prompt, true), c["prompt_with_generation_prompt"].get<std::string>());
    const auto p = tokenize_chat(tok, prompt, true);
    EXPECT_EQ(p.input_ids, c["prompt_ids"].get<std::vector<TokenId>>());
  }
}

TEST(Chat, SupervisesOnlyAssistantContentAndImEnd) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json gold = test::read_json(Q4_FIXTURES_DIR "/chat_template_golden.json");
  for (const auto& c : gold) {
    const auto msgs = messages_of(c["messages"]);
    const auto t = tokenize_chat(tok, msgs, false);
    ASSERT_EQ(t.labels.size(), t.input_ids.size());
    std::vector<std::string> want;
    for (const auto& m : msgs) {
      if (m.role == "assistant") want.push_back(m.content + "<|im_end|>");
    }
    EXPECT_EQ(supervised_runs(tok, t), want);
    // The "\n" after the final <|im_end|> is not supervised; the <|im_end|> before it is.
    ASSERT_GE(t.labels.size(), 2u);
    EXPECT_EQ(t.input_ids.back(), 198);
    EXPECT_EQ(t.labels.back(), kIgnoreIndex);
    EXPECT_EQ(t.labels[t.labels.size() - 2], tok.im_end_id());
    // The prompt part (identical to prompt_ids for single-turn) is fully masked.
    const auto prompt_ids = c["prompt_ids"].get<std::vector<TokenId>>();
    if (msgs.size() == 2) {
      for (size_t k = 0; k < prompt_ids.size(); ++k) EXPECT_EQ(t.labels[k], kIgnoreIndex) << k;
    }
  }
  // Golden case 0: exactly the 8 tokens from the answer start through <|im_end|>.
  const auto t0 = tokenize_chat(tok, messages_of(gold[0]["messages"]), false);
  EXPECT_EQ(t0.num_supervised(), 8);
  for (size_t k = 0; k < t0.labels.size(); ++k) {
    EXPECT_EQ(t0.labels[k] != kIgnoreIndex, k >= 10 && k <= 17) << k;
  }
}

TEST(Chat, TokenStraddlingHeaderAndAnswerIsSupervised) {
  // Content starting with "\n" merges with the header's "\n" into one "\n\n" token (271).
  const Tokenizer& tok = test::qwen3_tokenizer();
  const auto t = tokenize_chat(tok, {{"user", "q"}, {"assistant", "\nanswer"}});
  const auto header_end = std::find(t.input_ids.begin(), t.input_ids.end(), 271);
  ASSERT_NE(header_end, t.input_ids.end());
  const size_t k = header_end - t.input_ids.begin();
  EXPECT_EQ(t.labels[k], 271);
  EXPECT_EQ(t.labels[k - 1], kIgnoreIndex);  // "assistant"
  EXPECT_EQ(tok.decode(t.input_ids), render_chat({{"user", "q"}, {"assistant", "\nanswer"}}));
}

TEST(Chat, EmptyAssistantSupervisesOnlyImEnd) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const auto t = tokenize_chat(tok, {{"user", "hi"}, {"assistant", ""}});
  EXPECT_EQ(t.num_supervised(), 1);
  EXPECT_EQ(supervised_runs(tok, t), std::vector<std::string>{"<|im_end|>"});
}

TEST(Chat, GenerationPromptIsNotSupervised) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const auto t = tokenize_chat(tok, {{"user", "hi"}}, true);
  EXPECT_EQ(t.num_supervised(), 0);
  EXPECT_EQ(render_chat({{"user", "hi"}}, true),
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
}

TEST(Chat, LaterSystemAndToolTurnsFollowTheTemplate) {
  // Expected strings transcribed from the Jinja template in qwen3_2507.tokenizer_config.json:
  // a non-first system message is an ordinary turn; consecutive tool messages share one user
  // turn of <tool_response> blocks.
  const std::vector<Message> msgs = {{"user", "a"},  {"system", "s"}, {"assistant", "b"},
                                     {"tool", "r1"}, {"tool", "r2"},  {"assistant", "c"}};
  EXPECT_EQ(render_chat(msgs),
            "<|im_start|>user\na<|im_end|>\n<|im_start|>system\ns<|im_end|>\n"
            "<|im_start|>assistant\nb<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nr1\n</tool_response>\n<tool_response>\nr2\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\nc<|im_end|>\n");
  const Tokenizer& tok = test::qwen3_tokenizer();
  EXPECT_EQ(supervised_runs(tok, tokenize_chat(tok, msgs)),
            (std::vector<std::string>{"b<|im_end|>", "c<|im_end|>"}));
}

TEST(Chat, UnknownRoleIsAnError) {
  try {
    render_chat({{"user", "a"}, {"bot", "b"}});
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find("messages[1].role"), std::string::npos) << msg;
    EXPECT_NE(msg.find("bot"), std::string::npos) << msg;
  }
}

TEST(Chat, NonNfcContentKeepsLabelsAligned) {
  // "e" + U+0301 is NFC-composed by the tokenizer; labels must still cover the answer exactly.
  const Tokenizer& tok = test::qwen3_tokenizer();
  const auto t = tokenize_chat(tok, {{"user", "cafe\xCC\x81?"}, {"assistant", "cafe\xCC\x81!"}});
  EXPECT_EQ(t.input_ids,
            tok.encode(render_chat({{"user", "cafe\xCC\x81?"}, {"assistant", "cafe\xCC\x81!"}})));
  EXPECT_EQ(supervised_runs(tok, t), std::vector<std::string>{"caf\xC3\xA9!<|im_end|>"});
}

// ---- the three Qwen3 templates (chat_templates_golden.json)

ChatOptions options_of(const ordered_json& c) {
  ChatOptions o;
  o.chat_template = io::parse_enum<ChatTemplate>(c["template"].get<std::string>(), "template");
  if (c["kwargs"].contains("enable_thinking")) {
    o.enable_thinking = c["kwargs"]["enable_thinking"].get<bool>();
  }
  return o;
}

// The conversation of a fixture case, read as the data loader reads it (key order kept).
struct Case {
  std::vector<Message> messages;
  ToolList tools;
  ChatOptions options;
  bool add_generation_prompt = false;
};
Case case_of(const ordered_json& oc) {
  Case k;
  k.messages = messages_from_json(oc["conversation"], "conversation");
  k.tools = tools_from_json(oc);
  k.options = options_of(oc);
  k.add_generation_prompt = oc["kwargs"]["add_generation_prompt"].get<bool>();
  return k;
}

// What each assistant turn says, cut from the rendered text: from after its header through its
// <|im_end|>.
std::vector<std::string> assistant_spans(const std::string& text) {
  std::vector<std::string> out;
  const std::string header = "<|im_start|>assistant\n", end = "<|im_end|>";
  for (size_t p = text.find(header); p != std::string::npos; p = text.find(header, p)) {
    p += header.size();
    const size_t e = text.find(end, p);
    if (e == std::string::npos) break;  // the generation prompt
    out.push_back(text.substr(p, e + end.size() - p));
  }
  return out;
}

TEST(ChatTemplates, MatchGoldenRenderingIdsAndMask) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  std::ifstream in(Q4_FIXTURES_DIR "/chat_templates_golden.json");
  const ordered_json gold = ordered_json::parse(in);  // key order: tools print in it
  ASSERT_GE(gold.size(), 100u);
  std::set<std::string> templates;
  for (const auto& c : gold) {
    const std::string what = c["name"].get<std::string>() + " / " +
                             c["template"].get<std::string>() + " / " + c["kwargs"].dump();
    const Case k = case_of(c);
    templates.insert(c["template"].get<std::string>());
    const std::string want = c["rendered"].get<std::string>();
    EXPECT_EQ(render_chat(k.messages, k.add_generation_prompt, k.options, k.tools), want) << what;
    const ChatTokens t =
        tokenize_chat(tok, k.messages, k.add_generation_prompt, k.options, k.tools);
    if (c.contains("ids")) {  // the transformers-made fixture
      EXPECT_EQ(t.input_ids, c["ids"].get<std::vector<TokenId>>()) << what;
    } else {
      EXPECT_EQ(t.input_ids, tok.encode(want)) << what;
    }
    // Supervised: each assistant turn after its header through <|im_end|>, nothing else (a
    // leading "\n" of the answer merges with the header's into one token).
    const std::vector<std::string> runs = supervised_runs(tok, t);
    const std::vector<std::string> spans = assistant_spans(want);
    ASSERT_EQ(runs.size(), spans.size()) << what;
    for (size_t i = 0; i < runs.size(); ++i) {
      EXPECT_TRUE(runs[i] == spans[i] || runs[i] == "\n" + spans[i]) << what << ": " << runs[i];
    }
  }
  EXPECT_EQ(templates.size(), 3u);
}

TEST(ChatTemplates, ThinkingToolsMaskLeavesContextOut) {
  // Hybrid template, a tool round trip: the think blocks and tool calls are trained, the tools
  // block, user text and tool responses are not.
  const Tokenizer& tok = test::qwen3_tokenizer();
  const ordered_json rec = ordered_json::parse(R"({"tools": [{"name": "f", "parameters": {}}],
    "messages": [{"role": "user", "content": "U"},
      {"role": "assistant", "reasoning_content": "R1", "content": "",
       "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
      {"role": "tool", "content": "T"},
      {"role": "assistant", "reasoning_content": "R2", "content": "A"}]})");
  ChatOptions o;
  o.chat_template = ChatTemplate::kQwen3;
  const ChatTokens t = tokenize_chat(tok, messages_from_json(rec["messages"], "messages"), false, o,
                                     tools_from_json(rec));
  EXPECT_EQ(supervised_runs(tok, t),
            (std::vector<std::string>{
                "<think>\nR1\n</think>\n\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": "
                "1}}\n</tool_call><|im_end|>",
                "<think>\nR2\n</think>\n\nA<|im_end|>"}));
  EXPECT_EQ(t.reasoning_dropped, 0);
  // Only the messages from index 3 on are supervised when asked.
  const ChatTokens tail = tokenize_chat(tok, messages_from_json(rec["messages"], "messages"), false,
                                        o, tools_from_json(rec), 3);
  EXPECT_EQ(supervised_runs(tok, tail),
            std::vector<std::string>{"<think>\nR2\n</think>\n\nA<|im_end|>"});
}

TEST(ChatTemplates, DroppedReasoningIsCounted) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  Message a1{"assistant", "b"}, a2{"assistant", "d"};
  a1.reasoning_content = "r1";
  a2.reasoning_content = "r2";
  const std::vector<Message> msgs = {{"user", "a"}, a1, {"user", "c"}, a2};
  ChatOptions o;  // 2507 instruct renders no reasoning
  EXPECT_EQ(tokenize_chat(tok, msgs, false, o).reasoning_dropped, 2);
  o.chat_template = ChatTemplate::kQwen3_2507Thinking;  // drops it before the last query
  EXPECT_EQ(tokenize_chat(tok, msgs, false, o).reasoning_dropped, 1);
}

TEST(ChatTemplates, GenerationPromptFollowsEnableThinking) {
  ChatOptions o;
  o.chat_template = ChatTemplate::kQwen3;
  const std::vector<Message> u = {{"user", "hi"}};
  const std::string head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  EXPECT_EQ(render_chat(u, true, o), head);
  o.enable_thinking = true;
  EXPECT_EQ(render_chat(u, true, o), head);
  o.enable_thinking = false;
  EXPECT_EQ(render_chat(u, true, o), head + "<think>\n\n</think>\n\n");
  o.chat_template = ChatTemplate::kQwen3_2507Thinking;
  EXPECT_EQ(render_chat(u, true, o), head + "<think>\n");
  o.chat_template = ChatTemplate::kQwen3_2507Instruct;
  EXPECT_EQ(render_chat(u, true, o), head);
}

TEST(ChatTemplates, PyTojsonMatchesPythonJsonDumps) {
  // Expected strings from Python 3: json.dumps(json.loads(s), ensure_ascii=False).
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"b": 1, "a": [1.0, 0.1, 1e-5, 1e16, 1e15, 123456789012345680.0, -0.0, 2.5e-7]})",
       R"({"b": 1, "a": [1.0, 0.1, 1e-05, 1e+16, 1000000000000000.0, 1.2345678901234568e+17, -0.0, 2.5e-07]})"},
      {R"({"s": "q\"\\\n\t\u0001\u007f é 日"})",
       "{\"s\": \"q\\\"\\\\\\n\\t\\u0001\x7f \xC3\xA9 \xE6\x97\xA5\"}"},
      {R"([true, false, null, {}, [], 18446744073709551615, -9223372036854775808, 0.0001, 0.00001])",
       R"([true, false, null, {}, [], 18446744073709551615, -9223372036854775808, 0.0001, 1e-05])"},
      {R"([3.141592653589793, 1.7976931348623157e308, 5e-324, 100.0, 1e22])",
       R"([3.141592653589793, 1.7976931348623157e+308, 5e-324, 100.0, 1e+22])"},
  };
  for (const auto& [in, want] : cases) EXPECT_EQ(py_tojson(ordered_json::parse(in)), want) << in;
}

std::string chat_json_error(const std::string& record) {
  try {
    const ordered_json j = ordered_json::parse(record);
    tools_from_json(j);
    messages_from_json(j["messages"], "messages");
  } catch (const ChatJsonError& e) {
    return e.what();
  }
  return "no error";
}

TEST(ChatTemplates, BadMessagesAreOneLineErrorsNamingTheKey) {
  EXPECT_EQ(chat_json_error(R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]}]})"),
            "messages[1].tool_calls[0].function: a tool call without a \"name\" (expected a "
            "non-empty string)");
  EXPECT_EQ(
      chat_json_error(R"({"messages": [{"role": "assistant", "tool_calls": [{"name": "f"}]}]})"),
      "messages[0].tool_calls[0]: a tool call without \"arguments\" (expected an object or a "
      "JSON string)");
  EXPECT_EQ(chat_json_error(R"({"tools": {"name": "f"}, "messages": []})"),
            "\"tools\": expected a list of tool definitions, found object");
  EXPECT_EQ(chat_json_error(R"({"tools": ["f"], "messages": []})"),
            "tools[0]: expected an object, found string");
  EXPECT_EQ(chat_json_error(R"({"messages": [{"role": "user", "content": ["a"]}]})"),
            "messages[0].content: expected a string or null, found array");
  EXPECT_EQ(
      chat_json_error(R"({"messages": [{"role": "user", "content": "a", "tool_calls": []}]})"),
      "messages[0].tool_calls: only assistant messages have one (role \"user\")");
  EXPECT_EQ(chat_json_error(R"j({"messages": [{"role": "assistant", "tool_calls": "f()"}]})j"),
            "messages[0].tool_calls: expected a list, found string");
}

// ---- identifying a model folder's template (data.chat_template: auto)

std::string fixture_template(const std::string& file) {
  const std::string path = std::string(Q4_FIXTURES_DIR) + "/" + file;
  if (file.size() > 6 && file.compare(file.size() - 6, 6, ".jinja") == 0) {
    std::ifstream in(path);
    std::ostringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }
  return test::read_json(path)["chat_template"].get<std::string>();
}

TEST(ChatTemplates, AutoIdentifiesTheKnownTemplates) {
  EXPECT_EQ(identify_chat_template(fixture_template("qwen3_hybrid.tokenizer_config.json"), "x"),
            ChatTemplate::kQwen3);
  EXPECT_EQ(identify_chat_template(fixture_template("qwen3_2507.tokenizer_config.json"), "x"),
            ChatTemplate::kQwen3_2507Instruct);
  EXPECT_EQ(identify_chat_template(fixture_template("qwen3_2507_thinking.jinja"), "x"),
            ChatTemplate::kQwen3_2507Thinking);
  // Whitespace differences (re-indented, CRLF) do not matter; other text does.
  std::string t = fixture_template("qwen3_2507_thinking.jinja");
  std::string crlf;
  for (char ch : t) crlf += ch == '\n' ? std::string("\r\n  ") : std::string(1, ch);
  EXPECT_EQ(identify_chat_template(crlf, "x"), ChatTemplate::kQwen3_2507Thinking);
  t.replace(t.find("<think>"), 7, "<thonk>");
  try {
    identify_chat_template(t, "/m/chat_template.jinja");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_EQ(msg.rfind("/m/chat_template.jinja: the chat template is none of", 0), 0u) << msg;
    EXPECT_NE(msg.find("set data.chat_template"), std::string::npos) << msg;
  }
}

TEST(ChatTemplates, AutoReadsTheModelFolder) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("q4_chat_auto_" + std::to_string(::getpid()));
  fs::remove_all(dir);
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  // No template in the folder: today's 2507 Instruct template.
  EXPECT_EQ(resolve_chat_template(ChatTemplate::kAuto, dir.string()),
            ChatTemplate::kQwen3_2507Instruct);
  fs::copy_file(std::string(Q4_FIXTURES_DIR) + "/qwen3_hybrid.tokenizer_config.json",
                dir / "tokenizer_config.json");
  EXPECT_EQ(resolve_chat_template(ChatTemplate::kAuto, dir.string()), ChatTemplate::kQwen3);
  // An explicit choice is kept whatever the folder holds.
  EXPECT_EQ(resolve_chat_template(ChatTemplate::kQwen3_2507Thinking, dir.string()),
            ChatTemplate::kQwen3_2507Thinking);
  // chat_template.jinja wins over tokenizer_config.json, as in transformers.
  write("chat_template.jinja", fixture_template("qwen3_2507_thinking.jinja"));
  EXPECT_EQ(resolve_chat_template(ChatTemplate::kAuto, dir.string()),
            ChatTemplate::kQwen3_2507Thinking);
  write("chat_template.jinja", "{{ messages }}");
  try {
    resolve_chat_template(ChatTemplate::kAuto, dir.string());
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    EXPECT_NE(msg.find((dir / "chat_template.jinja").string()), std::string::npos) << msg;
  }
  fs::remove(dir / "chat_template.jinja");
  write("tokenizer_config.json", R"({"chat_template": [{"name": "default", "template": "x"}]})");
  EXPECT_THROW(resolve_chat_template(ChatTemplate::kAuto, dir.string()), c10::Error);
  fs::remove_all(dir);
}

TEST(ChatTemplates, TemplateNamesParse) {
  EXPECT_EQ(io::parse_enum<ChatTemplate>("qwen3-2507-thinking", "data.chat_template"),
            ChatTemplate::kQwen3_2507Thinking);
  try {
    io::parse_enum<ChatTemplate>("chatml", "data.chat_template");
    FAIL() << "expected an error";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace())
                  .find("data.chat_template: expected one of auto, qwen3, qwen3-2507-instruct, "
                        "qwen3-2507-thinking; got 'chatml'"),
              std::string::npos);
  }
}

}  // namespace
}  // namespace q4::data
