// Dataset loaders: TSV prompt/answer pairs, JSONL conversations or pairs, plain-text documents.
// Each line is validated (UTF-8, shape, roles) and tokenized with its supervision mask; a bad
// line either throws "<file>:<line>: <reason>" (OnError::kFail) or is skipped and counted in the
// LoadSummary (OnError::kSkip). Nothing here prints.
#include "q4/data/dataset.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "json_records.h"
#include "q4/data/chat_json.h"
#include "q4/io/utf8.h"

namespace q4::data {
namespace {

// Ordered: tool definitions and arguments print in the order they were written.
using json = nlohmann::ordered_json;

constexpr char kUtf8Bom[] = "\xEF\xBB\xBF";

// A malformed line; caught by the loader and turned into an error or a skip.
using BadLine = json_records::BadRecord;

// An example's part of the summary's token counts.
void count_example(const Example& ex, LoadSummary* s) {
  s->tokens += static_cast<int64_t>(ex.input_ids.size());
  for (TokenId l : ex.labels) s->supervised_tokens += l != kIgnoreIndex;
  s->reasoning_dropped += ex.reasoning_dropped;
}

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

bool is_blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](unsigned char c) { return std::isspace(c) != 0; });
}

std::string quote_excerpt(const std::string& s) {
  constexpr size_t kMax = 40;
  std::string e = s.size() > kMax ? s.substr(0, kMax) + "..." : s;
  return json(io::utf8::repair(e)).dump();
}

void check_utf8(const std::string& line) {
  const size_t bad = io::utf8::find_invalid(line);
  if (bad != std::string::npos) {
    throw BadLine{"invalid UTF-8 at byte " + std::to_string(bad) + " of the line"};
  }
}

Example from_chat(ChatTokens&& t, int64_t line) {
  Example e;
  e.input_ids = std::move(t.input_ids);
  e.labels = std::move(t.labels);
  e.reasoning_dropped = t.reasoning_dropped;
  e.source_line = line;
  return e;
}

std::string string_field(const json& obj, const char* key) {
  const json& v = obj[key];
  if (!v.is_string()) {
    throw BadLine{std::string("\"") + key + "\": expected a string, found " +
                  (v.is_null() ? "null" : v.type_name())};
  }
  return v.get<std::string>();
}

// An assistant turn with nothing in it trains the model to answer with nothing: an error, like
// an empty answer in every other format. `where` names the turn ("messages[2]"), `key` its text.
// A turn that only calls tools, or only reasons, says something.
void check_assistant_content(const Message& m, const std::string& where, const char* key) {
  if (is_blank(m.content) && m.tool_calls.empty() &&
      (!m.reasoning_content.has_value() || is_blank(*m.reasoning_content))) {
    throw BadLine{where + ": empty \"" + key + "\" of an assistant turn (nothing to supervise)"};
  }
}

// Chat messages and tools read from JSON, their errors as the line's reason.
std::vector<Message> messages_of(const json& list, const std::string& key) {
  try {
    return messages_from_json(list, key);
  } catch (const ChatJsonError& e) {
    throw BadLine{e.what()};
  }
}
ToolList tools_of(const json& record) {
  try {
    return tools_from_json(record);
  } catch (const ChatJsonError& e) {
    throw BadLine{e.what()};
  }
}

// ---- other JSONL shapes people have: TRL prompt/completion, ShareGPT, alpaca,
// {"text"}. parse_jsonl dispatches on the keys; `kind` names the shape for the load summary.

// A list of messages (TRL conversational fields), with reasoning and tool calls.
std::vector<Message> message_list(const json& jm, const std::string& key) {
  if (!jm.is_array()) throw BadLine{"\"" + key + "\": expected a string or a list of messages"};
  std::vector<Message> msgs = messages_of(jm, key);
  for (size_t i = 0; i < msgs.size(); ++i) {
    if (msgs[i].role == "assistant") {
      check_assistant_content(msgs[i], key + "[" + std::to_string(i) + "]", "content");
    }
  }
  return msgs;
}

