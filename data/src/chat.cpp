// The Qwen3 chat templates (see chat.h) written out in C++, statement by statement after their
// Jinja text (data/src/chat_templates.inc), and the supervision mask. The rendered text is
// tokenized in one piece and every token is attributed to the byte span it covers, so labels stay
// correct even when BPE merges across the boundary between an assistant header and its content
// (e.g. content starting with "\n").
#include "q4/data/chat.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "normalize.h"

namespace q4::data {
namespace {

#include "chat_templates.inc"

constexpr const char* kImStart = "<|im_start|>";
constexpr const char* kImEnd = "<|im_end|>";

// A byte span of the rendered text that is supervised.
struct Span {
  int64_t begin, end;
};

bool starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}
bool contains(const std::string& s, const std::string& p) { return s.find(p) != std::string::npos; }

// Python's str.lstrip('\n'), rstrip('\n'), strip('\n').
std::string lstrip_nl(const std::string& s) {
  const size_t b = s.find_first_not_of('\n');
  return b == std::string::npos ? "" : s.substr(b);
}
std::string rstrip_nl(const std::string& s) {
  const size_t e = s.find_last_not_of('\n');
  return e == std::string::npos ? "" : s.substr(0, e + 1);
}
std::string strip_nl(const std::string& s) { return lstrip_nl(rstrip_nl(s)); }

// The content as the templates see it: the 2507 templates map non-string content to ''; the
// hybrid template would fail on null, which q4train renders as '' too (docs/data.md).
const std::string& text_of(const Message& m) {
  static const std::string kEmpty;
  return m.content_is_string ? m.content : kEmpty;
}

// An assistant message's reasoning and answer as the thinking templates split them: an explicit
// reasoning_content, else the text before the first </think> (after the last <think> in it) and
// the text after the last </think>.
struct Split {
  std::string reasoning, content;
};
Split split_reasoning(const Message& m) {
  Split s{"", text_of(m)};
  if (m.reasoning_content.has_value()) {
    s.reasoning = *m.reasoning_content;
  } else if (contains(s.content, "</think>")) {
    const std::string& c = s.content;
    std::string before = rstrip_nl(c.substr(0, c.find("</think>")));
    const size_t open = before.rfind("<think>");
    if (open != std::string::npos) before = before.substr(open + 7);
    s.reasoning = lstrip_nl(before);
    s.content = lstrip_nl(c.substr(c.rfind("</think>") + 8));
  }
  return s;
}

// The index of the last user message that is a query (not a message consisting of a
// <tool_response>; the 2507 Thinking template also skips non-string contents); the last index
// when there is none.
int64_t last_query_index(const std::vector<Message>& messages, ChatTemplate t) {
  const auto n = static_cast<int64_t>(messages.size());
  for (int64_t i = n - 1; i >= 0; --i) {
    const Message& m = messages[static_cast<size_t>(i)];
    if (m.role != "user") continue;
    if (t == ChatTemplate::kQwen3_2507Thinking && !m.content_is_string) continue;
    const std::string& c = text_of(m);
    if (!(starts_with(c, "<tool_response>") && ends_with(c, "</tool_response>"))) return i;
  }
  return n - 1;
}

class Renderer {
 public:
  Renderer(const ChatOptions& o, bool normalize, std::vector<Span>* spans, size_t first_supervised)
      : o_(o), normalize_(normalize), spans_(spans), first_supervised_(first_supervised) {}

