// "[a, b, c]": a shape or an index in the model's messages.
#pragma once

#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <sstream>
#include <string>

namespace q4::model {

inline std::string bracketed(c10::ArrayRef<int64_t> v) {
  std::ostringstream o;
  o << "[";
  for (size_t i = 0; i < v.size(); ++i) o << (i ? ", " : "") << v[i];
  o << "]";
  return o.str();
}

}  // namespace q4::model
