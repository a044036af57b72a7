// The run log: a step's metrics record and log line, the validation record before the first
// step, eval answers in the eval log, and the end summary naming the files written.
#include "q4/trainer/report/run_log.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "component_fixtures.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/rundir/run_dir.h"

namespace fs = std::filesystem;
using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

namespace {

std::vector<nlohmann::json> records(const fs::path& path) {
  std::vector<nlohmann::json> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) out.push_back(nlohmann::json::parse(line));
  return out;
}

Config log_config(const fs::path& dir) {
  Config c = cpu_config(dir.string());
  c.train.steps = 4;
  c.log.tensorboard = false;
  c.log.report = false;
  c.log.every = 2;
  c.log.progress = ProgressStyle::kLine;
  return c;
}

// A leader RunLog of log_config's plan in a temporary run directory, opened for a fresh run.
struct OpenLog {
  ComponentTempDir t;
  RunPlan plan = resolve_plan(log_config(t.path), RunOptions{});
  std::ostringstream out, err;
  RunLog log{plan.report_plan(), out, err, /*leader=*/true};
  Evaluator ev{plan.eval_plan(), true};
  OpenLog() { log.open(/*resume=*/false, /*start_step=*/0, ev); }
};

}  // namespace

TEST(RunLog, StepRecordsAndLines) {
  OpenLog o;
  RunLog& log = o.log;
  std::ostringstream &out = o.out, &err = o.err;
  log.log_validation_at_start(Validation{2.5, 40, 1.0});
  log.start_steps(0);
  StepOutcome so;
  so.loss = 3.0;
  so.supervised = 10;
  so.real_tokens = 20;
  so.slots = 24;
  so.res.applied = true;
  so.res.grad_norm = 1.25;
  // Step `done` of 100 ms at lr 1e-3, one rank, no batcher.
  const auto rec = [](int64_t done, bool log_step, std::optional<Validation> val) {
    StepRecord r;
    r.done = done;
    r.lr = 1e-3;
    r.step_ms = 100.0;
    r.log_step = log_step;
    r.val = std::move(val);
    return r;
  };
  // The objective's values are written on logged steps, never over the log's own keys.
  so.logged = {{"kl", at::full({}, 0.5)}, {"loss", at::full({}, 99.0)}};
  log.record_step(so, rec(1, /*log_step=*/true, std::nullopt));
  log.add_tokens(so.real_tokens);
  so.loss = 2.0;
  log.record_step(so, rec(2, /*log_step=*/false, Validation{1.5, 40, 1.0}));
  log.add_tokens(so.real_tokens);
  EXPECT_EQ(out.str().find("time: about"), std::string::npos);
  log.record_step(so, rec(3, /*log_step=*/false, std::nullopt));
  log.close();
  const auto r = records(o.t.path / "metrics.jsonl");
  ASSERT_EQ(r.size(), 4u);
  EXPECT_EQ(r[0]["step"], 0);
  EXPECT_DOUBLE_EQ(r[0]["val_loss"].get<double>(), 2.5);
  EXPECT_EQ(r[1]["step"], 1);
  EXPECT_DOUBLE_EQ(r[1]["loss"].get<double>(), 3.0);
  EXPECT_DOUBLE_EQ(r[1]["grad_norm"].get<double>(), 1.25);
  EXPECT_EQ(r[1]["tokens"], 20);
  EXPECT_DOUBLE_EQ(r[1]["kl"].get<double>(), 0.5);
  EXPECT_FALSE(r[3].contains("kl"));  // step 3 is not logged
  EXPECT_DOUBLE_EQ(r[2]["val_loss"].get<double>(), 1.5);
  EXPECT_EQ(log.tokens_seen(), 40);
  // One log line (step 1), then the time estimate after the third step (of 4).
  EXPECT_NE(out.str().find("time: about 0s for the remaining 1 steps (0.10 s/step)"),
            std::string::npos)
      << out.str();
  EXPECT_EQ(err.str(), "");  // no progress bar with log.progress: line
}

