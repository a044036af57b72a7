// Whole-file helpers of the tests: read or write a file's bytes, its lines, a JSON document or a
// JSON-lines file (metrics.jsonl, eval.jsonl), and the files of a tree whose names hold a marker
// (left-over temporary files).
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace q4::test {

// The bytes of `p` ("" when it cannot be opened).
std::string read_text(const std::filesystem::path& p);

// Replaces `p` with `bytes`.
void write_text(const std::filesystem::path& p, const std::string& bytes);

// The lines of `p`, without their '\n'.
std::vector<std::string> read_lines(const std::filesystem::path& p);

// The JSON document in `p` (throws nlohmann's parse error when it is not one).
nlohmann::json read_json(const std::filesystem::path& p);

// The records of a JSON-lines file (blank lines skipped).
std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& p);

inline bool contains(const std::string& s, const std::string& needle) {
  return s.find(needle) != std::string::npos;
}

// Paths of the entries under `root` (recursively) whose file name contains `marker`; none when
// `root` does not exist.
std::vector<std::string> files_named(const std::filesystem::path& root, const std::string& marker);

}  // namespace q4::test
