// Child processes of the end-to-end tests: run a shell command with its exit code and output
// (captured into files kept for debugging, or through a pipe), or start one in the background with
// its output in a log, for a test that signals it.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

namespace q4::test {

// A finished command: its exit code (-1 when it did not exit normally) and what it printed.
struct Result {
  int code = -1;
  std::string out, err;
};

// The exit code of a wait status, -1 when the child did not exit normally.
int exit_code(int status);

// " 'a' 'b'": `args` single-quoted for sh (arguments hold no single quote).
std::string quoted(const std::vector<std::string>& args);

// The shell command line `cmd` with stdout and stderr captured in `out` and `err` (kept for
// debugging a failure) and read back.
Result run_captured(const std::string& cmd, const std::filesystem::path& out,
                    const std::filesystem::path& err);

// run_captured into dir/<tag>.out and dir/<tag>.err.
Result run_in(const std::filesystem::path& dir, const std::string& tag, const std::string& cmd);

// The shell command line `cmd` through a pipe: its stdout in `out` (add 2>&1 for stderr too).
Result run_piped(const std::string& cmd);

// Starts `exe` with `args` in a child process, its stdout and stderr both into `log`; returns the
// child's pid (the caller signals and waits for it).
pid_t spawn_logged(const std::string& exe, const std::vector<std::string>& args,
                   const std::filesystem::path& log);

// Waits until the file `log` holds `text`, reading it every `poll_ms` milliseconds, for at most
// `seconds`; returns whether it does.
bool wait_for_text(const std::filesystem::path& log, const std::string& text, int seconds,
                   int poll_ms = 20);

// Sends the signal `sig` to the child `pid` and waits for it to end; returns its exit code (-1
// when it did not exit normally).
int signal_and_wait(pid_t pid, int sig);

}  // namespace q4::test