// A prompt and its completion, the completion under the record's key `ckey`: both strings (a
// user prompt and its answer) or both message lists (only the completion is supervised, as
// TRL's completion-only loss). `tools`: the record's tool definitions.
Example prompt_and_completion(const json& p, const json& c, const std::string& ckey,
                              const Tokenizer& tok, const DatasetOptions& opt,
                              const ToolList& tools) {
  if (p.is_string() && c.is_string() && tools.empty()) {
    if (is_blank(c.get<std::string>())) throw BadLine{"empty \"" + ckey + "\""};
    return make_pair_example(tok, p.get<std::string>(), c.get<std::string>(), opt.system_prompt,
                             opt.chat);
  }
  // Each field is blamed for its own type, the pair for a mismatch between them.
  for (const auto& [v, key] : {std::pair<const json&, std::string>{p, "prompt"}, {c, ckey}}) {
    if (!v.is_string() && !v.is_array()) {
      throw BadLine{"\"" + key + "\": expected a string or a list of messages, found " +
                    (v.is_null() ? std::string("null") : v.type_name())};
    }
  }
  if (p.is_string() && c.is_string()) {  // with tools: a user turn and an assistant turn
    if (is_blank(c.get<std::string>())) throw BadLine{"empty \"" + ckey + "\""};
    return prompt_and_completion(json::array({{{"role", "user"}, {"content", p}}}),
                                 json::array({{{"role", "assistant"}, {"content", c}}}), ckey, tok,
                                 opt, tools);
  }
  if (p.is_string() != c.is_string()) {
    throw BadLine{"\"prompt\" and \"" + ckey +
                  "\": expected both strings or both lists of messages"};
  }
  std::vector<Message> prompt = message_list(p, "prompt");
  const std::vector<Message> completion = message_list(c, ckey);
  if (completion.empty() || completion.front().role != "assistant") {
    throw BadLine{"\"" + ckey + "\": expected a list starting with an assistant message"};
  }
  const bool has_system = std::any_of(prompt.begin(), prompt.end(),
                                      [](const Message& m) { return m.role == "system"; });
  if (!has_system && !opt.system_prompt.empty()) {
    prompt.insert(prompt.begin(), Message{"system", opt.system_prompt});
  }
  std::vector<Message> all = prompt;
  all.insert(all.end(), completion.begin(), completion.end());
  // Assistant turns inside the prompt are context: only the completion's are supervised.
  return from_chat(tokenize_chat(tok, all, false, opt.chat, tools, prompt.size()), 0);
}

// TRL prompt/completion.
Example parse_trl(const json& j, const Tokenizer& tok, const DatasetOptions& opt) {
  return prompt_and_completion(j["prompt"], j["completion"], "completion", tok, opt, tools_of(j));
}

// TRL preference record: {"prompt", "chosen", "rejected"} (strings, or message lists), or
// {"chosen", "rejected"} message lists whose shared leading messages are the prompt (TRL's
// implicit prompt). Each answer becomes a prompt/completion example.
PreferencePair parse_preference(const json& j, const Tokenizer& tok, const DatasetOptions& opt) {
  for (const char* key : {"chosen", "rejected"}) {
    if (!j.contains(key)) throw BadLine{std::string("a preference record needs \"") + key + "\""};
  }
  PreferencePair pair;
  if (!j.contains("prompt") && (j["chosen"].is_string() || j["rejected"].is_string())) {
    throw BadLine{
        "\"prompt\": missing (answers given as strings need one; without \"prompt\", "
        "\"chosen\" and \"rejected\" are message lists whose shared leading messages "
        "are the prompt)"};
  }
  const ToolList tools = tools_of(j);
  if (j.contains("prompt")) {
    pair.chosen = prompt_and_completion(j["prompt"], j["chosen"], "chosen", tok, opt, tools);
    pair.rejected = prompt_and_completion(j["prompt"], j["rejected"], "rejected", tok, opt, tools);
  } else {
    message_list(j["chosen"], "chosen");  // validates both lists
    message_list(j["rejected"], "rejected");
    const json &c = j["chosen"], &r = j["rejected"];
    size_t k = 0;  // the shared prefix (whole messages, tool calls included): the implicit prompt
    while (k < c.size() && k < r.size() && c[k] == r[k]) ++k;
    if (k == 0) {
      throw BadLine{
          "\"chosen\" and \"rejected\" share no leading message (without \"prompt\", "
          "the shared messages are the prompt)"};
    }
    auto slice = [](const json& m, size_t begin, size_t end) {
      json out = json::array();
      for (size_t i = begin; i < end; ++i) out.push_back(m[i]);
      return out;
    };
    const json prompt = slice(c, 0, k), jc = slice(c, k, c.size()), jr = slice(r, k, r.size());
    pair.chosen = prompt_and_completion(prompt, jc, "chosen", tok, opt, tools);
    pair.rejected = prompt_and_completion(prompt, jr, "rejected", tok, opt, tools);
  }
  if (pair.chosen.input_ids == pair.rejected.input_ids) {
    throw BadLine{"\"chosen\" and \"rejected\" are the same answer (nothing to prefer)"};
  }
  return pair;
}

