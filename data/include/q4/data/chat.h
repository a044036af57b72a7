// The Qwen3 chat templates (docs/data.md "Chat templates"), rendered byte-identically to HF
// transformers' apply_chat_template on their Jinja text, and the supervision mask for training.
// Three templates: the hybrid thinking template of the original Qwen3 models (`qwen3`), the
// Qwen3-2507 Instruct one and the Qwen3-2507 Thinking one. All render ChatML turns
//   <|im_start|>{role}\n{content}<|im_end|>\n
// with an optional tools block in the system turn, <tool_call> blocks in assistant turns, tool
// results as <tool_response> blocks of one user turn, and (the thinking templates) a
// <think>...</think> block in the assistant turns after the last user query. Labels are aligned
// with input_ids (the model shifts: logits[:, :-1] vs labels[:, 1:]); only what an assistant turn
// says after its "<|im_start|>assistant\n" header, through its closing <|im_end|>, carries its
// id, everything else is kIgnoreIndex (-100).
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "q4/data/tokenizer.h"
#include "q4/io/enum_names.h"

namespace q4::data {

enum class ChatTemplate {
  kAuto,                // the model folder's template, identified (resolve_chat_template)
  kQwen3,               // hybrid thinking: Qwen3 0.6B..32B, 30B-A3B, 235B-A22B
  kQwen3_2507Instruct,  // Qwen3-*-Instruct-2507: no thinking
  kQwen3_2507Thinking,  // Qwen3-*-Thinking-2507: always thinks
};

struct ChatOptions {
  ChatTemplate chat_template = ChatTemplate::kQwen3_2507Instruct;  // never kAuto when rendering
  // HF's enable_thinking kwarg: unset is Jinja's undefined (thinking on). Only the hybrid
  // template reads it, in the generation prompt.
  std::optional<bool> enable_thinking;
};

// One tool call of an assistant message, as the template prints it.
struct ToolCall {
  std::string name;
  std::string arguments;  // a string argument verbatim, anything else as tojson prints it
};

// role: "system", "user", "assistant" or "tool".
struct Message {
  Message() = default;
  Message(std::string r, std::string c) : role(std::move(r)), content(std::move(c)) {}
  std::string role;
  std::string content;
  bool content_is_string = true;                 // false: null or absent content, rendered as ""
  std::optional<std::string> reasoning_content;  // assistant only; unset: none given
  std::vector<ToolCall> tool_calls;              // assistant only
};

// Validates roles (unknown role -> error naming the message index and the role found).
void validate_messages(const std::vector<Message>& messages);

// Each element of `tools` is one tool definition as tojson prints it (py_tojson in chat_json.h);
// empty: no tools block.
using ToolList = std::vector<std::string>;

// Rendered text, exactly as apply_chat_template(messages, tools=..., tokenize=False,
// add_generation_prompt=..., enable_thinking=...).
std::string render_chat(const std::vector<Message>& messages, bool add_generation_prompt = false,
                        const ChatOptions& options = {}, const ToolList& tools = {});

struct ChatTokens {
  std::vector<TokenId> input_ids;  // encode(render_chat(...))
  std::vector<TokenId> labels;     // same length; id where supervised, kIgnoreIndex elsewhere
  // Assistant messages whose reasoning (reasoning_content, or a <think> block split out of the
  // content by a thinking template) the template does not render: the 2507 Instruct template
  // never does, the thinking templates drop it before the last user query.
  int64_t reasoning_dropped = 0;
  int64_t num_supervised() const;
};

// Tokenizes a conversation. Supervised tokens: every token overlapping what an assistant turn
// renders after its "<|im_start|>assistant\n" header (its <think> block, content and <tool_call>
// blocks) through its closing <|im_end|>, for the assistant messages at index >=
// `first_supervised` (earlier ones are context). Not supervised: system/user/tool turns, the tools
// block, assistant headers, the "\n" after <|im_end|>, the generation prompt. Texts are
// NFC-normalized before tokenizing (what the tokenizer does anyway).
ChatTokens tokenize_chat(const Tokenizer& tokenizer, const std::vector<Message>& messages,
                         bool add_generation_prompt = false, const ChatOptions& options = {},
                         const ToolList& tools = {}, size_t first_supervised = 0);

// kAuto -> the template of the model folder `folder` (its chat_template.jinja, else the
// "chat_template" of its tokenizer_config.json), identified by comparing whitespace-normalised
// text with the three known templates; no folder ("") or a folder with neither file ->
// kQwen3_2507Instruct. An
// unknown template is an error naming the file. Other values are returned unchanged.
ChatTemplate resolve_chat_template(ChatTemplate t, const std::string& folder);
// The folder of a tokenizer.json path, for resolve_chat_template ("" for an empty path).
std::string tokenizer_folder(const std::string& tokenizer_path);

// The template `text` (read from `source`) as one of the three; an error naming `source` when it
// is none of them.
ChatTemplate identify_chat_template(const std::string& text, const std::string& source);

}  // namespace q4::data

Q4_ENUM_NAMES(q4::data::ChatTemplate, {"auto", q4::data::ChatTemplate::kAuto},
              {"qwen3", q4::data::ChatTemplate::kQwen3},
              {"qwen3-2507-instruct", q4::data::ChatTemplate::kQwen3_2507Instruct},
              {"qwen3-2507-thinking", q4::data::ChatTemplate::kQwen3_2507Thinking});
