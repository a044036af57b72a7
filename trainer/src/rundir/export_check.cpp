// summarize_export_check (see export_check.h).
#include "q4/trainer/rundir/export_check.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

namespace q4::trainer {

// A block that moves on re-quantization can change all 16 of its elements (a new scale). About
// 0.1-0.5% of blocks move; the bound allows 2% (four times the most seen) and at least 4 blocks,
// since one moved block is already several percent of a tiny test tensor. A wrong tensor
// differs almost everywhere, far above either.
int64_t expected_requantization_diff(int64_t elements) {
  constexpr int64_t kBlock = 16;
  const int64_t blocks = (elements + kBlock - 1) / kBlock;
  return kBlock * std::max<int64_t>(4, (blocks * 2 + 99) / 100);
}

ExportCheckReport summarize_export_check(const std::vector<std::string>& differ, int64_t tensors,
                                         const std::function<bool(const std::string&)>& requantized,
                                         double seconds) {
  ExportCheckReport r;
  std::vector<std::string> expected;
  int64_t moved = 0, of = 0;
  for (const auto& d : differ) {
    // "name (k of n elements)": only this form can be re-quantization.
    const size_t open = d.rfind(" (");
    long long k = 0, n = 0;
    char tail = 0;
    const bool counted =
        open != std::string::npos &&
        std::sscanf(d.c_str() + open, " (%lld of %lld element%c", &k, &n, &tail) == 3;
    const std::string name = open == std::string::npos ? d : d.substr(0, open);
    if (counted && requantized(name) && k <= expected_requantization_diff(n)) {
      expected.push_back(d);
      moved += k;
      of += n;
    } else {
      r.failures.push_back(d);
    }
  }
  const int64_t same = tensors - static_cast<int64_t>(differ.size());
  r.lines.push_back(fmt::format(
      "export check: {}/{} tensors of the reloaded export give the trained model's forward "
      "weights bit for bit ({:.1f} s)",
      same, tensors, seconds));
  if (!expected.empty()) {
    r.lines.push_back(fmt::format(
        "  {} trained NVFP4 tensor(s) differ in {} of {} elements, as expected: quantizing a "
        "trained weight again on reload moves a few blocks (fake-quantization is not idempotent, "
        "docs/design.md); not an export error:",
        expected.size(), moved, of));
    for (const auto& e : expected) r.lines.push_back("    " + e);
  }
  if (!r.failures.empty()) {
    r.lines.push_back(fmt::format(
        "  FAILED: {} tensor(s) differ beyond re-quantization; the export does not reproduce the "
        "trained model:",
        r.failures.size()));
    for (const auto& f : r.failures) r.lines.push_back("    differs: " + f);
  }
  return r;
}

}  // namespace q4::trainer
