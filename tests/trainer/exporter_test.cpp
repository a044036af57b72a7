// The exporter: no file when export is off; the model of a step written with its export record
// and checked against the trained model; an older step never replaces a newer export (an error
// for the final export, a warning for a periodic one).
#include "q4/trainer/output/exporter.h"

#include <gtest/gtest.h>

#include <sstream>

#include "component_fixtures.h"
#include "q4/model/dat_file.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/rundir/run_dir.h"

namespace fs = std::filesystem;
using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(Exporter, OffWritesNothing) {
  ComponentTempDir t;
  Config c = cpu_config(t.path.string());
  c.output.export_path = "none";
  const RunPlan plan = resolve_plan(c, RunOptions{});
  std::ostringstream out, err;
  auto model = tiny_model();
  Exporter(plan.export_plan(), out, err).write(10, model, "unused.dat");
  EXPECT_TRUE(fs::is_empty(t.path));
  EXPECT_EQ(out.str(), "");
}

TEST(Exporter, WritesChecksAndNeverGoesBack) {
  ComponentTempDir t;
  // The source file as a random-init run writes it, and the model loaded from it.
  const std::string source = (t.path / "init.dat").string();
  q4::model::write_dat(tiny_model(), source, /*quantize_lm_head=*/false);
  auto cfg = tiny_model().config();
  model::ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.grad_dtype = at::kFloat;
  auto model = model::Qwen3Model::load(cfg, model::DatReader(source), o);
  Config c = cpu_config(t.path.string());
  const RunPlan plan = resolve_plan(c, RunOptions{});
  std::ostringstream out, err;
  Exporter exporter(plan.export_plan(), out, err);
  exporter.write(4, model, source);
  const std::string path = plan.export_path();
  EXPECT_TRUE(fs::exists(path));
  EXPECT_EQ(existing_export_step(path), 4);
  EXPECT_NE(out.str().find("export step 4 -> " + path), std::string::npos) << out.str();
  EXPECT_NE(out.str().find("export check"), std::string::npos) << out.str();
  EXPECT_ANY_THROW(exporter.write(3, model, source));  // the final export: an error
  exporter.write_periodic(2, model, source);           // a periodic one: a warning
  EXPECT_NE(err.str().find("warning: export at step 2 failed, training goes on"), std::string::npos)
      << err.str();
  EXPECT_EQ(existing_export_step(path), 4);
}