json parse_object(const std::string& line) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {
    throw BadLine{std::string("bad JSON: ") + e.what()};
  }
  if (!j.is_object()) throw BadLine{std::string("expected a JSON object, found ") + j.type_name()};
  return j;
}

// ShareGPT: {"conversations": [{"from": "system|human|gpt", "value": ...}]} ("user"/"assistant"
// and "tool" are accepted as roles too).
Example parse_sharegpt(const json& j, const Tokenizer& tok, const DatasetOptions& opt) {
  const json& jc = j["conversations"];
  if (!jc.is_array()) throw BadLine{"\"conversations\": expected an array"};
  std::vector<Message> msgs;
  bool has_system = false, has_assistant = false;
  for (size_t i = 0; i < jc.size(); ++i) {
    const json& m = jc[i];
    const std::string where = "conversations[" + std::to_string(i) + "]";
    if (!m.is_object() || !m.contains("from") || !m["from"].is_string() || !m.contains("value") ||
        !m["value"].is_string()) {
      throw BadLine{where + ": expected {\"from\": string, \"value\": string}"};
    }
    const std::string from = m["from"].get<std::string>();
    std::string role;
    if (from == "human" || from == "user") role = "user";
    if (from == "gpt" || from == "assistant") role = "assistant";
    if (from == "system") role = "system";
    if (from == "tool") role = "tool";
    if (role.empty()) {
      throw BadLine{where + ".from: unknown speaker \"" + from +
                    "\" (expected human, gpt or system)"};
    }
    has_system |= role == "system";
    has_assistant |= role == "assistant";
    msgs.push_back({role, m["value"].get<std::string>()});
    if (role == "assistant") check_assistant_content(msgs.back(), where, "value");
  }
  if (!has_assistant) throw BadLine{"\"conversations\": no gpt turn (nothing to supervise)"};
  if (!has_system && !opt.system_prompt.empty()) {
    msgs.insert(msgs.begin(), Message{"system", opt.system_prompt});
  }
  return from_chat(tokenize_chat(tok, msgs, false, opt.chat), 0);
}

// Alpaca: {"instruction", "input" (optional, may be empty), "output"}; the prompt is the
// instruction, then a blank line and the input when there is one.
Example parse_alpaca(const json& j, const Tokenizer& tok, const DatasetOptions& opt) {
  std::string prompt = string_field(j, "instruction");
  if (j.contains("input") && !j["input"].is_null()) {
    const std::string input = string_field(j, "input");
    if (!is_blank(input)) prompt += "\n\n" + input;
  }
  const std::string answer = string_field(j, "output");
  if (is_blank(answer)) throw BadLine{"empty \"output\""};
  return make_pair_example(tok, prompt, answer, opt.system_prompt, opt.chat);
}

