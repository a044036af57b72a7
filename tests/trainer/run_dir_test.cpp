// Checkpoint directories: names, DONE markers, rotation (newest K complete kept, incomplete
// removed), resume resolution and atomic writes.
#include "q4/trainer/rundir/run_dir.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "q4/io/remove_tree.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/options.h"

namespace fs = std::filesystem;
using namespace q4::trainer;

namespace {

struct TempDir {
  fs::path path;
  TempDir() {
    path = fs::temp_directory_path() /
           ("q4_run_dir_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    q4::io::remove_tree(path);
    fs::create_directories(path);
  }
  ~TempDir() { q4::io::remove_tree(path); }
};

void make_ckpt(const fs::path& run, int64_t step, bool done) {
  const fs::path d = run / checkpoint_dir_name(step);
  fs::create_directories(d);
  std::ofstream(d / "optim.state") << "x";
  if (done) mark_checkpoint_done(d.string(), step);
}

}  // namespace

TEST(RunDir, Names) {
  EXPECT_EQ(checkpoint_dir_name(12), "step_000012");
  EXPECT_EQ(checkpoint_dir_name(1234567), "step_1234567");
}

TEST(RunDir, ListAndLatestIgnoreIncomplete) {
  TempDir t;
  make_ckpt(t.path, 10, true);
  make_ckpt(t.path, 2, true);
  make_ckpt(t.path, 30, false);  // crashed mid-write
  fs::create_directories(t.path / "step_abc");
  fs::create_directories(t.path / "other");
  const auto all = list_checkpoints(t.path.string());
  ASSERT_EQ(all.size(), 3u);
  EXPECT_EQ(all[0].step, 2);
  EXPECT_EQ(all[1].step, 10);
  EXPECT_EQ(all[2].step, 30);
  EXPECT_FALSE(all[2].done);
  const auto latest = latest_checkpoint(t.path.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 10);
  EXPECT_FALSE(latest_checkpoint((t.path / "missing").string()).has_value());
}

TEST(RunDir, DoneMarkerHoldsStep) {
  TempDir t;
  make_ckpt(t.path, 5, true);
  std::ifstream in(t.path / "step_000005" / kDoneMarker);
  int64_t step = 0;
  in >> step;
  EXPECT_EQ(step, 5);
}

TEST(RunDir, RotationKeepsNewestComplete) {
  TempDir t;
  for (int64_t s : {1, 2, 3, 4}) make_ckpt(t.path, s, true);
  make_ckpt(t.path, 5, false);
  const auto removed = rotate_checkpoints(t.path.string(), 2);
  EXPECT_EQ(removed.size(), 3u);
  const auto left = list_checkpoints(t.path.string());
  ASSERT_EQ(left.size(), 2u);
  EXPECT_EQ(left[0].step, 3);
  EXPECT_EQ(left[1].step, 4);
  EXPECT_TRUE(left[0].done && left[1].done);
}

TEST(RunDir, ResolveResume) {
  TempDir t;
  make_ckpt(t.path, 4, true);
  make_ckpt(t.path, 8, true);
  make_ckpt(t.path, 12, false);
  EXPECT_EQ(resolve_resume_dir(t.path.string()).step, 8);  // run dir: newest complete
  EXPECT_EQ(resolve_resume_dir((t.path / "step_000004").string()).step, 4);
  EXPECT_EQ(resolve_resume_dir((t.path / "step_000004/").string()).step, 4);
  try {
    resolve_resume_dir((t.path / "step_000012").string());
    FAIL() << "an incomplete checkpoint must not resume";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
  EXPECT_THROW(resolve_resume_dir((t.path / "nope").string()), ConfigError);
  fs::create_directories(t.path / "empty");
  EXPECT_THROW(resolve_resume_dir((t.path / "empty").string()), ConfigError);
}

TEST(RunDir, AtomicWriteReplacesAndLeavesNoTemp) {
  TempDir t;
  const std::string p = (t.path / "f.txt").string();
  write_file_atomic(p, "one");
  write_file_atomic(p, "two");
  EXPECT_EQ(read_file(p), "two");
  int files = 0;
  for (const auto& e : fs::directory_iterator(t.path)) {
    (void)e;
    ++files;
  }
  EXPECT_EQ(files, 1);
  EXPECT_THROW(read_file((t.path / "missing").string()), ConfigError);
}

// What makes a fresh run refuse output.dir: anything but the lock, temp files, incomplete
// checkpoints, probe.json and the run's own inputs (and folders holding one).
TEST(RunDir, LeftoversIgnoreLockTempsIncompleteCheckpointsAndInputs) {
  TempDir t;
  Config c;
  c.output.dir = (t.path / "run").string();
  EXPECT_TRUE(run_dir_leftovers(run_paths(c), objective_needs(c)).empty());  // absent
  fs::create_directories(t.path / "run");
  std::ofstream(t.path / "run" / ".lock") << "1\n";
  std::ofstream(t.path / "run" / "model.dat.tmp.999999999") << "x";
  std::ofstream(t.path / "run" / "probe.json") << "{}";
  std::ofstream(t.path / "run" / "weights.dat") << "w";
  make_ckpt(t.path / "run", 3, /*done=*/false);
  c.model.weights = (t.path / "run" / "weights.dat").string();
  EXPECT_TRUE(run_dir_leftovers(run_paths(c), objective_needs(c)).empty());
  make_ckpt(t.path / "run", 4, /*done=*/true);
  std::ofstream(t.path / "run" / "metrics.jsonl") << "{}\n";
  EXPECT_EQ(run_dir_leftovers(run_paths(c), objective_needs(c)),
            (std::vector<std::string>{"metrics.jsonl", "step_000004"}));
  c.model.weights.clear();
  EXPECT_EQ(run_dir_leftovers(run_paths(c), objective_needs(c)).size(), 3u);
  // A folder holding an input (a distillation teacher's HF folder) is the run's too.
  fs::create_directories(t.path / "run" / "model-hf");
  std::ofstream(t.path / "run" / "model-hf" / "config.json") << "{}";
  c.train.objective = ObjectiveKind::kDistill;
  c.distill.teacher = (t.path / "run" / "model-hf").string();
  EXPECT_EQ(run_dir_leftovers(run_paths(c), objective_needs(c)).size(), 3u);
  c.distill.teacher = (t.path / "run" / "model-hf" / "config.json").string();
  EXPECT_EQ(run_dir_leftovers(run_paths(c), objective_needs(c)).size(), 3u);
  c.train.objective = ObjectiveKind::kCrossEntropy;  // the teacher is not read
  EXPECT_EQ(run_dir_leftovers(run_paths(c), objective_needs(c)).size(), 4u);
}
