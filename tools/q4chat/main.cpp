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
#include "q4/trainer/config/config.h"
#include "sampling.h"
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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4chat: chat with a Qwen3 model through the chat template"};
  q4::chat::ModelArgs m;
  std::string prompt, seed = "0";
  q4::chat::SamplingOptions so;
  so.temperature = 0.7;
  so.top_p = 0.8;
  so.top_k = 20;
  int64_t max_new = 512;
  bool quiet = false;
  q4::chat::add_model_options(app, m);
  app.add_option("--prompt", prompt, "one-shot: answer this and exit (default: interactive)");
  app.add_option("--temperature", so.temperature, "0 = greedy")->capture_default_str();
  app.add_option("--top-k", so.top_k, "0 = off")->capture_default_str();
  app.add_option("--top-p", so.top_p, "1 = off")->capture_default_str();
  app.add_option("--seed", seed, "sampling seed, 0..2^64-1")->capture_default_str();
  app.add_option("--repetition-penalty", so.repetition_penalty, "1 = off")->capture_default_str();
  app.add_option("--max-new-tokens", max_new, "tokens per reply at most")->capture_default_str();
  app.add_flag("--quiet", quiet, "no load/speed lines on stderr");
  return q4::tools::run_tool("q4chat", app, argc, argv, [&] {
    using namespace q4;
    const auto t0 = std::chrono::steady_clock::now();
    const model::ModelOptions opt = chat::inference_options(m.device);
    std::unique_ptr<data::Tokenizer> tok;
    chat::LoadedModel loaded;
    data::ChatOptions chat_opt;
    as_input([&] {
      so.seed = parse_seed(seed);
      so.validate();
      TORCH_CHECK(max_new > 0, "--max-new-tokens: expected > 0, got ", max_new);
      const chat::ModelPaths paths = chat::resolve_model_paths(m.model, m.config, m.tokenizer);
      tok = std::make_unique<data::Tokenizer>(chat::load_tokenizer(paths));
      // A run's system prompt is what its model was trained with; --system (even empty) wins.
      if (!m.system_given() && !paths.system_prompt.empty()) {
        m.system = paths.system_prompt;
        if (!quiet) std::cerr << "q4chat: system prompt from the run's data.system_prompt\n";
      }
      chat_opt = chat::chat_options(m, paths);
      if (!quiet) {
        std::cerr << "q4chat: chat template " << io::enum_name(chat_opt.chat_template)
                  << (chat_opt.enable_thinking ? *chat_opt.enable_thinking
                                                     ? ", enable_thinking true"
                                                     : ", enable_thinking false"
                                               : "")
                  << "\n";
      }
      check_text(*tok, prompt, "--prompt");
      check_text(*tok, m.system, m.system_given() ? "--system" : "data.system_prompt");
      loaded = chat::load_model(paths, *tok, opt, m.adapter);
      const auto& cfg = loaded.config;
      if (!quiet) {
        std::cerr << fmt::format(
            "q4chat: {}: {}{} ({} layers, hidden {}, {}), loaded in {:.1f} s\n", paths.described,
            paths.weights, m.adapter.empty() ? "" : " with adapter " + m.adapter, cfg.num_hidden_layers, cfg.hidden_size, m.device,
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        if (!loaded.adapter_summary.empty())
          std::cerr << "q4chat: " << loaded.adapter_summary << "\n";
      }
      return 0;
    });
    auto session =
        std::make_unique<chat::ChatSession>(*loaded.model, *tok, so, m.system, max_new, chat_opt);
    const auto print = [](const std::string& s) { std::cout << s << std::flush; };
    const auto stats = [&](const chat::TurnResult& r, double s) {
      if (quiet) return;
      std::cerr << fmt::format("[{} tokens, {:.1f} tok/s{}]\n", r.tokens.size(),
                               s > 0 ? static_cast<double>(r.tokens.size()) / s : 0.0,
                               r.stopped ? "" : ", no stop token");
    };
    if (!prompt.empty()) {
      const auto t = std::chrono::steady_clock::now();
      const auto r = session->turn(prompt, print);
      std::cout << "\n";
      stats(r, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
      return 0;
    }
    const bool tty = ::isatty(0) != 0;
    constexpr const char* kCommands = "/reset, /exit";
    if (tty) {
      std::setlocale(LC_CTYPE, "");  // libedit edits UTF-8 (CJK) lines by the terminal's locale
      std::cerr << "q4chat: one message per line; /reset starts over, /exit or EOF ends\n";
    }
    chat::LineInput input(std::cin, /*edit=*/tty);
    std::string line;
    while (true) {
      try {
        if (!input.next(tty ? "> " : "", line)) break;
      } catch (const std::length_error& e) {
        throw InputError(e.what());
      }
      if (line == "/exit" || line.empty()) break;
      if (line == "/reset") {
        session = std::make_unique<chat::ChatSession>(*loaded.model, *tok, so, m.system, max_new,
                                                      chat_opt);
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
          check_text(*tok, line, where);
        } catch (const InputError& e) {
          std::cerr << "q4chat: error: " << e.what() << "\n";
          continue;
        }
      } else {
        check_text(*tok, line, where);
      }
      const auto t = std::chrono::steady_clock::now();
      const auto r = session->turn(line, print);
      std::cout << "\n";
      stats(r, std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count());
    }
    return 0;
  });
}
