// One spelling table per enum, shared by the library that owns the enum and by every file or
// flag that names its values (the YAML config, state headers, command lines, logs). The owner
// declares the table beside the enum, at global scope, in the order docs list the choices:
//
//   Q4_ENUM_NAMES(q4::optim::StateMode, {"fp32", q4::optim::StateMode::kFp32}, ...);
//
// and everything else reads it through enum_name / enum_from_name / enum_choices.
#pragma once

#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace q4::io {

// Specialized once per enum (Q4_ENUM_NAMES): kNames, (spelling, value) pairs.
template <typename E>
struct EnumNames;

// The spelling of v; "<invalid>" for a value outside the table.
template <typename E>
const char* enum_name(E v) {
  for (const auto& entry : EnumNames<E>::kNames) {
    if (entry.second == v) return entry.first;
  }
  return "<invalid>";
}

// The value spelled exactly `text`, or nullopt.
template <typename E>
std::optional<E> enum_from_name(std::string_view text) {
  for (const auto& entry : EnumNames<E>::kNames) {
    if (text == entry.first) return entry.second;
  }
  return std::nullopt;
}

// Every spelling, in table order.
template <typename E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  for (const auto& entry : EnumNames<E>::kNames) out.emplace_back(entry.first);
  return out;
}

// "a, b, c": the choices for an error message.
template <typename E>
std::string enum_choices() {
  std::string out;
  for (const auto& entry : EnumNames<E>::kNames) {
    if (!out.empty()) out += ", ";
    out += entry.first;
  }
  return out;
}

// The value spelled exactly `text`; otherwise a c10::Error "<what>: expected one of a, b, c; got
// 'text'".
template <typename E>
E parse_enum(std::string_view text, const char* what) {
  const std::optional<E> v = enum_from_name<E>(text);
  TORCH_CHECK(v.has_value(), what, ": expected one of ", enum_choices<E>(), "; got '", text, "'");
  return *v;
}

}  // namespace q4::io

// Declares the spelling table of enum E; use at global scope, after E is complete.
#define Q4_ENUM_NAMES(E, ...)                                            \
  template <>                                                            \
  struct q4::io::EnumNames<E> {                                          \
    static constexpr std::pair<const char*, E> kNames[] = {__VA_ARGS__}; \
  }
