// The reward section's list of mappings (reward.functions): each entry read against its own
// small field table (reward_function_fields), printed back with the keys its kind uses, and
// validated (names, required keys, PCRE2 regexes compiled here so a bad one is a config error
// naming its key). docs/trainer.md#rewards.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <set>
#include <string>
#include <vector>

// config_text.h uses config.h's types: kept after it.
// clang-format off
#include "q4/trainer/config/config.h"
#include "config/config_text.h"
// clang-format on
#include "config/reward_regex.h"

namespace q4::trainer {
using namespace config_detail;

pcre2_code* compile_reward_regex(const std::string& pattern, const std::string& key) {
  int err = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw ConfigError("config key " + key + ": invalid regular expression '" + pattern +
                      "' at offset " + std::to_string(offset) + ": " +
                      reinterpret_cast<const char*>(msg));
  }
  return code;
}

namespace {

// The entry's key for messages: "reward.functions[2].pattern".
std::string reward_entry_key(const std::string& list_key, size_t i, const std::string& leaf) {
  return list_key + "[" + std::to_string(i) + "]" + (leaf.empty() ? "" : "." + leaf);
}

// Checks that `pattern` compiles as the rewards layer compiles it and, for an extraction, has a
// capture group.
void check_reward_regex(const std::string& pattern, const std::string& key, bool needs_group) {
  pcre2_code* code = compile_reward_regex(pattern, key);
  uint32_t groups = 0;
  pcre2_pattern_info(code, PCRE2_INFO_CAPTURECOUNT, &groups);
  pcre2_code_free(code);
  if (needs_group && groups == 0) {
    throw ConfigError("config key " + key + ": '" + pattern +
                      "' has no capture group; the first group (...) is the extracted answer");
  }
}

// A name that reads as one component of a metric path (rewards/<name>/mean).
bool is_metric_name(const std::string& name) {
  if (name.empty()) return false;
  for (char ch : name) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '_' && ch != '.' && ch != '-') {
      return false;
    }
  }
  return true;
}

// One entry: its kind first (which decides the keys that apply), then every key it gives.
RewardFunctionConfig read_reward_entry(const std::string& key, const YAML::Node& item,
                                       const std::string& src) {
  if (!item.IsMap()) type_error(key, item, src, "a mapping {kind: ..., ...}");
  RewardFunctionConfig entry;
  auto fields = reward_function_fields(entry);
  std::vector<std::string> leaves;
  for (const auto& f : fields) leaves.push_back(f.key);
  const YAML::Node& citem = item;
  if (!citem["kind"].IsDefined()) {
    throw ConfigError("config key " + key + ".kind" + where(item, src) + ": required (one of " +
                      join(enum_names<RewardKind>(), ", ") + ")");
  }
  std::set<std::string> seen;
  for (const auto& kv : item) {
    if (!kv.first.IsScalar()) type_error(key + ".<key>", kv.first, src, "a plain key");
    const std::string leaf = kv.first.Scalar();
    if (!seen.insert(leaf).second) {
      throw ConfigError("duplicate config key " + key + "." + leaf + where(kv.first, src));
    }
    if (std::find(leaves.begin(), leaves.end(), leaf) == leaves.end()) {
      const std::string hint = did_you_mean(leaf, leaves);
      throw ConfigError("unknown config key " + key + "." + leaf + where(kv.first, src) +
                        " (keys: " + join(leaves, ", ") + ")" +
                        (hint.empty() ? "" : "; did you mean " + hint + "?"));
    }
  }
  for (auto& f : fields) {
    if (f.key != "kind") continue;
    f.key = key + ".kind";
    read_field(f, citem["kind"], src);
  }
  for (auto& f : fields) {
    const YAML::Node node = citem[f.key];
    if (!node.IsDefined() || f.key == "kind") continue;
    if (!reward_key_applies(entry.kind, f.key)) {
      throw ConfigError("config key " + key + "." + f.key + where(node, src) +
                        ": does not apply to kind " + to_string(entry.kind));
    }
    const std::string leaf = f.key;
    f.key = key + "." + leaf;
    read_field(f, node, src);
  }
  if (entry.name.empty()) entry.name = to_string(entry.kind);
  return entry;
}

}  // namespace

std::vector<RewardFunctionConfig> config_detail::read_reward_functions(const std::string& key,
                                                                       const YAML::Node& n,
                                                                       const std::string& src) {
  std::vector<RewardFunctionConfig> out;
  if (n.IsNull()) return out;
  if (!n.IsSequence()) type_error(key, n, src, "a list of mappings {kind: ..., ...}");
  for (size_t i = 0; i < n.size(); ++i) {
    out.push_back(read_reward_entry(reward_entry_key(key, i, ""), n[i], src));
  }
  return out;
}

void config_detail::emit_reward_functions(YAML::Emitter& out,
                                          const std::vector<RewardFunctionConfig>& v) {
  out << YAML::BeginSeq;
  for (const auto& entry_in : v) {
    RewardFunctionConfig entry = entry_in;
    out << YAML::BeginMap;
    for (const auto& f : reward_function_fields(entry)) {
      if (!reward_key_applies(entry.kind, f.key)) continue;
      out << YAML::Key << f.key << YAML::Value;
      emit_value(out, f.ptr);
    }
    out << YAML::EndMap;
  }
  out << YAML::EndSeq;
}

void config_detail::validate_reward(const Config& c) {
  const auto& r = c.reward;
  std::set<std::string> names;
  if (!r.command.empty()) names.insert("command");  // the command's own metric name
  for (size_t i = 0; i < r.functions.size(); ++i) {
    RewardFunctionConfig e = r.functions[i];
    const std::string key = reward_entry_key("reward.functions", i, "");
    for (auto f : reward_function_fields(e)) {
      f.key = key + "." + f.key;
      if (const auto* p = std::get_if<int64_t*>(&f.ptr)) check_range(f, **p, "");
      if (const auto* p = std::get_if<double*>(&f.ptr)) check_range(f, **p, "");
    }
    if (!is_metric_name(e.name)) {
      range_error(key + ".name", "letters, digits, '_', '.' or '-'", "'" + e.name + "'");
    }
    if (!names.insert(e.name).second) {
      throw ConfigError("config key " + key + ".name: '" + e.name + "' names two rewards" +
                        (e.name == "command" && !r.command.empty() ? " (reward.command's)" : "") +
                        "; give each a unique name");
    }
    const bool needs_field = e.kind == RewardKind::kExactMatch || e.kind == RewardKind::kLastNumber;
    if (needs_field && e.field.empty()) {
      throw ConfigError("config key " + key + ".field: required by kind " + to_string(e.kind) +
                        " (the example's field holding the answer)");
    }
    if (e.kind == RewardKind::kRegex && e.pattern.empty()) {
      throw ConfigError("config key " + key + ".pattern: required by kind regex");
    }
    if (!e.pattern.empty()) check_reward_regex(e.pattern, key + ".pattern", false);
    if (!e.extract.empty()) check_reward_regex(e.extract, key + ".extract", true);
  }
  if (!r.command.empty() && r.command.front().empty()) {
    range_error("reward.command", "a program name first", "an empty argv[0]");
  }
}

}  // namespace q4::trainer
