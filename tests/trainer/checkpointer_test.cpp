// Checkpointing without a model run: save and restore of an optimizer over small fake tensors,
// retention (the newest output.keep kept), reshard (a checkpoint of two ranks' optimizer shards
// continues on one rank with the same global batch) and the checks a resume makes.
#include "q4/trainer/output/checkpointer.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "component_fixtures.h"
#include "q4/trainer/objectives/registry.h"

namespace fs = std::filesystem;
using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace {

// Two fake trainable parameters (a matrix and a vector) with an optimizer over them.
struct FakeState {
  std::vector<model::Parameter> storage;
  std::vector<model::Parameter*> params;
  optim::PackedAdamW optimizer{optim::AdamWOptions{}};
  optim::LrSchedule schedule{[] {
    optim::LrScheduleOptions s;
    s.kind = optim::LrScheduleKind::kConstant;
    s.peak_lr = 1e-2;
    return s;
  }()};

  explicit FakeState(uint64_t seed, const std::vector<int>& owned = {0, 1}) {
    at::Generator gen = at::detail::createCPUGenerator(seed);
    storage.resize(2);
    storage[0].name = "a.weight";
    storage[0].master = at::randn({8, 16}, gen);
    storage[1].name = "b.weight";
    storage[1].master = at::randn({16}, gen);
    for (auto& p : storage) {
      p.trainable = true;
      params.push_back(&p);
    }
    for (int i : owned) {
      optimizer.add_param(storage[static_cast<size_t>(i)].name,
                          storage[static_cast<size_t>(i)].master, true, i);
    }
  }
  void step(uint64_t seed) {
    at::Generator gen = at::detail::createCPUGenerator(seed);
    std::vector<at::Tensor> grads;
    for (int64_t i = 0; i < optimizer.num_params(); ++i) {
      grads.push_back(at::randn(optimizer.params()[static_cast<size_t>(i)].shape, gen));
    }
    optimizer.step(grads);
  }
};

Config config_in(const fs::path& dir, int64_t keep = 2) {
  Config c = cpu_config(dir.string());
  c.output.keep = keep;
  return c;
}

}  // namespace

TEST(Checkpointer, SaveRestoreRoundTrip) {
  ComponentTempDir t;
  RunPlan plan = resolve_plan(config_in(t.path), RunOptions{});
  std::ostringstream out;
  FakeState saved(1);
  saved.step(2);
  Checkpointer ck(plan.checkpoint_plan(), out);
  ck.attach(saved.optimizer, saved.params, nullptr, saved.schedule);
  ck.save(3, /*tokens_seen=*/123);
  EXPECT_EQ(ck.last_step(), 3);
  const auto latest = latest_checkpoint(t.path.string());
  ASSERT_TRUE(latest.has_value());
  EXPECT_EQ(latest->step, 3);
  EXPECT_TRUE(fs::exists(fs::path(latest->path) / kOptimStateFile));

  FakeState fresh(9);  // other masters: the checkpoint's come back
  RunPlan plan2 = resolve_plan(config_in(t.path), RunOptions{});
  Checkpointer ck2(plan2.checkpoint_plan(), out);
  ck2.attach(fresh.optimizer, fresh.params, nullptr, fresh.schedule);
  const auto r = ck2.restore(*latest, Checkpointer::RestoreFor::kResume);
  EXPECT_EQ(r.step, 3);
  EXPECT_EQ(r.tokens_seen, 123);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(fresh.storage[i].master.equal(saved.storage[i].master)) << i;
  }
  EXPECT_NE(out.str().find("resumed from"), std::string::npos);
}

TEST(Checkpointer, RetentionKeepsTheNewest) {
  ComponentTempDir t;
  RunPlan plan = resolve_plan(config_in(t.path, /*keep=*/2), RunOptions{});
  std::ostringstream out;
  FakeState s(1);
  Checkpointer ck(plan.checkpoint_plan(), out);
  ck.attach(s.optimizer, s.params, nullptr, s.schedule);
  for (int64_t step = 1; step <= 4; ++step) ck.save(step, 0);
  const auto all = list_checkpoints(t.path.string());
  ASSERT_EQ(all.size(), 2u);
  EXPECT_EQ(all[0].step, 3);
  EXPECT_EQ(all[1].step, 4);
  EXPECT_NE(out.str().find("(rotated 1 old)"), std::string::npos);
}

