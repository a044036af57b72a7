// Whole-file helpers of the tests (see q4/test/files.h).
#include "q4/test/files.h"

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace fs = std::filesystem;

namespace q4::test {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void write_text(const fs::path& p, const std::string& bytes) {
  std::ofstream out(p, std::ios::binary);
  out << bytes;
}

std::vector<std::string> read_lines(const fs::path& p) {
  std::vector<std::string> out;
  std::ifstream in(p);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

nlohmann::json read_json(const fs::path& p) { return nlohmann::json::parse(read_text(p)); }

std::vector<nlohmann::json> read_jsonl(const fs::path& p) {
  std::vector<nlohmann::json> out;
  for (const std::string& line : read_lines(p)) {
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::vector<std::string> files_named(const fs::path& root, const std::string& marker) {
  std::vector<std::string> v;
  if (!fs::exists(root)) return v;
  for (const auto& e : fs::recursive_directory_iterator(root)) {
    if (contains(e.path().filename().string(), marker)) v.push_back(e.path().string());
  }
  return v;
}

}  // namespace q4::test
