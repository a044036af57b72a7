// Regression tests of build/bin/q4train (tiny random Qwen3, real tokenizer, CPU) for the rule that
// no command overwrites a finished model or a user's file: --resume DIR writes into DIR (a copied
// run leaves the original untouched), an export never replaces a newer one, outputs never
// replace inputs, devices or FIFOs, the last step is checkpointed before the end-of-run eval,
// checkpoints are on by default, a closed stdout does not end a run, a stop during set-up leaves
// nothing that blocks the same command, resume errors name the file and the previous
// checkpoint, and no output (the export, its HF and adapter folders, the top-K file, the metrics
// log, what --overwrite removes) ever replaces a file the run reads, --overwrite or not.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <utility>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"
#include "q4/trainer/rundir/run_dir.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::safety_test {

namespace {

using namespace q4::test;

// A fresh directory with model.json, data.tsv and config.yaml (random init, run in dir/run);
// checkpoint_every < 0 leaves the key out (the default cadence).
fs::path setup_dir(const std::string& name, int64_t steps, int64_t checkpoint_every) {
  return write_checkpointing_run("safety", name, steps, checkpoint_every,
                                 "  verify_export: false\n");
}

Result run(const fs::path& dir, const std::vector<std::string>& args, const std::string& tag,
           const std::string& env = "") {
  return run_in(dir, tag, (env.empty() ? "" : env + " ") + kQ4train + quoted(args));
}

// Every regular file under `root` (relative path -> bytes) and its modification time.
struct Snapshot {
  std::map<std::string, std::string> bytes;
  std::map<std::string, fs::file_time_type> mtime;
};
Snapshot snapshot(const fs::path& root) {
  Snapshot s;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (!e.is_regular_file()) continue;
    const std::string rel = fs::relative(e.path(), root).string();
    if (rel == ".lock") continue;  // the lock's pid is informational and rewritten by a lock
    s.bytes[rel] = read_text(e.path());
    s.mtime[rel] = fs::last_write_time(e.path());
  }
  return s;
}

void expect_same(const Snapshot& a, const Snapshot& b, const std::string& what) {
  EXPECT_EQ(a.bytes.size(), b.bytes.size()) << what;
  for (const auto& [rel, bytes] : a.bytes) {
    auto it = b.bytes.find(rel);
    ASSERT_NE(it, b.bytes.end()) << what << ": " << rel << " is gone";
    EXPECT_TRUE(it->second == bytes) << what << ": " << rel << " changed";
    EXPECT_TRUE(b.mtime.at(rel) == a.mtime.at(rel)) << what << ": " << rel << " was rewritten";
  }
  for (const auto& [rel, bytes] : b.bytes) {
    EXPECT_TRUE(a.bytes.count(rel)) << what << ": " << rel << " is new";
  }
}

// Item 1: --resume of a copied run wrote into the original (its output.dir in config.yaml).
TEST(Safety, ResumeOfACopyLeavesTheOriginalUntouched) {
  const fs::path dir = setup_dir("copy", 4, 2);
  // An absolute export path inside output.dir moves with the run, as a relative one does.
  const std::string exp = "output.export_path=" + (dir / "run" / "final.dat").string();
  Result r = run(dir, config_args(dir, {exp}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  ASSERT_TRUE(fs::exists(dir / "run" / "step_000004" / "DONE"));
  ASSERT_EQ(
      std::system(
          ("cp -a '" + (dir / "run").string() + "' '" + (dir / "copy").string() + "'").c_str()),
      0);
  const Snapshot before = snapshot(dir / "run");

  // More steps on the copy, then an export of one of its checkpoints.
  r = run(
      dir,
      {"--resume", (dir / "copy").string(), "--set", "train.steps=6", "--allow-schedule-change"},
      "b");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "--resume writes into " + (dir / "copy").string())) << r.out;
  r = run(dir,
          {"--resume", (dir / "copy" / "step_000004").string(), "--export-only", "--set",
           "output.export_path=model-step4.dat"},
          "c");
  ASSERT_EQ(r.code, 0) << r.err;

  expect_same(before, snapshot(dir / "run"), "the original run");
  EXPECT_TRUE(fs::exists(dir / "copy" / "step_000006" / "DONE"));
  EXPECT_EQ(q4::trainer::existing_export_step((dir / "copy" / "final.dat").string()), 6);
  EXPECT_TRUE(fs::exists(dir / "copy" / "model-step4.dat"));
  EXPECT_FALSE(fs::exists(dir / "run" / "model-step4.dat"));
  EXPECT_TRUE(contains(read_text(dir / "copy" / "config.yaml"), (dir / "copy").string()));
}

