// Qwen3-2507 ChatML rendering (the tokenizer_config.json Jinja template, no tools) and the
// supervision mask. The rendered text is tokenized in one piece and every token is attributed
// to the byte span it covers, so labels stay correct even when BPE merges across the boundary
// between an assistant header and its content (e.g. content starting with "\n").
#include "q4/data/chat.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>

#include "normalize.h"

namespace q4::data {
namespace {

constexpr const char* kImStart = "<|im_start|>";
constexpr const char* kImEnd = "<|im_end|>";

// A byte span of the rendered text that is supervised.
struct Span {
  int64_t begin, end;
};

// Renders exactly like the template; with `spans`, records for every assistant turn the span of
// its content and of its closing <|im_end|> (one span covering both).
std::string render(const std::vector<Message>& messages, bool add_generation_prompt, bool normalize,
                   std::vector<Span>* spans) {
  validate_messages(messages);
  std::string out;
  auto content_of = [&](const Message& m) {
    return normalize ? nfc_like_hf(m.content) : m.content;
  };
  if (!messages.empty() && messages[0].role == "system") {
    out += kImStart;
    out += "system\n" + content_of(messages[0]) + kImEnd + "\n";
  }
  for (size_t i = 0; i < messages.size(); ++i) {
    const Message& m = messages[i];
    const std::string content = content_of(m);
    if (m.role == "user" || (m.role == "system" && i != 0)) {
      out += kImStart + m.role + "\n" + content + kImEnd + "\n";
    } else if (m.role == "assistant") {
      out += kImStart + m.role + "\n";
      const auto begin = static_cast<int64_t>(out.size());
      out += content + kImEnd;
      if (spans != nullptr) spans->push_back({begin, static_cast<int64_t>(out.size())});
      out += "\n";
    } else if (m.role == "tool") {
      if (i == 0 || messages[i - 1].role != "tool") out += std::string(kImStart) + "user";
      out += "\n<tool_response>\n" + content + "\n</tool_response>";
      if (i + 1 == messages.size() || messages[i + 1].role != "tool") {
        out += std::string(kImEnd) + "\n";
      }
    }
  }
  if (add_generation_prompt) out += std::string(kImStart) + "assistant\n";
  return out;
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

std::string render_chat(const std::vector<Message>& messages, bool add_generation_prompt) {
  return render(messages, add_generation_prompt, false, nullptr);
}

int64_t ChatTokens::num_supervised() const {
  int64_t n = 0;
  for (TokenId l : labels) n += l != kIgnoreIndex;
  return n;
}

ChatTokens tokenize_chat(const Tokenizer& tokenizer, const std::vector<Message>& messages,
                         bool add_generation_prompt) {
  std::vector<Span> spans;
  // NFC-normalized contents: the tokenizer would normalize each segment anyway and '\n'/'<'
  // never compose with neighbours, so ids are unchanged and offsets index this exact text.
  const std::string text = render(messages, add_generation_prompt, true, &spans);
  const Encoding enc = tokenizer.encode_with_offsets(text);
  ChatTokens out;
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

}  // namespace q4::data
