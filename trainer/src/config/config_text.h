// Text helpers shared by the config's parser, validation, YAML emitter and reference (internal
// to trainer/src/config): YAML node reading with key/line errors, paths, number formatting.
#pragma once

#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "q4/io/bounded_read.h"
#include "q4/io/enum_names.h"

namespace fs = std::filesystem;

namespace q4::trainer::config_detail {

using io::enum_from_name;
using io::enum_name;
using io::enum_names;

inline std::vector<std::string> split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char ch : s) {
    if (ch == sep) {
      out.push_back(cur);
      cur.clear();
    } else {
      cur.push_back(ch);
    }
  }
  out.push_back(cur);
  return out;
}

inline std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

inline bool parse_int(const std::string& s, int64_t* out) {
  if (s.empty()) return false;
  size_t pos = 0;
  try {
    const long long v = std::stoll(s, &pos, 10);
    if (pos != s.size()) return false;
    *out = v;
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

inline constexpr const char* kFromSet = "--set";

// Where a node came from, for messages: " (demo.yaml line 12)" or " (from --set)".
inline std::string where(const YAML::Node& node, const std::string& source) {
  if (source == kFromSet) return " (from --set)";
  const YAML::Mark m = node.Mark();
  if (m.is_null() || m.line < 0) return " (from --set)";
  return " (" + source + " line " + std::to_string(m.line + 1) + ")";
}

inline std::string describe(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Null:
      return "null";
    case YAML::NodeType::Scalar:
      return "'" + node.Scalar() + "'";
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a mapping";
    default:
      return "nothing";
  }
}

[[noreturn]] inline void type_error(const std::string& key, const YAML::Node& node,
                                    const std::string& source, const std::string& expected) {
  throw ConfigError("config key " + key + where(node, source) + ": expected " + expected +
                    ", found " + describe(node));
}

inline std::string read_string(const std::string& key, const YAML::Node& n,
                               const std::string& src) {
  if (n.IsNull()) return "";
  if (!n.IsScalar()) type_error(key, n, src, "a string");
  return n.Scalar();
}

inline int64_t read_int(const std::string& key, const YAML::Node& n, const std::string& src) {
  int64_t v = 0;
  if (!n.IsScalar() || !parse_int(trim(n.Scalar()), &v)) type_error(key, n, src, "an integer");
  return v;
}

// A scalar converted by yaml-cpp to T; anything else is a type error expecting `expected`.
template <typename T>
T read_scalar_as(const std::string& key, const YAML::Node& n, const std::string& src,
                 const std::string& expected) {
  if (!n.IsScalar()) type_error(key, n, src, expected);
  try {
    return n.as<T>();
  } catch (const YAML::Exception&) {
    type_error(key, n, src, expected);
  }
}

inline double read_double(const std::string& key, const YAML::Node& n, const std::string& src) {
  return read_scalar_as<double>(key, n, src, "a number");
}

inline bool read_bool(const std::string& key, const YAML::Node& n, const std::string& src) {
  return read_scalar_as<bool>(key, n, src, "true or false");
}

inline std::vector<std::string> read_string_list(const std::string& key, const YAML::Node& n,
                                                 const std::string& src) {
  std::vector<std::string> out;
  if (n.IsNull()) return out;
  if (n.IsScalar()) return {n.Scalar()};  // a single value is a one-element list
  if (!n.IsSequence()) type_error(key, n, src, "a list of strings");
  for (const auto& item : n) {
    if (!item.IsScalar()) type_error(key + "[]", item, src, "a string");
    out.push_back(item.Scalar());
  }
  return out;
}

inline LayerSelection read_layers(const std::string& key, const YAML::Node& n,
                                  const std::string& src) {
  if (n.IsSequence()) {
    LayerSelection sel;
    sel.kind = LayerSelection::Kind::kList;
    for (const auto& item : n) sel.layers.push_back(read_int(key + "[]", item, src));
    return sel;
  }
  if (!n.IsScalar()) type_error(key, n, src, "all, none, last:N or a list of layer indices");
  try {
    return LayerSelection::parse(n.Scalar(), key);
  } catch (const ConfigError& e) {
    throw ConfigError(std::string(e.what()) + where(n, src));
  }
}

inline size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t sub = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, sub});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

