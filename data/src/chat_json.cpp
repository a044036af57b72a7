// Chat JSON reading and Python-compatible tojson (see chat_json.h).
#include "q4/data/chat_json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <optional>

namespace q4::data {
namespace {

// Python's repr of a finite double: the shortest digits that read back to the same double, in
// fixed notation when the decimal point falls in -4 < exponent <= 16 (with ".0" for integers),
// else d.ddde[+-]XX.
std::string py_float_repr(double d) {
  char buf[40];
  int prec = 0;
  for (; prec < 17; ++prec) {
    std::snprintf(buf, sizeof buf, "%.*e", prec, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  const std::string s(buf);  // [-]d.ddde[+-]XX
  const size_t e = s.find('e');
  const bool neg = s[0] == '-';
  std::string digits;
  for (size_t i = neg ? 1 : 0; i < e; ++i) {
    if (s[i] != '.') digits += s[i];
  }
  const int exp10 = std::atoi(s.c_str() + e + 1);
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const int decpt = exp10 + 1;  // value = 0.digits * 10^decpt
  std::string out = neg ? "-" : "";
  if (decpt <= -4 || decpt > 16) {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    const int x = decpt - 1;
    char eb[16];
    std::snprintf(eb, sizeof eb, "e%c%02d", x < 0 ? '-' : '+', std::abs(x));
    return out + eb;
  }
  if (decpt <= 0) return out + "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  if (static_cast<size_t>(decpt) >= digits.size()) {
    return out + digits + std::string(decpt - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, static_cast<size_t>(decpt)) + "." +
         digits.substr(static_cast<size_t>(decpt));
}

// json.dumps(s, ensure_ascii=False): escapes '"', '\\' and control characters below 0x20.
void py_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof b, "\\u%04x", c);
          out += b;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

void dump(const ordered_json& v, std::string& out) {
  switch (v.type()) {
    case ordered_json::value_t::null:
      out += "null";
      break;
    case ordered_json::value_t::boolean:
      out += v.get<bool>() ? "true" : "false";
      break;
    case ordered_json::value_t::number_integer:
      out += std::to_string(v.get<int64_t>());
      break;
    case ordered_json::value_t::number_unsigned:
      out += std::to_string(v.get<uint64_t>());
      break;
    case ordered_json::value_t::number_float:
      out += py_float_repr(v.get<double>());
      break;
    case ordered_json::value_t::string:
      py_string(v.get_ref<const std::string&>(), out);
      break;
    case ordered_json::value_t::array: {
      out += '[';
      bool first = true;
      for (const auto& e : v) {
        if (!first) out += ", ";
        first = false;
        dump(e, out);
      }
      out += ']';
      break;
    }
    case ordered_json::value_t::object: {
      out += '{';
      bool first = true;
      for (const auto& [k, e] : v.items()) {
        if (!first) out += ", ";
        first = false;
        py_string(k, out);
        out += ": ";
        dump(e, out);
      }
      out += '}';
      break;
    }
    default:
      throw ChatJsonError(std::string("cannot print a JSON ") + v.type_name());
  }
}

std::string found(const ordered_json& v) { return v.is_null() ? "null" : v.type_name(); }

// The tool call `c` ("messages[2].tool_calls[0]"): OpenAI's {"function": {...}} or flat; the
// template takes "function" when it is a non-empty object.
ToolCall tool_call_from_json(const ordered_json& c, const std::string& where) {
  if (!c.is_object()) throw ChatJsonError(where + ": expected an object, found " + found(c));
  const bool nested = c.contains("function") && !c["function"].is_null();
  if (nested && !c["function"].is_object()) {
    throw ChatJsonError(where + ".function: expected an object, found " + found(c["function"]));
  }
  const ordered_json& f = nested && !c["function"].empty() ? c["function"] : c;
  const std::string fw = &f == &c ? where : where + ".function";
  if (!f.contains("name") || !f["name"].is_string() || f["name"].get<std::string>().empty()) {
    throw ChatJsonError(fw + ": a tool call without a \"name\" (expected a non-empty string)");
  }
  if (!f.contains("arguments")) {
    throw ChatJsonError(fw +
                        ": a tool call without \"arguments\" (expected an object or a "
                        "JSON string)");
  }
  ToolCall t;
  t.name = f["name"].get<std::string>();
  const ordered_json& a = f["arguments"];
  t.arguments = a.is_string() ? a.get<std::string>() : py_tojson(a);
  return t;
}

// m[key]: its string, or nothing when the key is absent or null; any other value throws.
std::optional<std::string> string_or_null(const ordered_json& m, const char* key,
                                          const std::string& where) {
  if (!m.contains(key) || m[key].is_null()) return std::nullopt;
  if (!m[key].is_string()) {
    throw ChatJsonError(where + "." + key + ": expected a string or null, found " + found(m[key]));
  }
  return m[key].get<std::string>();
}

}  // namespace

std::string py_tojson(const ordered_json& v) {
  std::string out;
  dump(v, out);
  return out;
}

Message message_from_json(const ordered_json& m, const std::string& where) {
  if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
    throw ChatJsonError(where + ": expected {\"role\": string, \"content\": string}");
  }
  Message msg;
  msg.role = m["role"].get<std::string>();
  const std::string& r = msg.role;
  if (r != "system" && r != "user" && r != "assistant" && r != "tool") {
    throw ChatJsonError(where + ".role: unknown role \"" + r +
                        "\" (expected system, user, assistant or tool)");
  }
  if (std::optional<std::string> content = string_or_null(m, "content", where)) {
    msg.content = std::move(*content);
  } else {
    msg.content_is_string = false;
  }
  for (const char* key : {"reasoning_content", "tool_calls"}) {
    if (m.contains(key) && !m[key].is_null() && r != "assistant") {
      throw ChatJsonError(where + "." + key + ": only assistant messages have one (role \"" + r +
                          "\")");
    }
  }
  msg.reasoning_content = string_or_null(m, "reasoning_content", where);
  if (m.contains("tool_calls") && !m["tool_calls"].is_null()) {
    const ordered_json& calls = m["tool_calls"];
    if (!calls.is_array()) {
      throw ChatJsonError(where + ".tool_calls: expected a list, found " + found(calls));
    }
    for (size_t k = 0; k < calls.size(); ++k) {
      msg.tool_calls.push_back(
          tool_call_from_json(calls[k], where + ".tool_calls[" + std::to_string(k) + "]"));
    }
  }
  return msg;
}

std::vector<Message> messages_from_json(const ordered_json& list, const std::string& key) {
  if (!list.is_array()) throw ChatJsonError("\"" + key + "\": expected a list of messages");
  std::vector<Message> out;
  for (size_t i = 0; i < list.size(); ++i) {
    out.push_back(message_from_json(list[i], key + "[" + std::to_string(i) + "]"));
  }
  return out;
}

ToolList tools_from_json(const ordered_json& record) {
  ToolList out;
  if (!record.is_object() || !record.contains("tools") || record["tools"].is_null()) return out;
  const ordered_json& t = record["tools"];
  if (!t.is_array()) {
    throw ChatJsonError("\"tools\": expected a list of tool definitions, found " + found(t));
  }
  for (size_t k = 0; k < t.size(); ++k) {
    if (!t[k].is_object()) {
      throw ChatJsonError("tools[" + std::to_string(k) + "]: expected an object, found " +
                          found(t[k]));
    }
    out.push_back(py_tojson(t[k]));
  }
  return out;
}

}  // namespace q4::data
