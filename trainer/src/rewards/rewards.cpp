// The built-in verifiers of reward.functions, the command's requests, the weighted total and the
// logged values (docs/trainer.md#rewards). Regexes are PCRE2 with UTF and invalid-UTF matching
// (a completion cut inside a character still matches byte for byte), compiled once here through
// the compilation config validation uses (config/reward_regex.h).
#include "q4/trainer/rewards/rewards.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "config/reward_regex.h"
#include "q4/trainer/rewards/reward_command.h"

namespace q4::trainer {

namespace rewards_detail {

using json = nlohmann::json;

// A compiled pattern and its first-match search (the match data is per call: cheap next to
// generation, and a Rewards may be used from another thread than the one that made it).
class RewardPattern {
 public:
  RewardPattern(const std::string& pattern, const std::string& key)
      : code_(compile_reward_regex(pattern, key)) {
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);  // an optimization; the interpreter otherwise
    key_ = key;
  }
  RewardPattern(const RewardPattern&) = delete;
  RewardPattern& operator=(const RewardPattern&) = delete;
  ~RewardPattern() { pcre2_code_free(code_); }

  // The first match in `text`: true, and its first group in `group` when asked for (false when
  // that group took no part in the match).
  bool search(const std::string& text, std::string* group = nullptr) const {
    MatchSpan m;
    if (!match_at(text, 0, &m)) return false;
    if (group == nullptr) return true;
    if (m.group_begin == PCRE2_UNSET) return false;
    *group = text.substr(m.group_begin, m.group_end - m.group_begin);
    return true;
  }

  // The last of the non-overlapping matches, left to right (the pattern never matches "").
  bool last_match(const std::string& text, std::string* whole) const {
    MatchSpan m, last;
    bool found = false;
    for (size_t at = 0; at <= text.size() && match_at(text, at, &m); at = m.end) {
      last = m;
      found = true;
      if (m.end == m.begin) break;
    }
    if (found) *whole = text.substr(last.begin, last.end - last.begin);
    return found;
  }

 private:
  struct MatchSpan {
    size_t begin = 0, end = 0;
    size_t group_begin = PCRE2_UNSET, group_end = PCRE2_UNSET;
  };

  // The first match at or after `offset`; a PCRE2 failure other than no match (a match limit)
  // is a RewardError naming the key.
  bool match_at(const std::string& text, size_t offset, MatchSpan* m) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    TORCH_CHECK(md != nullptr, "out of memory creating PCRE2 match data");
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(),
                               offset, 0, md, nullptr);
    if (rc > 0) {
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      *m = MatchSpan{ov[0], ov[1], PCRE2_UNSET, PCRE2_UNSET};
      if (rc > 1) m->group_begin = ov[2], m->group_end = ov[3];
    }
    pcre2_match_data_free(md);
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(rc, msg, sizeof msg);
      throw RewardError(key_ + ": the regular expression failed on a completion: " +
                        reinterpret_cast<const char*>(msg));
    }
    return rc > 0;
  }

  pcre2_code* code_ = nullptr;
  std::string key_;
};

}  // namespace rewards_detail

namespace {

using rewards_detail::json;
using rewards_detail::RewardPattern;

// A number as GSM8K answers write it: an optional minus, digits with optional thousands commas,
// an optional fraction; never the tail of a longer number or of a range ("3-5" holds 3 and 5).
const RewardPattern& number_pattern() {
  static const RewardPattern re(R"((?<![\d.])-?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?)",
                                "the number pattern");
  return re;
}

// A record's field, nullptr when it is missing.
const json* record_field(const json* fields, const std::string& name) {
  if (fields == nullptr || !fields->is_object()) return nullptr;
  const auto it = fields->find(name);
  return it == fields->end() ? nullptr : &*it;
}

std::string shorten_reward_text(const std::string& s, size_t n = 60) {
  return s.size() <= n ? s : s.substr(0, n) + "...";
}

std::string reward_json_type(const json& v) { return v.type_name(); }

// The answer of an exact_match or last_number field: its string, or a number's JSON text.
std::string field_text(const json& v) { return v.is_string() ? v.get<std::string>() : v.dump(); }

// The function's label for messages: "reward.functions[0] ('accuracy', exact_match)".
std::string function_label(const RewardFunctionConfig& f, size_t i) {
  return "reward.functions[" + std::to_string(i) + "] ('" + f.name + "', " + to_string(f.kind) +
         ")";
}

}  // namespace

