// LineInput (see line_input.h).
#include "line_input.h"

#include <dlfcn.h>

#include <cstdlib>
#include <iostream>
#include <stdexcept>

#include "q4/io/bounded_read.h"

namespace q4::chat {

LineInput::LineInput(std::istream& in, bool edit, size_t max_bytes)
    : in_(in), max_bytes_(max_bytes) {
  if (!edit) return;
  // The handle is kept for the life of the process (libedit keeps terminal state).
  void* lib = ::dlopen("libedit.so.2", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return;
  readline_ = reinterpret_cast<char* (*)(const char*)>(::dlsym(lib, "readline"));
  add_history_ = reinterpret_cast<int (*)(const char*)>(::dlsym(lib, "add_history"));
  if (readline_ == nullptr || add_history_ == nullptr) {
    readline_ = nullptr;
    add_history_ = nullptr;
  }
}

bool LineInput::next(const std::string& prompt, std::string& line) {
  const std::string where = "stdin line " + std::to_string(line_no_ + 1);
  const std::string limit = io::format_byte_limit(max_bytes_);
  if (readline_ != nullptr) {
    char* s = readline_(prompt.c_str());
    if (s == nullptr) return false;
    line = s;
    std::free(s);
    ++line_no_;
    if (line.size() > max_bytes_) {
      throw std::length_error(where + ": longer than " + limit + " (the longest message)");
    }
    if (!line.empty()) add_history_(line.c_str());
    return true;
  }
  if (!prompt.empty()) std::cout << prompt << std::flush;
  switch (io::read_line_bounded(in_, line, max_bytes_)) {
    case io::LineRead::kEof:
      return false;
    case io::LineRead::kTooLong:
      throw std::length_error(where + ": longer than " + limit +
                              " (the longest message) without a newline");
    case io::LineRead::kLine:
      break;
  }
  ++line_no_;
  return true;
}

}  // namespace q4::chat