// A plain-text document: no template, every token supervised, plus <|endoftext|> when asked.
Example text_example(const std::string& text, const Tokenizer& tok, const DatasetOptions& opt) {
  Example e;
  e.input_ids = tok.encode(text);
  if (opt.text_append_endoftext) e.input_ids.push_back(tok.endoftext_id());
  e.labels = e.input_ids;
  e.plain_text = true;
  return e;
}

// {"text": ...}: plain text, no template, every token supervised (like the text format).
Example parse_text_record(const json& j, const Tokenizer& tok, const DatasetOptions& opt) {
  const std::string text = string_field(j, "text");
  if (is_blank(text)) throw BadLine{"empty \"text\""};
  return text_example(text, tok, opt);
}

Example parse_jsonl(const std::string& line, int64_t line_no, const Tokenizer& tok,
                    const DatasetOptions& opt, std::string* kind) {
  json j;
  try {
    j = json::parse(line);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e400
    throw BadLine{std::string("bad JSON: ") + e.what() +
                  " (JSONL holds one whole JSON object per line; a file of one JSON array of "
                  "records starts with '[')"};
  }
  if (!j.is_object()) throw BadLine{std::string("expected a JSON object, found ") + j.type_name()};
  if (j.contains("chosen") && j.contains("rejected")) {
    throw BadLine{
        "a preference record ({\"prompt\", \"chosen\", \"rejected\"}), not a "
        "training example" +
        (opt.preference_hint.empty() ? std::string() : "; " + opt.preference_hint)};
  }
  if (j.contains("messages")) {
    const json& jm = j["messages"];
    if (!jm.is_array()) throw BadLine{"\"messages\": expected an array"};
    std::vector<Message> msgs = messages_of(jm, "messages");
    bool has_system = false, has_assistant = false;
    for (size_t i = 0; i < msgs.size(); ++i) {
      has_system |= msgs[i].role == "system";
      has_assistant |= msgs[i].role == "assistant";
      if (msgs[i].role == "assistant") {
        check_assistant_content(msgs[i], "messages[" + std::to_string(i) + "]", "content");
      }
    }
    if (!has_assistant) throw BadLine{"\"messages\": no assistant message (nothing to supervise)"};
    if (!has_system && !opt.system_prompt.empty()) {
      msgs.insert(msgs.begin(), Message{"system", opt.system_prompt});
    }
    *kind = "messages";
    return from_chat(tokenize_chat(tok, msgs, false, opt.chat, tools_of(j)), line_no);
  }
  if (j.contains("prompt") && j.contains("completion")) {
    *kind = "trl prompt/completion";
    return parse_trl(j, tok, opt);
  }
  if (j.contains("prompt")) {
    const std::string prompt = string_field(j, "prompt");
    const char* key = j.contains("answer")     ? "answer"
                      : j.contains("response") ? "response"
                      : j.contains("target")   ? "target"
                                               : nullptr;
    if (key == nullptr) throw BadLine{"\"prompt\" without \"answer\", \"response\" or \"target\""};
    const std::string answer = string_field(j, key);
    if (is_blank(answer)) throw BadLine{std::string("empty \"") + key + "\""};
    Example e = make_pair_example(tok, prompt, answer, opt.system_prompt, opt.chat);
    e.source_line = line_no;
    *kind = "prompt/answer";
    return e;
  }
  if (j.contains("conversations")) {
    *kind = "sharegpt";
    return parse_sharegpt(j, tok, opt);
  }
  if (j.contains("instruction") && j.contains("output")) {
    *kind = "alpaca";
    return parse_alpaca(j, tok, opt);
  }
  if (j.contains("text")) {
    *kind = "text";
    return parse_text_record(j, tok, opt);
  }
  throw BadLine{
      "expected {\"messages\": [...]}, {\"prompt\", \"answer\"|\"completion\"}, "
      "{\"conversations\": [...]} (ShareGPT), {\"instruction\", \"output\"} (alpaca) or "
      "{\"text\"}"};
}

}  // namespace

