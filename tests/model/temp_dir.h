// The .dat container and q4dat tool tests name the support library's ScopedTempDir (a fresh
// folder per test, removed with its files) in their own namespace; tests whose folder holds
// subfolders take fresh_test_dir.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "q4/test/temp_dir.h"

namespace q4::model::test {

using q4::test::ScopedTempDir;

// <gtest TempDir>/<prefix><pid>_<test name>, emptied: the running test's own folder, which may
// hold subfolders (the fixture removes it with q4::io::remove_tree in TearDown).
inline std::filesystem::path fresh_test_dir(const std::string& prefix) {
  return q4::test::fresh_dir(std::filesystem::path(::testing::TempDir()) /
                             (prefix + std::to_string(::getpid()) + "_" +
                              ::testing::UnitTest::GetInstance()->current_test_info()->name()));
}

}  // namespace q4::model::test
