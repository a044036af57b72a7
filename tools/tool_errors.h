// The tools' one error convention. A problem with what the user gave (options, files, data) is
// an InputError (or std::invalid_argument, from cli_number.h) and exits 2; anything else that
// throws is a runtime failure and exits 1. Every error is one line on stderr,
// "<tool>: error: <message>" (run_tool in tool_main.h prints it).
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

namespace q4::tools {

// Bad usage or bad input: exit code 2.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// `s` with its line breaks turned into spaces: an error is one line.
inline std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

// Runs fn() for a step that reads the user's input: a library error it throws (c10::Error, or
// one of the Extra exception types) becomes an InputError with the same message.
template <class... Extra, class F>
auto as_input(F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const c10::Error& e) {
    throw InputError(e.what_without_backtrace());
  } catch (const std::exception& e) {
    if ((... || (dynamic_cast<const Extra*>(&e) != nullptr))) throw InputError(e.what());
    throw;
  }
}

}  // namespace q4::tools