// The record reading and skip rule that the prompt loader shares (json_records.h).
namespace json_records {

// Line ends ("\n", "\r\n" or a lone "\r", as the line reader splits) in content[0, end).
int64_t count_line_ends(const std::string& content, size_t end) {
  int64_t n = 0;
  for (size_t i = 0; i < end && i < content.size(); ++i) {
    n += content[i] == '\n' ||
         (content[i] == '\r' && (i + 1 >= content.size() || content[i + 1] != '\n'));
  }
  return n;
}

// The top-level elements of `content` (a JSON array starting at byte `pos`), each with the
// 1-based line where it starts; invalid JSON throws "<name>:<line>: ..." naming the line of the
// error. Elements are re-parsed one by one, so a bad record is an error (or a skip) of its own.
std::vector<ArrayRecord> split_json_array(const std::string& content, size_t pos,
                                          const std::string& name) {
  auto line_at = [&](size_t byte) { return 1 + count_line_ends(content, byte); };
  try {
    const json whole =
        json::parse(content.begin() + static_cast<std::ptrdiff_t>(pos), content.end());
    TORCH_CHECK(whole.is_array(), name, ": expected a JSON array of records");
  } catch (const json::parse_error& e) {
    TORCH_CHECK(false, name, ":", line_at(pos + (e.byte > 0 ? e.byte - 1 : 0)),
                ": bad JSON array: ", e.what());
  } catch (const json::exception& e) {  // out_of_range for numbers like 1e400
    TORCH_CHECK(false, name, ": bad JSON array: ", e.what());
  }
  std::vector<ArrayRecord> out;
  int depth = 0;
  bool in_string = false, escaped = false;
  size_t start = std::string::npos;
  for (size_t i = pos; i < content.size(); ++i) {
    const char ch = content[i];
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (ch == '\\') {
        escaped = true;
      } else if (ch == '"') {
        in_string = false;
      }
      continue;
    }
    if (ch == '"') {
      in_string = true;
    } else if (ch == '[' || ch == '{') {
      ++depth;
    } else if (ch == ']' || ch == '}') {
      --depth;
    }
    const bool boundary = (depth == 1 && ch == ',') || (depth == 0 && ch == ']');
    if (boundary && start != std::string::npos) {
      out.push_back({content.substr(start, i - start), line_at(start)});
      start = std::string::npos;
    } else if (depth >= 1 && start == std::string::npos && !(depth == 1 && ch == '[') &&
               !(depth == 1 && ch == ',') && std::isspace(static_cast<unsigned char>(ch)) == 0) {
      start = i;
    }
    if (depth == 0) break;
  }
  return out;
}

void for_each_record(const std::string& content, const std::string& name, LoadSummary* summary,
                     const std::function<void(const std::string&, int64_t)>& take) {
  size_t pos = content.rfind(kUtf8Bom, 0) == 0 ? sizeof(kUtf8Bom) - 1 : 0;
  const size_t first = content.find_first_not_of(" \t\r\n", pos);
  if (first != std::string::npos && content[first] == '[') {
    summary->json_array = true;
    summary->lines = count_line_ends(content, content.size()) +
                     ((content.back() == '\n' || content.back() == '\r') ? 0 : 1);
    for (const ArrayRecord& r : split_json_array(content, first, name)) take(r.text, r.line);
    return;
  }
  int64_t line_no = 0;
  while (pos < content.size()) {
    size_t nl = content.find_first_of("\r\n", pos);
    if (nl == std::string::npos) nl = content.size();
    const std::string line = content.substr(pos, nl - pos);
    pos = nl + (content.compare(nl, 2, "\r\n") == 0 ? 2 : 1);
    summary->lines = ++line_no;
    if (is_blank(line)) {
      ++summary->ignored;
      continue;
    }
    take(line, line_no);
  }
}

