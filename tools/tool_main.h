// A tool's main function: the command line, then the body with the error convention of
// tool_errors.h.
#pragma once

#include <c10/util/Exception.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <stdexcept>
#include <string>

#include "q4/io/process_exit.h"
#include "tool_errors.h"

namespace q4::tools {

// run_tool's exit code, the process left running.
template <class F>
int tool_exit_code(const char* tool, CLI::App& app, int argc, char** argv, F&& body,
                   int library_error_code) {
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  const auto fail = [tool](const std::string& message, int code) {
    std::fprintf(stderr, "%s: error: %s\n", tool, one_line(message).c_str());
    return code;
  };
  try {
    return body();
  } catch (const InputError& e) {
    return fail(e.what(), 2);
  } catch (const std::invalid_argument& e) {
    return fail(e.what(), 2);
  } catch (const c10::OutOfMemoryError& e) {
    return fail(e.what_without_backtrace(), 1);
  } catch (const c10::Error& e) {
    return fail(e.what_without_backtrace(), library_error_code);
  } catch (const std::exception& e) {
    return fail(e.what(), 1);
  }
}

// A tool's main: parses the command line (--help exits 0, a usage error 2), then ends the process
// (q4::io::end_process) with body()'s exit code, mapping what it throws as above.
// `library_error_code` is the exit code of a c10::Error that escapes body: 1 (a runtime failure)
// unless every library call of the tool reads the user's input; running out of memory is always 1.
template <class F>
[[noreturn]] void run_tool(const char* tool, CLI::App& app, int argc, char** argv, F&& body,
                           int library_error_code = 1) {
  io::end_process(tool_exit_code(tool, app, argc, argv, body, library_error_code));
}

}  // namespace q4::tools