// Item 2: the end-of-run hint `--resume RUN --export-only` exported an older checkpoint over the
// final model. An export never replaces a newer one unless --overwrite; the hint names a new file.
TEST(Safety, ExportNeverReplacesANewerModel) {
  const fs::path dir = setup_dir("newer", 4, 2);
  Result r = run(dir, config_args(dir, {}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path model = dir / "run" / "model.dat";
  const std::string final_bytes = read_text(model);
  ASSERT_EQ(q4::trainer::existing_export_step(model.string()), 4);
  const std::string hint = "--export-only --set output.export_path=model-step4.dat";
  EXPECT_TRUE(contains(r.out, hint)) << r.out;

  // The older checkpoint over the step-4 model: refused, nothing written.
  const std::string older = (dir / "run" / "step_000002").string();
  r = run(dir, {"--resume", older, "--export-only"}, "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "holds step 4, newer than step 2")) << r.err;
  EXPECT_TRUE(contains(r.err, "model-step2.dat")) << r.err;
  EXPECT_TRUE(read_text(model) == final_bytes);
  // An export of unknown step (no record) is not replaced either.
  fs::rename(dir / "run" / "model.dat.json", dir / "model.dat.json.saved");
  r = run(dir, {"--resume", (dir / "run").string(), "--export-only"}, "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "its step is unknown")) << r.err;
  EXPECT_TRUE(read_text(model) == final_bytes);
  fs::rename(dir / "model.dat.json.saved", dir / "run" / "model.dat.json");

  // The printed hint works and writes a new file; --overwrite replaces on request.
  r = run(dir,
          {"--resume", (dir / "run").string(), "--export-only", "--set",
           "output.export_path=model-step4.dat"},
          "d");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / "run" / "model-step4.dat"));
  r = run(dir, {"--resume", older, "--export-only", "--overwrite"}, "e");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(q4::trainer::existing_export_step(model.string()), 2);
}

// Item 4: the export over the config file, --probe-report over anything, and a fresh run whose
// config is <output.dir>/config.yaml (even with --overwrite) replaced the user's files.
TEST(Safety, OutputsNeverReplaceTheConfigDataOrAForeignFile) {
  const fs::path dir = setup_dir("inputs", 1, 0);
  const std::string config = read_text(dir / "config.yaml");
  const std::string data = read_text(dir / "data.tsv");
  Result r =
      run(dir, config_args(dir, {"output.export_path=" + (dir / "config.yaml").string()}), "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "the config file")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run"));
  EXPECT_EQ(read_text(dir / "config.yaml"), config);

  for (const char* target : {"data.tsv", "config.yaml"}) {
    auto args = config_args(dir, {});
    args.insert(args.end(), {"--probe", "--probe-report", (dir / target).string()});
    r = run(dir, args, "b");
    EXPECT_EQ(r.code, 2) << target << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "is not a previous probe report")) << r.err;
    EXPECT_FALSE(contains(r.err, "probe: start")) << "checked after loading: " << r.err;
  }
  EXPECT_EQ(read_text(dir / "data.tsv"), data);
  EXPECT_EQ(read_text(dir / "config.yaml"), config);
  // A previous probe report is replaced.
  auto args = config_args(dir, {});
  args.insert(args.end(), {"--probe", "--probe-report", (dir / "p.json").string()});
  ASSERT_EQ(run(dir, args, "c").code, 0);
  r = run(dir, args, "d");
  EXPECT_EQ(r.code, 0) << r.err;

  // The user's config inside output.dir.
  fs::create_directories(dir / "run2");
  std::string moved = config;
  moved.replace(moved.find((dir / "run").string()), (dir / "run").string().size(),
                (dir / "run2").string());
  for (const char* f : {"model.json", "data.tsv"}) fs::copy_file(dir / f, dir / "run2" / f);
  write_text(dir / "run2" / "config.yaml", moved);
  for (bool overwrite : {false, true}) {
    std::vector<std::string> a = {"--config", (dir / "run2" / "config.yaml").string()};
    if (overwrite) a.push_back("--overwrite");
    r = run(dir, a, "e");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "where a run writes its resolved config")) << r.err;
    EXPECT_EQ(read_text(dir / "run2" / "config.yaml"), moved);
  }
}