void skip_or_fail(LoadSummary* s, const DatasetOptions& options, const std::string& name,
                  int64_t line, const std::string& reason, const char* unit) {
  TORCH_CHECK(options.on_error == OnError::kSkip, name, ":", line, ": ", reason,
              options.skip_hint.empty()
                  ? std::string()
                  : " (" + options.skip_hint + " to skip malformed " + unit + ")");
  ++s->skipped;
  if (static_cast<int64_t>(s->first_skipped.size()) < LoadSummary::kMaxReported) {
    s->first_skipped.push_back({line, reason});
  }
}

void load_records(const std::string& content, const std::string& name,
                  const DatasetOptions& options, LoadSummary* summary,
                  const std::function<void(const std::string&, int64_t)>& take) {
  TORCH_CHECK(io::utf8::find_invalid(options.system_prompt) == std::string::npos,
              "system_prompt: not valid UTF-8");
  summary->path = name;
  for_each_record(content, name, summary, [&](const std::string& text, int64_t line) {
    try {
      take(text, line);
    } catch (const BadRecord& bad) {
      skip_or_fail(summary, options, name, line, bad.reason, "records");
    }
  });
}

std::string read_data_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), path, ": cannot open data file");
  std::ostringstream ss;
  ss << in.rdbuf();
  TORCH_CHECK(!in.bad(), path, ": read error");
  return ss.str();
}

}  // namespace json_records

namespace {

using json_records::ArrayRecord;
using json_records::count_line_ends;
using json_records::read_data_file;
using json_records::skip_or_fail;
using json_records::split_json_array;

DataFormat resolve_format(DataFormat f, const std::string& name) {
  if (f != DataFormat::kAuto) return f;
  const size_t dot = name.rfind('.');
  const std::string ext = dot == std::string::npos ? "" : lower(name.substr(dot + 1));
  if (ext == "tsv") return DataFormat::kTsv;
  if (ext == "jsonl" || ext == "json") return DataFormat::kJsonl;  // JSON lines or one array
  if (ext == "txt" || ext == "text") return DataFormat::kText;
  TORCH_CHECK(false, name, ": cannot infer the data format from the file extension \"", ext,
              "\"; expected .tsv, .jsonl/.json or .txt, or set the format to tsv, jsonl or text");
  return f;
}

// A text file read by paragraphs or as one document (TextUnit::kParagraph, kFile) from byte
// `pos`: its lines (split as the line reader splits them) joined by "\n", blank lines separating
// paragraphs and, at either end of a document, dropped. A line with invalid UTF-8 makes its
// document an error or (on_error: skip) a skip naming that line.
void load_text_documents(const std::string& content, size_t pos, const Tokenizer& tok,
                         const DatasetOptions& options, Dataset* ds) {
  std::string doc, bad;
  int64_t first = 0, bad_line = 0, line_no = 0;
  const auto flush = [&] {
    if (first == 0) return;
    if (!bad.empty()) {
      skip_or_fail(&ds->summary, options, ds->summary.path, bad_line, bad, "documents");
    } else {
      Example ex = text_example(doc, tok, options);
      ex.source_line = first;
      ds->summary.tokens += static_cast<int64_t>(ex.input_ids.size());
      ds->summary.supervised_tokens += static_cast<int64_t>(ex.labels.size());
      ds->examples.push_back(std::move(ex));
    }
    doc.clear();
    bad.clear();
    first = 0;
  };
  std::string blanks;  // blank lines inside a file's document, kept once text follows
  while (pos < content.size()) {
    size_t nl = content.find_first_of("\r\n", pos);
    if (nl == std::string::npos) nl = content.size();
    const std::string line = content.substr(pos, nl - pos);
    pos = nl + (content.compare(nl, 2, "\r\n") == 0 ? 2 : 1);
    ds->summary.lines = ++line_no;
    if (is_blank(line)) {
      ++ds->summary.ignored;
      if (options.text_unit == TextUnit::kParagraph) flush();
      if (first != 0) blanks += line + "\n";
      continue;
    }
    if (first == 0) {
      first = line_no;
    } else {
      doc += "\n" + blanks;
    }
    blanks.clear();
    doc += line;
    if (bad.empty()) {
      try {
        check_utf8(line);
      } catch (const BadLine& b) {
        bad = b.reason;
        bad_line = line_no;
      }
    }
  }
  flush();
}

}  // namespace

