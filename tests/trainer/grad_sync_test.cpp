// Gradient sync with one process: every parameter is this rank's, registered with the optimizer
// in model order with its model index as the rounding stream, and nothing is communicated.
#include "q4/trainer/grad_sync.h"

#include <gtest/gtest.h>

#include "component_fixtures.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(GradSync, OneProcessOwnsEverything) {
  auto model = tiny_model();
  const auto params = model.trainable_parameters();
  GradSync sync(nullptr, model, params);
  EXPECT_FALSE(sync.distributed());
  EXPECT_EQ(sync.params().size(), params.size());
  optim::PackedAdamW optimizer{optim::AdamWOptions{}};
  const auto index = sync.add_owned_params(optimizer);
  ASSERT_EQ(optimizer.num_params(), static_cast<int64_t>(params.size()));
  ASSERT_EQ(index.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(index.at(params[i]), static_cast<int64_t>(i));
    EXPECT_EQ(optimizer.params()[i].name, params[i]->name);
  }
  EXPECT_EQ(sync.ownership_summary(optimizer.num_params()), "");
  sync.broadcast_masters();  // nothing to broadcast
}

TEST(GradSync, OwnersSplitTheElements) {
  // The sharded layout the ranks agree on: every parameter has exactly one owner and the
  // elements are spread over the ranks.
  const std::vector<int64_t> numels = {1000, 10, 500, 500, 990, 20};
  const auto owners = assign_owners(numels, 2);
  ASSERT_EQ(owners.size(), numels.size());
  int64_t per_rank[2] = {0, 0};
  for (size_t i = 0; i < numels.size(); ++i) {
    ASSERT_TRUE(owners[i] == 0 || owners[i] == 1);
    per_rank[owners[i]] += numels[i];
  }
  EXPECT_GT(per_rank[0], 0);
  EXPECT_GT(per_rank[1], 0);
  EXPECT_EQ(assign_owners(numels, 2), owners);  // the same on every rank
}