// One entry of reward.functions with its compiled regexes.
struct Rewards::Verifier {
  RewardFunctionConfig config;
  std::string label;
  std::unique_ptr<rewards_detail::RewardPattern> extract, pattern;

  // The text a check reads: the extract regex's first group, or the whole completion; false when
  // the regex does not match.
  bool checked_text(const std::string& completion, std::string* text) const {
    if (!extract) {
      *text = completion;
      return true;
    }
    return extract->search(completion, text);
  }

  double score(const RewardInput& in) const {
    const auto& c = config;
    std::string text;
    switch (c.kind) {
      case RewardKind::kExactMatch: {
        if (!checked_text(in.completion, &text)) return 0.0;
        const std::string want = field_text(*record_field(in.fields, c.field));
        return c.normalize ? double(normalize_answer(text) == normalize_answer(want))
                           : double(text == want);
      }
      case RewardKind::kLastNumber: {
        double got = 0, want = 0;
        if (!checked_text(in.completion, &text) || !last_number(text, &got)) return 0.0;
        const nlohmann::json& v = *record_field(in.fields, c.field);
        if (v.is_number()) {
          want = v.get<double>();
        } else {
          last_number(v.get<std::string>(), &want);  // check_example made sure it holds one
        }
        return double(got == want);
      }
      case RewardKind::kRegex:
        return double(pattern->search(in.completion));
      case RewardKind::kJson: {
        if (!checked_text(in.completion, &text)) return 0.0;
        return double(nlohmann::json::accept(text));
      }
      case RewardKind::kLength: {
        TORCH_CHECK(in.completion_tokens >= 0, label,
                    ": the completion's token count was not given (RewardInput::"
                    "completion_tokens)");
        const double over = double(std::max<int64_t>(0, in.completion_tokens - c.target_tokens));
        return -std::min(1.0, c.penalty_per_token * over);
      }
    }
    return 0.0;
  }
};

std::string normalize_answer(const std::string& text) {
  std::string out;
  bool space = false;
  for (char ch : text) {
    const auto u = static_cast<unsigned char>(ch);
    if (std::isspace(u)) {
      space = !out.empty();
      continue;
    }
    if (space) out += ' ';
    space = false;
    out += static_cast<char>(std::tolower(u));
  }
  return out;
}

bool last_number(const std::string& text, double* value) {
  std::string last;
  if (!number_pattern().last_match(text, &last)) return false;
  last.erase(std::remove(last.begin(), last.end(), ','), last.end());
  *value = std::strtod(last.c_str(), nullptr);
  return true;
}

Rewards::Rewards() = default;
Rewards::Rewards(Rewards&&) noexcept = default;
Rewards& Rewards::operator=(Rewards&&) noexcept = default;
Rewards::~Rewards() = default;

Rewards make_rewards(const RewardConfig& config) {
  Rewards r;
  r.config_ = config;
  for (size_t i = 0; i < config.functions.size(); ++i) {
    const auto& f = config.functions[i];
    auto v = std::make_unique<Rewards::Verifier>();
    v->config = f;
    v->label = function_label(f, i);
    const std::string key = "reward.functions[" + std::to_string(i) + "]";
    if (!f.extract.empty())
      v->extract = std::make_unique<RewardPattern>(f.extract, key + ".extract");
    if (!f.pattern.empty())
      v->pattern = std::make_unique<RewardPattern>(f.pattern, key + ".pattern");
    TORCH_CHECK(f.kind != RewardKind::kRegex || v->pattern, key,
                ".pattern: required by kind regex");
    r.names_.push_back(f.name);
    r.verifiers_.push_back(std::move(v));
  }
  if (!config.command.empty()) {
    r.command_ = std::make_unique<RewardCommand>(config.command, config.command_dir,
                                                 config.command_timeout_s);
    r.names_.push_back("command");
  }
  return r;
}

