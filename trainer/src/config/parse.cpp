// YAML -> Config. The tree is loaded once, `--set` overrides are spliced into it, every key is
// checked against the field table (unknown ones get a did-you-mean across sections and aliases),
// and each known field is converted with the type, range and choice checks of its table row
// (errors name the key and the line).
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
#include "q4/trainer/config/config.h"

namespace fs = std::filesystem;

#include "config/config_text.h"

namespace q4::trainer {
using namespace config_detail;

// ---------------------------------------------------------------------------------------------
// Overrides, did-you-mean

Override parse_override(const std::string& text) {
  const auto eq = text.find('=');
  if (eq == std::string::npos || eq == 0) {
    throw ConfigError("--set expects key.path=value, found '" + text + "'");
  }
  Override o{trim(text.substr(0, eq)), text.substr(eq + 1)};
  for (const auto& part : split(o.key, '.')) {
    if (part.empty()) throw ConfigError("--set: malformed key '" + o.key + "'");
  }
  return o;
}

std::string did_you_mean(const std::string& key, const std::vector<std::string>& known) {
  const std::string last = last_component(key);
  // Another name of a field ("learning_rate" for optim.lr), under any section or none.
  Config scratch;
  for (const auto& f : config_fields(scratch)) {
    if (std::find(known.begin(), known.end(), f.key) == known.end()) continue;
    for (const auto& a : f.aliases) {
      if (a == last) return f.key;
    }
  }
  std::string best;
  size_t best_d = std::string::npos;
  for (const auto& k : known) {
    size_t d = edit_distance(key, k);
    // A right field name under the wrong section ("train.lr" -> "optim.lr") counts as close.
    if (last_component(k) == last) d = std::min<size_t>(d, 1);
    d = std::min(d, edit_distance(last, last_component(k)) + 1);
    if (d < best_d) {
      best_d = d;
      best = k;
    }
  }
  const size_t limit = std::max<size_t>(2, last.size() / 3 + 1);
  return best_d <= limit ? best : "";
}

// ---------------------------------------------------------------------------------------------
// Parsing

namespace {

// The YAML text as a mapping of sections (an empty file is an empty mapping).
YAML::Node load_root(const std::string& yaml_text, const std::string& source_name) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw ConfigError(source_name + " line " + std::to_string(e.mark.line + 1) +
                      ": invalid YAML: " + e.msg);
  }
  if (const int64_t line = second_document_line(yaml_text); line > 0) {
    throw ConfigError(source_name + " line " + std::to_string(line) +
                      ": a second YAML document (after a \"---\" or \"...\" line); a config is "
                      "one document: merge it into the first or remove the marker");
  }
  if (!root.IsDefined() || root.IsNull()) root = YAML::Node(YAML::NodeType::Map);
  if (!root.IsMap()) {
    throw ConfigError(source_name + ": expected a mapping of sections at the top level, found " +
                      describe(root));
  }
  return root;
}

}  // namespace

// One field's value from its YAML node, type- and range-checked against its table row.
void config_detail::read_field(const FieldRef& f, const YAML::Node& cur, const std::string& src) {
  std::visit(
      [&](auto* ptr) {
        using T = std::remove_pointer_t<decltype(ptr)>;
        if constexpr (std::is_same_v<T, std::string>) {
          *ptr = read_string(f.key, cur, src);
        } else if constexpr (std::is_same_v<T, int64_t>) {
          *ptr = read_int(f.key, cur, src);
          check_range(f, *ptr, where(cur, src));
        } else if constexpr (std::is_same_v<T, double>) {
          *ptr = read_double(f.key, cur, src);
          check_range(f, *ptr, where(cur, src));
        } else if constexpr (std::is_same_v<T, bool>) {
          *ptr = read_bool(f.key, cur, src);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          *ptr = read_string_list(f.key, cur, src);
        } else if constexpr (std::is_same_v<T, LayerSelection>) {
          *ptr = read_layers(f.key, cur, src);
        } else if constexpr (std::is_same_v<T, std::vector<RewardFunctionConfig>>) {
          *ptr = read_reward_functions(f.key, cur, src);
        } else if constexpr (std::is_same_v<T, IntOrAuto>) {
          if (cur.IsScalar() && trim(cur.Scalar()) == "auto") {
            ptr->value.reset();
          } else {
            int64_t v = 0;
            if (!cur.IsScalar() || !parse_int(trim(cur.Scalar()), &v)) {
              type_error(f.key, cur, src, "an integer or auto");
            }
            check_range(f, v, where(cur, src));
            ptr->value = v;
          }
        } else if constexpr (std::is_same_v<T, FloatOrAuto>) {
          if (cur.IsScalar() && trim(cur.Scalar()) == "auto") {
            ptr->value.reset();
          } else {
            ptr->value = read_double(f.key, cur, src);
            check_range(f, *ptr->value, where(cur, src));
          }
        } else {
          static_assert(std::is_enum_v<T>);
          if (!cur.IsScalar()) type_error(f.key, cur, src, "one of " + join(f.choices(), ", "));
          const auto v = enum_from_name<T>(cur.Scalar());
          if (!v) {
            throw ConfigError("config key " + f.key + where(cur, src) + ": expected one of " +
                              join(f.choices(), ", ") + ", found '" + cur.Scalar() + "'");
          }
          *ptr = *v;
        }
      },
      f.ptr);
}

