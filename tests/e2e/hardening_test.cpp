// Regression tests of build/bin/q4train (tiny random Qwen3, real tokenizer, CPU): the run
// directory protects itself (lock, reserved names, output paths checked before the first step,
// the user's init.dat kept, stale temp files removed), a failed export is checkpointed first, a
// full disk is an error, checkpoints are checksummed at resume, data problems are named, and
// stop signals during set-up or repeated still end with exit 0 and a checkpoint.
#include <ATen/ATen.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "q4/io/dat_file.h"
#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/temp_dir.h"
#include "q4/test/tiny_run.h"

namespace fs = std::filesystem;

// Each file's helpers and tests in a namespace of their own: test_e2e is a unity build.
namespace q4::test::hardening_test {

namespace {

using namespace q4::test;

// A fresh directory with model.json, data.tsv and config.yaml (random init, run in dir/run).
fs::path setup_dir(const std::string& name, int64_t steps, int64_t checkpoint_every) {
  return write_checkpointing_run("hard", name, steps, checkpoint_every);
}

// q4train with `args`, optionally under a shell prefix (e.g. a ulimit).
Result run(const fs::path& dir, const std::vector<std::string>& args, const std::string& tag,
           const std::string& shell_prefix = "") {
  if (shell_prefix.empty()) return run_in(dir, tag, kQ4train + quoted(args));
  // The prefix applies to q4train alone; sh's own redirections follow run_captured's.
  return run_in(dir, tag, "sh -c \"" + shell_prefix + "; exec " + kQ4train + quoted(args) + "\"");
}

std::vector<std::string> run(const fs::path& dir, std::initializer_list<const char*> sets) {
  return config_args(dir, std::vector<std::string>(sets.begin(), sets.end()));
}

// The temporary files left under `dir`, which must exist.
std::vector<std::string> temp_files(const fs::path& dir) {
  EXPECT_TRUE(fs::exists(dir)) << dir;
  return files_named(dir, ".tmp.");
}

// Defect 1: model.weights = <output.dir>/init.dat with model.init: file was deleted.
TEST(Hardening, UserInitDatInOutputDirIsKept) {
  const fs::path dir = setup_dir("initdat", 1, 0);
  Result r = run(dir, run(dir, {"output.export_path=none"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const std::string weights = read_text(dir / "run" / "init.dat");
  q4::io::remove_tree(dir / "run2");
  fs::create_directories(dir / "run2");
  fs::copy_file(dir / "run" / "init.dat", dir / "run2" / "init.dat");
  const std::string w = (dir / "run2" / "init.dat").string();
  const std::string d = "output.dir=" + (dir / "run2").string();
  const std::string m = "model.weights=" + w;
  r = run(dir, run(dir, {"model.init=file", m.c_str(), d.c_str()}), "b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_EQ(read_text(w), weights);
}

// Defect 2: run files collided with outputs the user named.
TEST(Hardening, ReservedNamesAndCollisionsAreRejectedUpFront) {
  const fs::path dir = setup_dir("names", 1, 0);
  for (const char* bad :
       {"log.metrics=config.yaml", "log.metrics=init.dat", "log.metrics=.", "log.metrics=..",
        "log.metrics=step_000001", "log.metrics=a/b.jsonl", "output.export_path=config.yaml",
        "output.export_path=eval.jsonl", "output.export_path=metrics.jsonl"}) {
    const Result r = run(dir, run(dir, {bad}), "r");
    EXPECT_EQ(r.code, 2) << bad << ": " << r.err;
    const std::string key = std::string(bad).substr(0, std::string(bad).find('='));
    EXPECT_TRUE(contains(r.err, key)) << bad << ": " << r.err;
    EXPECT_FALSE(fs::exists(dir / "run" / "config.yaml")) << bad;  // nothing written
  }
}

// Defect 3: export targets were checked only after training (and --dry-run said ok).
TEST(Hardening, ExportTargetsAreCheckedBeforeTheFirstStep) {
  const fs::path dir = setup_dir("export", 1, 0);
  const std::string missing = "output.export_path=" + (dir / "nope" / "m.dat").string();
  const std::string input = "output.export_path=" + (dir / "data.tsv").string();
  const std::string self = "output.export_path=" + (dir / "run").string() + "/.";
  for (const std::string& bad : {missing, input, self}) {
    for (bool dry : {false, true}) {
      auto args = run(dir, {bad.c_str()});
      if (dry) args.push_back("--dry-run");
      const Result r = run(dir, args, "r");
      EXPECT_EQ(r.code, 2) << bad << (dry ? " --dry-run: " : ": ") << r.err;
      EXPECT_TRUE(contains(r.err, "output.export_path")) << r.err;
      EXPECT_FALSE(contains(r.out, " 1/1 ")) << "trained before failing: " << bad;
    }
  }
  EXPECT_EQ(read_text(dir / "data.tsv").substr(0, 4), "Who ");
}

// Defect 4: no lock on output.dir.
TEST(Hardening, ASecondRunOnTheSameDirectoryIsRefused) {
  const fs::path dir = setup_dir("lock", 1, 0);
  fs::create_directories(dir / "run");
  const int fd = ::open((dir / "run" / ".lock").c_str(), O_CREAT | O_RDWR, 0644);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::flock(fd, LOCK_EX | LOCK_NB), 0);
  Result r = run(dir, run(dir, {}), "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "in use by another q4train run")) << r.err;
  ::close(fd);
  r = run(dir, run(dir, {}), "b");
  EXPECT_EQ(r.code, 0) << r.err;
}

// Defect 5 and 9: a failing final export (file size limit, like a full disk) used to end the run
// before its checkpoint, leaving the temp export behind; now the step is checkpointed, no temp
// file survives, and a resume without the limit exports.
TEST(Hardening, FailedExportIsCheckpointedAndResumable) {
  const fs::path dir = setup_dir("diskfull", 2, 0);
  Result r = run(dir, run(dir, {"output.export_path=none", "train.steps=0"}), "init");
  ASSERT_EQ(r.code, 0) << r.err;
  fs::rename(dir / "run" / "init.dat", dir / "weights.dat");
  q4::io::remove_tree(dir / "run");
  const std::string w = "model.weights=" + (dir / "weights.dat").string();
  // init.dat is ~12 MB (the 151936 x 32 embedding); a 4 MB limit stops the export, not the
  // checkpoint (lm_head and embeddings are frozen).
  r = run(dir, run(dir, {"model.init=file", w.c_str()}), "a", "trap '' XFSZ; ulimit -f 4096");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(fs::exists(dir / "run" / "step_000002" / "DONE")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run" / "model.dat"));
  EXPECT_TRUE(temp_files(dir / "run").empty());
  r = run(dir, {"--resume", (dir / "run").string()}, "b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir / "run" / "model.dat"));
}

// Defect 5: metrics.jsonl on a full disk exited 0 with lines missing.
TEST(Hardening, MetricsOnAFullDiskIsAnError) {
  const fs::path dir = setup_dir("metricsfull", 2, 0);
  fs::create_directories(dir / "run");
  fs::create_symlink("/dev/full", dir / "run" / "metrics.jsonl");
  auto args = run(dir, {"output.export_path=none"});
  args.push_back("--overwrite");  // the directory is not empty (a symlink is kept: the user's)
  const Result r = run(dir, args, "a");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "metrics.jsonl")) << r.err;
}

// Defect 7: a flipped byte in optim.state resumed with rc 0; a broken state.json named no file.
TEST(Hardening, DamagedCheckpointIsRefusedNamingTheFileAndThePreviousOne) {
  const fs::path dir = setup_dir("crc", 4, 2);
  Result r = run(dir, run(dir, {"output.export_path=none", "train.steps=4"}), "a");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path ck = dir / "run" / "step_000004";
  ASSERT_TRUE(fs::exists(ck / "checksums.json"));
  auto flip = [&] {
    std::fstream f(ck / "optim.state", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(200);
    char c = 0;
    f.seekg(200);
    f.get(c);
    f.seekp(200);
    f.put(static_cast<char>(c ^ 0x10));
  };
  flip();
  const std::string steps = "train.steps=6";
  r = run(dir, {"--resume", (dir / "run").string(), "--set", steps, "--allow-schedule-change"},
          "b");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "optim.state")) << r.err;
  EXPECT_TRUE(contains(r.err, "step_000002")) << r.err;
  // A broken state.json (optim.state repaired): named, with a hint.
  flip();
  write_text(ck / "state.json", "{\"step\": 4, ");
  r = run(dir, {"--resume", (dir / "run").string(), "--set", steps, "--allow-schedule-change"},
          "c");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "state.json")) << r.err;
  EXPECT_TRUE(contains(r.err, "step_000002")) << r.err;
  // The previous checkpoint resumes.
  r = run(dir,
          {"--resume", (dir / "run" / "step_000002").string(), "--set", steps,
           "--allow-schedule-change"},
          "d");
  EXPECT_EQ(r.code, 0) << r.err;
}

// Defect 6: empty / comment-only data blamed train.seq_len; on_error: skip did not say what it
// skipped (on stderr).
TEST(Hardening, DataProblemsAreNamed) {
  const fs::path dir = setup_dir("data", 1, 0);
  write_text(dir / "data.tsv", "# only a comment\n\n   \n");
  Result r = run(dir, run(dir, {}), "a");
  EXPECT_EQ(r.code, 2) << r.err;
  EXPECT_TRUE(contains(r.err, "no training examples")) << r.err;
  EXPECT_FALSE(contains(r.err, "seq_len")) << r.err;
  EXPECT_FALSE(fs::exists(dir / "run")) << "the failed set-up left files behind";
  write_text(dir / "data.tsv", "good\tyes\nno tab here\nalso\tfine\n");
  r = run(dir, run(dir, {"data.on_error=skip", "output.export_path=none"}), "b");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(contains(r.err, "data.tsv:2: skipped")) << r.err;
}

// Defect 9: stale temp files and incomplete checkpoints of a killed run are removed at start.
TEST(Hardening, StaleTempFilesAreRemovedAtStart) {
  const fs::path dir = setup_dir("stale", 1, 0);
  fs::create_directories(dir / "run" / "step_000007");
  write_text(dir / "run" / "step_000007" / "optim.state", "partial");
  write_text(dir / "run" / "model.dat.tmp.999999999.0", "partial export");
  write_text(dir / "run" / "config.yaml.tmp.999999999", "x");
  const Result r = run(dir, run(dir, {}), "a");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_TRUE(temp_files(dir / "run").empty());
  EXPECT_FALSE(fs::exists(dir / "run" / "step_000007"));
}

// Defect 9: SIGHUP during set-up killed the process; a second SIGINT killed it without a
// checkpoint and nothing was printed.
TEST(Hardening, SignalsDuringSetUpAndTwiceStopCleanly) {
  for (int variant = 0; variant < 2; ++variant) {
    const fs::path dir = setup_dir("signals" + std::to_string(variant), 100000, 0);
    const std::string out = (dir / "a.out").string();
    const pid_t pid = spawn_logged(
        kQ4train, {"--config", (dir / "config.yaml").string(), "--set", "log.every=1"}, out);
    ASSERT_GE(pid, 0);
    wait_for_text(out, variant == 0 ? ", run directory " : " 2/100000 ", 120);
    int code = -1;
    if (variant == 0) {
      // main prints its one line just before set-up starts (loading the tokenizer alone takes
      // about a second), so this lands in set-up.
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      code = signal_and_wait(pid, SIGHUP);
    } else {
      // A second SIGINT sent before the handler ran for the first would merge with it (standard
      // signals are not queued): send it once the first one is acknowledged.
      ::kill(pid, SIGINT);
      wait_for_text(out, "stop signal received", 60, /*poll_ms=*/5);
      code = signal_and_wait(pid, SIGINT);
    }
    const std::string log = read_text(out);
    EXPECT_EQ(code, 0) << "variant " << variant << ":\n" << log;
    EXPECT_TRUE(contains(log, "stop signal received")) << log;
    if (variant == 1) {
      EXPECT_TRUE(contains(log, "already stopping")) << log;
      bool done = false;
      for (const auto& e : fs::directory_iterator(dir / "run")) {
        done |= fs::exists(e.path() / "DONE");
      }
      EXPECT_TRUE(done) << log;
    }
    // A fresh run stopped in set-up removes what it created, the run directory included.
    if (fs::exists(dir / "run")) {
      EXPECT_TRUE(temp_files(dir / "run").empty()) << log;
    }
  }
}

// A run whose every step is skipped for non-finite gradients, shorter than
// train.max_nonfinite_steps, is an error (it used to end with exit 0 and export the starting
// model). An lm_head of 3e38 (finite, so the weights load) makes the logits overflow.
TEST(Hardening, EveryStepSkippedIsAnError) {
  const fs::path dir = setup_dir("allskipped", 1, 0);
  Result r = run(dir, run(dir, {"output.export_path=none"}), "init");
  ASSERT_EQ(r.code, 0) << r.err;
  const q4::model::DatReader init((dir / "run" / "init.dat").string());
  const fs::path big = dir / "big.dat";
  {
    std::vector<const q4::io::DatEntry*> kept;  // every entry but lm_head's, its type kept
    for (const auto& e : init.entries()) {
      if (e.key.rfind("lm_head.weight", 0) != 0) kept.push_back(&e);
    }
    const int64_t hidden = init.load("model.norm.weight").size(0);
    q4::io::DatWriter w(big.string(), static_cast<int64_t>(kept.size()) + 1);
    for (const auto* e : kept) w.add(e->key, init.load(*e), e->type);
    w.add("lm_head.weight", at::full({151936, hidden}, 3e38, at::kFloat));
    w.commit();
  }
  const std::string weights = "model.weights=" + big.string();
  const std::string out_dir = "output.dir=" + (dir / "run2").string();
  r = run(dir,
          run(dir, {"model.init=file", weights.c_str(), "model.master_dtype=fp32", out_dir.c_str(),
                    "train.steps=2", "output.export_path=none"}),
          "skipped");
  EXPECT_EQ(r.code, 1) << r.err;
  EXPECT_TRUE(contains(r.err, "every step of this run (2) had non-finite gradients")) << r.err;
}

// Ctrl-C stops --write-teacher-topk at its next batch: exit 0, a line saying nothing was written,
// and no file (it used to be killed by the signal, or to run the whole pass first).
TEST(Hardening, WriteTeacherTopkStopsOnASignal) {
  TinyRun t;
  t.steps = 1;
  std::string data;
  for (int i = 0; i < 20000; ++i) data += "Question " + std::to_string(i) + "?\tAnswer.\n";
  t.data = data;
  const fs::path dir = t.write_fresh("hard", "topkstop");
  Result r = run(dir, run(dir, {"output.export_path=none", "data.eval_fraction=0"}), "init");
  ASSERT_EQ(r.code, 0) << r.err;
  const fs::path topk = dir / "topk.dat";
  std::vector<std::string> args =
      config_args(dir, {"train.objective=distill", "output.dir=" + (dir / "w").string(),
                        "distill.teacher=" + (dir / "run" / "init.dat").string(),
                        "distill.topk_file=" + topk.string()});
  args.push_back("--write-teacher-topk");
  const std::string out = (dir / "w.out").string();
  const pid_t pid = spawn_logged(kQ4train, args, out);
  ASSERT_GE(pid, 0);
  wait_for_text(out, "teacher ", 120);
  const int code = signal_and_wait(pid, SIGINT);
  const std::string log = read_text(out);
  EXPECT_EQ(code, 0) << log;
  EXPECT_TRUE(contains(log, "nothing written")) << log;
  EXPECT_FALSE(fs::exists(topk)) << log;
  EXPECT_TRUE(temp_files(dir).empty()) << log;
}

// --dry-run checks the teacher's vocabulary as the run does (it used to pass a mismatch).
TEST(Hardening, DryRunChecksTheTeachersVocabulary) {
  const fs::path dir = setup_dir("dryvocab", 1, 0);
  std::string cfg = read_text(dir / "model.json");
  const std::string from = "\"vocab_size\": 151936", to = "\"vocab_size\": 1000";
  ASSERT_NE(cfg.find(from), std::string::npos) << cfg;
  cfg.replace(cfg.find(from), from.size(), to);
  std::ofstream(dir / "teacher.json") << cfg;
  std::ofstream(dir / "teacher.dat") << "x";
  const std::string t = "distill.teacher=" + (dir / "teacher.dat").string();
  const std::string tc = "distill.teacher_config=" + (dir / "teacher.json").string();
  std::vector<std::string> args = run(dir, {"train.objective=distill", t.c_str(), tc.c_str()});
  args.push_back("--dry-run");
  const Result r = run(dir, args, "dry");
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_TRUE(contains(r.err, "config key distill.teacher: the teacher's vocabulary (1000 tokens"))
      << r.err;
}

}  // namespace

}  // namespace q4::test::hardening_test
