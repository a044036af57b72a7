// q4chat's input lines: one user turn per line from stdin, each at most a stated length (a
// stream without newlines, such as /dev/zero, is an error naming the line, not an endless read),
// with line editing and history on a terminal. Editing comes from BSD libedit (libedit2, its
// readline-compatible entry points) loaded at run time with dlopen: no build dependency and no
// GPL readline linked in; without libedit2 the terminal reads plain lines.
#pragma once

#include <cstddef>
#include <cstdint>
#include <istream>
#include <string>

namespace q4::chat {

// The longest user line q4chat accepts: far above any context a Qwen3 model has, far below a
// read that exhausts memory.
constexpr size_t kMaxInputLineBytes = size_t{1} << 20;

class LineInput {
 public:
  // `in`: the stream read when editing is off; `edit`: use libedit when it loads (a terminal).
  LineInput(std::istream& in, bool edit, size_t max_bytes = kMaxInputLineBytes);
  // The next line into `line` (no '\n'); false at end of input. A line longer than the limit
  // throws std::length_error naming its line number and the limit.
  bool next(const std::string& prompt, std::string& line);
  int64_t line_number() const { return line_no_; }  // of the last line returned (1-based)
  bool editing() const { return readline_ != nullptr; }

 private:
  std::istream& in_;
  size_t max_bytes_;
  int64_t line_no_ = 0;
  char* (*readline_)(const char*) = nullptr;
  int (*add_history_)(const char*) = nullptr;
};

}  // namespace q4::chat
