// TRL prompt-only records -> rendered, tokenized prompts with their other fields (see
// prompt_dataset.h). Records are read as the SFT loader reads them: "\n", "\r\n" or a lone "\r"
// end a line, a UTF-8 byte-order mark is skipped, and a file starting with '[' is one JSON array.
#include "q4/data/prompt_dataset.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>

#include "json_records.h"
#include "q4/data/chat_json.h"
#include "q4/io/utf8.h"

namespace q4::data {
namespace prompt_records {

// A malformed record: its reason, turned into an error or a skip by the loader.
using BadPrompt = json_records::BadRecord;

bool blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

// The record's prompt as chat messages: a string is one user turn; a list is read as messages
// and must not end with an assistant turn (the completion is the next assistant turn).
std::vector<Message> prompt_messages(const ordered_json& p, const DatasetOptions& opt) {
  std::vector<Message> msgs;
  if (p.is_string()) {
    if (blank(p.get<std::string>())) throw BadPrompt{"empty \"prompt\""};
    msgs.push_back(Message{"user", p.get<std::string>()});
  } else if (p.is_array()) {
    try {
      msgs = messages_from_json(p, "prompt");
    } catch (const ChatJsonError& e) {
      throw BadPrompt{e.what()};
    }
    if (msgs.empty()) throw BadPrompt{"\"prompt\": an empty list of messages"};
    if (msgs.back().role == "assistant") {
      throw BadPrompt{
          "\"prompt\": ends with an assistant message (the completion is the next "
          "assistant turn)"};
    }
  } else {
    throw BadPrompt{std::string("\"prompt\": expected a string or a list of messages, found ") +
                    p.type_name()};
  }
  const bool has_system =
      std::any_of(msgs.begin(), msgs.end(), [](const Message& m) { return m.role == "system"; });
  if (!has_system && !opt.system_prompt.empty()) {
    msgs.insert(msgs.begin(), Message{"system", opt.system_prompt});
  }
  return msgs;
}

PromptRecord parse_prompt(const std::string& text, const Tokenizer& tok,
                          const DatasetOptions& opt) {
  if (const size_t bad = io::utf8::find_invalid(text); bad != std::string::npos) {
    throw BadPrompt{"invalid UTF-8 at byte " + std::to_string(bad) + " of the record"};
  }
  ordered_json j;
  try {
    j = ordered_json::parse(text);
  } catch (const ordered_json::exception& e) {
    throw BadPrompt{std::string("bad JSON: ") + e.what()};
  }
  if (!j.is_object()) {
    throw BadPrompt{std::string("expected a JSON object, found ") + j.type_name()};
  }
  if (!j.contains("prompt")) {
    throw BadPrompt{"expected {\"prompt\": ...} (TRL's prompt-only format), found no \"prompt\""};
  }
  PromptRecord r;
  r.prompt = j["prompt"];
  r.conversational = r.prompt.is_array();
  ToolList tools;
  try {
    tools = tools_from_json(j);
    const std::vector<Message> msgs = prompt_messages(r.prompt, opt);
    validate_messages(msgs);
    r.prompt_text = render_chat(msgs, /*add_generation_prompt=*/true, opt.chat, tools);
    r.prompt_ids = tokenize_chat(tok, msgs, true, opt.chat, tools).input_ids;
  } catch (const ChatJsonError& e) {
    throw BadPrompt{e.what()};
  } catch (const c10::Error& e) {
    throw BadPrompt{e.what_without_backtrace()};
  }
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() != "prompt") r.fields[it.key()] = it.value();
  }
  if (r.fields.is_null()) r.fields = ordered_json::object();
  return r;
}

}  // namespace prompt_records

PromptDataset load_prompt_dataset_from_string(const std::string& content, const std::string& name,
                                              const Tokenizer& tokenizer,
                                              const DatasetOptions& options) {
  using namespace prompt_records;
  PromptDataset ds;
  json_records::load_records(
      content, name, options, &ds.summary, [&](const std::string& text, int64_t line) {
        PromptRecord r = parse_prompt(text, tokenizer, options);
        r.source_line = line;
        ds.summary.tokens += static_cast<int64_t>(r.prompt_ids.size());
        ++ds.summary.jsonl_formats[r.conversational ? "trl prompt (conversational)" : "trl prompt"];
        ds.prompts.push_back(std::move(r));
      });
  ds.summary.examples = static_cast<int64_t>(ds.prompts.size());
  return ds;
}

PromptDataset load_prompt_dataset(const std::string& path, const Tokenizer& tokenizer,
                                  const DatasetOptions& options) {
  return load_prompt_dataset_from_string(json_records::read_data_file(path), path, tokenizer,
                                         options);
}

}  // namespace q4::data
