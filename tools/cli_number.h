// Strict numeric command-line arguments for the tools: the whole text must be one number in the
// stated range. CLI11's own conversion wraps "-5" into a uint64 seed, saturates huge integers and
// prints out-of-range doubles with hundreds of digits; these print what was given (cut to 32
// characters) and the range. Errors throw std::invalid_argument (the tools map it to exit 2).
#pragma once

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace q4::tools {

inline std::string cli_excerpt(const std::string& s) {
  return s.size() > 32 ? s.substr(0, 32) + "..." : s;
}

// An integer in [lo, hi] (decimal, optional leading '-').
inline int64_t parse_int_arg(const std::string& name, const std::string& text, int64_t lo,
                             int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = text.empty() ? 0 : std::strtoll(text.c_str(), &end, 10);
  const bool parsed = !text.empty() && end == text.c_str() + text.size() && errno == 0;
  if (!parsed || v < lo || v > hi) {
    throw std::invalid_argument(name + ": expected an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "], found '" + cli_excerpt(text) + "'");
  }
  return static_cast<int64_t>(v);
}

// A finite number in (lo, hi] (lo excluded: positive quantities).
inline double parse_positive_arg(const std::string& name, const std::string& text, double hi) {
  errno = 0;
  char* end = nullptr;
  const double v = text.empty() ? 0.0 : std::strtod(text.c_str(), &end);
  const bool parsed = !text.empty() && end == text.c_str() + text.size() && errno == 0;
  if (!parsed || !std::isfinite(v) || !(v > 0.0) || v > hi) {
    char range[64];
    std::snprintf(range, sizeof(range), "(0, %g]", hi);
    throw std::invalid_argument(name + ": expected a number in " + range + ", found '" +
                                cli_excerpt(text) + "'");
  }
  return v;
}

// A finite number >= 0; returns "" when `text` is one, else a short message (a CLI11 check).
inline std::string check_nonnegative_arg(const std::string& text) {
  errno = 0;
  char* end = nullptr;
  const double v = text.empty() ? -1.0 : std::strtod(text.c_str(), &end);
  const bool parsed = !text.empty() && end == text.c_str() + text.size() && errno == 0;
  if (parsed && std::isfinite(v) && v >= 0.0) return "";
  return "expected a finite number >= 0, found '" + cli_excerpt(text) + "'";
}

}  // namespace q4::tools
