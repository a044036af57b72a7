// q4chat: chat with a Qwen3 model (.dat, q4train run directory, or a model folder) through the
// Qwen3 chat template. Greedy (--temperature 0) or sampled (temperature, top-k, top-p, seed,
// repetition penalty); the reply streams as it is decoded and ends at <|im_end|>. One-shot with
// --prompt; otherwise interactive multi-turn on stdin (one line per turn, at most
// kMaxInputLineBytes; empty line, "/exit" or EOF ends; "/reset" starts over; any other "/word"
// is an unknown command, "//" sends a line beginning with "/"), the KV cache kept across turns,
// with line editing on a terminal when libedit2 is installed (line_input.h).
// Exit codes: 0 ok, 2 usage/config/input error, 1 runtime.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <charconv>
#include <chrono>
#include <clocale>
#include <iostream>
#include <limits>
#include <memory>
#include <string>

#include "../tool_main.h"
#include "line_input.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "q4/model/sampling.h"
#include "q4/trainer/config/config.h"
#include "session.h"

namespace {

using q4::chat::as_input;
using q4::chat::InputError;

// --seed as given: a decimal integer in the generator's range. CLI11 would wrap -1 and saturate
// 2^64 to 2^64-1, so two different seeds would silently give the same replies.
uint64_t parse_seed(const std::string& s) {
  uint64_t v = 0;
  const char* end = s.data() + s.size();
  const auto r = std::from_chars(s.data(), end, v);
  if (s.empty() || r.ec != std::errc() || r.ptr != end) {
    throw InputError("--seed: expected an integer in 0.." +
                     std::to_string(std::numeric_limits<uint64_t>::max()) + ", got '" + s + "'");
  }
  return v;
}

// Text the tokenizer must take (it refuses invalid UTF-8): checked before a turn, so the error
// names where the text came from (an option or a stdin line).
void check_text(const q4::data::Tokenizer& tok, const std::string& text, const std::string& where) {
  try {
    (void)tok.encode(text);
  } catch (const c10::Error& e) {
    throw InputError(where + ": " + e.msg());
  }
}

// A user line that is a command: "/" and letters, nothing else ("/usr/bin is ..." is text).
bool is_command(const std::string& line) {
  if (line.size() < 2 || line[0] != '/') return false;
  for (size_t i = 1; i < line.size(); ++i) {
    if (!std::isalpha(static_cast<unsigned char>(line[i]))) return false;
  }
  return true;
}

// The command line of q4chat.
struct ChatArgs {
  q4::chat::ModelArgs m;
  std::string prompt, seed = "0";
  q4::model::SamplingParams so;
  int64_t max_new = 512;
  bool quiet = false;
};

void add_chat_options(CLI::App& app, ChatArgs& a) {
  a.so.temperature = 0.7;
  a.so.top_p = 0.8;
  a.so.top_k = 20;
  q4::chat::add_model_options(app, a.m);
  app.add_option("--prompt", a.prompt, "one-shot: answer this and exit (default: interactive)");
  app.add_option("--temperature", a.so.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", a.so.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", a.so.top_p, "1 = off")->capture_default_str();
  app.add_option("--seed", a.seed, "sampling seed, 0..2^64-1")->capture_default_str();
  app.add_option("--repetition-penalty", a.so.repetition_penalty, "1 = off")->capture_default_str();
  app.add_option("--max-new-tokens", a.max_new, "tokens per reply at most")->capture_default_str();
  app.add_flag("--quiet", a.quiet, "no load/speed lines on stderr");
}

// What a chat needs once the options are read: the tokenizer, the model and the template.
struct ChatSetup {
  std::unique_ptr<q4::data::Tokenizer> tok;
  q4::chat::LoadedModel loaded;
  q4::data::ChatOptions chat_opt;
};

// Checks the options and loads the tokenizer and model (every error here is the user's input).
ChatSetup load_chat(ChatArgs& a) {
  using namespace q4;
  const auto t0 = std::chrono::steady_clock::now();
  const model::ModelOptions opt = chat::inference_options(a.m.device);
  ChatSetup s;
  as_input([&] {
    a.so.seed = parse_seed(a.seed);
    a.so.validate("", /*cli=*/true);
    TORCH_CHECK(a.max_new > 0, "--max-new-tokens: expected > 0, got ", a.max_new);
    const chat::ModelPaths paths = chat::resolve_model_paths(a.m.model, a.m.config, a.m.tokenizer);
    s.tok = std::make_unique<data::Tokenizer>(chat::load_tokenizer(paths));
    // A run's system prompt is what its model was trained with; --system (even empty) wins.
    if (!a.m.system_given() && !paths.system_prompt.empty()) {
      a.m.system = paths.system_prompt;
      if (!a.quiet) std::cerr << "q4chat: system prompt from the run's data.system_prompt\n";
    }
    s.chat_opt = chat::chat_options(a.m, paths);
    if (!a.quiet) {
      const auto& th = s.chat_opt.enable_thinking;
      std::cerr << "q4chat: chat template " << io::enum_name(s.chat_opt.chat_template)
                << (th ? *th ? ", enable_thinking true" : ", enable_thinking false" : "") << "\n";
    }
    check_text(*s.tok, a.prompt, "--prompt");
    check_text(*s.tok, a.m.system, a.m.system_given() ? "--system" : "data.system_prompt");
    s.loaded = chat::load_model(paths, *s.tok, opt, a.m.adapter);
    const auto& cfg = s.loaded.config;
    if (!a.quiet) {
      std::cerr << fmt::format(
          "q4chat: {}: {}{} ({} layers, hidden {}, {}), loaded in {:.1f} s\n", paths.described,
          paths.weights, a.m.adapter.empty() ? "" : " with adapter " + a.m.adapter,
          cfg.num_hidden_layers, cfg.hidden_size, a.m.device,
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (!s.loaded.adapter_summary.empty())
        std::cerr << "q4chat: " << s.loaded.adapter_summary << "\n";
    }
    return 0;
  });
  return s;
}

// A session over the loaded model; replies stream to stdout, a speed line goes to stderr.
class Chat {
 public:
  Chat(const ChatArgs& a, const ChatSetup& s) : a_(a), s_(s) { reset(); }
  void reset() {
    session_ = std::make_unique<q4::chat::ChatSession>(*s_.loaded.model, *s_.tok, a_.so,
                                                       a_.m.system, a_.max_new, s_.chat_opt);
  }
  void turn(const std::string& text) {
    const auto t = std::chrono::steady_clock::now();
    const auto r =
        session_->turn(text, [](const std::string& piece) { std::cout << piece << std::flush; });
    std::cout << "\n";
    if (a_.quiet) return;
    const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
    std::cerr << fmt::format("[{} tokens, {:.1f} tok/s{}]\n", r.tokens.size(),
                             sec > 0 ? static_cast<double>(r.tokens.size()) / sec : 0.0,
                             r.stopped ? "" : ", no stop token");
  }
  const q4::data::Tokenizer& tokenizer() const { return *s_.tok; }

 private:
  const ChatArgs& a_;
  const ChatSetup& s_;
  std::unique_ptr<q4::chat::ChatSession> session_;
};

// Interactive turns on stdin until an empty line, /exit or EOF.
int interactive(Chat& chat) {
  const bool tty = ::isatty(0) != 0;
  constexpr const char* kCommands = "/reset, /exit";
  if (tty) {
    std::setlocale(LC_CTYPE, "");  // libedit edits UTF-8 (CJK) lines by the terminal's locale
    std::cerr << "q4chat: one message per line; /reset starts over, /exit or EOF ends\n";
  }
  q4::chat::LineInput input(std::cin, /*edit=*/tty);
  std::string line;
  while (true) {
    try {
      if (!input.next(tty ? "> " : "", line)) break;
    } catch (const std::length_error& e) {
      throw InputError(e.what());
    }
    if (line == "/exit" || line.empty()) break;
    if (line == "/reset") {
      chat.reset();
      continue;
    }
    if (is_command(line)) {
      std::cerr << "q4chat: unknown command " << line << "; commands: " << kCommands
                << " (start a message with // to send text beginning with /)\n";
      continue;
    }
    if (line.rfind("//", 0) == 0) line.erase(0, 1);
    const std::string where = "stdin line " + std::to_string(input.line_number());
    if (tty) {
      // At a terminal a bad line is reported and the conversation goes on.
      try {
        check_text(chat.tokenizer(), line, where);
      } catch (const InputError& e) {
        std::cerr << "q4chat: error: " << e.what() << "\n";
        continue;
      }
    } else {
      check_text(chat.tokenizer(), line, where);
    }
    chat.turn(line);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4chat: chat with a Qwen3 model through the chat template"};
  ChatArgs args;
  add_chat_options(app, args);
  q4::tools::run_tool("q4chat", app, argc, argv, [&] {
    const ChatSetup setup = load_chat(args);
    Chat chat(args, setup);
    if (args.prompt.empty()) return interactive(chat);
    chat.turn(args.prompt);
    return 0;
  });
}
