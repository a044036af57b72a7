// Qwen3-2507 ChatML rendering (byte-identical to the tokenizer_config.json Jinja template
// without tools) and the supervision mask for training. Rendered turn:
//   <|im_start|>{role}\n{content}<|im_end|>\n     (assistant turns likewise; optional
// generation prompt "<|im_start|>assistant\n"). Labels are aligned with input_ids (the model
// shifts: logits[:, :-1] vs labels[:, 1:]); only assistant content tokens and the <|im_end|>
// closing each assistant turn carry their id, everything else is kIgnoreIndex (-100).
#pragma once

#include <string>
#include <vector>

#include "q4/data/tokenizer.h"

namespace q4::data {

// role: "system", "user", "assistant" or "tool" (rendered as the template does:
// consecutive tool messages become <tool_response> blocks inside one user turn).
struct Message {
  std::string role;
  std::string content;
};

// Validates roles (unknown role -> error naming the message index and the role found).
void validate_messages(const std::vector<Message>& messages);

// Rendered text, exactly as apply_chat_template(messages, tokenize=False, add_generation_prompt).
std::string render_chat(const std::vector<Message>& messages, bool add_generation_prompt = false);

struct ChatTokens {
  std::vector<TokenId> input_ids;  // encode(render_chat(...))
  std::vector<TokenId> labels;     // same length; id where supervised, kIgnoreIndex elsewhere
  int64_t num_supervised() const;
};

// Tokenizes a conversation. Supervised tokens: every token overlapping the content of an
// assistant turn, plus that turn's closing <|im_end|>. Not supervised: system/user/tool turns,
// "<|im_start|>assistant\n" headers, the "\n" after <|im_end|>, the generation prompt.
// Message contents are NFC-normalized before rendering (what the tokenizer does anyway).
ChatTokens tokenize_chat(const Tokenizer& tokenizer, const std::vector<Message>& messages,
                         bool add_generation_prompt = false);

}  // namespace q4::data