  std::string render(const std::vector<Message>& messages, bool add_generation_prompt,
                     const ToolList& tools, int64_t* reasoning_dropped) {
    TORCH_CHECK(o_.chat_template != ChatTemplate::kAuto,
                "chat template auto: resolve it first (resolve_chat_template)");
    validate_messages(messages);
    const bool thinking = o_.chat_template != ChatTemplate::kQwen3_2507Instruct;
    const bool first_is_system = !messages.empty() && messages[0].role == "system";
    if (!tools.empty()) {
      out_ += std::string(kImStart) + "system\n";
      if (first_is_system) out_ += user_text(text_of(messages[0])) + "\n\n";
      out_ +=
          "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are "
          "provided with function signatures within <tools></tools> XML tags:\n<tools>";
      for (const std::string& t : tools) out_ += "\n" + user_text(t);
      out_ +=
          "\n</tools>\n\nFor each function call, return a json object with function name and "
          "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": "
          "<function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
      out_ += std::string(kImEnd) + "\n";
    } else if (first_is_system) {
      out_ += std::string(kImStart) + "system\n" + user_text(text_of(messages[0])) + kImEnd + "\n";
    }
    const int64_t last_query = last_query_index(messages, o_.chat_template);
    for (size_t i = 0; i < messages.size(); ++i) {
      const Message& m = messages[i];
      const bool last = i + 1 == messages.size();
      if (m.role == "user" || (m.role == "system" && i != 0)) {
        out_ += kImStart + m.role + "\n" + user_text(text_of(m)) + kImEnd + "\n";
      } else if (m.role == "assistant") {
        out_ += std::string(kImStart) + "assistant\n";
        const auto begin = static_cast<int64_t>(out_.size());
        std::string content = text_of(m);
        bool reasoning_shown = false;
        Split s;
        if (thinking) {
          s = split_reasoning(m);
          content = s.content;
          if (static_cast<int64_t>(i) > last_query && (last || !s.reasoning.empty())) {
            out_ += "<think>\n" + user_text(strip_nl(s.reasoning)) + "\n</think>\n\n" +
                    user_text(lstrip_nl(content));
            reasoning_shown = true;
          } else {
            out_ += user_text(content);
          }
        } else {
          out_ += user_text(content);
          if (m.reasoning_content.has_value()) s.reasoning = *m.reasoning_content;
        }
        if (!reasoning_shown && !strip_nl(s.reasoning).empty() && reasoning_dropped != nullptr) {
          ++*reasoning_dropped;
        }
        for (size_t k = 0; k < m.tool_calls.size(); ++k) {
          if (k > 0 || !content.empty()) out_ += "\n";
          out_ += "<tool_call>\n{\"name\": \"" + user_text(m.tool_calls[k].name) +
                  "\", \"arguments\": " + user_text(m.tool_calls[k].arguments) + "}\n</tool_call>";
        }
        out_ += kImEnd;
        if (spans_ != nullptr && i >= first_supervised_) {
          spans_->push_back({begin, static_cast<int64_t>(out_.size())});
        }
        out_ += "\n";
      } else if (m.role == "tool") {
        if (i == 0 || messages[i - 1].role != "tool") out_ += std::string(kImStart) + "user";
        out_ += "\n<tool_response>\n" + user_text(text_of(m)) + "\n</tool_response>";
        if (last || messages[i + 1].role != "tool") out_ += std::string(kImEnd) + "\n";
      }
    }
    if (add_generation_prompt) {
      out_ += std::string(kImStart) + "assistant\n";
      if (o_.chat_template == ChatTemplate::kQwen3 && o_.enable_thinking.has_value() &&
          !*o_.enable_thinking) {
        out_ += "<think>\n\n</think>\n\n";
      }
      if (o_.chat_template == ChatTemplate::kQwen3_2507Thinking) out_ += "<think>\n";
    }
    return std::move(out_);
  }

 private:
  // Text from the data, NFC-normalized when tokenizing: the tokenizer would normalize each
  // segment anyway, and the template's own text ('\n', '<', ASCII) never composes with a
  // neighbour, so ids are unchanged and offsets index this exact text.
  std::string user_text(const std::string& s) const { return normalize_ ? nfc_like_hf(s) : s; }

