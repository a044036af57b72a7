// q4tok: line-oriented front end of the q4_data tokenizer, chat template and loaders.
//   encode: one JSON string per stdin line  -> one JSON array of ids per line
//   decode: one JSON array of ids per line  -> one JSON string per line (invalid UTF-8 -> U+FFFD)
//   chat:   one JSON conversation per line ({"messages":[...], "tools":[...]} or [...]) -> one
//           JSON object {"rendered", "ids", "mask"} per line (mask 1 = supervised); the chat
//           template by --chat-template / --enable-thinking (docs/data.md "Chat templates")
//   data:   load a dataset file and print its LoadSummary and token counts, then what truncation
//           to --seq-len does to it (the counts the trainer prints, and its warning); with
//           --show N, the first N examples as the model sees them (the rendered text, trained
//           spans marked); --preference reads TRL preference pairs and shows each pair's two
//           answers
// Input lines are at most kMaxLineBytes (a stream without newlines, e.g. /dev/zero, is an error
// naming the line, not an endless read).
// Exit codes: 0 ok, 2 usage or input error, 1 runtime error.
#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <iostream>
#include <limits>
#include <nlohmann/json.hpp>
#include <string>

#include "../tool_main.h"
#include "q4/data/chat.h"
#include "q4/data/chat_json.h"
#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/io/bounded_read.h"