DataFormat parse_data_format(const std::string& name) {
  const std::string n = lower(name);
  if (n == "json") return DataFormat::kJsonl;
  if (n == "txt") return DataFormat::kText;
  return io::parse_enum<DataFormat>(n, "data format");
}

OnError parse_on_error(const std::string& name) {
  return io::parse_enum<OnError>(lower(name), "on_error");
}

TextUnit parse_text_unit(const std::string& name) {
  return io::parse_enum<TextUnit>(lower(name), "text_unit");
}

std::string LoadSummary::format_name() const {
  if (jsonl_formats.empty()) return json_array ? "json array" : "";
  const std::string base = json_array ? "json array" : "jsonl";
  if (jsonl_formats.size() == 1) return base + " (" + jsonl_formats.begin()->first + ")";
  std::string s = base + " (mixed:";
  for (const auto& [k, n] : jsonl_formats) s += " " + k + " " + std::to_string(n) + ",";
  s.back() = ')';
  return s;
}

std::string LoadSummary::to_string() const {
  std::ostringstream s;
  s << path << ": " << examples << " examples from " << lines << " lines (" << ignored
    << " blank/comment/header), " << skipped << " skipped, " << tokens << " tokens, "
    << supervised_tokens << " supervised";
  if (!format_name().empty()) s << ", format " << format_name();
  if (reasoning_dropped > 0) {
    s << "\n  " << reasoning_dropped
      << " assistant turns' reasoning not rendered (the chat template drops it: see "
         "data.chat_template)";
  }
  for (const auto& k : first_skipped) s << "\n  skipped line " << k.line << ": " << k.reason;
  if (skipped > static_cast<int64_t>(first_skipped.size())) {
    s << "\n  ... and " << (skipped - static_cast<int64_t>(first_skipped.size())) << " more";
  }
  return s.str();
}

Example make_pair_example(const Tokenizer& tokenizer, const std::string& prompt,
                          const std::string& answer, const std::string& system_prompt,
                          const ChatOptions& chat) {
  std::vector<Message> msgs;
  if (!system_prompt.empty()) msgs.push_back({"system", system_prompt});
  msgs.push_back({"user", prompt});
  msgs.push_back({"assistant", answer});
  return from_chat(tokenize_chat(tokenizer, msgs, false, chat), 0);
}