  const ChatOptions& o_;
  bool normalize_;
  std::vector<Span>* spans_;
  size_t first_supervised_;
  std::string out_;
};

// Every run of whitespace as one space, none at the ends.
std::string normalize_whitespace(const std::string& s) {
  std::string out;
  bool space = false;
  for (char c : s) {
    if (std::isspace(static_cast<unsigned char>(c)) != 0) {
      space = true;
      continue;
    }
    if (space && !out.empty()) out += ' ';
    space = false;
    out += c;
  }
  return out;
}

std::string read_file(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  TORCH_CHECK(in.good(), p.string(), ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

void validate_messages(const std::vector<Message>& messages) {
  for (size_t i = 0; i < messages.size(); ++i) {
    const std::string& r = messages[i].role;
    TORCH_CHECK(r == "system" || r == "user" || r == "assistant" || r == "tool", "messages[", i,
                "].role: expected \"system\", \"user\", \"assistant\" or \"tool\", found \"", r,
                "\"");
  }
}

std::string render_chat(const std::vector<Message>& messages, bool add_generation_prompt,
                        const ChatOptions& options, const ToolList& tools) {
  return Renderer(options, false, nullptr, 0)
      .render(messages, add_generation_prompt, tools, nullptr);
}

int64_t ChatTokens::num_supervised() const {
  int64_t n = 0;
  for (TokenId l : labels) n += l != kIgnoreIndex;
  return n;
}

ChatTokens tokenize_chat(const Tokenizer& tokenizer, const std::vector<Message>& messages,
                         bool add_generation_prompt, const ChatOptions& options,
                         const ToolList& tools, size_t first_supervised) {
  std::vector<Span> spans;
  ChatTokens out;
  const std::string text =
      Renderer(options, true, &spans, first_supervised)
          .render(messages, add_generation_prompt, tools, &out.reasoning_dropped);
  const Encoding enc = tokenizer.encode_with_offsets(text);
  out.input_ids = enc.ids;
  out.labels.assign(enc.ids.size(), kIgnoreIndex);
  size_t s = 0;
  for (size_t k = 0; k < enc.ids.size(); ++k) {
    const auto [b, e] = enc.offsets[k];
    while (s < spans.size() && spans[s].end <= b) ++s;
    if (s < spans.size() && b < spans[s].end && e > spans[s].begin) out.labels[k] = enc.ids[k];
  }
  return out;
}

ChatTemplate identify_chat_template(const std::string& text, const std::string& source) {
  const std::string t = normalize_whitespace(text);
  if (t == normalize_whitespace(kQwen3HybridTemplate)) return ChatTemplate::kQwen3;
  if (t == normalize_whitespace(kQwen3_2507InstructTemplate)) {
    return ChatTemplate::kQwen3_2507Instruct;
  }
  if (t == normalize_whitespace(kQwen3_2507ThinkingTemplate)) {
    return ChatTemplate::kQwen3_2507Thinking;
  }
  TORCH_CHECK(false, source,
              ": the chat template is none of the Qwen3 templates q4train implements (qwen3, "
              "qwen3-2507-instruct, qwen3-2507-thinking); set data.chat_template to the one "
              "this model was trained with");
  return ChatTemplate::kAuto;
}

std::string tokenizer_folder(const std::string& tokenizer_path) {
  if (tokenizer_path.empty()) return "";
  return std::filesystem::absolute(tokenizer_path).parent_path().string();
}

ChatTemplate resolve_chat_template(ChatTemplate t, const std::string& folder) {
  namespace fs = std::filesystem;
  if (t != ChatTemplate::kAuto) return t;
  if (folder.empty()) return ChatTemplate::kQwen3_2507Instruct;
  std::error_code ec;
  const fs::path jinja = fs::path(folder) / "chat_template.jinja";
  if (fs::is_regular_file(jinja, ec))
    return identify_chat_template(read_file(jinja), jinja.string());
  const fs::path config = fs::path(folder) / "tokenizer_config.json";
  if (!fs::is_regular_file(config, ec)) return ChatTemplate::kQwen3_2507Instruct;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(config));
  } catch (const nlohmann::json::exception& e) {
    TORCH_CHECK(false, config.string(), ": bad JSON: ", e.what());
  }
  if (!j.is_object() || !j.contains("chat_template")) return ChatTemplate::kQwen3_2507Instruct;
  TORCH_CHECK(j["chat_template"].is_string(), config.string(),
              ": \"chat_template\" is not one template text (a list of named templates?); set "
              "data.chat_template to the one this model was trained with");
  return identify_chat_template(j["chat_template"].get<std::string>(),
                                config.string() + " (chat_template)");
}

}  // namespace q4::data