namespace {

using json = nlohmann::json;
using q4::data::TokenId;

using q4::tools::InputError;  // an input line that is not what the command expects (exit 2)

// The longest stdin line: one JSON document; a whole book's text fits.
constexpr size_t kMaxLineBytes = size_t{64} << 20;

// The largest tokenizer.json read (Qwen3's is 11 MB).
constexpr size_t kMaxTokenizerBytes = size_t{256} << 20;

// Line `line_no` of stdin into `line`; false at the end of input.
bool next_line(std::string& line, int64_t line_no) {
  switch (q4::io::read_line_bounded(std::cin, line, kMaxLineBytes)) {
    case q4::io::LineRead::kEof:
      return false;
    case q4::io::LineRead::kTooLong:
      throw InputError("stdin:" + std::to_string(line_no) + ": line longer than " +
                       q4::io::format_byte_limit(kMaxLineBytes) + " (one JSON value per line)");
    case q4::io::LineRead::kLine:
      break;
  }
  return true;
}

json parse_line(const std::string& line, int64_t line_no) {
  try {
    return json::parse(line);
  } catch (const json::exception& e) {  // parse_error, and out_of_range for numbers like 1e400
    throw InputError("stdin:" + std::to_string(line_no) + ": bad JSON: " + e.what());
  }
}

void run_encode(const q4::data::Tokenizer& tok) {
  std::string line;
  for (int64_t n = 1; next_line(line, n); ++n) {
    const json j = parse_line(line, n);
    if (!j.is_string()) {
      throw InputError("stdin:" + std::to_string(n) + ": expected a JSON string, found " +
                       j.type_name());
    }
    std::cout << json(tok.encode(j.get<std::string>())).dump() << '\n';
  }
}

void run_decode(const q4::data::Tokenizer& tok, bool skip_special) {
  std::string line;
  for (int64_t n = 1; next_line(line, n); ++n) {
    const json j = parse_line(line, n);
    const std::string where = "stdin:" + std::to_string(n);
    if (!j.is_array()) throw InputError(where + ": expected a JSON array of ids");
    // Checked element by element: nlohmann's get<int32_t> converts 1.5, true and 4294967297
    // silently (to 1, 1 and 1) and 1e23 to INT32_MIN.
    std::vector<TokenId> ids;
    ids.reserve(j.size());
    for (size_t k = 0; k < j.size(); ++k) {
      const json& v = j[k];
      const bool in_range = v.is_number_unsigned()
                                ? v.get<uint64_t>() <= uint64_t{INT32_MAX}
                                : v.is_number_integer() && v.get<int64_t>() >= 0 &&
                                      v.get<int64_t>() <= int64_t{INT32_MAX};
      if (!in_range) {
        std::string found = v.dump();
        if (found.size() > 40) found = found.substr(0, 40) + "...";
        throw InputError(where + ": element " + std::to_string(k) +
                         ": expected a token id (integer 0.." + std::to_string(INT32_MAX) +
                         "), found " + found);
      }
      ids.push_back(static_cast<TokenId>(v.get<int64_t>()));
    }
    std::cout << json(tok.decode_lossy(ids, skip_special)).dump() << '\n';
  }
}

// A conversation per line: {"messages": [...], "tools": [...]} or [...messages].
void run_chat(const q4::data::Tokenizer& tok, bool add_generation_prompt,
              const q4::data::ChatOptions& chat) {
  using q4::data::ordered_json;
  std::string line;
  for (int64_t n = 1; next_line(line, n); ++n) {
    const std::string where = "stdin:" + std::to_string(n);
    ordered_json j;
    try {
      j = ordered_json::parse(line);  // ordered: tool definitions print in their order
    } catch (const ordered_json::exception& e) {
      throw InputError(where + ": bad JSON: " + e.what());
    }
    const ordered_json& jm = j.is_object() && j.contains("messages") ? j["messages"] : j;
    if (!jm.is_array()) {
      throw InputError(where + ": expected {\"messages\": [...]} or an array of messages");
    }
    std::vector<q4::data::Message> msgs;
    q4::data::ToolList tools;
    try {
      msgs = q4::data::messages_from_json(jm, "messages");
      tools = q4::data::tools_from_json(j);
    } catch (const q4::data::ChatJsonError& e) {
      throw InputError(where + ": " + e.what());
    }
    const auto t = q4::data::tokenize_chat(tok, msgs, add_generation_prompt, chat, tools);
    std::vector<int> mask(t.labels.size());
    for (size_t k = 0; k < mask.size(); ++k) mask[k] = t.labels[k] != q4::data::kIgnoreIndex;
    json out = {{"rendered", q4::data::render_chat(msgs, add_generation_prompt, chat, tools)},
                {"ids", t.input_ids},
                {"mask", mask}};
    std::cout << out.dump() << '\n';
  }
}

// Marks around the tokens an example trains on (rare in real text, unlike brackets).
constexpr const char* kTrainedOpen = "\u27e6";   // ⟦
constexpr const char* kTrainedClose = "\u27e7";  // ⟧

// One example as the model sees it: the text its tokens decode to (the rendered chat template
// for chat formats, the raw line for text) with each run of trained tokens between the marks. As
// in a batch, an example's first token is never a target.
void show_example(const q4::data::Tokenizer& tok, const q4::data::Example& ex,
                  const std::string& title) {
  auto trained = [&](size_t k) { return k > 0 && ex.labels[k] != q4::data::kIgnoreIndex; };
  int64_t num_trained = 0;
  for (size_t k = 0; k < ex.labels.size(); ++k) num_trained += trained(k);
  std::cout << "--- " << title << ": " << ex.input_ids.size() << " tokens, " << num_trained
            << " trained\n";
  std::string text;
  for (size_t k = 0; k < ex.input_ids.size();) {
    size_t e = k;
    while (e < ex.input_ids.size() && trained(e) == trained(k)) ++e;
    const std::string span = tok.decode_lossy(
        std::vector<TokenId>(ex.input_ids.begin() + static_cast<std::ptrdiff_t>(k),
                             ex.input_ids.begin() + static_cast<std::ptrdiff_t>(e)));
    text += trained(k) ? kTrainedOpen + span + kTrainedClose : span;
    k = e;
  }
  std::cout << text << (text.empty() || text.back() != '\n' ? "\n" : "");
}

void print_marks_legend() {
  std::cout << "trained tokens are shown between " << kTrainedOpen << " and " << kTrainedClose
            << "\n";
}

// What truncation to `seq_len` does to `examples` (in groups of `group`: a preference pair), as
// the trainer's start lines say it; the warning on stderr.
void print_truncation(std::vector<q4::data::Example> examples, int64_t seq_len,
                      q4::data::Truncation truncation, int64_t group) {
  q4::data::BatcherOptions bo;
  bo.max_seq_len = seq_len;
  bo.truncation = truncation;
  bo.group = group;
  bo.batch_size = group;
  bo.shuffle = false;
  const q4::data::Batcher b(std::move(examples), bo);
  std::cout << "truncation to " << seq_len << " tokens (" << q4::data::describe(truncation)
            << "): " << b.truncation_stats().to_string() << "\n";
  const std::string w =
      q4::data::truncation_warning(b.truncation_stats(), seq_len, truncation,
                                   "--seq-len (train.seq_len)", "--truncation (data.truncation)");
  if (!w.empty()) std::cerr << "warning: " << w << "\n";
}

// The first `n` examples of `ds` as the model sees them.
void show_examples(const q4::data::Tokenizer& tok, const q4::data::Dataset& ds, int64_t n) {
  print_marks_legend();
  const auto count = std::min<int64_t>(n, static_cast<int64_t>(ds.examples.size()));
  for (int64_t i = 0; i < count; ++i) {
    const auto& ex = ds.examples[static_cast<size_t>(i)];
    show_example(tok, ex,
                 "example " + std::to_string(i + 1) + " (" + ds.summary.path + ":" +
                     std::to_string(ex.source_line) + ")");
  }
}

// The first `n` preference pairs: each answer as the model sees it (only the answer trained).
void show_pairs(const q4::data::Tokenizer& tok, const q4::data::PreferenceDataset& ds, int64_t n) {
  print_marks_legend();
  const auto count = std::min<int64_t>(n, static_cast<int64_t>(ds.pairs.size()));
  for (int64_t i = 0; i < count; ++i) {
    const auto& p = ds.pairs[static_cast<size_t>(i)];
    const std::string where = "pair " + std::to_string(i + 1) + " (" + ds.summary.path + ":" +
                              std::to_string(p.source_line) + ")";
    show_example(tok, p.chosen, where + " chosen");
    show_example(tok, p.rejected, where + " rejected");
  }
}

// The command line: the subcommands and every option they take.
struct TokArgs {
  std::string tokenizer_path;
  bool skip_special = false, gen_prompt = false, preference = false;
  std::string chat_template = "auto", enable_thinking;
  std::string data_path, format = "auto", on_error = "fail", system_prompt;
  std::string truncation = "auto", text_unit = "file";
  int64_t seq_len = 256, show = 0;
  CLI::App *enc = nullptr, *dec = nullptr, *chat = nullptr, *data = nullptr;
};

void add_data_command(CLI::App& app, TokArgs& a) {
  a.data = app.add_subcommand("data", "load a dataset file and print its summary");
  CLI::App* data = a.data;
  data->add_option("--tokenizer", a.tokenizer_path, "HF tokenizer.json")->required();
  data->add_option("--data", a.data_path, "TSV / JSONL / text file")->required();
  data->add_option("--format", a.format, "auto | tsv | jsonl | text");
  data->add_option("--on-error", a.on_error, "fail | skip");
  data->add_option("--system", a.system_prompt, "system prompt");
  data->add_option("--text-unit", a.text_unit,
                   "a text file's examples: file | paragraph | line (data.text_unit)")
      ->capture_default_str();
  data->add_option("--seq-len", a.seq_len,
                   "tokens per row truncation is counted for (train.seq_len)")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{2}, std::numeric_limits<int64_t>::max()));
  data->add_option("--truncation", a.truncation,
                   "auto | cut_left | cut_right | drop | split (data.truncation)")
      ->capture_default_str();
}

