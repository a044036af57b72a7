// NVFP4 pair discovery and small formatting helpers for q4dat (see common.h).
#include "common.h"

#include <fmt/core.h>

#include "q4dat.h"

namespace q4::tools {

using q4::model::DatEntry;
using q4::model::DatReader;
using q4::model::ElemType;

namespace {

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

std::vector<Nvfp4Pair> find_nvfp4_pairs(const DatReader& r, bool strict) {
  std::vector<Nvfp4Pair> pairs;
  const auto& es = r.entries();
  auto fail = [&](const std::string& msg) {
    if (strict) throw InputError(r.path() + ": " + msg);
  };
  for (size_t i = 0; i < es.size(); ++i) {
    const DatEntry& e = es[i];
    if (e.type == ElemType::kE4M3Scale && ends_with(e.key, ".scale")) {
      const std::string name = e.key.substr(0, e.key.size() - 6);
      const DatEntry* q = r.find(name + ".qdata");
      if (q == nullptr || (q->type != ElemType::kUInt8 && q->type != ElemType::kE2M1Packed)) {
        fail("entry " + std::to_string(i) + " '" + e.key + "' (e4m3) has no '" + name +
             ".qdata' entry of type uint8 or e2m1");
      }
      continue;
    }
    if (!ends_with(e.key, ".qdata") ||
        (e.type != ElemType::kUInt8 && e.type != ElemType::kE2M1Packed)) {
      continue;
    }
    const std::string name = e.key.substr(0, e.key.size() - 6);
    const DatEntry* s = r.find(name + ".scale");
    if (s == nullptr || s->type != ElemType::kE4M3Scale) {
      fail("entry " + std::to_string(i) + " '" + e.key + "' has no '" + name +
           ".scale' entry of type e4m3 (101)");
      continue;
    }
    const bool ok = e.shape.size() == 2 && s->shape.size() == 2 && e.shape[0] == s->shape[0] &&
                    e.shape[1] == 8 * s->shape[1];
    if (!ok) {
      fail("NVFP4 pair '" + name + "': qdata " + shape_str(e.shape) + " and scale " +
           shape_str(s->shape) + " are inconsistent (expected (r, c/2) and (r, c/16))");
      continue;
    }
    pairs.push_back({name, i, static_cast<size_t>(s - es.data()), e.shape[0], 2 * e.shape[1]});
  }
  return pairs;
}

std::string shape_str(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

std::string one_line(std::string s) {
  for (char& c : s) {
    if (c == '\n' || c == '\r') c = ' ';
  }
  return s;
}

}  // namespace q4::tools
