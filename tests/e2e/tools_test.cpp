// The user-facing tools end to end (tiny random Qwen3, real tokenizer, CPU): q4train's config
// file is a bounded regular text file; q4chat and q4tok read stdin in bounded lines (/dev/zero
// is an error, not an endless read); q4chat checks --seed's range, names the option or line of
// invalid UTF-8, reports unknown /commands, opens the Hugging Face folder q4train writes and
// applies a run's data.system_prompt; report.html is rewritten while a run is live.
// Every child runs under `timeout` and a memory limit, so a regression fails instead of hanging
// or exhausting the machine.
#include <dlfcn.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <thread>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::tools_test {

namespace {

using namespace q4::test;

const std::string kSystemPrompt = "You answer in one word.";

// `cmd` under sh with a 60 s timeout and an 8 GB address-space limit; stdout and stderr apart.
Result sh(const std::string& cmd, const fs::path& dir) {
  return run_captured("ulimit -v 8000000; timeout 60 sh -c '" + cmd + "'", dir / "sh.out",
                      dir / "sh.err");
}

// The tools' tiny run: its output in <dir>/<run>, the system prompt, an HF export.
TinyRun tiny_run(const std::string& run, int64_t steps) {
  TinyRun t;
  t.steps = steps;
  t.data_extra = "  system_prompt: " + kSystemPrompt + "\n";
  t.run = run;
  t.output_extra = "  hf_export: modelopt\n";
  t.log = "  every: 1\n";
  return t;
}

// One trained run shared by the tests: dir/run with model.dat, model-hf/ and config.yaml.
class Tools : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = fresh_dir(work_root("tools") / std::to_string(::getpid()));
    tiny_run("run", 2).write(dir_);
    train_ = sh(kQ4train + " --config " + (dir_ / "config.yaml").string(), dir_);
  }
  static void TearDownTestSuite() { q4::io::remove_tree(dir_); }
  void SetUp() override {
    ASSERT_TRUE(fs::exists(kTokenizer)) << "run tools/fetch_tokenizer.sh";
    ASSERT_EQ(train_.code, 0) << train_.out << train_.err;
  }
  static std::string chat(const std::string& model, const std::string& args) {
    return kBin + "/q4chat --model " + model + " --temperature 0 --max-new-tokens 6 " + args;
  }
  static std::string run_dir() { return (dir_ / "run").string(); }
  static fs::path dir_;
  static Result train_;
};
fs::path Tools::dir_;
Result Tools::train_;

// /dev/zero, a FIFO, a binary file or a huge file as --config: one line naming it, exit 2.
TEST_F(Tools, ConfigMustBeABoundedRegularTextFile) {
  const std::string fifo = (dir_ / "config.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string big = (dir_ / "big.yaml").string();
  write_text(big, "# " + std::string(size_t{17} << 20, 'x') + "\n");
  const std::string dat = run_dir() + "/model.dat";
  for (const auto& [path, expect] : std::vector<std::pair<std::string, std::string>>{
           {"/dev/zero", "is a character device; expected a regular file"},
           {fifo, "is a FIFO (named pipe); expected a regular file"},
           {dat, "is not a YAML text file: NUL byte at offset"},
           {big, "the limit is 16 MiB"}}) {
    const Result r = sh(kQ4train + " --config " + path + " --dry-run", dir_);
    EXPECT_EQ(r.code, 2) << path << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "config file " + path)) << r.err;
    EXPECT_TRUE(contains(r.err, expect)) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
  }
}

// Stdin without newlines (/dev/zero) for q4chat and q4tok: an error naming the line.
TEST_F(Tools, StdinLinesAreBounded) {
  Result r = sh(chat(run_dir(), "--quiet") + " </dev/zero", dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "stdin line 1: longer than 1 MiB")) << r.err;
  for (const char* cmd : {"encode", "decode", "chat"}) {
    r = sh(kBin + "/q4tok " + cmd + " --tokenizer " + kTokenizer + " </dev/zero", dir_);
    EXPECT_EQ(r.code, 2) << cmd << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "stdin:1: line longer than 64 MiB")) << r.err;
  }
}

