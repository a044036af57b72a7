// YAML -> Config. The tree is loaded once, `--set` overrides are spliced into it, every key is
// checked against the field table (unknown ones get a did-you-mean across sections and aliases),
// each known field is converted with the type, range and choice checks of its table row (errors
// name the key and the line), and validate_config() applies the cross-field rules.
// config_to_yaml() and the configs/README.md reference are generated from the same table.
#include "q4/trainer/config.h"

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

namespace q4::trainer {
namespace {

std::vector<std::string> split(const std::string& s, char sep) {
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

std::string trim(const std::string& s) {
  const auto b = s.find_first_not_of(" \t\r\n");
  if (b == std::string::npos) return "";
  const auto e = s.find_last_not_of(" \t\r\n");
  return s.substr(b, e - b + 1);
}

bool parse_int(const std::string& s, int64_t* out) {
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

constexpr const char* kFromSet = "--set";

// Where a node came from, for messages: " (demo.yaml line 12)" or " (from --set)".
std::string where(const YAML::Node& node, const std::string& source) {
  if (source == kFromSet) return " (from --set)";
  const YAML::Mark m = node.Mark();
  if (m.is_null() || m.line < 0) return " (from --set)";
  return " (" + source + " line " + std::to_string(m.line + 1) + ")";
}

std::string describe(const YAML::Node& node) {
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

[[noreturn]] void type_error(const std::string& key, const YAML::Node& node,
                             const std::string& source, const std::string& expected) {
  throw ConfigError("config key " + key + where(node, source) + ": expected " + expected +
                    ", found " + describe(node));
}

std::string read_string(const std::string& key, const YAML::Node& n, const std::string& src) {
  if (n.IsNull()) return "";
  if (!n.IsScalar()) type_error(key, n, src, "a string");
  return n.Scalar();
}

int64_t read_int(const std::string& key, const YAML::Node& n, const std::string& src) {
  int64_t v = 0;
  if (!n.IsScalar() || !parse_int(trim(n.Scalar()), &v)) type_error(key, n, src, "an integer");
  return v;
}

double read_double(const std::string& key, const YAML::Node& n, const std::string& src) {
  if (!n.IsScalar()) type_error(key, n, src, "a number");
  try {
    return n.as<double>();
  } catch (const YAML::Exception&) {
    type_error(key, n, src, "a number");
  }
}

bool read_bool(const std::string& key, const YAML::Node& n, const std::string& src) {
  if (!n.IsScalar()) type_error(key, n, src, "true or false");
  try {
    return n.as<bool>();
  } catch (const YAML::Exception&) {
    type_error(key, n, src, "true or false");
  }
}

std::vector<std::string> read_string_list(const std::string& key, const YAML::Node& n,
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

LayerSelection read_layers(const std::string& key, const YAML::Node& n, const std::string& src) {
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

size_t edit_distance(const std::string& a, const std::string& b) {
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

std::string last_component(const std::string& key) {
  const auto p = key.rfind('.');
  return p == std::string::npos ? key : key.substr(p + 1);
}

// Splices `value` at the dotted `parts` path of `node`, creating mappings on the way.
void set_path(YAML::Node node, const std::vector<std::string>& parts, size_t i,
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
void check_keys(const YAML::Node& node, const std::string& prefix,
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
std::optional<YAML::Node> lookup(const YAML::Node& root, const std::vector<std::string>& parts) {
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
int64_t second_document_line(const std::string& text) {
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
std::string expand_home(const std::string& p) {
  if (p != "~" && p.rfind("~/", 0) != 0) return p;
  const char* home = std::getenv("HOME");
  if (home == nullptr || *home == '\0') return p;
  return std::string(home) + p.substr(1);
}

std::string resolve_path(const std::string& p_in, const std::string& base) {
  const std::string p = expand_home(p_in);
  if (p.empty()) return p;
  fs::path path(p);
  if (path.is_absolute()) return path.lexically_normal().string();
  return (fs::absolute(fs::path(base)) / path).lexically_normal().string();
}

std::string join(const std::vector<std::string>& v, const std::string& sep) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? sep : "") + v[i];
  return out;
}

[[noreturn]] void range_error(const std::string& key, const std::string& expected,
                              const std::string& found) {
  throw ConfigError("config key " + key + ": expected " + expected + ", found " + found);
}

// The shortest decimal that reads back as exactly `v` ("0.9", "1e-08"), so printing loses nothing.
std::string fmt_double(double v) {
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
std::string fmt_float(double v) {
  std::string s = fmt_double(v);
  if (std::isfinite(v) && s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

}  // namespace
}  // namespace q4::trainer

namespace q4::trainer {
namespace {

using io::enum_from_name;
using io::enum_name;
using io::enum_names;

// "expected ..." text of a range: ">= 1", "a value in [0, 1)"; floats say finite.
std::string expected_range(const Range& r, bool is_float) {
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

}  // namespace

std::string to_string(InitKind v) { return enum_name(v); }
std::string to_string(Dtype v) { return enum_name(v); }
std::string to_string(DtypeOrAuto v) { return enum_name(v); }
std::string to_string(AutoBool v) { return enum_name(v); }
std::string to_string(Offload v) { return enum_name(v); }
std::string to_string(data::DataFormat v) { return enum_name(v); }
std::string to_string(data::OnError v) { return enum_name(v); }
std::string to_string(data::TextUnit v) { return enum_name(v); }
std::string to_string(data::ChatTemplate v) { return enum_name(v); }
std::string to_string(ProgressStyle v) { return enum_name(v); }
std::string to_string(HfExport v) { return enum_name(v); }
std::string to_string(ObjectiveKind v) { return enum_name(v); }
std::string to_string(TrainMethod v) { return enum_name(v); }
std::string to_string(Divergence v) { return enum_name(v); }
std::string to_string(PreferenceLossKind v) { return enum_name(v); }

// ---------------------------------------------------------------------------------------------
// Range, FieldRef

bool Range::contains(double v) const {
  if (min && (min_exclusive ? !(v > *min) : !(v >= *min))) return false;
  if (max && (max_exclusive ? !(v < *max) : !(v <= *max))) return false;
  return true;
}

std::string Range::to_string() const {
  if (min && max) {
    return std::string(min_exclusive ? "(" : "[") + fmt_double(*min) + ", " + fmt_double(*max) +
           (max_exclusive ? ")" : "]");
  }
  if (min) return std::string(min_exclusive ? "> " : ">= ") + fmt_double(*min);
  if (max) return std::string(max_exclusive ? "< " : "<= ") + fmt_double(*max);
  return "";
}

std::vector<std::string> FieldRef::choices() const {
  return std::visit(
      [](auto* p) -> std::vector<std::string> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_enum_v<T>) {
          return enum_names<T>();
        } else {
          return {};
        }
      },
      ptr);
}

std::string FieldRef::type_name() const {
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return is_path ? "path" : "string";
        if constexpr (std::is_same_v<T, int64_t>) return "int";
        if constexpr (std::is_same_v<T, double>) return "float";
        if constexpr (std::is_same_v<T, bool>) return "bool";
        if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return is_path ? "list of paths" : "list of strings";
        }
        if constexpr (std::is_same_v<T, LayerSelection>) return "layers";
        if constexpr (std::is_same_v<T, IntOrAuto>) return "int or auto";
        if constexpr (std::is_enum_v<T>) return "enum";
        return "";
      },
      ptr);
}

std::string IntOrAuto::to_string() const { return value ? std::to_string(*value) : "auto"; }

// ---------------------------------------------------------------------------------------------
// LayerSelection

LayerSelection LayerSelection::parse(const std::string& text, const std::string& key) {
  const std::string t = trim(text);
  LayerSelection sel;
  if (t == "all") {
    sel.kind = Kind::kAll;
    return sel;
  }
  if (t == "none") {
    sel.kind = Kind::kNone;
    return sel;
  }
  if (t.rfind("last:", 0) == 0) {
    int64_t n = 0;
    if (!parse_int(trim(t.substr(5)), &n) || n < 1) {
      throw ConfigError("config key " + key + ": expected last:N with N >= 1, found '" + t + "'");
    }
    sel.kind = Kind::kLast;
    sel.last_n = n;
    return sel;
  }
  sel.kind = Kind::kList;
  for (const auto& part : split(t, ',')) {
    int64_t idx = 0;
    if (!parse_int(trim(part), &idx)) {
      throw ConfigError("config key " + key +
                        ": expected all, none, last:N or a list of layer indices, found '" + t +
                        "'");
    }
    sel.layers.push_back(idx);
  }
  return sel;
}

std::string LayerSelection::to_string() const {
  switch (kind) {
    case Kind::kAll:
      return "all";
    case Kind::kNone:
      return "none";
    case Kind::kLast:
      return "last:" + std::to_string(last_n);
    case Kind::kList: {
      std::string out;
      for (size_t i = 0; i < layers.size(); ++i) out += (i ? "," : "") + std::to_string(layers[i]);
      return out;
    }
  }
  return "";
}

std::vector<int64_t> LayerSelection::resolve(int64_t num_layers) const {
  std::vector<int64_t> out;
  switch (kind) {
    case Kind::kAll:
      for (int64_t i = 0; i < num_layers; ++i) out.push_back(i);
      break;
    case Kind::kNone:
      break;
    case Kind::kLast:
      if (last_n > num_layers) {
        throw ConfigError(
            "config key train.trainable.layers: last:" + std::to_string(last_n) +
            " selects more layers than the model has (model.config: " + std::to_string(num_layers) +
            " decoder layer" + (num_layers == 1 ? "" : "s") +
            "); use last:1 to last:" + std::to_string(num_layers) + " or all");
      }
      for (int64_t i = num_layers - last_n; i < num_layers; ++i) out.push_back(i);
      break;
    case Kind::kList:
      for (int64_t i : layers) {
        if (i < 0 || i >= num_layers) {
          throw ConfigError("config key train.trainable.layers: layer " + std::to_string(i) +
                            " is out of range for a model with " + std::to_string(num_layers) +
                            " layers");
        }
        out.push_back(i);
      }
      std::sort(out.begin(), out.end());
      break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The field list

std::vector<FieldRef> config_fields(Config& c) {
  // field(key, member, doc, range, aliases): aliases are other names people use for the field
  // (Hugging Face TrainingArguments and the like); did_you_mean() suggests the field for them.
  auto field = [](std::string key, FieldPtr ptr, std::string doc, Range range = {},
                  std::vector<std::string> aliases = {}) {
    FieldRef f;
    f.key = std::move(key);
    f.ptr = ptr;
    f.doc = std::move(doc);
    f.range = range;
    f.aliases = std::move(aliases);
    return f;
  };
  auto path = [&](std::string key, FieldPtr ptr, std::string doc) {
    FieldRef f = field(std::move(key), ptr, std::move(doc));
    f.is_path = true;
    return f;
  };
  using R = Range;
  return {
      path("model.dir", &c.model.dir, "HF model directory holding config.json and tokenizer.json"),
      path("model.config", &c.model.config, "config.json path (default <dir>/config.json)"),
      path("model.weights", &c.model.weights,
           "NVFP4 .dat weights or a Hugging Face model folder (required when init is file)"),
      path("model.tokenizer", &c.model.tokenizer,
           "tokenizer.json path (default <dir>/tokenizer.json)"),
      field("model.init", &c.model.init, "file: load weights; random: random init from config"),
      field("model.init_seed", &c.model.init_seed, "seed of the random init"),
      field("model.quantize_lm_head", &c.model.quantize_lm_head,
            "random init: store lm_head as NVFP4 like the shipped checkpoint"),
      field("model.fake_quant", &c.model.fake_quant,
            "NVFP4 linears compute with fake-quantized masters and train straight through the "
            "quantizer (QAT); false: plain precision, the masters as they are (the NVFP4 export "
            "is then the trained model's post-training quantization)"),
      field("model.master_dtype", &c.model.master_dtype, "dtype of the trained master weights", {},
            {"dtype", "torch_dtype"}),
      field("model.compute_dtype", &c.model.compute_dtype,
            "activation/matmul dtype (auto: bf16 on cuda, fp32 on cpu; fp16 needs cuda)", {},
            {"bf16", "fp16", "precision"}),
      field("model.device", &c.model.device, "cpu, cuda or cuda:N"),
      field("model.grad_dtype", &c.model.grad_dtype,
            "gradient storage (auto: fp32 with fp32 masters, else bf16)"),
      // Qwen3 uses 0.02. Above 1, products of random weights overflow fp16 masters and bf16
      // activations within a layer or two, and the run fails later on "bad weights" that the
      // init made.
      field("model.init_std", &c.model.init_std, "random init: std of linears and embeddings",
            Range{0.0, 1.0, true, false}, {"initializer_range"}),
      field("model.loss_chunk_tokens", &c.model.loss_chunk_tokens,
            "logit rows computed at once by the chunked cross-entropy", R::at_least(1)),
      field("train.objective", &c.train.objective,
            "what training minimizes: cross_entropy on the labels, distill (a teacher's "
            "distribution, distill.*) or preference (chosen over rejected answers, preference.*)",
            {}, {"loss_type"}),
      field("train.method", &c.train.method,
            "full: the selected weights train; lora: low-rank adapters on the NVFP4 linears "
            "(lora.*), which stay frozen"),
      field("train.trainable.layers", &c.train.trainable.layers,
            "decoder layers that train: all, none, last:N or a list of indices"),
      field("train.trainable.projections", &c.train.trainable.projections,
            "q/k/v/o/gate/up/down linears of the selected layers train (fake-quantized, STE)"),
      field("train.trainable.norms", &c.train.trainable.norms,
            "RMSNorm weights of the selected layers and the final norm train"),
      field("train.trainable.lm_head", &c.train.trainable.lm_head, "the output projection trains"),
      field("train.trainable.embeddings", &c.train.trainable.embeddings, "embed_tokens trains"),
      field("train.gradient_checkpointing", &c.train.gradient_checkpointing,
            "recompute decoder layers in backward (less activation memory): auto = as many as "
            "the GPU memory budget needs (guard.max_gpu_gb, else the free memory; none on the "
            "CPU), true = every layer (or train.recompute_layers), false = none",
            {}, {"activation_checkpointing"}),
      field("train.recompute_layers", &c.train.recompute_layers,
            "with gradient_checkpointing true: the first N decoder layers recompute, the others "
            "keep their activations (-1: every layer)",
            R::at_least(-1)),
      field("train.recompute_keep_attention", &c.train.recompute_keep_attention,
            "with gradient_checkpointing true: this many of the recomputed layers (below those of "
            "recompute_keep_mlp) keep their attention block's activations and recompute only "
            "the MLP block",
            R::at_least(0)),
      field("train.recompute_keep_mlp", &c.train.recompute_keep_mlp,
            "with gradient_checkpointing true: the last this many recomputed layers keep their "
            "MLP block's activations and recompute only the attention block",
            R::at_least(0)),
      field("train.offload_layer_inputs", &c.train.offload_layer_inputs,
            "CUDA: recomputed layers keep their input in pinned host memory instead of the GPU "
            "(long context); gradient_checkpointing auto turns it on when the budget needs it"),
      field("train.mlp_chunk_tokens", &c.train.mlp_chunk_tokens,
            "recomputed layers run their MLP block over row chunks of this many of the "
            "micro-batch's tokens (less memory at long context; 0: one pass; auto: 8192 when "
            "batch_size x seq_len is over 16384, else 0)",
            R::at_least(0)),
      field("train.steps", &c.train.steps, "optimizer steps (leave out when train.epochs is set)",
            R::at_least(0), {"max_steps", "num_steps", "total_steps", "iters"}),
      // Upper bound: a safety net against absurd settings; 1e6 passes over any data is never
      // intended, and steps computed from it stay far inside int64.
      field("train.epochs", &c.train.epochs,
            "passes over the training data instead of train.steps (0: use train.steps); steps = "
            "ceil(epochs x micro-batches per epoch / (grad_accum x ranks))",
            R::between(0, 1e6, false), {"num_train_epochs", "num_epochs"}),
      // Rows per micro-batch. Every row is an int64 [seq_len] input of the batcher and a
      // [seq_len, hidden] activation per layer: 4096 rows of the shortest useful rows already
      // exceed one GPU, and a larger value is a typo that would reach the allocator as a raw
      // out-of-memory error instead of this key.
      field("train.batch_size", &c.train.batch_size, "rows (sequences) per micro-batch",
            R::between(1, 4096, false),
            {"micro_batch_size", "per_device_train_batch_size", "train_batch_size"}),
      field("train.grad_accum", &c.train.grad_accum, "micro-batches per optimizer step",
            R::at_least(1), {"gradient_accumulation_steps", "accumulation_steps"}),
      // Tokens per row: at most Qwen3-2507's native context (262,144 positions); the RoPE
      // tables, masks and activations are sized by it.
      field("train.seq_len", &c.train.seq_len,
            "tokens per row (longer examples are truncated per data.truncation)",
            R::between(2, 262144, false),
            {"max_seq_length", "max_seq_len", "seq_length", "max_length", "block_size"}),
      field("train.seed", &c.train.seed, "seed of data order and stochastic rounding"),
      field("train.max_grad_norm", &c.train.max_grad_norm, "global gradient-norm clip; 0 disables",
            R::at_least(0), {"grad_clip", "clip_grad_norm", "gradient_clipping"}),
      field("train.max_nonfinite_steps", &c.train.max_nonfinite_steps,
            "consecutive non-finite steps skipped before the run fails", R::at_least(0)),
      field("optim.lr", &c.optim.lr, "peak learning rate", R::above(0), {"learning_rate"}),
      field("optim.beta1", &c.optim.beta1, "AdamW first-moment decay", R::between(0, 1, true),
            {"adam_beta1"}),
      field("optim.beta2", &c.optim.beta2, "AdamW second-moment decay", R::between(0, 1, true),
            {"adam_beta2"}),
      field("optim.eps", &c.optim.eps, "AdamW epsilon", R::above(0), {"adam_epsilon", "epsilon"}),
      field("optim.weight_decay", &c.optim.weight_decay, "decoupled weight decay", R::at_least(0)),
      field("optim.state", &c.optim.state, "moment storage format", {},
            {"optim_bits", "state_dtype", "moment_dtype"}),
      field("optim.offload", &c.optim.offload,
            "none; moments: on CUDA the AdamW moments live in pinned host memory (no GPU "
            "memory for them; the update runs at PCIe speed; same results); all: the trained "
            "NVFP4 linears' masters too (the GPU keeps their 4-bit codes)"),
      field("optim.in_backward", &c.optim.in_backward,
            "update each parameter inside the backward and free its gradient (with grad_accum "
            "> 1: inside the last micro-batch's backward, from the summed gradient); clipping "
            "then uses the previous step's norm (auto: CUDA, full fine-tuning, grad_accum 1 or "
            "optim.offload all)"),
      field("optim.chunk_rows", &c.optim.chunk_rows,
            "rows per optimizer chunk (bounds temporaries)", R::at_least(1)),
      field("optim.master_rounding", &c.optim.master_rounding,
            "how updates are written back to fp16/bf16 masters", {}, {"rounding"}),
      field("optim.schedule.kind", &c.optim.schedule.kind, "learning-rate schedule after warmup",
            {}, {"lr_scheduler_type", "lr_scheduler", "scheduler"}),
      field("optim.schedule.warmup_steps", &c.optim.schedule.warmup_steps,
            "linear warmup steps from 0 to lr", R::at_least(0),
            {"warmup", "num_warmup_steps", "lr_warmup_steps"}),
      field("optim.schedule.warmup_ratio", &c.optim.schedule.warmup_ratio,
            "warmup as a fraction of the run instead of warmup_steps: round(ratio x steps)",
            R::between(0, 1, true), {"warmup_fraction"}),
      field("optim.schedule.min_lr_ratio", &c.optim.schedule.min_lr_ratio,
            "final lr / lr for linear and cosine decay", R::between(0, 1, false),
            {"min_lr", "final_lr_ratio"}),
      path("data.files", &c.data.files, "training files (TSV prompt<TAB>answer, JSONL, text)"),
      path("data.eval_files", &c.data.eval_files,
           "held-out files for validation loss (same formats as files)"),
      field("data.eval_fraction", &c.data.eval_fraction,
            "hold out this fraction of training examples for validation loss",
            R::between(0, 0.5, true), {"validation_split", "val_fraction", "eval_split"}),
      field("data.format", &c.data.format, "file format (auto: by extension)"),
      field("data.system_prompt", &c.data.system_prompt,
            "optional system turn before every example", {}, {"system"}),
      field("data.chat_template", &c.data.chat_template,
            "chat template: qwen3 (hybrid thinking), qwen3-2507-instruct, qwen3-2507-thinking, "
            "or auto (the model folder's, identified; qwen3-2507-instruct when it has none)",
            {}, {"template"}),
      field("data.enable_thinking", &c.data.enable_thinking,
            "HF's enable_thinking for the qwen3 template's generation prompt (auto: unset, "
            "thinking on)"),
      field("data.shuffle", &c.data.shuffle, "reshuffle every epoch (seeded by train.seed)"),
      field("data.packing", &c.data.packing,
            "pack several examples into one seq_len row (best fit; false: one example per row)", {},
            {"pack"}),
      field("data.pack_window", &c.data.pack_window,
            "packing: examples considered when filling a row", R::at_least(1)),
      field("data.on_error", &c.data.on_error, "malformed data lines: fail or skip"),
      field("data.truncation", &c.data.truncation,
            "examples longer than train.seq_len (auto: plain text split into windows, every "
            "token trained; conversations and prompt/answer records cut_left)"),
      field("data.text_unit", &c.data.text_unit,
            "what one example of a text file is: the whole file, each paragraph (blank lines "
            "separate them) or each line"),
      field("eval.prompts", &c.eval.prompts, "user prompts answered greedily"),
      field("eval.every", &c.eval.every, "evaluate every N steps (0: only before and after)",
            R::at_least(0), {"eval_steps", "eval_interval"}),
      // The KV cache of an eval answer is sized by prompt + max_new_tokens (Qwen3-4B: 144 KiB
      // per token, so 32,768 tokens is 4.5 GiB); 32,768 is twice the longest answer the
      // Qwen3-2507 model card suggests, and an unbounded value became a terabyte allocation.
      field("eval.max_new_tokens", &c.eval.max_new_tokens, "generation length limit",
            R::between(1, 32768, false), {"max_tokens"}),
      field("eval.at_start", &c.eval.at_start, "evaluate before the first step"),
      field("eval.at_end", &c.eval.at_end, "evaluate after the last step"),
      field("output.dir", &c.output.dir,
            "run directory (config, metrics, eval, checkpoints, export)", {}, {"output_dir"}),
      field("output.export_path", &c.output.export_path,
            "exported .dat (default <dir>/model.dat; relative to dir; none disables)"),
      field("output.export_every", &c.output.export_every,
            "also export every N steps (0: at the end)", R::at_least(0)),
      field("output.checkpoint_every", &c.output.checkpoint_every,
            "also checkpoint every N steps (0: by output.checkpoint_minutes only)", R::at_least(0),
            {"save_steps", "checkpoint_interval"}),
      field("output.checkpoint_minutes", &c.output.checkpoint_minutes,
            "checkpoint every N minutes of training, and the last step (0 with checkpoint_every 0: "
            "only on SIGINT/SIGTERM)",
            R::at_least(0)),
      field("output.keep", &c.output.keep, "newest complete checkpoints kept", R::at_least(1),
            {"save_total_limit", "keep_checkpoints"}),
      field("output.verify_export", &c.output.verify_export,
            "read the export back and check its forward weights equal the trained model's, tensor "
            "by tensor"),
      field("output.hf_export", &c.output.hf_export,
            "also write a Hugging Face folder at <export .dat minus .dat>-hf: NVFP4 in the "
            "modelopt or compressed-tensors layout (vLLM serves it), or bf16 (dense, the "
            "export's NVFP4 linears dequantized exactly)"),
      field("output.export_dense", &c.output.export_dense,
            "model.fake_quant false: write the trained NVFP4 linears as fp16 tensors (the "
            "full-precision model) instead of their NVFP4 quantization"),
      field("guard.max_gpu_gb", &c.guard.max_gpu_gb,
            "stop (exit 3) when reserved or device-used GPU memory passes this many GB; 0 off",
            R::at_least(0)),
      field("lora.rank", &c.lora.rank, "train.method lora: rank of each adapter", R::at_least(1),
            {"r", "lora_r"}),
      field("lora.alpha", &c.lora.alpha, "the adapter's update is scaled by alpha / rank",
            R::above(0), {"lora_alpha"}),
      field("lora.dropout", &c.lora.dropout, "dropout on the adapter's input (only 0 is supported)",
            R::at_least(0), {"lora_dropout"}),
      field("lora.targets", &c.lora.targets,
            "adapted linears: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj "
            "(in the train.trainable.layers), lm_head",
            {}, {"target_modules"}),
      field("lora.merge_aware", &c.lora.merge_aware,
            "true: train through the quantization of the merged weight (the merged NVFP4 export "
            "is what was trained); false: plain LoRA on the 4-bit weight"),
      field("lora.cache_base_weights", &c.lora.cache_base_weights,
            "plain adapters: keep the adapted linears' frozen weights dequantized in the compute "
            "dtype (2 bytes an element) instead of dequantizing them in every forward; auto: when "
            "no decoder layer recomputes"),
      path("distill.teacher", &c.distill.teacher,
           "train.objective distill: the teacher, a .dat, Hugging Face folder or q4train run "
           "directory (its export; frozen, compute dtype, same device; dense linears stay "
           "dense)"),
      path("distill.teacher_config", &c.distill.teacher_config,
           "the teacher's config.json (default: the folder's config.json, a run directory's "
           "model.config, else model.config)"),
      field("distill.alpha", &c.distill.alpha,
            "loss = alpha x divergence + (1 - alpha) x cross-entropy on the labels",
            R::between(0, 1, false)),
      // Bounded so that logits / T and T^2 stay finite in fp32 (config.h).
      field("distill.temperature", &c.distill.temperature,
            "softmax temperature of both models; the divergence is scaled by T^2",
            R::between(kMinDistillTemperature, kMaxDistillTemperature, false), {"kd_temperature"}),
      field("distill.divergence", &c.distill.divergence,
            "KL(teacher || student) (forward_kl, mass-covering) or KL(student || teacher) "
            "(reverse_kl, mode-seeking)"),
      path("distill.topk_file", &c.distill.topk_file,
           "offline distillation: the teacher's top-K log-probabilities of the training data "
           "(written by q4train --write-teacher-topk), read instead of running the teacher"),
      // One (rows, K) id and log-probability table per written token: K = 65,536 would be 2.5x
      // the full-vocabulary logits of the model itself.
      field("distill.topk", &c.distill.topk, "tokens per position that --write-teacher-topk keeps",
            R::between(1, 4096, false)),
      field("preference.loss", &c.preference.loss,
            "sigmoid (DPO), ipo, or simpo (reference-free, per-token averages)"),
      field("preference.beta", &c.preference.beta,
            "scale of the implicit reward beta x (log pi - log ref)",
            R::between(kMinPreferenceBeta, kMaxPreferenceBeta, false)),
      field("preference.label_smoothing", &c.preference.label_smoothing,
            "sigmoid and simpo: the assumed chance that a pair's labels are flipped",
            R::between(0, 0.5, true)),
      field("preference.simpo_gamma", &c.preference.simpo_gamma,
            "simpo: the target reward margin (divided by beta in the loss)",
            R::between(-kMaxSimpoGamma, kMaxSimpoGamma, false), {"gamma_beta_ratio"}),
      field("preference.sft_weight", &c.preference.sft_weight,
            "adds this x the chosen answer's mean cross-entropy per pair (TRL's rpo_alpha)",
            R::between(0, kMaxSftWeight, false), {"rpo_alpha"}),
      path("preference.reference", &c.preference.reference,
           "the reference model, a .dat, Hugging Face folder or q4train run directory (default: "
           "the starting model); "
           "its log-probabilities are computed once before training"),
      path("preference.reference_config", &c.preference.reference_config,
           "the reference's config.json (default: the folder's config.json, a run directory's "
           "model.config, else model.config)"),
      field("log.every", &c.log.every, "log line every N steps", R::at_least(1),
            {"logging_steps", "log_interval"}),
      field("log.metrics", &c.log.metrics, "metrics file inside output.dir (empty disables)"),
      field("log.progress", &c.log.progress,
            "auto: progress bar on a terminal, log lines otherwise; bar; line"),
      field("log.tensorboard", &c.log.tensorboard,
            "write TensorBoard event files (events.out.tfevents.*) into output.dir"),
      field("log.report", &c.log.report,
            "write output.dir/report.html (SVG plots, eval answers) at each eval and at the end"),
  };
}

std::vector<std::string> config_keys() {
  Config c;
  std::vector<std::string> keys;
  for (const auto& f : config_fields(c)) keys.push_back(f.key);
  return keys;
}

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

// One field's value from its YAML node, type- and range-checked against its table row.
void read_field(const FieldRef& f, const YAML::Node& cur, const std::string& src) {
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
}

}  // namespace

Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::string& base_dir, const std::vector<Override>& overrides) {
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

Config load_config(const std::string& path, const std::vector<Override>& overrides) {
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
  return parse_config(text, path, base, overrides);
}

// ---------------------------------------------------------------------------------------------
// Validation

void validate_config(const Config& c) {
  // Per-field ranges from the table (parse_config has checked them with line numbers already;
  // this covers configs built or edited in code).
  Config copy = c;
  for (const auto& f : config_fields(copy)) {
    if (const auto* p = std::get_if<int64_t*>(&f.ptr)) check_range(f, **p, "");
    if (const auto* p = std::get_if<double*>(&f.ptr)) check_range(f, **p, "");
    if (const auto* p = std::get_if<IntOrAuto*>(&f.ptr); p && (*p)->value) {
      check_range(f, *(*p)->value, "");
    }
  }

  const auto& m = c.model;
  if (m.init == InitKind::kFile && m.weights.empty()) {
    throw ConfigError("config key model.weights: required when model.init is file");
  }
  if (m.init == InitKind::kRandom && m.config.empty()) {
    throw ConfigError(
        "config key model.config: required when model.init is random (or set "
        "model.dir)");
  }
  if (m.config.empty() && m.weights.empty()) {
    throw ConfigError("config key model.config: required (or set model.dir)");
  }
  if (m.config.empty()) {
    throw ConfigError(
        "config key model.config: required to know the architecture (or set "
        "model.dir)");
  }
  if (m.tokenizer.empty()) {
    throw ConfigError("config key model.tokenizer: required (or set model.dir)");
  }
  const bool cuda = device_is_cuda(c);
  if (m.device != "cpu" && !cuda) {
    range_error("model.device", "cpu, cuda or cuda:N", "'" + m.device + "'");
  }
  if (!cuda && m.compute_dtype == DtypeOrAuto::kFp16) {
    throw ConfigError(
        "config key model.compute_dtype: fp16 compute needs model.device cuda "
        "(CPU matmuls run in fp32 or bf16)");
  }

  const auto& t = c.train;
  // Tokens of one micro-batch: each field's own range still allows 4096 rows of 262,144 tokens.
  // 2^22 tokens is already about 20 GiB per activation tensor at Qwen3-4B's hidden size 2560
  // in bf16, more than any one micro-batch fits; past it the allocator would fail with a raw
  // error instead of naming these keys.
  constexpr int64_t kMaxMicroBatchTokens = int64_t{1} << 22;
  if (t.batch_size * t.seq_len > kMaxMicroBatchTokens) {
    throw ConfigError("config keys train.batch_size x train.seq_len: expected at most " +
                      std::to_string(kMaxMicroBatchTokens) + " tokens per micro-batch, found " +
                      std::to_string(t.batch_size) + " x " + std::to_string(t.seq_len) + " = " +
                      std::to_string(t.batch_size * t.seq_len) +
                      " (use train.grad_accum for a larger batch per step)");
  }
  const auto& tr = t.trainable;
  if (tr.layers.kind == LayerSelection::Kind::kList) {
    std::set<int64_t> seen;
    for (int64_t i : tr.layers.layers) {
      if (i < 0) range_error("train.trainable.layers", "layer indices >= 0", std::to_string(i));
      if (!seen.insert(i).second) {
        range_error("train.trainable.layers", "distinct layer indices",
                    "layer " + std::to_string(i) + " twice");
      }
    }
    if (tr.layers.layers.empty()) {
      range_error("train.trainable.layers", "at least one index (or none)", "an empty list");
    }
  }
  const bool layers_train =
      tr.layers.kind != LayerSelection::Kind::kNone && (tr.projections || tr.norms);
  if (!layers_train && !tr.norms && !tr.lm_head && !tr.embeddings) {
    throw ConfigError(
        "config key train.trainable: nothing is trainable (select layers with "
        "projections or norms, or lm_head, or embeddings)");
  }

  const auto& o = c.optim;
  if (!(o.lr * o.weight_decay < 1)) {  // decoupled decay multiplies weights by 1 - lr * wd
    throw ConfigError(
        "config key optim.weight_decay: optim.lr * optim.weight_decay must be < 1 "
        "(weights would shrink to zero or flip sign), found " +
        fmt_double(o.lr) + " * " + fmt_double(o.weight_decay));
  }
  if (o.schedule.warmup_ratio > 0 && o.schedule.warmup_steps > 0) {
    throw ConfigError(
        "config key optim.schedule.warmup_ratio: set together with optim.schedule.warmup_steps; "
        "give one of them");
  }
  // optim.schedule.warmup_steps > train.steps is not an error: the trainer clips it to the run
  // with a note (clip_warmup_to_run), so a smoke run with --set train.steps=3 just works.

  const auto& out = c.output;
  if (out.dir.empty()) range_error("output.dir", "a directory", "an empty value");
  if (out.export_every > 0 && out.export_path == "none") {
    throw ConfigError("config key output.export_every: set, but output.export_path is none");
  }
  if (out.export_dense && m.fake_quant) {
    throw ConfigError(
        "config key output.export_dense: set, but model.fake_quant is true (a straight-through "
        "model's weights are its NVFP4 quantization; set model.fake_quant: false)");
  }
  if (out.export_dense &&
      (out.hf_export == HfExport::kModelOpt || out.hf_export == HfExport::kCompressedTensors)) {
    throw ConfigError(std::string("config key output.export_dense: the ") +
                      enum_name(out.hf_export) +
                      " layout is NVFP4; with dense linears use output.hf_export: bf16");
  }
  if (out.hf_export != HfExport::kNone && out.export_path == "none") {
    throw ConfigError("config key output.hf_export: set, but output.export_path is none");
  }

  const auto& d = c.distill;
  if (c.train.objective == ObjectiveKind::kDistill) {
    if (d.teacher.empty() && d.topk_file.empty()) {
      throw ConfigError(
          "config key distill.teacher: train.objective is distill, but neither distill.teacher "
          "nor distill.topk_file is set");
    }
    if (!d.topk_file.empty() && d.divergence != Divergence::kForwardKl) {
      throw ConfigError(
          std::string("config key distill.divergence: ") + enum_name(d.divergence) +
          " needs the teacher's whole distribution; distill.topk_file holds its top K (use "
          "forward_kl, or distill.teacher without distill.topk_file)");
    }
  } else {
    for (const auto& [key, set] :
         {std::pair<const char*, bool>{"distill.teacher", !d.teacher.empty()},
          {"distill.topk_file", !d.topk_file.empty()}}) {
      if (set) {
        throw ConfigError(std::string("config key ") + key +
                          ": set, but train.objective is " + to_string(c.train.objective) +
                          " (set it to distill)");
      }
    }
  }

  const auto& pref = c.preference;
  if (c.train.objective == ObjectiveKind::kPreference) {
    if (c.train.batch_size % 2 != 0) {
      throw ConfigError("config key train.batch_size: " + std::to_string(c.train.batch_size) +
                        " rows, but train.objective preference needs an even number (a pair's "
                        "chosen and rejected answers share a micro-batch)");
    }
    if (c.data.truncation == Truncation::kSplit) {
      throw ConfigError("config key data.truncation: split would cut an answer into windows "
                        "that are no longer a pair (use cut_left, cut_right or drop)");
    }
    if (!pref.reference.empty() && pref.loss == PreferenceLossKind::kSimpo) {
      throw ConfigError("config key preference.reference: set, but preference.loss simpo uses "
                        "no reference");
    }
  } else if (!pref.reference.empty()) {
    throw ConfigError("config key preference.reference: set, but train.objective is " +
                      to_string(c.train.objective) + " (set it to preference)");
  }

  if (c.train.recompute_layers >= 0 && c.train.gradient_checkpointing != Recompute::kTrue) {
    throw ConfigError("config key train.recompute_layers: set, but train.gradient_checkpointing "
                      "is " +
                      to_string(c.train.gradient_checkpointing) + " (set it to true)");
  }
  for (const auto& [key, n] : {std::pair<const char*, int64_t>{"train.recompute_keep_attention",
                                                               c.train.recompute_keep_attention},
                               {"train.recompute_keep_mlp", c.train.recompute_keep_mlp}}) {
    if (n > 0 && c.train.gradient_checkpointing != Recompute::kTrue) {
      throw ConfigError(std::string("config key ") + key + ": set, but " +
                        "train.gradient_checkpointing is " +
                        to_string(c.train.gradient_checkpointing) + " (set it to true)");
    }
  }
  if (c.train.offload_layer_inputs && c.train.gradient_checkpointing == Recompute::kFalse) {
    throw ConfigError("config key train.offload_layer_inputs: true, but "
                      "train.gradient_checkpointing is false (only recomputed layers offload "
                      "their input)");
  }
  if (c.optim.offload != Offload::kNone && !cuda) {
    throw ConfigError("config key optim.offload: " + to_string(c.optim.offload) +
                      ", but model.device is " + m.device +
                      " (offload moves optimizer state from the GPU to the host)");
  }
  if (c.train.method == TrainMethod::kLora) {
    if (!c.model.fake_quant) {
      throw ConfigError("config key train.method: lora, but model.fake_quant is false (adapters "
                        "train on the NVFP4 weights)");
    }
    if (c.lora.dropout != 0.0) {
      throw ConfigError("config key lora.dropout: " + fmt_double(c.lora.dropout) +
                        ", but only 0 is supported (a dropout mask would have to be replayed "
                        "by the recompute)");
    }
    static const std::vector<std::string> kTargets = {"q_proj", "k_proj",    "v_proj",
                                                      "o_proj", "gate_proj", "up_proj",
                                                      "down_proj", "lm_head"};
    if (c.lora.targets.empty()) {
      throw ConfigError("config key lora.targets: empty (name at least one of q_proj, k_proj, "
                        "v_proj, o_proj, gate_proj, up_proj, down_proj, lm_head)");
    }
    for (const auto& t : c.lora.targets) {
      if (std::find(kTargets.begin(), kTargets.end(), t) == kTargets.end()) {
        throw ConfigError("config key lora.targets: unknown linear '" + t +
                          "' (expected q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                          "down_proj or lm_head)");
      }
    }
    const bool head = std::find(c.lora.targets.begin(), c.lora.targets.end(), "lm_head") !=
                      c.lora.targets.end();
    if (head && !c.lora.merge_aware) {
      throw ConfigError("config key lora.targets: lm_head takes a merge-aware adapter only (set "
                        "lora.merge_aware: true or drop lm_head)");
    }
    if (head && c.train.trainable.lm_head) {
      throw ConfigError("config key train.trainable.lm_head: true, but lora.targets adapts "
                        "lm_head (one or the other)");
    }
  }
  if (c.optim.offload == Offload::kAll && !c.model.fake_quant) {
    throw ConfigError("config key optim.offload: all, but model.fake_quant is false (the GPU "
                      "keeps the NVFP4 codes of offloaded masters; plain precision computes with "
                      "the masters themselves)");
  }
  if (c.guard.max_gpu_gb > 0 && !cuda) {
    throw ConfigError("config key guard.max_gpu_gb: set, but model.device is " + m.device +
                      " (the guard watches GPU memory)");
  }
  if (c.log.metrics.find('/') != std::string::npos) {
    range_error("log.metrics", "a file name inside output.dir", "'" + c.log.metrics + "'");
  }
}

// ---------------------------------------------------------------------------------------------
// Printing

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
          } else if constexpr (std::is_same_v<T, double>) {
            out << fmt_float(*ptr);
          } else if constexpr (std::is_same_v<T, IntOrAuto>) {
            if (ptr->value) {
              out << *ptr->value;
            } else {
              out << "auto";
            }
          } else {
            out << *ptr;
          }
        },
        f.ptr);
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
    "<!-- BEGIN config reference: generated from the field table in trainer/src/config.cpp by "
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
        } else if constexpr (std::is_same_v<T, IntOrAuto>) {
          return "`" + p->to_string() + "`";
        } else {
          return "`" + std::string(enum_name(*p)) + "`";
        }
      },
      f.ptr);
}

}  // namespace

std::string ignored_settings_warning(const Config& c_in) {
  Config c = c_in, defaults;
  const auto fields = config_fields(c), base = config_fields(defaults);
  const bool lora = c.train.method == TrainMethod::kLora;
  const auto& p = c.preference;
  // Why each setting does not apply here; "" when it does.
  auto why = [&](const std::string& key) -> std::string {
    auto starts = [&](const char* prefix) { return key.rfind(prefix, 0) == 0; };
    if (starts("lora.") && !lora) return "train.method is " + to_string(c.train.method);
    if (starts("distill.") && c.train.objective != ObjectiveKind::kDistill) {
      return "train.objective is " + to_string(c.train.objective);
    }
    if (starts("preference.") && c.train.objective != ObjectiveKind::kPreference) {
      return "train.objective is " + to_string(c.train.objective);
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
    std::string allowed;
    const auto choices = f.choices();
    for (size_t i = 0; i < choices.size(); ++i) allowed += (i ? ", `" : "`") + choices[i] + "`";
    if (!f.range.empty()) allowed = "`" + f.range.to_string() + "`";
    os << "| `" << f.key << "` | " << f.type_name() << " | " << md_default(f) << " | " << allowed
       << " | " << md_cell(f.doc) << " |\n";
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

// ---------------------------------------------------------------------------------------------
// Derived settings

bool device_is_cuda(const Config& c) {
  const std::string& d = c.model.device;
  if (d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0) return false;
  int64_t idx = 0;
  return parse_int(d.substr(5), &idx) && idx >= 0;
}

Dtype resolved_compute_dtype(const Config& c) {
  switch (c.model.compute_dtype) {
    case DtypeOrAuto::kFp32:
      return Dtype::kFp32;
    case DtypeOrAuto::kBf16:
      return Dtype::kBf16;
    case DtypeOrAuto::kFp16:
      return Dtype::kFp16;
    case DtypeOrAuto::kAuto:
      break;
  }
  return device_is_cuda(c) ? Dtype::kBf16 : Dtype::kFp32;
}

bool resolved_packing(const Config& c) {
  return c.data.packing && c.train.objective != ObjectiveKind::kPreference;
}

std::string resolved_export_path(const Config& c) {
  const std::string& p = c.output.export_path;
  if (p == "none") return "";
  if (p.empty()) return (fs::path(c.output.dir) / "model.dat").string();
  fs::path path(p);
  if (path.is_absolute()) return path.string();
  return (fs::path(c.output.dir) / path).lexically_normal().string();
}

void set_recompute_layers(Config& c, int64_t n, int64_t num_layers, bool offload_layer_inputs,
                          int64_t keep_attention, int64_t keep_mlp) {
  c.train.offload_layer_inputs = n > 0 && offload_layer_inputs;
  c.train.recompute_keep_attention = n > 0 ? keep_attention : 0;
  c.train.recompute_keep_mlp = n > 0 ? keep_mlp : 0;
  if (n <= 0) {
    c.train.gradient_checkpointing = Recompute::kFalse;
    c.train.recompute_layers = -1;
  } else {
    c.train.gradient_checkpointing = Recompute::kTrue;
    c.train.recompute_layers = n >= num_layers ? -1 : n;
  }
}

int64_t resolved_mlp_chunk_tokens(const Config& c) {
  if (c.train.mlp_chunk_tokens.value) return *c.train.mlp_chunk_tokens.value;
  return c.train.batch_size * c.train.seq_len > kAutoMlpChunkAboveTokens ? kAutoMlpChunkTokens : 0;
}

bool in_backward_updates(const Config& c) {
  switch (c.optim.in_backward) {
    case InBackward::kTrue:
      return true;
    case InBackward::kFalse:
      return false;
    case InBackward::kAuto:
      break;
  }
  // Adapters: their gradients are small (nothing to free early), and the buffered step takes
  // their norm in a few multi-tensor launches instead of three launches per adapter tensor.
  // Several micro-batches a step: only with masters in host memory, whose summed gradients then
  // go to their updates without a round trip over PCIe (docs/optim.md, "In-backward updates").
  return device_is_cuda(c) && c.train.method != TrainMethod::kLora &&
         (c.train.grad_accum == 1 || c.optim.offload == Offload::kAll);
}

}  // namespace q4::trainer
