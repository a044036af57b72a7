// The external verifier process of reward.command: spawn, the batch's poll loop (write requests,
// read answers, one deadline), the answer parser and the stop (docs/trainer.md#rewards).
#include "q4/trainer/rewards/reward_command.h"

#include <c10/util/Exception.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "q4/trainer/config/config.h"
#include "q4/trainer/rewards/rewards.h"

extern char** environ;

namespace q4::trainer {

namespace {

std::string reward_errno_text(int e) { return std::strerror(e); }

// write() to a pipe whose reader is gone raises SIGPIPE, which ends a process that does not
// ignore it (q4train does; a test binary or another caller may not): SIGPIPE is blocked in this
// thread around the write and a pending one consumed, so the error comes back as EPIPE only.
ssize_t write_without_sigpipe(int fd, const char* data, size_t n) {
  sigset_t pipe_set, old_set;
  sigemptyset(&pipe_set);
  sigaddset(&pipe_set, SIGPIPE);
  pthread_sigmask(SIG_BLOCK, &pipe_set, &old_set);
  const ssize_t r = ::write(fd, data, n);
  const int e = errno;
  if (r < 0 && e == EPIPE) {
    sigset_t pending;
    sigpending(&pending);
    if (sigismember(&pending, SIGPIPE)) {
      const timespec zero{0, 0};
      sigtimedwait(&pipe_set, nullptr, &zero);
    }
  }
  pthread_sigmask(SIG_SETMASK, &old_set, nullptr);
  errno = e;
  return r;
}

// One answer line: a finite number and nothing else (surrounding blanks and a '\r' allowed).
// Returns "" when it is one, else why not.
std::string parse_answer(const std::string& line_in, double* value) {
  std::string line = line_in;
  while (!line.empty() && std::isspace(static_cast<unsigned char>(line.back()))) line.pop_back();
  size_t b = 0;
  while (b < line.size() && std::isspace(static_cast<unsigned char>(line[b]))) ++b;
  line = line.substr(b);
  if (line.empty()) return "an empty line";
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(line.c_str(), &end);
  const bool hex = line.find_first_of("xX") != std::string::npos;
  if (end != line.c_str() + line.size() || hex) {
    std::string shown = line.substr(0, 80);
    return "'" + shown + (line.size() > 80 ? "...'" : "'") + ", not a number";
  }
  if (!std::isfinite(v)) return line + ", not a finite number";
  *value = v;
  return "";
}

std::string reward_exit_text(int status) {
  if (WIFEXITED(status)) return "exited with status " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    const int sig = WTERMSIG(status);
    const char* name = strsignal(sig);
    return "was killed by signal " + std::to_string(sig) +
           (name ? std::string(" (") + name + ")" : "");
  }
  return "stopped (status " + std::to_string(status) + ")";
}

// Waits for `pid` up to `ms`; true (and the status) when it ended.
bool wait_for_exit(pid_t pid, int ms, int* status) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  while (true) {
    const pid_t r = waitpid(pid, status, WNOHANG);
    if (r == pid || (r < 0 && errno == ECHILD)) return true;
    if (std::chrono::steady_clock::now() >= deadline) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

}  // namespace

RewardCommand::RewardCommand(std::vector<std::string> argv, std::string dir, double timeout_s)
    : timeout_s_(timeout_s) {
  TORCH_CHECK(!argv.empty() && !argv[0].empty(), "reward.command: empty command line");
  for (size_t i = 0; i < argv.size(); ++i) display_ += (i ? " " : "") + argv[i];
  int to_child[2], from_child[2];
  if (pipe2(to_child, O_CLOEXEC) != 0) {
    throw RewardError("reward.command '" + display_ + "': pipe: " + reward_errno_text(errno));
  }
  if (pipe2(from_child, O_CLOEXEC) != 0) {
    const int e = errno;
    ::close(to_child[0]);
    ::close(to_child[1]);
    throw RewardError("reward.command '" + display_ + "': pipe: " + reward_errno_text(e));
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
  if (!dir.empty()) posix_spawn_file_actions_addchdir_np(&actions, dir.c_str());
  // Its own process group (a terminal's SIGINT is the trainer's to handle), default signal
  // actions and an empty mask (q4train ignores SIGPIPE; the verifier should not inherit that).
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  sigaddset(&defaults, SIGPIPE);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr,
                           POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  std::vector<char*> cargv;
  for (auto& a : argv) cargv.push_back(a.data());
  cargv.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, argv[0].c_str(), &actions, &attr, cargv.data(), environ);
  posix_spawn_file_actions_destroy(&actions);
  posix_spawnattr_destroy(&attr);
  ::close(to_child[0]);
  ::close(from_child[1]);
  in_fd_ = to_child[1];
  out_fd_ = from_child[0];
  if (rc != 0) {
    pid_ = -1;
    ::close(in_fd_);
    ::close(out_fd_);
    in_fd_ = out_fd_ = -1;
    throw ConfigError("config key reward.command: cannot start '" + display_ + "'" +
                      (dir.empty() ? "" : " in " + dir) + ": " + reward_errno_text(rc));
  }
  fcntl(in_fd_, F_SETFL, fcntl(in_fd_, F_GETFL) | O_NONBLOCK);
  fcntl(out_fd_, F_SETFL, fcntl(out_fd_, F_GETFL) | O_NONBLOCK);
}

RewardCommand::~RewardCommand() {
  if (in_fd_ >= 0) ::close(in_fd_);
  in_fd_ = -1;
  if (pid_ > 0) {
    int status = 0;
    if (!wait_for_exit(pid_, kExitGraceMs, &status)) kill_and_reap();
    pid_ = -1;
  }
  if (out_fd_ >= 0) ::close(out_fd_);
}

void RewardCommand::kill_and_reap() {
  if (pid_ <= 0) return;
  ::kill(pid_, SIGKILL);
  int status = 0;
  while (waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
  }
  pid_ = -1;
}

void RewardCommand::fail(const std::string& what) {
  failure_ = "reward.command '" + display_ + "' " + what;
  kill_and_reap();
  throw RewardError(failure_);
}

// Its stdout reached end of file or its stdin broke: it exited (or closed them); reaped with a
// grace, its exit status or signal in the message.
void RewardCommand::fail_exited(size_t answered, size_t total) {
  int status = 0;
  std::string how = "closed its output";
  if (wait_for_exit(pid_, kExitGraceMs, &status)) {
    how = reward_exit_text(status);
    pid_ = -1;
  }
  fail(how + " after answering " + std::to_string(answered) + " of " + std::to_string(total) +
       " requests of this batch (its stderr is above)");
}

// Output between batches answers nothing that was asked: read what is there without waiting.
void RewardCommand::drain_unasked(size_t total) {
  char buf[4096];
  const ssize_t n = ::read(out_fd_, buf, sizeof buf);
  if (n == 0) fail_exited(0, total);
  if (n > 0) pending_.append(buf, static_cast<size_t>(n));
  if (!pending_.empty()) {
    const std::string shown = pending_.substr(0, std::min<size_t>(pending_.find('\n'), 80));
    fail("wrote '" + shown + "' before this batch's requests (lines no request asked for)");
  }
}

std::string RewardCommand::request_name(size_t i, size_t total,
                                        const std::vector<std::string>& labels) const {
  std::string s = "request " + std::to_string(i + 1) + " of " + std::to_string(total);
  if (i < labels.size() && !labels[i].empty()) s += " (" + labels[i] + ")";
  return s;
}

void RewardCommand::write_some(const std::string& out, size_t* written, size_t answered,
                               size_t total) {
  const ssize_t n = write_without_sigpipe(in_fd_, out.data() + *written, out.size() - *written);
  if (n >= 0) {
    *written += static_cast<size_t>(n);
    return;
  }
  if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return;
  if (errno == EPIPE) fail_exited(answered, total);
  fail("cannot be written to: " + reward_errno_text(errno));
}

std::vector<double> RewardCommand::score(const std::vector<std::string>& requests,
                                         const std::vector<std::string>& labels) {
  if (!failure_.empty()) throw RewardError(failure_);
  drain_unasked(requests.size());
  std::string out;
  for (const auto& r : requests) {
    TORCH_INTERNAL_ASSERT(r.find('\n') == std::string::npos, "a request spans lines");
    out += r;
    out += '\n';
  }
  const size_t total = requests.size();
  std::vector<double> answers;
  size_t written = 0;
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s_);
  char buf[4096];
  while (answers.size() < total) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) {
      char seconds[32];
      std::snprintf(seconds, sizeof seconds, "%g", timeout_s_);
      fail("gave no answer to " + request_name(answers.size(), total, labels) + " within " +
           seconds + " s (reward.command_timeout_s); it was stopped");
    }
    pollfd fds[2] = {{out_fd_, POLLIN, 0}, {in_fd_, POLLOUT, 0}};
    const nfds_t nfds = written < out.size() ? 2 : 1;
    const int r = ::poll(fds, nfds, static_cast<int>(std::min<int64_t>(left.count(), 1 << 30)));
    if (r < 0 && errno != EINTR) fail("cannot be polled: " + reward_errno_text(errno));
    if (r <= 0) continue;
    if (nfds == 2 && (fds[1].revents & (POLLOUT | POLLERR | POLLHUP))) {
      write_some(out, &written, answers.size(), total);
    }
    if (!(fds[0].revents & (POLLIN | POLLHUP | POLLERR))) continue;
    const ssize_t n = ::read(out_fd_, buf, sizeof buf);
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) continue;
    if (n < 0) fail("cannot be read from: " + reward_errno_text(errno));
    if (n == 0) fail_exited(answers.size(), total);
    pending_.append(buf, static_cast<size_t>(n));
    size_t nl;
    while ((nl = pending_.find('\n')) != std::string::npos) {
      const std::string line = pending_.substr(0, nl);
      pending_.erase(0, nl + 1);
      if (answers.size() == total) {
        fail("wrote more lines than the " + std::to_string(total) +
             " requests of this batch (one number a line, one line a request)");
      }
      double v = 0;
      const std::string bad = parse_answer(line, &v);
      if (!bad.empty()) {
        fail("answered " + bad + " to " + request_name(answers.size(), total, labels) +
             "; expected one finite number a line");
      }
      answers.push_back(v);
    }
    if (pending_.size() > kMaxLineBytes) {
      fail("wrote a line of over " + std::to_string(kMaxLineBytes) + " bytes for " +
           request_name(answers.size(), total, labels) + "; expected one number a line");
    }
  }
  if (!pending_.empty()) {
    fail("wrote more than the " + std::to_string(total) +
         " lines of this batch (one number a line, one line a request)");
  }
  return answers;
}

}  // namespace q4::trainer
