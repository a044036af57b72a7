// Set-up helpers: the held-out split is deterministic and disjoint, the probe's synthetic
// examples are fully supervised, the CPU batcher settings and the input files a run requires.
#include "q4/trainer/plan/setup.h"

#include <gtest/gtest.h>

#include <fstream>
#include <set>

#include "component_fixtures.h"

namespace fs = std::filesystem;
using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(Setup, HoldOutIsDeterministicAndDisjoint) {
  auto train = random_examples(20, 6, 100, 3);
  auto copy = train;
  const auto held = hold_out(&train, 0.25, /*seed=*/7);
  EXPECT_EQ(held.size(), 5u);  // ceil(0.25 x 20)
  EXPECT_EQ(train.size(), 15u);
  std::set<int64_t> lines;
  for (const auto& e : train) lines.insert(e.source_line);
  for (const auto& e : held) EXPECT_EQ(lines.count(e.source_line), 0u);
  const auto again = hold_out(&copy, 0.25, 7);
  ASSERT_EQ(again.size(), held.size());
  for (size_t i = 0; i < held.size(); ++i) EXPECT_EQ(again[i].source_line, held[i].source_line);
  auto one = random_examples(1, 6, 100, 3);
  EXPECT_THROW(hold_out(&one, 0.5, 7), ConfigError);  // nothing left to train on
}

TEST(Setup, SyntheticExamplesAndBatcherOptions) {
  const auto ex = synthetic_examples(3, 8, 50, 1);
  ASSERT_EQ(ex.size(), 3u);
  for (const auto& e : ex) {
    EXPECT_EQ(e.input_ids.size(), 8u);
    EXPECT_EQ(e.labels, e.input_ids);
  }
  Config c = cpu_config("unused");
  c.train.seq_len = 32;
  const auto bo = batcher_options(c, /*pad_id=*/5, /*pack=*/true, /*group=*/1);
  EXPECT_EQ(bo.batch_size, c.train.batch_size);
  EXPECT_EQ(bo.max_seq_len, 32);
  EXPECT_EQ(bo.pad_id, 5);
  EXPECT_FALSE(bo.flatten);  // the CPU path keeps rows apart
}

TEST(Setup, RequiredInputs) {
  ComponentTempDir t;
  Config c = cpu_config(t.path.string());
  c.model.config = (t.path / "missing.json").string();
  try {
    check_input_files(c, ObjectiveNeeds{}, false);
    ADD_FAILURE() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("model.config"), std::string::npos) << e.what();
  }
  EXPECT_THROW(require_file(t.path.string(), "data.files"), ConfigError);  // a directory
  std::ofstream(t.path / "f.txt") << "x";
  EXPECT_NO_THROW(require_file((t.path / "f.txt").string(), "data.files"));
  EXPECT_EQ(join_names({"a", "b", "c"}, 2), "a, b, ... (3 in all)");
}
