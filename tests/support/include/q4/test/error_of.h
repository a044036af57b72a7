// error_of: the message of the c10::Error a callable throws (what_without_backtrace, as main
// prints it), or "" when it throws none; a test then checks what the message names.
#pragma once

#include <c10/util/Exception.h>

#include <string>
#include <utility>

namespace q4::test {

template <typename Fn>
std::string error_of(Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (const c10::Error& e) {
    return std::string(e.what_without_backtrace());
  }
  return std::string();
}

}  // namespace q4::test