inline std::string last_component(const std::string& key) {
  const auto p = key.rfind('.');
  return p == std::string::npos ? key : key.substr(p + 1);
}

// Splices `value` at the dotted `parts` path of `node`, creating mappings on the way.
inline void set_path(YAML::Node node, const std::vector<std::string>& parts, size_t i,
                     const YAML::Node& value, const std::string& full_key) {
  if (i + 1 == parts.size()) {
    node[parts[i]] = value;
    return;
  }
  YAML::Node child = node[parts[i]];
  if (!child.IsDefined() || child.IsNull()) {
    node[parts[i]] = YAML::Node(YAML::NodeType::Map);
  } else if (!child.IsMap()) {
    std::string prefix;
    for (size_t k = 0; k <= i; ++k) prefix += (k ? "." : "") + parts[k];
    throw ConfigError("--set " + full_key + ": " + prefix + " is a value, not a section");
  }
  set_path(node[parts[i]], parts, i + 1, value, full_key);
}

// Rejects every key of the tree that is neither a field nor a section holding fields.
inline void check_keys(const YAML::Node& node, const std::string& prefix,
                       const std::set<std::string>& leaves, const std::set<std::string>& sections,
                       const std::vector<std::string>& all_keys, const std::string& src) {
  if (!node.IsMap()) {
    throw ConfigError("config section " + (prefix.empty() ? std::string("<root>") : prefix) +
                      where(node, src) + ": expected a mapping, found " + describe(node));
  }
  std::set<std::string> seen;
  for (const auto& kv : node) {
    if (!kv.first.IsScalar()) type_error(prefix + "<key>", kv.first, src, "a plain key");
    const std::string key = (prefix.empty() ? "" : prefix + ".") + kv.first.Scalar();
    if (!seen.insert(kv.first.Scalar()).second) {
      throw ConfigError("duplicate config key " + key + where(kv.first, src) +
                        " (a later copy would silently replace the first)");
    }
    if (leaves.count(key)) continue;
    if (sections.count(key)) {
      if (kv.second.IsNull()) continue;  // an empty section keeps its defaults
      check_keys(kv.second, key, leaves, sections, all_keys, src);
      continue;
    }
    std::vector<std::string> candidates(all_keys.begin(), all_keys.end());
    candidates.insert(candidates.end(), sections.begin(), sections.end());
    const std::string hint = did_you_mean(key, candidates);
    throw ConfigError("unknown config key " + key + where(kv.first, src) +
                      (hint.empty() ? "" : "; did you mean " + hint + "?"));
  }
}

// The node at a dotted path, without creating anything (yaml-cpp's non-const [] inserts, and
// assigning to a valid Node handle overwrites the tree: reset() rebinds instead).
inline std::optional<YAML::Node> lookup(const YAML::Node& root,
                                        const std::vector<std::string>& parts) {
  YAML::Node cur;
  cur.reset(root);
  for (const auto& p : parts) {
    if (!cur.IsMap()) return std::nullopt;
    const YAML::Node& ccur = cur;
    const YAML::Node child = ccur[p];
    if (!child.IsDefined()) return std::nullopt;
    cur.reset(child);
  }
  return cur;
}

// The line where a second YAML document's content starts, or 0 when `text` holds one document
// (YAML::Load reads the first and silently ignores the rest). A document ends at a "---" line
// that follows content, or at a "..." line; blank lines, comments and directives ("%YAML") hold
// nothing, so a leading or trailing marker is fine. Scanned as text: yaml-cpp's LoadAll can loop
// forever on malformed input.
inline int64_t second_document_line(const std::string& text) {
  std::istringstream in(text);
  std::string line;
  bool content = false, ended = false;
  auto marker = [](const std::string& l, const char* m) {
    return l.rfind(m, 0) == 0 && (l.size() == 3 || l[3] == ' ' || l[3] == '\t');
  };
  for (int64_t n = 1; std::getline(in, line); ++n) {
    if (!line.empty() && line.back() == '\r') line.pop_back();
    const bool start = marker(line, "---"), end = marker(line, "...");
    if ((start || end) && content) ended = true;
    const std::string rest = start || end ? line.substr(3) : line;
    const auto b = rest.find_first_not_of(" \t");
    const bool has_content =
        b != std::string::npos && rest[b] != '#' && !(b == 0 && rest[0] == '%');
    if (!has_content) continue;
    if (ended) return n;
    content = true;
  }
  return 0;
}