void add_commands(CLI::App& app, TokArgs& a) {
  app.require_subcommand(1);
  auto add_tok = [&](CLI::App* sub) {
    sub->add_option("--tokenizer", a.tokenizer_path, "HF tokenizer.json")->required();
  };
  auto add_template = [&](CLI::App* sub) {
    sub->add_option("--chat-template", a.chat_template,
                    "auto (the template beside --tokenizer, identified; qwen3-2507-instruct when "
                    "there is none), qwen3, qwen3-2507-instruct or qwen3-2507-thinking")
        ->check(CLI::IsMember(q4::io::enum_names<q4::data::ChatTemplate>()));
    sub->add_option("--enable-thinking", a.enable_thinking,
                    "true | false: HF's enable_thinking (default: unset, thinking on)")
        ->check(CLI::IsMember({"true", "false"}));
  };
  a.enc = app.add_subcommand("encode", "JSON string per line -> JSON array of ids per line");
  add_tok(a.enc);
  a.dec = app.add_subcommand("decode", "JSON array of ids per line -> JSON string per line");
  add_tok(a.dec);
  a.dec->add_flag("--skip-special", a.skip_special, "drop special added tokens");
  a.chat = app.add_subcommand("chat", "JSON conversation per line -> rendered, ids, mask");
  add_tok(a.chat);
  a.chat->add_flag("--add-generation-prompt", a.gen_prompt, "append <|im_start|>assistant\\n");
  add_template(a.chat);
  add_data_command(app, a);
  add_template(a.data);
  a.data
      ->add_option("--show", a.show,
                   "print the first N examples (pairs) as the model sees them (trained tokens "
                   "marked)")
      ->check(CLI::NonNegativeNumber);
  a.data->add_flag("--preference", a.preference,
                   "read TRL preference pairs {prompt, chosen, rejected} (train.objective "
                   "preference)");
}