// The JSON files the tools load whole (model config, tokenizer) as /dev/zero or a FIFO.
TEST_F(Tools, LoadedFilesMustBeRegular) {
  const std::string fifo = (dir_ / "tok.fifo").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  const std::string dat = run_dir() + "/model.dat", json = (dir_ / "model.json").string();
  Result r = sh(kBin + "/q4chat --model " + dat + " --config /dev/zero --tokenizer " + kTokenizer +
                    " --prompt hi",
                dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "model config /dev/zero is a character device")) << r.err;
  r = sh(kBin + "/q4chat --model " + dat + " --config " + json + " --tokenizer " + fifo +
             " --prompt hi",
         dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "tokenizer " + fifo + " is a FIFO")) << r.err;
  r = sh(kBin + "/q4tok encode --tokenizer /dev/zero </dev/null", dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--tokenizer /dev/zero is a character device")) << r.err;
}

// --seed outside 0..2^64-1 is an error (-1 and 2^64 must not both become 2^64-1).
TEST_F(Tools, SeedOutOfRangeIsAnError) {
  for (const char* bad : {"-1", "18446744073709551616", "1e3", "seven", "\"\""}) {
    const Result r = sh(chat(run_dir(), std::string("--prompt hi --seed ") + bad), dir_);
    EXPECT_EQ(r.code, 2) << bad << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "--seed: expected an integer in 0..18446744073709551615")) << r.err;
  }
  const Result ok = sh(chat(run_dir(), "--quiet --prompt hi --seed 18446744073709551615"), dir_);
  EXPECT_EQ(ok.code, 0) << ok.err;
}

// Invalid UTF-8 names the option or the stdin line.
TEST_F(Tools, InvalidUtf8NamesTheOptionOrLine) {
  Result r = sh(chat(run_dir(), "--quiet --prompt \"$(printf \"\\377\")\""), dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--prompt: ") && contains(r.err, "not valid UTF-8")) << r.err;
  r = sh(chat(run_dir(), "--quiet --prompt hi --system \"$(printf \"a\\377\")\""), dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "--system: ")) << r.err;
  r = sh("printf \"hello\\n\\376\\n\" | " + chat(run_dir(), "--quiet"), dir_);
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "stdin line 2: ") && contains(r.err, "not valid UTF-8")) << r.err;
}

// A mistyped command ("/rest") is reported, not sent to the model as a prompt.
TEST_F(Tools, UnknownCommandsAreReported) {
  const Result r =
      sh("printf \"hello\\n/rest\\n//etc is a folder\\n\" | " + chat(run_dir(), "--quiet"), dir_);
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "unknown command /rest; commands: /reset, /exit")) << r.err;
  // The same replies as without the command line: it never reached the model, and "//" sent
  // the text "/etc is a folder".
  const Result same =
      sh("printf \"hello\\n/etc is a folder\\n\" | " + chat(run_dir(), "--quiet"), dir_);
  EXPECT_EQ(r.out, same.out);
}