// A leading "~/" (or a lone "~") is the user's home directory, as in a shell: paths in configs
// and --set values are often copied from one. Unchanged when HOME is unset.
inline std::string expand_home(const std::string& p) {
  if (p != "~" && p.rfind("~/", 0) != 0) return p;
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') return p;
  return std::string(home) + p.substr(1);
}

inline std::string resolve_path(const std::string& p_in, const std::string& base) {
  const std::string p = expand_home(p_in);
  if (p.empty()) return p;
  fs::path path(p);
  if (path.is_absolute()) return path.lexically_normal().string();
  return (fs::absolute(fs::path(base)) / path).lexically_normal().string();
}

inline std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

[[noreturn]] inline void range_error(const std::string& key, const std::string& expected,
                                     const std::string& found) {
  throw ConfigError("config key " + key + ": expected " + expected + ", found " + found);
}

// The shortest decimal that reads back as exactly `v` ("0.9", "1e-08"), so printing loses nothing.
inline std::string fmt_double(double v) {
  char buf[32];
  for (int prec = 1; prec <= 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*g", prec, v);
    if (std::strtod(buf, nullptr) == v) break;
  }
  std::string s = buf;
  const auto e = s.find('e');  // "1e-08" -> "1e-8"
  if (e != std::string::npos) {
    size_t d = e + 1;
    if (d < s.size() && (s[d] == '-' || s[d] == '+')) ++d;
    while (d + 1 < s.size() && s[d] == '0') s.erase(d, 1);
    if (s[e + 1] == '+') s.erase(e + 1, 1);
  }
  return s;
}

// fmt_double, marked as a float: "0.0", "1.0", "0.02", "1e-08".
inline std::string fmt_float(double v) {
  std::string s = fmt_double(v);
  if (std::isfinite(v) && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

using io::enum_name;
using io::enum_names;

// "expected ..." text of a range: ">= 1", "a value in [0, 1)"; floats say finite.
inline std::string expected_range(const Range& r, bool is_float) {
  std::string out = is_float ? "a finite value" : "";
  if (r.min && r.max) {
    out += (out.empty() ? "a value in " : " in ") + r.to_string();
  } else if (!r.empty()) {
    out += (out.empty() ? "" : " ") + r.to_string();
  }
  return out;
}

// Checks the value of one numeric field against its table row; `where_text` locates it.
template <typename T>
void check_range(const FieldRef& f, T v, const std::string& where_text) {
  constexpr bool kFloat = std::is_same_v<T, double>;
  const bool ok = f.range.contains(static_cast<double>(v)) &&
                  (!kFloat || std::isfinite(static_cast<double>(v)));
  if (ok) return;
  const std::string found = kFloat ? fmt_double(static_cast<double>(v)) : std::to_string(v);
  throw ConfigError("config key " + f.key + where_text + ": expected " +
                    expected_range(f.range, kFloat) + ", found " + found);
}

// One field's value from its YAML node, type- and range-checked against its table row
// (parse.cpp).
void read_field(const FieldRef& f, const YAML::Node& cur, const std::string& src);

// reward.functions (reward_entries.cpp): a list of mappings, each key checked against
// reward_function_fields and reward_key_applies; names default to the kind.
std::vector<RewardFunctionConfig> read_reward_functions(const std::string& key, const YAML::Node& n,
                                                        const std::string& src);
// reward.*: the entries' ranges, names, required keys and regexes, the command.
void validate_reward(const Config& c);
// One field's value as YAML, as read_field reads it back (emit.cpp).
void emit_value(YAML::Emitter& out, const FieldPtr& field);
// One reward.functions entry as a YAML mapping: the keys that apply to its kind.
void emit_reward_functions(YAML::Emitter& out, const std::vector<RewardFunctionConfig>& v);

}  // namespace q4::trainer::config_detail
