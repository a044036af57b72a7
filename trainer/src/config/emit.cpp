// Config -> YAML (config_to_yaml), the ignored-settings warning and the configs/README.md
// reference, all generated from the field table.
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
// Printing

// One field's value, as parse_config reads it back.
void config_detail::emit_value(YAML::Emitter& out, const FieldPtr& field) {
  std::visit(
      [&](auto* ptr) {
        using T = std::remove_pointer_t<decltype(ptr)>;
        if constexpr (std::is_same_v<T, std::string>) {
          out << YAML::DoubleQuoted << *ptr;
        } else if constexpr (std::is_enum_v<T>) {
          out << YAML::DoubleQuoted << enum_name(*ptr);
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          out << YAML::BeginSeq;
          for (const auto& s : *ptr) out << YAML::DoubleQuoted << s;
          out << YAML::EndSeq;
        } else if constexpr (std::is_same_v<T, LayerSelection>) {
          if (ptr->kind == LayerSelection::Kind::kList) {
            out << YAML::Flow << YAML::BeginSeq;
            for (int64_t i : ptr->layers) out << i;
            out << YAML::EndSeq;
          } else {
            out << ptr->to_string();
          }
        } else if constexpr (std::is_same_v<T, std::vector<RewardFunctionConfig>>) {
          emit_reward_functions(out, *ptr);
        } else if constexpr (std::is_same_v<T, double>) {
          out << fmt_float(*ptr);
        } else if constexpr (std::is_same_v<T, IntOrAuto>) {
          if (ptr->value) {
            out << *ptr->value;
          } else {
            out << "auto";
          }
        } else if constexpr (std::is_same_v<T, FloatOrAuto>) {
          out << (ptr->value ? fmt_float(*ptr->value) : std::string("auto"));
        } else {
          out << *ptr;
        }
      },
      field);
}

std::string config_to_yaml(const Config& c_in) {
  Config c = c_in;
  auto fields = config_fields(c);
  YAML::Emitter out;
  out << YAML::BeginMap;
  std::vector<std::string> open;  // currently open section path
  for (const auto& f : fields) {
    if (f.key == "train.steps" && c.train.epochs > 0) continue;  // epochs set the run length
    auto parts = split(f.key, '.');
    const std::string leaf = parts.back();
    parts.pop_back();
    size_t common = 0;
    while (common < open.size() && common < parts.size() && open[common] == parts[common]) {
      ++common;
    }
    while (open.size() > common) {
      out << YAML::EndMap;
      open.pop_back();
    }
    while (open.size() < parts.size()) {
      out << YAML::Key << parts[open.size()] << YAML::Value << YAML::BeginMap;
      open.push_back(parts[open.size()]);
    }
    out << YAML::Key << leaf << YAML::Value;
    emit_value(out, f.ptr);
    out << YAML::Comment(f.doc);
  }
  while (!open.empty()) {
    out << YAML::EndMap;
    open.pop_back();
  }
  out << YAML::EndMap;
  return std::string(out.c_str()) + "\n";
}

// ---------------------------------------------------------------------------------------------
// The configs/README.md reference

namespace {

constexpr const char* kReferenceBegin =
    "<!-- BEGIN config reference: generated from the field table in trainer/src/config/fields.cpp "
    "by "
    "`q4train --config-reference configs/README.md`; edit the table, not this text -->";
constexpr const char* kReferenceEnd = "<!-- END config reference -->";

// Table-cell text: '|' would end the cell, '<...>' would read as HTML.
std::string md_cell(const std::string& s) {
  std::string out;
  for (char ch : s) {
    if (ch == '|' || ch == '<' || ch == '>') out += '\\';
    out += ch;
  }
  return out;
}

std::string md_default(const FieldRef& f) {
  return std::visit(
      [](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) {
          return p->empty() ? "`\"\"`" : "`" + *p + "`";
        } else if constexpr (std::is_same_v<T, int64_t>) {
          return "`" + std::to_string(*p) + "`";
        } else if constexpr (std::is_same_v<T, double>) {
          return "`" + fmt_float(*p) + "`";
        } else if constexpr (std::is_same_v<T, bool>) {
          return *p ? "`true`" : "`false`";
        } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return "`[" + join(*p, ", ") + "]`";
        } else if constexpr (std::is_same_v<T, LayerSelection>) {
          return "`" + p->to_string() + "`";
        } else if constexpr (std::is_same_v<T, IntOrAuto> || std::is_same_v<T, FloatOrAuto>) {
          return "`" + p->to_string() + "`";
        } else if constexpr (std::is_same_v<T, std::vector<RewardFunctionConfig>>) {
          return p->empty() ? "`[]`" : "`[" + std::to_string(p->size()) + " entries]`";
        } else {
          return "`" + std::string(enum_name(*p)) + "`";
        }
      },
      f.ptr);
}

