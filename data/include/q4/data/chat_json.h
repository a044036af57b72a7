// Chat messages and tool lists read from JSON (the data files' "messages", "tools", TRL and
// OpenAI shapes; q4tok chat), and Python's json.dumps as the chat templates' tojson filter prints
// values (docs/data.md "Tools").
#pragma once

#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "q4/data/chat.h"

namespace q4::data {

// Key order matters: tojson prints objects in the order they were written.
using ordered_json = nlohmann::ordered_json;

// Malformed chat JSON; what() names the key ("messages[2].tool_calls[0]: ...").
struct ChatJsonError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// transformers' tojson: json.dumps(v, ensure_ascii=False) with the default separators ", " and
// ": ", keys in their order, floats as Python's repr (1.0, 1e-05, 1e+16).
std::string py_tojson(const ordered_json& v);

// One message {"role", "content" (string, null or absent), "reasoning_content" (string or null),
// "tool_calls" ([{"function": {"name", "arguments"}}] or [{"name", "arguments"}]; arguments a
// string or any JSON value)}. `where` names it in errors ("messages[2]").
Message message_from_json(const ordered_json& m, const std::string& where);

// A list of messages under `key` ("messages", "prompt", "completion").
std::vector<Message> messages_from_json(const ordered_json& list, const std::string& key);

// A record's "tools": absent or null -> none; otherwise a list of objects (OpenAI's
// {"type": "function", "function": {...}} or a bare function schema), each printed by py_tojson.
ToolList tools_from_json(const ordered_json& record);

}  // namespace q4::data
