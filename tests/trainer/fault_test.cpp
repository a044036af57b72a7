// The test-fault plan (runtime/fault.h): KIND:RANK:STEP specs parse to the fault they name; an
// unset, empty, malformed or unknown spec injects nothing.
#include "q4/trainer/runtime/fault.h"

#include <gtest/gtest.h>

using q4::trainer::FaultPlan;
using Kind = q4::trainer::FaultPlan::Kind;

TEST(FaultPlan, ParsesEachKind) {
  const FaultPlan exit = FaultPlan::parse("exit:1:15");
  EXPECT_EQ(exit.kind, Kind::kExit);
  EXPECT_EQ(exit.rank, 1);
  EXPECT_EQ(exit.step, 15);
  EXPECT_TRUE(exit.at(Kind::kExit, 1, 15));
  EXPECT_FALSE(exit.at(Kind::kExit, 0, 15));
  EXPECT_FALSE(exit.at(Kind::kExit, 1, 14));
  EXPECT_FALSE(exit.at(Kind::kHang, 1, 15));
  EXPECT_TRUE(FaultPlan::parse("hang:1:3").at(Kind::kHang, 1, 3));
  EXPECT_TRUE(FaultPlan::parse("endeval:0:3").at(Kind::kEndEval, 0, 3));
  EXPECT_TRUE(FaultPlan::parse("valsignal:0:2").at(Kind::kValSignal, 0, 2));
}

TEST(FaultPlan, AnythingElseInjectsNothing) {
  for (const char* spec : {static_cast<const char*>(nullptr), "", "exit", "exit:1", "exit:x:3",
                           "EXIT:1:3", "crash:0:1", ":0:1"}) {
    const FaultPlan f = FaultPlan::parse(spec);
    EXPECT_EQ(f.kind, Kind::kNone) << (spec ? spec : "null");
    EXPECT_FALSE(f.at(Kind::kNone, -1, -1)) << (spec ? spec : "null");
  }
}

TEST(FaultPlan, InstalledOnce) {
  EXPECT_EQ(q4::trainer::installed_fault_plan().kind, Kind::kNone);
  q4::trainer::install_fault_plan(FaultPlan::parse("exit:0:4"));
  EXPECT_TRUE(q4::trainer::installed_fault_plan().at(Kind::kExit, 0, 4));
  q4::trainer::install_fault_plan(FaultPlan{});
  EXPECT_EQ(q4::trainer::installed_fault_plan().kind, Kind::kNone);
}