namespace {

// train.epochs and train.steps both set the run length: exactly one of them. A --set of one
// overrides the other from the file (a smoke run: --set train.steps=3). Likewise
// optim.schedule.warmup_ratio and warmup_steps (validate_config refuses both).
void resolve_overridden_lengths(Config& c, const YAML::Node& root,
                                const std::set<std::string>& overridden,
                                const std::string& source_name) {
  const bool steps_from_set = overridden.count("train.steps") > 0;
  const bool epochs_from_set = overridden.count("train.epochs") > 0;
  if (c.train.epochs > 0 && lookup(root, {"train", "steps"}) && steps_from_set &&
      !epochs_from_set) {
    c.train.epochs = 0;
  } else if (c.train.epochs > 0 && lookup(root, {"train", "steps"}) &&
             !(epochs_from_set && !steps_from_set)) {
    throw ConfigError("config key train.epochs: set together with train.steps" +
                      where(*lookup(root, {"train", "steps"}),
                            overridden.count("train.steps") ? std::string(kFromSet) : source_name) +
                      "; give one of them (steps are computed from epochs and the data)");
  }
  auto& sched = c.optim.schedule;
  const bool ratio_from_set = overridden.count("optim.schedule.warmup_ratio") > 0;
  const bool wsteps_from_set = overridden.count("optim.schedule.warmup_steps") > 0;
  if (sched.warmup_ratio > 0 && sched.warmup_steps > 0 && ratio_from_set != wsteps_from_set) {
    if (ratio_from_set) {
      sched.warmup_steps = 0;
    } else {
      sched.warmup_ratio = 0;
    }
  }
}

// Paths: a leading ~/ expanded; inputs relative to the config file's directory (or the CWD for
// --set values); model.dir (or an HF folder as model.weights) supplying config.json and
// tokenizer.json; output.dir relative to the CWD (absolute in the saved config, so --resume
// works anywhere).
void resolve_paths(Config& c, std::vector<FieldRef>& fields,
                   const std::set<std::string>& overridden, const std::string& base_dir) {
  c.output.dir = expand_home(c.output.dir);
  c.output.export_path = expand_home(c.output.export_path);
  for (auto& f : fields) {
    if (!f.is_path) continue;
    const std::string base = overridden.count(f.key) ? fs::current_path().string() : base_dir;
    if (auto* s = std::get_if<std::string*>(&f.ptr)) {
      **s = resolve_path(**s, base);
    } else if (auto* v = std::get_if<std::vector<std::string>*>(&f.ptr)) {
      for (auto& p : **v) p = resolve_path(p, base);
    }
  }
  std::error_code ec;
  if (c.model.dir.empty() && !c.model.weights.empty() && fs::is_directory(c.model.weights, ec)) {
    c.model.dir = c.model.weights;
  }
  if (!c.model.dir.empty()) {
    if (c.model.config.empty()) c.model.config = (fs::path(c.model.dir) / "config.json").string();
    if (c.model.tokenizer.empty()) {
      c.model.tokenizer = (fs::path(c.model.dir) / "tokenizer.json").string();
    }
  }
  if (!c.output.dir.empty()) c.output.dir = resolve_path(c.output.dir, fs::current_path().string());
  if (!c.reward.command.empty() && c.reward.command_dir.empty()) {
    c.reward.command_dir = resolve_path(base_dir, fs::current_path().string());
  }
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::string& base_dir, const std::vector<Override>& overrides,
                    const ConfigRules& more_rules) {
  YAML::Node root = load_root(yaml_text, source_name);
  const bool empty_file = root.size() == 0;  // before the --set overrides are spliced in
  Config c;
  c.source = source_name;
  auto fields = config_fields(c);
  std::set<std::string> leaves, sections;
  std::vector<std::string> keys;
  for (const auto& f : fields) {
    leaves.insert(f.key);
    keys.push_back(f.key);
    const auto parts = split(f.key, '.');
    std::string prefix;
    for (size_t i = 0; i + 1 < parts.size(); ++i) {
      prefix += (i ? "." : "") + parts[i];
      sections.insert(prefix);
    }
  }

  std::set<std::string> overridden;
  for (const auto& o : overrides) {
    if (!leaves.count(o.key)) {
      const std::string hint = did_you_mean(o.key, keys);
      throw ConfigError("--set: unknown config key " + o.key +
                        (hint.empty() ? "" : "; did you mean " + hint + "?"));
    }
    YAML::Node value;
    try {
      value = o.value.empty() ? YAML::Node(std::string()) : YAML::Load(o.value);
    } catch (const YAML::ParserException& e) {
      throw ConfigError("--set " + o.key + ": invalid YAML value '" + o.value + "': " + e.msg);
    }
    set_path(root, split(o.key, '.'), 0, value, o.key);
    overridden.insert(o.key);
  }

  check_keys(root, "", leaves, sections, keys, source_name);
  for (auto& f : fields) {
    const auto node = lookup(root, split(f.key, '.'));
    if (!node) continue;
    read_field(f, *node, overridden.count(f.key) ? std::string(kFromSet) : source_name);
  }
  resolve_overridden_lengths(c, root, overridden, source_name);
  resolve_paths(c, fields, overridden, base_dir);
  try {
    c.data.chat_template = data::resolve_chat_template(c.data.chat_template,
                                                       data::tokenizer_folder(c.model.tokenizer));
  } catch (const c10::Error& e) {
    throw ConfigError(std::string("config key data.chat_template (auto): ") +
                      e.what_without_backtrace());
  }
  // A cross-field rule has no line to point at: the message names the file instead (a saved
  // config.yaml that lost its contents reads "model.weights: required" otherwise).
  try {
    validate_config(c);
    if (more_rules) more_rules(c);
  } catch (const ConfigError& e) {
    if (source_name == kFromSet) throw;
    throw ConfigError(std::string(e.what()) + " (config file " + source_name +
                      (empty_file ? ", which is empty)" : ")"));
  }
  return c;
}

// The largest config file read: a hand-written YAML is kilobytes; 16 MiB leaves room for
// generated ones (long eval.prompts lists) and bounds a mistaken huge or endless file.
constexpr size_t kMaxConfigBytes = size_t{16} << 20;

Config load_config(const std::string& path, const std::vector<Override>& overrides,
                   const ConfigRules& more_rules) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    throw ConfigError("config file " + path + " is a directory; expected a YAML file");
  }
  // A config is a small text file: anything else (a FIFO, /dev/zero, a .dat given by mistake)
  // is an error naming the file, not a read without end or a binary parsed as an empty YAML.
  std::string text;
  try {
    text = io::read_regular_file(path, kMaxConfigBytes, "config file");
  } catch (const c10::Error& e) {
    throw ConfigError(e.what_without_backtrace());
  }
  const size_t nul = text.find('\0');
  if (nul != std::string::npos) {
    throw ConfigError("config file " + path + " is not a YAML text file: NUL byte at offset " +
                      std::to_string(nul));
  }
  const std::string base = fs::absolute(fs::path(path)).parent_path().string();
  return parse_config(text, path, base, overrides, more_rules);
}

}  // namespace q4::trainer