Dataset load_dataset_from_string(const std::string& content, const std::string& name,
                                 const Tokenizer& tokenizer, const DatasetOptions& options) {
  const DataFormat format = resolve_format(options.format, name);
  TORCH_CHECK(io::utf8::find_invalid(options.system_prompt) == std::string::npos,
              "system_prompt: not valid UTF-8");
  Dataset ds;
  ds.summary.path = name;
  bool seen_content = false;  // TSV header is only recognized before the first data line
  // A UTF-8 byte-order mark (editors on Windows write one) is not part of the first line.
  size_t pos = content.rfind(kUtf8Bom, 0) == 0 ? sizeof(kUtf8Bom) - 1 : 0;
  // A JSON file whose first character is '[' is one JSON array of records (alpaca_data.json and
  // the like), whatever its extension says; each element is read like a JSONL line.
  const size_t first = content.find_first_not_of(" \t\r\n", pos);
  if (format == DataFormat::kJsonl && first != std::string::npos && content[first] == '[') {
    ds.summary.json_array = true;
    const int64_t ends = count_line_ends(content, content.size());
    const bool last_ended = content.back() == '\n' || content.back() == '\r';
    ds.summary.lines = ends + (last_ended ? 0 : 1);
    for (const ArrayRecord& r : split_json_array(content, first, name)) {
      try {
        check_utf8(r.text);
        std::string kind;
        Example ex = parse_jsonl(r.text, r.line, tokenizer, options, &kind);
        ++ds.summary.jsonl_formats[kind];
        ex.source_line = r.line;
        count_example(ex, &ds.summary);
        ds.examples.push_back(std::move(ex));
      } catch (const BadLine& bad) {
        skip_or_fail(&ds.summary, options, name, r.line, bad.reason, "records");
      }
    }
    ds.summary.examples = static_cast<int64_t>(ds.examples.size());
    return ds;
  }
  if (format == DataFormat::kText && options.text_unit != TextUnit::kLine) {
    load_text_documents(content, pos, tokenizer, options, &ds);
    ds.summary.examples = static_cast<int64_t>(ds.examples.size());
    return ds;
  }
  int64_t line_no = 0;
  while (pos < content.size()) {
    // "\n", "\r\n" and a lone "\r" (old Mac tools) each end a line: a raw CR is never part of
    // a record (JSON escapes it, and a TSV or text line holding one would merge two records).
    size_t nl = content.find_first_of("\r\n", pos);
    if (nl == std::string::npos) nl = content.size();
    std::string line = content.substr(pos, nl - pos);
    pos = nl + (content.compare(nl, 2, "\r\n") == 0 ? 2 : 1);
    ++line_no;
    ds.summary.lines = line_no;
    if (is_blank(line)) {
      ++ds.summary.ignored;
      continue;
    }
    try {
      Example ex;
      if (format == DataFormat::kTsv) {
        if (line[0] == '#') {
          ++ds.summary.ignored;
          continue;
        }
        check_utf8(line);
        const size_t tab = line.find('\t');
        if (!seen_content) {
          seen_content = true;
          const std::string l = lower(line);
          if (l == "prompt\tanswer" || l == "prompt\ttarget" || l == "prompt\tresponse") {
            ++ds.summary.ignored;
            continue;
          }
        }
        if (tab == std::string::npos) {
          throw BadLine{"expected prompt<TAB>answer, found no tab in " + quote_excerpt(line)};
        }
        const std::string answer = line.substr(tab + 1);
        if (is_blank(answer)) throw BadLine{"empty answer after the tab"};
        ex = make_pair_example(tokenizer, line.substr(0, tab), answer, options.system_prompt,
                               options.chat);
      } else if (format == DataFormat::kJsonl) {
        check_utf8(line);
        std::string kind;
        ex = parse_jsonl(line, line_no, tokenizer, options, &kind);
        ++ds.summary.jsonl_formats[kind];
      } else {
        check_utf8(line);
        ex = text_example(line, tokenizer, options);
      }
      ex.source_line = line_no;
      count_example(ex, &ds.summary);
      ds.examples.push_back(std::move(ex));
    } catch (const BadLine& bad) {
      skip_or_fail(&ds.summary, options, name, line_no, bad.reason, "lines");
    }
  }
  ds.summary.examples = static_cast<int64_t>(ds.examples.size());
  return ds;
}

PreferenceDataset load_preference_dataset_from_string(const std::string& content,
                                                      const std::string& name,
                                                      const Tokenizer& tokenizer,
                                                      const DatasetOptions& options) {
  PreferenceDataset ds;
  json_records::load_records(
      content, name, options, &ds.summary, [&](const std::string& text, int64_t line) {
        check_utf8(text);
        PreferencePair p = parse_preference(parse_object(text), tokenizer, options);
        p.source_line = p.chosen.source_line = p.rejected.source_line = line;
        count_example(p.chosen, &ds.summary);
        count_example(p.rejected, &ds.summary);
        ++ds.summary.jsonl_formats["trl preference"];
        ds.pairs.push_back(std::move(p));
      });
  ds.summary.examples = static_cast<int64_t>(ds.pairs.size());
  return ds;
}

PreferenceDataset load_preference_dataset(const std::string& path, const Tokenizer& tokenizer,
                                          const DatasetOptions& options) {
  return load_preference_dataset_from_string(read_data_file(path), path, tokenizer, options);
}

Dataset load_dataset(const std::string& path, const Tokenizer& tokenizer,
                     const DatasetOptions& options) {
  return load_dataset_from_string(read_data_file(path), path, tokenizer, options);
}

}  // namespace q4::data
