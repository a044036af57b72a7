// Shared helpers for the test_data binary: the real Qwen3 tokenizer (loaded once per process;
// a missing file is a test FAILURE telling how to fetch it, never a skip), JSON fixture
// reading, and temporary files.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/test/files.h"

namespace q4::data::test {

inline const char* kQwen3TokenizerPath = Q4_SOURCE_DIR "/assets/qwen3/tokenizer.json";

inline bool file_exists(const std::string& p) { return std::ifstream(p).good(); }

// Returns the shared tokenizer; the ADD_FAILURE + throw makes every caller fail loudly.
inline const Tokenizer& qwen3_tokenizer() {
  static std::unique_ptr<Tokenizer> tok;
  if (!tok) {
    if (!file_exists(kQwen3TokenizerPath)) {
      ADD_FAILURE() << "missing " << kQwen3TokenizerPath
                    << ": run tools/fetch_tokenizer.sh to fetch the Qwen3 tokenizer.json";
      throw std::runtime_error("Qwen3 tokenizer.json missing; run tools/fetch_tokenizer.sh");
    }
    tok = std::make_unique<Tokenizer>(Tokenizer::from_file(kQwen3TokenizerPath));
  }
  return *tok;
}

inline nlohmann::json read_json(const std::string& path) {
  EXPECT_TRUE(file_exists(path)) << "cannot open " << path;
  return q4::test::read_json(path);
}

// A file under the system temp dir, removed when the object dies.
class TempFile {
 public:
  TempFile(const std::string& suffix, const std::string& content) {
    static int counter = 0;
    path_ = std::string(::testing::TempDir()) + "q4data_" + std::to_string(::getpid()) + "_" +
            std::to_string(counter++) + suffix;
    std::ofstream out(path_, std::ios::binary);
    out << content;
  }
  ~TempFile() { std::remove(path_.c_str()); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// The same ids and labels.
inline void expect_same(const Example& a, const Example& b) {
  EXPECT_EQ(a.input_ids, b.input_ids);
  EXPECT_EQ(a.labels, b.labels);
}

}  // namespace q4::data::test
