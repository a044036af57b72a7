// reward.command: a long-lived verifier process (docs/trainer.md#rewards). Started once with
// posix_spawnp in its own process group (a terminal's Ctrl-C reaches the trainer, which then
// stops it), it reads one request a line on stdin and writes one number a line on stdout, in
// order. A batch's requests are written while its answers are read (one poll loop, so neither
// pipe can fill and stall the other), under one deadline. A timeout, an exit or crash, a line
// that is not one finite number, or extra output is a RewardError naming the command and the
// request; the process is then killed and reaped, and every later call repeats the error.
#pragma once

#include <sys/types.h>

#include <string>
#include <vector>

namespace q4::trainer {

class RewardCommand {
 public:
  // Starts `argv` in `dir` (empty: the current directory). ConfigError when it cannot start.
  RewardCommand(std::vector<std::string> argv, std::string dir, double timeout_s);
  RewardCommand(const RewardCommand&) = delete;
  RewardCommand& operator=(const RewardCommand&) = delete;
  // Closes its stdin (a verifier exits at end of input), waits up to kExitGraceMs, then kills it;
  // always reaps it.
  ~RewardCommand();

  // One finite number per request (each a line without '\n'), in order. `labels[i]` names
  // request i in messages ("train.jsonl:12"; may be empty).
  std::vector<double> score(const std::vector<std::string>& requests,
                            const std::vector<std::string>& labels);

  pid_t pid() const { return pid_; }
  const std::string& display() const { return display_; }  // the command line, for messages

  static constexpr int kExitGraceMs = 2000;
  // The longest answer line accepted: a number is a few dozen bytes.
  static constexpr size_t kMaxLineBytes = size_t{1} << 16;

 private:
  [[noreturn]] void fail(const std::string& what);
  [[noreturn]] void fail_exited(size_t answered, size_t total);
  void write_some(const std::string& out, size_t* written, size_t answered, size_t total);
  void kill_and_reap();
  void drain_unasked(size_t total);
  std::string request_name(size_t i, size_t total, const std::vector<std::string>& labels) const;

  std::string display_;
  double timeout_s_ = 0;
  pid_t pid_ = -1;       // -1 once reaped
  int in_fd_ = -1;       // its stdin (we write)
  int out_fd_ = -1;      // its stdout (we read)
  std::string pending_;  // bytes read past the last complete line
  std::string failure_;  // the first error; repeated by every later call
};

}  // namespace q4::trainer