// One row of the reference: key, type, default, allowed values, doc.
std::string md_row(const FieldRef& f, const std::string& key, const std::string& default_text) {
  std::string allowed;
  const auto choices = f.choices();
  for (size_t i = 0; i < choices.size(); ++i) allowed += (i ? ", `" : "`") + choices[i] + "`";
  if (!f.range.empty()) allowed = "`" + f.range.to_string() + "`";
  return "| `" + key + "` | " + f.type_name() + " | " + default_text + " | " + allowed + " | " +
         md_cell(f.doc) + " |\n";
}

}  // namespace

std::string ignored_settings_warning(const Config& c_in, const ObjectiveNeeds& needs) {
  Config c = c_in, defaults;
  const auto fields = config_fields(c), base = config_fields(defaults);
  const bool lora = c.train.method == TrainMethod::kLora;
  const auto& p = c.preference;
  // Why each setting does not apply here; "" when it does.
  auto why = [&](const std::string& key) -> std::string {
    auto starts = [&](const char* prefix) { return key.rfind(prefix, 0) == 0; };
    if (starts("lora.") && !lora) return "train.method is " + to_string(c.train.method);
    for (const char* section : {"distill", "preference", "grpo", "reward"}) {
      const bool applies =
          std::find(needs.sections.begin(), needs.sections.end(), section) != needs.sections.end();
      if (starts((std::string(section) + ".").c_str()) && !applies) {
        return "train.objective is " + to_string(c.train.objective);
      }
    }
    if (key == "preference.label_smoothing" && p.loss == PreferenceLossKind::kIpo) {
      return "preference.loss is ipo";
    }
    if (key == "preference.simpo_gamma" && p.loss != PreferenceLossKind::kSimpo) {
      return "preference.loss is " + to_string(p.loss);
    }
    if (key == "lora.cache_base_weights" && c.lora.merge_aware) return "lora.merge_aware is true";
    return "";
  };
  std::map<std::string, std::vector<std::string>> by_reason;  // reason -> keys, in table order
  std::vector<std::string> order;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (md_default(fields[i]) == md_default(base[i])) continue;  // at its default
    const std::string r = why(fields[i].key);
    if (r.empty()) continue;
    if (!by_reason.count(r)) order.push_back(r);
    by_reason[r].push_back(fields[i].key);
  }
  if (order.empty()) return "";
  std::string s = "warning: settings that do not apply to this run are ignored:";
  for (size_t i = 0; i < order.size(); ++i) {
    s += (i ? "; " : " ") + join(by_reason[order[i]], ", ") + " (" + order[i] + ")";
  }
  return s;
}

std::string config_reference_markdown() {
  Config defaults;
  std::ostringstream os;
  std::string section;
  for (const auto& f : config_fields(defaults)) {
    const std::string sec = split(f.key, '.').front();
    if (sec != section) {
      os << (section.empty() ? "" : "\n") << "### `" << sec << "`\n\n"
         << "| key | type | default | allowed | meaning |\n|---|---|---|---|---|\n";
      section = sec;
    }
    os << md_row(f, f.key, md_default(f));
    if (std::holds_alternative<std::vector<RewardFunctionConfig>*>(f.ptr)) {
      RewardFunctionConfig entry;  // the keys of one entry, under the list's key
      for (const auto& sub : reward_function_fields(entry)) {
        os << md_row(sub, f.key + "[]." + sub.key,
                     sub.key == "kind" ? "required" : md_default(sub));
      }
    }
  }
  return os.str();
}

std::string splice_config_reference(const std::string& readme) {
  const auto b = readme.find(kReferenceBegin);
  const auto e = b == std::string::npos ? b : readme.find(kReferenceEnd, b);
  if (e == std::string::npos) {
    throw ConfigError(std::string("expected the markers '") + kReferenceBegin + "' and '" +
                      kReferenceEnd + "' around the generated reference");
  }
  const size_t body = b + std::string(kReferenceBegin).size();
  return readme.substr(0, body) + "\n\n" + config_reference_markdown() + "\n" + readme.substr(e);
}

}  // namespace q4::trainer