// The data subcommand: the dataset's summary, what truncation does to it, and --show.
void run_data(const q4::data::Tokenizer& tok, const q4::data::ChatOptions& chat_opt,
              const TokArgs& a) {
  q4::data::DatasetOptions opt;
  opt.format = q4::data::parse_data_format(a.format);
  opt.on_error = q4::data::parse_on_error(a.on_error);
  opt.system_prompt = a.system_prompt;
  opt.text_unit = q4::data::parse_text_unit(a.text_unit);
  const auto policy = q4::data::parse_truncation(a.truncation);
  opt.skip_hint = "pass --on-error skip";
  opt.preference_hint = "pass --preference to read preference pairs";
  opt.chat = chat_opt;
  // Any size, but a regular file: a FIFO or /dev/zero would block or never end.
  q4::io::check_regular_file(a.data_path, std::numeric_limits<size_t>::max(), "--data");
  if (a.preference) {
    const auto ds = q4::data::load_preference_dataset(a.data_path, tok, opt);
    std::cout << ds.summary.to_string() << '\n';
    std::vector<q4::data::Example> examples;
    for (const auto& p : ds.pairs) {
      examples.push_back(p.chosen);
      examples.push_back(p.rejected);
    }
    if (!examples.empty()) print_truncation(std::move(examples), a.seq_len, policy, 2);
    if (a.show > 0) show_pairs(tok, ds, a.show);
  } else {
    const auto ds = q4::data::load_dataset(a.data_path, tok, opt);
    std::cout << ds.summary.to_string() << '\n';
    if (!ds.examples.empty()) print_truncation(ds.examples, a.seq_len, policy, 1);
    if (a.show > 0) show_examples(tok, ds, a.show);
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4tok: Qwen3 tokenizer, chat template and dataset tool"};
  TokArgs a;
  add_commands(app, a);
  std::ios::sync_with_stdio(false);
  // Every library call reads the user's tokenizer or data: its errors are input errors.
  q4::tools::run_tool(
      "q4tok", app, argc, argv,
      [&] {
        // from_file reads the whole file: a FIFO or /dev/zero named here would never end.
        q4::io::check_regular_file(a.tokenizer_path, kMaxTokenizerBytes, "--tokenizer");
        const auto tok = q4::data::Tokenizer::from_file(a.tokenizer_path);
        q4::data::ChatOptions chat_opt;
        chat_opt.chat_template = q4::data::resolve_chat_template(
            q4::io::parse_enum<q4::data::ChatTemplate>(a.chat_template, "--chat-template"),
            q4::data::tokenizer_folder(a.tokenizer_path));
        if (!a.enable_thinking.empty()) chat_opt.enable_thinking = a.enable_thinking == "true";
        if (*a.enc) run_encode(tok);
        if (*a.dec) run_decode(tok, a.skip_special);
        if (*a.chat) run_chat(tok, a.gen_prompt, chat_opt);
        if (*a.data) run_data(tok, chat_opt, a);
        return 0;
      },
      /*library_error_code=*/2);
}