// Item 5: writers renamed over FIFOs and devices (as root, export_path=/dev/null replaced the
// system's /dev/null). Only a FIFO and a symbolic link to /dev/null are used here: if the check
// failed, the rename would replace the link, never the device.
TEST(Safety, NonRegularOutputsAreRefusedBeforeTheFirstStep) {
  const fs::path dir = setup_dir("nonregular", 1, 0);
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  fs::create_symlink("/dev/null", dir / "devnull");
  for (const char* target : {"fifo", "devnull"}) {
    const std::string p = (dir / target).string();
    Result r = run(dir, config_args(dir, {"output.export_path=" + p}), "a");
    EXPECT_EQ(r.code, 2) << target << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "output.export_path")) << r.err;
    EXPECT_FALSE(fs::exists(dir / "run")) << target;
    auto args = config_args(dir, {});
    args.insert(args.end(), {"--probe", "--probe-report", p});
    r = run(dir, args, "b");
    EXPECT_EQ(r.code, 2) << target << ": " << r.err;
    EXPECT_FALSE(contains(r.err, "probe: start")) << "checked after loading: " << r.err;
  }
  // The HF folder and an entry of output.dir (the metrics file) as a FIFO.
  ASSERT_EQ(::mkfifo((dir / "x-hf").c_str(), 0644), 0);
  Result r = run(dir,
                 config_args(dir, {"output.export_path=" + (dir / "x.dat").string(),
                                   "output.hf_export=modelopt"}),
                 "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "output.hf_export")) << r.err;
  fs::create_directories(dir / "run");
  ASSERT_EQ(::mkfifo((dir / "run" / "metrics.jsonl").c_str(), 0644), 0);
  auto args = config_args(dir, {});
  args.push_back("--overwrite");
  r = run(dir, args, "d");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "log.metrics")) << r.err;
  EXPECT_TRUE(fs::is_fifo(dir / "fifo"));
  EXPECT_TRUE(fs::is_symlink(dir / "devnull"));
  EXPECT_TRUE(fs::is_fifo(dir / "run" / "metrics.jsonl"));
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000001"));
}

// Item 6: the end-of-run eval ran before the final checkpoint, so its failure lost every step.
// Item 7: checkpoints are on by default (no checkpoint_every in this config).
TEST(Safety, LastStepIsCheckpointedBeforeTheEndEvalByDefault) {
  const fs::path dir = setup_dir("endeval", 3, -1);
  Result r = run(dir, config_args(dir, {}), "a", "Q4_FAULT=endeval:0:3");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "end-of-run eval fails")) << r.err;
  EXPECT_TRUE(fs::exists(dir / "run" / "step_000003" / "DONE")) << r.out;
  r = run(dir, {"--resume", (dir / "run").string()}, "b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "resumed from " + (dir / "run" / "step_000003").string())) << r.out;
  EXPECT_EQ(q4::trainer::existing_export_step((dir / "run" / "model.dat").string()), 3);
}

// A stop signal during a validation ends it before its next batch and stops the run at that
// step: checkpointed there, no further step, no validation loss over part of the examples.
TEST(Safety, StopSignalDuringValidationCheckpointsThatStep) {
  const fs::path dir = setup_dir("valsignal", 6, -1);
  const Result r = run(dir,
                       config_args(dir, {"data.eval_fraction=0.25", "eval.every=2",
                                         "output.checkpoint_minutes=0", "log.every=1"}),
                       "a", "Q4_FAULT=valsignal:0:2");
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_TRUE(contains(r.out, "validation after step 2 cut short by the stop signal")) << r.out;
  EXPECT_TRUE(contains(r.out, "stopping after step 2")) << r.out;
  EXPECT_TRUE(fs::exists(dir / "run" / "step_000002" / "DONE")) << r.out;
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000003")) << r.out;
  for (const auto& rec : read_jsonl(dir / "run" / "metrics.jsonl")) {
    EXPECT_LE(rec["step"].get<int64_t>(), 2) << rec.dump();
    if (rec["step"] == 2) {
      EXPECT_FALSE(rec.contains("val_loss")) << rec.dump();
    }
  }
}

