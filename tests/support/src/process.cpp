// Child processes of the end-to-end tests (see q4/test/process.h).
#include "q4/test/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <thread>

#include "q4/test/files.h"

namespace fs = std::filesystem;

namespace q4::test {

int exit_code(int status) { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }

std::string quoted(const std::vector<std::string>& args) {
  std::string s;
  for (const auto& a : args) s += " '" + a + "'";
  return s;
}

Result run_captured(const std::string& cmd, const fs::path& out, const fs::path& err) {
  const std::string full = cmd + " >'" + out.string() + "' 2>'" + err.string() + "'";
  Result r;
  r.code = exit_code(std::system(full.c_str()));
  r.out = read_text(out);
  r.err = read_text(err);
  return r;
}

Result run_in(const fs::path& dir, const std::string& tag, const std::string& cmd) {
  return run_captured(cmd, dir / (tag + ".out"), dir / (tag + ".err"));
}

Result run_piped(const std::string& cmd) {
  Result r;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return r;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  r.code = exit_code(::pclose(p));
  return r;
}

pid_t spawn_logged(const std::string& exe, const std::vector<std::string>& args,
                   const fs::path& log) {
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  const int fd = ::open(log.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
  ::dup2(fd, 1);
  ::dup2(fd, 2);
  std::vector<char*> argv = {const_cast<char*>(exe.c_str())};
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  ::execv(exe.c_str(), argv.data());
  ::_exit(127);
}

bool wait_for_text(const fs::path& log, const std::string& text, int seconds, int poll_ms) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
  while (read_text(log).find(text) == std::string::npos) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
  return true;
}

int signal_and_wait(pid_t pid, int sig) {
  ::kill(pid, sig);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return exit_code(status);
}

}  // namespace q4::test