TEST(Checkpointer, ReshardsTwoRanksOntoOne) {
  ComponentTempDir t;
  std::ostringstream out;
  // A checkpoint as two ranks write it: rank 0 owns a.weight, rank 1 b.weight; each shard holds
  // its masters and moments; the run state says world 2 x grad_accum 1.
  FakeState rank0(1, {0}), rank1(1, {1});
  rank0.step(2);
  rank1.step(3);
  RunPlan plan = resolve_plan(config_in(t.path), RunOptions{});
  Checkpointer writer(plan.checkpoint_plan(), out);
  writer.attach(rank0.optimizer, rank0.params, nullptr, rank0.schedule);
  writer.save(5, 0);
  const fs::path dir = t.path / checkpoint_dir_name(5);
  fs::remove(dir / kOptimStateFile);
  rank0.optimizer.save((dir / shard_file_name(0, 2)).string(), true);
  rank1.optimizer.save((dir / shard_file_name(1, 2)).string(), true);
  auto state = nlohmann::json::parse(std::ifstream(dir / kTrainStateFile));
  state["world_size"] = 2;
  state["grad_accum"] = 1;
  state["batch_size"] = plan.config().train.batch_size;
  std::ofstream(dir / kTrainStateFile) << state.dump(2) << "\n";
  write_checkpoint_checksums(
      dir.string(), {shard_file_name(0, 2), shard_file_name(1, 2), kRngFile, kTrainStateFile});
  EXPECT_EQ(optimizer_files(resolve_resume_dir(dir.string())).size(), 2u);

  FakeState one(9);
  RunPlan resumed = resolve_plan(config_in(t.path), RunOptions{});
  Checkpointer ck(resumed.checkpoint_plan(), out);
  ck.attach(one.optimizer, one.params, nullptr, one.schedule);
  int64_t told = 0;
  const auto r = ck.restore(resolve_resume_dir(dir.string()), Checkpointer::RestoreFor::kResume,
                            [&](int64_t accum) {
                              told = accum;
                              resumed = resumed.with_grad_accum(accum);
                            });
  EXPECT_EQ(r.step, 5);
  EXPECT_EQ(told, 2);  // the same global batch: 2 ranks x 1 = 1 rank x 2
  EXPECT_EQ(resumed.grad_accum(), 2);
  EXPECT_TRUE(one.storage[0].master.equal(rank0.storage[0].master));
  EXPECT_TRUE(one.storage[1].master.equal(rank1.storage[1].master));
  EXPECT_NE(out.str().find("continues on 1 rank(s) with grad_accum 2"), std::string::npos);
  // Its checkpoints from then on record the resume's grad_accum, not the plan slice's.
  ck.save(6, 0);
  const auto after =
      nlohmann::json::parse(std::ifstream(t.path / checkpoint_dir_name(6) / kTrainStateFile));
  EXPECT_EQ(after["grad_accum"], 2);
  EXPECT_EQ(after["world_size"], 1);
}

TEST(Checkpointer, GradAccumForWorld) {
  EXPECT_FALSE(grad_accum_for_world(2, 3, 4, 2, 4, "ck").has_value());
  EXPECT_EQ(grad_accum_for_world(2, 1, 4, 1, 4, "ck"), 2);
  EXPECT_EQ(grad_accum_for_world(1, 4, 4, 2, 4, "ck"), 2);
  EXPECT_THROW(grad_accum_for_world(2, 1, 4, 3, 4, "ck"), ConfigError);  // 2 x 1 not / 3
  EXPECT_THROW(grad_accum_for_world(2, 1, 4, 1, 8, "ck"), ConfigError);  // batch_size changed
}

TEST(Checkpointer, IncompleteShardsAndScheduleChanges) {
  ComponentTempDir t;
  std::ostringstream out;
  FakeState s(1);
  RunPlan plan = resolve_plan(config_in(t.path), RunOptions{});
  Checkpointer ck(plan.checkpoint_plan(), out);
  ck.attach(s.optimizer, s.params, nullptr, s.schedule);
  ck.save(2, 0);
  const auto saved = resolve_resume_dir((t.path / checkpoint_dir_name(2)).string());
  EXPECT_NO_THROW(ck.check_schedule_unchanged(saved));
  Config longer = config_in(t.path);
  longer.train.steps = 20;
  RunPlan plan2 = resolve_plan(longer, RunOptions{});
  Checkpointer ck2(plan2.checkpoint_plan(), out);
  try {
    ck2.check_schedule_unchanged(saved);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("train.steps 10 -> 20"), std::string::npos) << e.what();
  }
  RunOptions allow;
  allow.allow_schedule_change = true;
  RunPlan plan3 = resolve_plan(longer, allow);
  EXPECT_NO_THROW(Checkpointer(plan3.checkpoint_plan(), out).check_schedule_unchanged(saved));

  const fs::path dir = t.path / checkpoint_dir_name(2);
  fs::rename(dir / kOptimStateFile, dir / shard_file_name(0, 2));
  try {
    optimizer_files(saved);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("incomplete checkpoint (found 1 of 2"), std::string::npos)
        << e.what();
  }
}
