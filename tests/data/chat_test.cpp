// Chat template tests: byte-identical rendering and ids against chat_template_golden.json (made
// with transformers' apply_chat_template on the Qwen3-4B-Instruct-2507 template), and the
// supervision mask: only assistant content and its closing <|im_end|> are labelled.
#include "q4/data/chat.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <nlohmann/json.hpp>

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

}  // namespace
}  // namespace q4::data