// A mixture-of-experts run: the load-balancing loss (the objective's moe_aux_loss, each step's
// mean over its units) is averaged over the log window weighted by the steps' units, like the
// loss; the loads, entropy and dropped tokens come from the log step's RouterStats. Steps that
// are not logged carry none of them.
TEST(RunLog, RouterMetricsOverTheLogWindow) {
  OpenLog o;
  RunLog& log = o.log;
  std::ostringstream& out = o.out;
  log.start_steps(0);
  StepOutcome so;
  so.loss = 3.0;
  so.res.applied = true;
  StepRecord r;
  r.lr = 1e-3;
  r.step_ms = 100.0;
  // Step 1: 10 units at aux 2.0, not logged; step 2: 30 units at aux 4.0, logged.
  so.units = so.supervised = 10;
  so.logged = {{"moe_aux_loss", at::full({}, 2.0, at::kDouble)}};
  r.done = 1;
  log.record_step(so, r);
  so.units = so.supervised = 30;
  so.logged = {{"moe_aux_loss", at::full({}, 4.0, at::kDouble)}};
  r.done = 2;
  r.log_step = true;
  q4::model::RouterStats rs;
  rs.aux_loss = 9.0;  // the last forward's: not the window's mean
  rs.layers = {{0, 1.5, 0.5, 2.0}, {1, 1.9, 0.25, 1.0}};
  r.router = rs;
  log.record_step(so, r);
  log.close();
  const auto recs = records(o.t.path / "metrics.jsonl");
  ASSERT_EQ(recs.size(), 2u);
  EXPECT_FALSE(recs[0].contains("moe_aux_loss"));
  EXPECT_FALSE(recs[0].contains("moe_max_load"));
  EXPECT_DOUBLE_EQ(recs[1]["moe_aux_loss"].get<double>(), (2.0 * 10 + 4.0 * 30) / 40);
  EXPECT_DOUBLE_EQ(recs[1]["moe_max_load"].get<double>(), 1.9);
  EXPECT_DOUBLE_EQ(recs[1]["moe_min_load"].get<double>(), 0.25);
  EXPECT_DOUBLE_EQ(recs[1]["moe_router_entropy"].get<double>(), 1.5);
  EXPECT_EQ(recs[1]["moe_dropped_tokens"], 0);
  EXPECT_NE(out.str().find("| aux 3.500 load 1.90/0.25 |"), std::string::npos) << out.str();
}

TEST(RunLog, AnswersAndEndSummary) {
  ComponentTempDir t;
  const RunPlan plan = resolve_plan(log_config(t.path), RunOptions{});
  std::ostringstream out, err;
  RunLog log(plan.report_plan(), out, err, true);
  Evaluator ev(plan.eval_plan(), true);
  log.open(false, 0, ev);
  EvalAnswer a;
  a.prompt = "two\nlines";
  a.answer = "ok";
  a.tokens = {1, 2};
  a.stopped = true;
  log.log_answers({a}, 3, "step", 1500.0);
  log.log_answers({a}, 4, "end", 10.0);
  log.close();
  // A periodic answer names its step once; the others say when.
  EXPECT_NE(out.str().find("eval[step 3] two lines => ok\n"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("eval[end step 4] two lines => ok\n"), std::string::npos) << out.str();
  EXPECT_EQ(out.str().find("step step"), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("eval took 1.5 s"), std::string::npos);
  const auto r = records(t.path / kEvalFile);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0]["new_tokens"], 2);
  EXPECT_EQ(r[0]["when"], "step");
  ev.note_validation(1.25, 3);
  log.print_end_summary(4, ev);
  EXPECT_NE(out.str().find("done: 4 steps in"), std::string::npos);
  EXPECT_NE(out.str().find("validation loss 1.2500 (best 1.2500 at step 3)"), std::string::npos);
  EXPECT_NE(out.str().find("metrics"), std::string::npos);
  EXPECT_EQ(tool_command("no-such-q4-tool"), "no-such-q4-tool");
}