// Item 7: the time cadence (output.checkpoint_minutes) checkpoints during the run.
TEST(Safety, CheckpointsByTime) {
  const fs::path dir = setup_dir("minutes", 3, -1);
  // 0.0001 minutes (6 ms) is shorter than a step: every step is checkpointed.
  Result r = run(dir, config_args(dir, {"output.checkpoint_minutes=0.0001"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"step_000001", "step_000002", "step_000003"}) {
    EXPECT_TRUE(fs::exists(dir / "run" / s / "DONE")) << s << "\n" << r.out;
  }
  // Both cadences off: no checkpoint.
  q4::io::remove_tree(dir / "run");
  r = run(dir, config_args(dir, {"output.checkpoint_minutes=0"}), "b");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000003"));
}

// Item 7 with two ranks (Gloo on CPU): rank 0's clock decides and every rank checkpoints the
// same steps (ranks that disagreed would deadlock in the checkpoint's barriers).
TEST(Safety, TimedCheckpointsAgreeAcrossRanks) {
  if (!kCpuRanks) GTEST_SKIP() << "q4train was built without Gloo: no CPU ranks";
  const fs::path dir = setup_dir("minutes2", 3, -1);
  auto args = config_args(dir, {"output.checkpoint_minutes=0.0001", "output.export_path=none"});
  args.insert(args.end(), {"--nproc", "2", "--dist-timeout", "60"});
  const Result r = run(dir, args, "a");
  ASSERT_EQ(r.code, 0) << r.err;
  for (const char* s : {"step_000001", "step_000002", "step_000003"}) {
    EXPECT_TRUE(fs::exists(dir / "run" / s / "DONE")) << s << "\n" << r.out;
    EXPECT_TRUE(fs::exists(dir / "run" / s / "optim-00001-of-00002.state")) << s;
  }
}

// Item 8: `q4train ... | head` ended the run with SIGPIPE (exit 141, no checkpoint, no export).
TEST(Safety, ClosedStdoutDoesNotEndTheRun) {
  const fs::path dir = setup_dir("sigpipe", 2, 0);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const std::string err = (dir / "a.err").string();
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::close(fds[0]);
    ::dup2(fds[1], 1);
    const int fd = ::open(err.c_str(), O_CREAT | O_WRONLY | O_TRUNC, 0644);
    ::dup2(fd, 2);
    const std::string cfg = (dir / "config.yaml").string();
    ::execl(kQ4train.c_str(), kQ4train.c_str(), "--config", cfg.c_str(),
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(fds[1]);
  ::close(fds[0]);  // the reader is gone before the first line
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << "killed by signal "
                                 << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "\n"
                                 << read_text(err);
  EXPECT_EQ(WEXITSTATUS(status), 0) << read_text(err);
  EXPECT_TRUE(fs::exists(dir / "run" / "model.dat"));
  EXPECT_TRUE(fs::exists(dir / "run" / "step_000002" / "DONE"));
}

// A stop signal during set-up of a fresh run left config.yaml, init.dat and .lock behind, so the
// same command then refused the non-empty output.dir.
TEST(Safety, StopDuringSetUpLeavesNothingThatBlocksTheSameCommand) {
  const fs::path dir = setup_dir("setupstop", 1, 0);
  const std::string out = (dir / "a.out").string();
  const pid_t pid = spawn_logged(
      kQ4train, {"--config", (dir / "config.yaml").string(), "--set", "train.steps=100000"}, out);
  ASSERT_GE(pid, 0);
  wait_for_text(out, ", run directory ", 120);
  // main prints that line just before set-up (loading the tokenizer alone takes about a second).
  std::this_thread::sleep_for(std::chrono::milliseconds(150));
  const int code = signal_and_wait(pid, SIGINT);
  const std::string log = read_text(out);
  EXPECT_EQ(code, 0) << log;
  ASSERT_TRUE(contains(log, "during set-up")) << "the signal missed set-up:\n" << log;
  const Result r = run(dir, config_args(dir, {"train.steps=1"}), "b");
  EXPECT_EQ(r.code, 0) << r.err;
}

// Resume errors named neither the file nor the previous checkpoint (a state.json whose batcher
// state is missing gave a bare JSON exception, exit 1).
TEST(Safety, ResumeStateErrorsNameTheFileAndThePreviousCheckpoint) {
  const fs::path dir = setup_dir("state", 4, 2);
  Result r = run(dir, config_args(dir, {"output.export_path=none"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path ck = dir / "run" / "step_000004";
  auto state = nlohmann::json::parse(read_text(ck / "state.json"));
  state.erase("batcher");
  write_text(ck / "state.json", state.dump(2) + "\n");
  // Checksums that match the edit: the error must come from the state, not the CRC check.
  const auto sums = nlohmann::json::parse(read_text(ck / "checksums.json"));
  std::vector<std::string> files;
  for (const auto& [name, v] : sums.at("files").items()) files.push_back(name);
  q4::trainer::write_checkpoint_checksums(ck.string(), files);
  r = run(dir,
          {"--resume", (dir / "run").string(), "--set", "train.steps=6", "--allow-schedule-change"},
          "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, (ck / "state.json").string())) << r.err;
  EXPECT_TRUE(contains(r.err, "step_000002")) << r.err;
}

// An input that is not a regular file was "file not found" (a directory) or a read that blocked
// forever (a FIFO): each is named as what it is, exit 2, before anything is written.
TEST(Safety, InputsThatAreNotRegularFilesAreNamed) {
  const fs::path dir = setup_dir("inputs", 1, 0);
  ASSERT_EQ(::mkfifo((dir / "fifo.tsv").c_str(), 0644), 0);
  fs::create_directories(dir / "folder.tsv");
  for (const auto& [value, kind] : std::vector<std::pair<std::string, std::string>>{
           {(dir / "fifo.tsv").string(), "a FIFO"},
           {(dir / "folder.tsv").string(), "a directory"}}) {
    const Result r = run(dir, config_args(dir, {"data.files=[" + value + "]"}), "a", "timeout 60");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "data.files")) << r.err;
    EXPECT_TRUE(contains(r.err, kind)) << r.err;
    EXPECT_FALSE(fs::exists(dir / "run")) << value;
  }
  const Result t = run_captured("timeout 60 " + std::string(Q4_BIN_DIR) + "/q4tok data" +
                                    quoted({"--tokenizer", kSource + "/assets/qwen3/tokenizer.json",
                                            "--data", (dir / "fifo.tsv").string()}),
                                dir / "t.out", dir / "t.err");
  EXPECT_EQ(t.code, 2) << t.err;
  EXPECT_TRUE(contains(t.err, "--data")) << t.err;
  EXPECT_TRUE(contains(t.err, "FIFO")) << t.err;
}

// A fresh run replaced any file at output.export_path outside output.dir (a user's file, another
// run's finished model) and wrote its record over a user's <export>.json; a resumed copy replaced
// the original run's export at an absolute path outside the run. Each is refused before the first
// step unless --overwrite.
TEST(Safety, ExportsNeverReplaceAFileThatIsNotThisRunsExport) {
  const fs::path dir = setup_dir("foreign", 4, 2);
  fs::create_directories(dir / "exports");
  write_text(dir / "exports" / "notes.dat", "precious");
  Result r =
      run(dir, config_args(dir, {"output.export_path=" + (dir / "exports" / "notes.dat").string()}),
          "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "unknown")) << r.err;
  EXPECT_EQ(read_text(dir / "exports" / "notes.dat"), "precious");
  EXPECT_FALSE(fs::exists(dir / "run"));

  write_text(dir / "exports" / "new.dat.json", "{\"my\": \"settings\"}");
  r = run(dir, config_args(dir, {"output.export_path=" + (dir / "exports" / "new.dat").string()}),
          "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "not q4train's export record")) << r.err;
  EXPECT_EQ(read_text(dir / "exports" / "new.dat.json"), "{\"my\": \"settings\"}");

  // output.dir itself as the export: refused up front, not after training.
  r = run(dir, config_args(dir, {"output.export_path=" + (dir / "run").string()}), "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "is a directory")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run"));

  // A run exporting outside its directory, copied and resumed: the original's export stays.
  const std::string final_dat = (dir / "exports" / "final.dat").string();
  r = run(dir, config_args(dir, {"output.export_path=" + final_dat}), "d");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string original = read_text(final_dat);
  ASSERT_EQ(
      std::system(
          ("cp -a '" + (dir / "run").string() + "' '" + (dir / "copy").string() + "'").c_str()),
      0);
  const std::vector<std::string> resume = {"--resume", (dir / "copy").string(), "--set",
                                           "train.steps=6", "--allow-schedule-change"};
  r = run(dir, resume, "e");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "of the run in " + (dir / "run").string())) << r.err;
  EXPECT_EQ(read_text(final_dat), original);
  EXPECT_FALSE(fs::exists(dir / "copy" / "step_000006"));
  // Told to: replaced.
  auto told = resume;
  told.push_back("--overwrite");
  r = run(dir, told, "f");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(q4::trainer::existing_export_step(final_dat), 6);
}

// Resuming with a changed train.trainable silently reset the dropped tensors to their initial
// weights (their trained masters are only in the checkpoint): refused, naming the key.
TEST(Safety, ResumeWithAnotherTrainableSetIsRefused) {
  const fs::path dir = setup_dir("trainable", 4, 2);
  Result r = run(dir, config_args(dir, {"output.export_path=none"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  r = run(dir,
          {"--resume", (dir / "run").string(), "--set", "train.steps=6", "--allow-schedule-change",
           "--set", "train.trainable.norms=false"},
          "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "train.trainable")) << r.err;
  EXPECT_TRUE(contains(r.err, "norm")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000006"));
  // The refused resume left the run's config as it was: the same command without the change runs.
  EXPECT_TRUE(contains(read_text(dir / "run" / "config.yaml"), "norms: true"));
  r = run(dir,
          {"--resume", (dir / "run").string(), "--set", "train.steps=6", "--allow-schedule-change"},
          "c");
  EXPECT_EQ(r.code, 0) << r.err;
}

// The teacher of the distillation tests: a one-step run's export, dir/teacher/model.dat (with its
// HF folder dir/teacher/model-hf when `hf`). Returns the .dat's path.
std::string make_teacher(const fs::path& dir, bool hf) {
  std::vector<std::string> sets = {"output.dir=" + (dir / "teacher").string()};
  if (hf) sets.push_back("output.hf_export=bf16");
  const Result r = run(dir, config_args(dir, sets), "teacher");
  EXPECT_EQ(r.code, 0) << r.err;
  return (dir / "teacher" / "model.dat").string();
}

std::vector<std::string> with_flags(std::vector<std::string> args,
                                    const std::vector<std::string>& flags) {
  args.insert(args.end(), flags.begin(), flags.end());
  return args;
}

// --write-teacher-topk --overwrite with distill.topk_file naming an input replaced it, and the
// refusal without --overwrite suggested adding it; a top-K path that cannot be written (a device,
// a FIFO, a directory, a missing or read-only directory) failed only after the teacher loaded
// (exit 1); a killed writer's temp file stayed forever. Inputs are refused whatever --overwrite
// says and never with a hint to add it; the path is checked before anything loads; the next
// write removes the dead writer's temp file.
TEST(Safety, TopkFileNeverReplacesAnInputAndIsCheckedBeforeLoading) {
  const fs::path dir = setup_dir("topk", 1, 0);
  const std::string teacher = make_teacher(dir, false);
  fs::copy_file(kTokenizer, dir / "tokenizer.json");  // never the source tree's
  fs::copy_file(teacher, dir / "weights.dat");
  const auto topk_args = [&](const std::string& file, std::vector<std::string> sets) {
    for (const std::string& s : {"model.tokenizer=" + (dir / "tokenizer.json").string(),
                                 std::string("train.objective=distill"),
                                 "distill.teacher=" + teacher, "distill.topk_file=" + file}) {
      sets.push_back(s);
    }
    return with_flags(config_args(dir, sets), {"--write-teacher-topk"});
  };
  const std::vector<std::pair<fs::path, std::string>> inputs = {
      {dir / "data.tsv", "data.files"},     {dir / "config.yaml", "the config file"},
      {dir / "model.json", "model.config"}, {dir / "tokenizer.json", "model.tokenizer"},
      {teacher, "distill.teacher"},         {dir / "weights.dat", "model.weights"}};
  for (const auto& [file, key] : inputs) {
    const std::vector<std::string> weights = {"model.init=file",
                                              "model.weights=" + (dir / "weights.dat").string()};
    const std::string before = read_text(file);
    for (const bool overwrite : {false, true}) {
      auto args =
          topk_args(file.string(), key == "model.weights" ? weights : std::vector<std::string>{});
      if (overwrite) args.push_back("--overwrite");
      const Result r = run(dir, args, "a");
      EXPECT_EQ(r.code, 2) << key << ": " << r.err;
      EXPECT_TRUE(contains(r.err, "config key distill.topk_file")) << r.err;
      EXPECT_TRUE(contains(r.err, "the input " + key)) << r.err;
      EXPECT_FALSE(contains(r.err, "--overwrite")) << "suggested for an input: " << r.err;
      EXPECT_TRUE(read_text(file) == before) << key << " was replaced";
    }
  }

  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0644), 0);
  fs::create_symlink("/dev/null", dir / "devnull");
  fs::create_directories(dir / "folder");
  std::vector<fs::path> bad = {dir / "fifo", dir / "devnull", dir / "folder",
                               dir / "missing" / "topk.dat"};
  if (::geteuid() != 0) {  // root writes into a read-only directory
    fs::create_directories(dir / "readonly");
    fs::permissions(dir / "readonly", fs::perms::owner_read | fs::perms::owner_exec);
    bad.push_back(dir / "readonly" / "topk.dat");
  }
  for (const auto& target : bad) {
    const Result r =
        run(dir, with_flags(topk_args(target.string(), {}), {"--overwrite"}), "b", "timeout 120");
    EXPECT_EQ(r.code, 2) << target << ": " << r.err;
    EXPECT_TRUE(contains(r.err, "config key distill.topk_file")) << r.err;
    EXPECT_FALSE(contains(r.out, " layers, hidden ")) << "checked after loading: " << r.out;
  }
  EXPECT_TRUE(fs::is_fifo(dir / "fifo"));
  EXPECT_TRUE(fs::is_symlink(dir / "devnull"));
  EXPECT_TRUE(fs::is_empty(dir / "folder"));

  // A writer killed before its rename left topk.dat.tmp.<pid>.<n>: the next write removes it.
  const fs::path topk = dir / "topk.dat";
  write_text(dir / "topk.dat.tmp.999999999.0", "partial");
  const Result r = run(dir, topk_args(topk.string(), {}), "c");
  ASSERT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::is_regular_file(topk));
  EXPECT_FALSE(fs::exists(dir / "topk.dat.tmp.999999999.0"));
}

// An export over the teacher (--overwrite), the top-K file or preference.reference replaced it;
// output.hf_export replaced the teacher's HF folder without --overwrite. Refused before anything
// loads, naming both keys, by the run and by --dry-run alike.
TEST(Safety, OutputsNeverReplaceTheTeacherTopkFileOrReference) {
  const fs::path dir = setup_dir("teacher", 1, 0);
  const std::string teacher = make_teacher(dir, true);
  const std::string before = read_text(teacher);
  const auto refused = [&](const std::vector<std::string>& args, const std::string& out_key,
                           const std::string& in_key) {
    for (const char* flag : {"--overwrite", "--dry-run"}) {
      const Result r = run(dir, with_flags(args, {flag}), "a");
      EXPECT_EQ(r.code, 2) << flag << ": " << r.err;
      EXPECT_TRUE(contains(r.err, "config key " + out_key)) << r.err;
      EXPECT_TRUE(contains(r.err, "the input " + in_key)) << r.err;
      EXPECT_FALSE(contains(r.err, "pass --overwrite")) << r.err;
    }
    EXPECT_FALSE(fs::exists(dir / "run"));
  };
  refused(config_args(dir, {"train.objective=distill", "distill.teacher=" + teacher,
                            "output.export_path=" + teacher}),
          "output.export_path", "distill.teacher");
  EXPECT_TRUE(read_text(teacher) == before);

  const std::string topk = (dir / "topk.dat").string();
  const std::vector<std::string> offline = {"train.objective=distill", "distill.teacher=" + teacher,
                                            "distill.topk_file=" + topk, "distill.topk=4"};
  const Result w = run(dir, with_flags(config_args(dir, offline), {"--write-teacher-topk"}), "w");
  ASSERT_EQ(w.code, 0) << w.err;
  const std::string topk_bytes = read_text(topk);
  auto sets = offline;
  sets.push_back("output.export_path=" + topk);
  refused(config_args(dir, sets), "output.export_path", "distill.topk_file");
  EXPECT_TRUE(read_text(topk) == topk_bytes);

  write_text(dir / "pairs.jsonl", kTinyPairsJsonl);
  refused(config_args(dir, {"data.files=[" + (dir / "pairs.jsonl").string() + "]",
                            "train.objective=preference", "preference.reference=" + teacher,
                            "output.export_path=" + teacher}),
          "output.export_path", "preference.reference");
  EXPECT_TRUE(read_text(teacher) == before);

  // The teacher's HF folder as the new export's HF folder (the export itself a new file).
  const fs::path hf = dir / "teacher" / "model-hf";
  const Snapshot folder = snapshot(hf);
  const Result r =
      run(dir,
          config_args(dir, {"train.objective=distill", "distill.teacher=" + hf.string(),
                            "output.export_path=" + (dir / "teacher" / "model").string(),
                            "output.hf_export=bf16"}),
          "h");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "config key output.hf_export")) << r.err;
  EXPECT_TRUE(contains(r.err, "the input distill.teacher")) << r.err;
  expect_same(folder, snapshot(hf), "the teacher's HF folder");
}

// --overwrite into a run directory holding the teacher the new run reads deleted it (then "file
// not found"): an input there is never removed, and one at a path the run writes (init.dat, the
// export) is refused before anything is removed.
TEST(Safety, OverwriteNeverRemovesAnInputOfTheNewRun) {
  const fs::path dir = setup_dir("overwrite_teacher", 1, 0);
  Result r = run(dir, config_args(dir, {"output.hf_export=bf16"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path run_dir = dir / "run";
  const std::string init = read_text(run_dir / "init.dat");
  const std::string model = read_text(run_dir / "model.dat");
  for (const char* teacher : {"init.dat", "model.dat"}) {
    const auto args = config_args(
        dir, {"train.objective=distill", "distill.teacher=" + (run_dir / teacher).string()});
    for (const char* flag : {"--dry-run", "--overwrite"}) {
      r = run(dir, with_flags(args, {"--overwrite", flag}), "b");
      EXPECT_EQ(r.code, 2) << teacher << ": " << r.err;
      EXPECT_TRUE(contains(r.err, "the input distill.teacher")) << r.err;
      EXPECT_FALSE(contains(r.err, "pass --overwrite")) << r.err;
    }
  }
  EXPECT_TRUE(read_text(run_dir / "init.dat") == init);
  EXPECT_TRUE(read_text(run_dir / "model.dat") == model);
  // The previous run's HF folder as the teacher: the new run (no HF export) keeps it.
  const fs::path hf = run_dir / "model-hf";
  r = run(
      dir,
      with_flags(config_args(dir, {"train.objective=distill", "distill.teacher=" + hf.string()}),
                 {"--overwrite"}),
      "c");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "removed the previous run's")) << r.out;
  EXPECT_TRUE(fs::exists(hf / "config.json"));
  EXPECT_TRUE(fs::exists(run_dir / "model.dat"));
}

// log.metrics named like the export's record was accepted; the export was then refused after
// training, and the --overwrite it suggested replaced the metrics log with the record.
TEST(Safety, MetricsLogAndExportRecordAreDistinct) {
  const fs::path dir = setup_dir("metrics_record", 1, 0);
  for (const char* flag : {"--dry-run", "--overwrite"}) {
    const Result r =
        run(dir, with_flags(config_args(dir, {"log.metrics=model.dat.json"}), {flag}), "a");
    EXPECT_EQ(r.code, 2) << r.err;
    EXPECT_TRUE(contains(r.err, "log.metrics")) << r.err;
    EXPECT_TRUE(contains(r.err, "record")) << r.err;
    EXPECT_FALSE(fs::exists(dir / "run")) << flag;
  }
}

// <export>-adapter/ replaced any folder there (another run's adapter, a symbolic link to the
// user's folder) without the checks the -hf folder gets: a folder with files is replaced only as
// the adapter of this run's own export, or with --overwrite.
TEST(Safety, AdapterFolderIsNeverAnotherRunsOrAUsersFolder) {
  const fs::path dir = setup_dir("adapter", 1, 0);
  fs::create_directories(dir / "shared");
  const auto lora = [&](const std::string& run, const std::string& exp) {
    return config_args(dir,
                       {"output.dir=" + (dir / run).string(), "train.method=lora", "lora.rank=4",
                        "output.export_path=" + (dir / "shared" / exp).string()});
  };
  Result r = run(dir, lora("a", "m.dat"), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path theirs = dir / "shared" / "m-adapter";
  ASSERT_TRUE(fs::exists(theirs / "adapter_config.json"));
  const Snapshot adapter = snapshot(theirs);
  // Another run's export "m" (no .dat) has the same adapter folder.
  r = run(dir, lora("b", "m"), "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, theirs.string())) << r.err;
  expect_same(adapter, snapshot(theirs), "the other run's adapter");
  EXPECT_FALSE(fs::exists(dir / "b"));
  // A symbolic link to the user's folder.
  fs::create_directories(dir / "mine");
  write_text(dir / "mine" / "notes.txt", "precious");
  fs::create_directory_symlink(dir / "mine", dir / "shared" / "s-adapter");
  r = run(dir, lora("c", "s.dat"), "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "adapter")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "mine" / "adapter_config.json"));
  // This run's own adapter is replaced by its next export (a resume).
  r = run(dir,
          {"--resume", (dir / "a").string(), "--set", "train.steps=2", "--allow-schedule-change"},
          "d");
  EXPECT_EQ(r.code, 0) << r.err;
}

}  // namespace

}  // namespace q4::test::safety_test
