// Helpers of the end-to-end tests beside the support library's (q4/test/*.h): q4train with its
// output in files, a copy of a finished run to resume, and the step-by-step comparison of two
// runs' metrics.
#pragma once

#include <gtest/gtest.h>

#include <cstddef>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/test/files.h"
#include "q4/test/process.h"
#include "q4/test/tiny_run.h"

namespace q4::test {

// q4train with `args`; stdout and stderr in <log_prefix>.out and <log_prefix>.err.
inline Result run_q4train(const std::vector<std::string>& args,
                          const std::filesystem::path& log_prefix) {
  return run_captured(kQ4train + quoted(args), log_prefix.string() + ".out",
                      log_prefix.string() + ".err");
}

// `dir` made afresh with a copy of `base`/run as `dir`/run.
inline void copy_run(const std::filesystem::path& base, const std::filesystem::path& dir) {
  q4::io::remove_tree(dir);
  std::filesystem::create_directories(dir);
  std::filesystem::copy(base / "run", dir / "run", std::filesystem::copy_options::recursive);
}

// The metrics.jsonl `got` has the steps of `want`, each with the same values of `keys` bit for
// bit (CPU arithmetic in the same shapes and thread count is deterministic). A fatal failure when
// the step counts differ: wrap the call in ASSERT_NO_FATAL_FAILURE.
inline void expect_same_steps(const std::filesystem::path& want, const std::filesystem::path& got,
                              std::initializer_list<const char*> keys) {
  const auto w = read_jsonl(want);
  const auto g = read_jsonl(got);
  ASSERT_EQ(g.size(), w.size());
  for (size_t i = 0; i < w.size(); ++i) {
    for (const char* k : keys) {
      EXPECT_EQ(g[i][k].get<double>(), w[i][k].get<double>()) << k << " at step " << i + 1;
    }
  }
}

}  // namespace q4::test