// Line editing at a terminal (libedit): "/rst", two cursor-left keys, "e" and Enter
// is the line "/rest", reported as an unknown command; without editing the escape bytes would be
// part of the line and it would go to the model as text.
TEST_F(Tools, TerminalLinesAreEdited) {
  if (::dlopen("libedit.so.2", RTLD_NOW | RTLD_LOCAL) == nullptr) {
    GTEST_SKIP() << "libedit2 is not installed (q4chat reads plain lines then)";
  }
  int master = -1;
  const pid_t pid = ::forkpty(&master, nullptr, nullptr, nullptr);
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::setenv("TERM", "xterm", 1);
    const std::string bin = kBin + "/q4chat", model = run_dir();
    ::execl(bin.c_str(), bin.c_str(), "--model", model.c_str(), "--quiet", "--max-new-tokens", "2",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  std::string seen;
  const auto read_until = [&](const std::string& what, int seconds) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(seconds);
    while (!contains(seen, what) && std::chrono::steady_clock::now() < deadline) {
      pollfd p{master, POLLIN, 0};
      if (::poll(&p, 1, 100) > 0) {
        std::array<char, 4096> buf{};
        const ssize_t n = ::read(master, buf.data(), buf.size());
        if (n <= 0) break;
        seen.append(buf.data(), static_cast<size_t>(n));
      }
    }
    return contains(seen, what);
  };
  EXPECT_TRUE(read_until("> ", 60)) << seen;
  const std::string keys = "/rst\x1b[D\x1b[De\r";
  ASSERT_EQ(::write(master, keys.data(), keys.size()), static_cast<ssize_t>(keys.size()));
  EXPECT_TRUE(read_until("unknown command /rest;", 30)) << seen;
  const std::string bye = "/exit\r";
  ASSERT_EQ(::write(master, bye.data(), bye.size()), static_cast<ssize_t>(bye.size()));
  read_until("\n\n", 2);
  int status = 0;
  ::waitpid(pid, &status, 0);
  ::close(master);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << seen;
}

// The HF folder q4train writes, and the run's data.system_prompt.
TEST_F(Tools, OpensTheHfFolderAndAppliesTheRunSystemPrompt) {
  const std::string dat = run_dir() + "/model.dat";
  const std::string explicit_args =
      "--config " + (dir_ / "model.json").string() + " --tokenizer " + kTokenizer + " --prompt hi";
  const Result with_system =
      sh(chat(dat, explicit_args + " --quiet --system \"" + kSystemPrompt + "\""), dir_);
  const Result without_system = sh(chat(dat, explicit_args + " --quiet"), dir_);
  ASSERT_EQ(with_system.code, 0) << with_system.err;
  ASSERT_EQ(without_system.code, 0) << without_system.err;
  ASSERT_NE(with_system.out, without_system.out) << "the system prompt changes nothing here";
  // A run directory applies data.system_prompt; --system "" turns it off.
  Result r = sh(chat(run_dir(), "--prompt hi"), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, with_system.out);
  EXPECT_TRUE(contains(r.err, "system prompt from the run's data.system_prompt")) << r.err;
  r = sh(chat(run_dir(), "--quiet --prompt hi --system \"\""), dir_);
  EXPECT_EQ(r.out, without_system.out);
  // The HF folder (config.json, model.safetensors, tokenizer.json) gives the export's answer.
  const std::string hf = run_dir() + "/model-hf";
  ASSERT_TRUE(fs::exists(hf + "/model.safetensors")) << train_.out;
  r = sh(chat(hf, "--prompt hi"), dir_);
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(r.out, without_system.out);
  EXPECT_TRUE(contains(r.err, "Hugging Face folder")) << r.err;
}

// report.html is rewritten on the log cadence with a reload tag while the run is live, and
// without it once the run has stopped.
TEST_F(Tools, ReportIsLiveDuringTheRun) {
  write_text(dir_ / "long.yaml", tiny_run("long", 100000).yaml(dir_));
  const fs::path run = dir_ / "long";
  const std::string out = (dir_ / "long.out").string();
  const pid_t pid = spawn_logged(
      kQ4train, {"--config", (dir_ / "long.yaml").string(), "--set", "output.hf_export=none"},
      out);
  ASSERT_GE(pid, 0);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(90);
  std::string live;
  while (std::chrono::steady_clock::now() < deadline) {
    live = read_text(run / "report.html");
    if (contains(live, "<polyline")) break;  // two or more steps plotted
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ::kill(pid, SIGINT);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string log = read_text(out);
  EXPECT_TRUE(contains(live, "<polyline")) << "no report.html while the run was going\n" << log;
  EXPECT_TRUE(contains(live, "<meta http-equiv=\"refresh\"")) << live;
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << log;
  const std::string final_page = read_text(run / "report.html");
  EXPECT_FALSE(contains(final_page, "http-equiv=\"refresh\"")) << final_page;
  EXPECT_TRUE(contains(final_page, "(log scale)")) << final_page;
}

}  // namespace

}  // namespace q4::test::tools_test