void check_reward_example(const RewardConfig& config, const nlohmann::json& fields,
                          const std::string& where) {
  if (!fields.is_object()) {
    throw ConfigError(where +
                      ": expected a JSON object record (the rewards read its fields), "
                      "found " +
                      reward_json_type(fields));
  }
  for (size_t i = 0; i < config.functions.size(); ++i) {
    const auto& f = config.functions[i];
    if (f.kind != RewardKind::kExactMatch && f.kind != RewardKind::kLastNumber) continue;
    const nlohmann::json* v = record_field(&fields, f.field);
    if (v == nullptr) {
      std::string keys;
      for (const auto& kv : fields.items()) keys += (keys.empty() ? "" : ", ") + kv.key();
      throw ConfigError(where + ": " + function_label(f, i) + " needs the field '" + f.field +
                        "', which this record lacks (its keys: " + (keys.empty() ? "none" : keys) +
                        ")");
    }
    if (!v->is_string() && !v->is_number()) {
      throw ConfigError(where + ": " + function_label(f, i) + " reads the field '" + f.field +
                        "' as its answer: expected a string or a number, found " +
                        reward_json_type(*v));
    }
    double unused = 0;
    if (f.kind == RewardKind::kLastNumber && v->is_string() &&
        !last_number(v->get<std::string>(), &unused)) {
      throw ConfigError(where + ": " + function_label(f, i) + ": the field '" + f.field +
                        "' holds no number ('" + shorten_reward_text(v->get<std::string>()) + "')");
    }
  }
}

void Rewards::check_example(const nlohmann::json& fields, const std::string& where) const {
  check_reward_example(config_, fields, where);
}

RewardScores Rewards::score(const std::vector<RewardInput>& batch) {
  static const nlohmann::json kNoFields = nlohmann::json::object();
  const size_t n = batch.size();
  for (const auto& in : batch) check_example(in.fields ? *in.fields : kNoFields, in.where);
  RewardScores s;
  s.names = names_;
  for (const auto& v : verifiers_) {
    s.weights.push_back(v->config.weight);
    std::vector<double> r(n);
    for (size_t i = 0; i < n; ++i) r[i] = v->score(batch[i]);
    s.per_function.push_back(std::move(r));
  }
  if (command_) {
    std::vector<std::string> requests, labels;
    for (const auto& in : batch) {
      nlohmann::json req =
          in.fields && in.fields->is_object() ? *in.fields : nlohmann::json::object();
      req["prompt"] = in.prompt;
      req["completion"] = in.completion;
      // A completion cut inside a UTF-8 character is sent with U+FFFD in its place.
      requests.push_back(req.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
      labels.push_back(in.where);
    }
    s.weights.push_back(config_.command_weight);
    s.per_function.push_back(command_->score(requests, labels));
  }
  s.total.assign(n, 0.0);
  for (size_t f = 0; f < s.per_function.size(); ++f) {
    for (size_t i = 0; i < n; ++i) s.total[i] += s.weights[f] * s.per_function[f][i];
  }
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(s.total[i])) {
      throw RewardError(
          "the total reward of " +
          (batch[i].where.empty() ? "completion " + std::to_string(i + 1) : batch[i].where) +
          " is not finite");
    }
  }
  return s;
}

namespace {

// Mean and standard deviation (n - 1 in the denominator; 0 below two values) of v[b, e).
std::pair<double, double> reward_mean_std(const std::vector<double>& v, size_t b, size_t e) {
  const size_t n = e - b;
  if (n == 0) return {0.0, 0.0};
  double sum = 0;
  for (size_t i = b; i < e; ++i) sum += v[i];
  const double mean = sum / double(n);
  if (n < 2) return {mean, 0.0};
  double sq = 0;
  for (size_t i = b; i < e; ++i) sq += (v[i] - mean) * (v[i] - mean);
  return {mean, std::sqrt(sq / double(n - 1))};
}

}  // namespace

std::vector<std::pair<std::string, double>> reward_metrics(const RewardScores& scores,
                                                           int64_t group_size) {
  const size_t n = scores.total.size();
  TORCH_CHECK(group_size >= 1 && n % size_t(group_size) == 0, "reward_metrics: ", n,
              " completions do not split into groups of ", group_size);
  std::vector<std::pair<std::string, double>> out;
  out.emplace_back("reward", reward_mean_std(scores.total, 0, n).first);
  double group_std = 0;
  const size_t groups = n / size_t(group_size);
  for (size_t g = 0; g < groups; ++g) {
    group_std += reward_mean_std(scores.total, g * group_size, (g + 1) * group_size).second;
  }
  out.emplace_back("reward_std", groups ? group_std / double(groups) : 0.0);
  for (size_t f = 0; f < scores.names.size(); ++f) {
    const auto [mean, std] = reward_mean_std(scores.per_function[f], 0, n);
    out.emplace_back("rewards/" + scores.names[f] + "/mean", mean);
    out.emplace_back("rewards/" + scores.names[f] + "/std", std);
  }
  return out;
}

}  // namespace q4::trainer
