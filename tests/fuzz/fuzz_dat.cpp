// libFuzzer target: the .dat reader (index in one pass, then every payload) on arbitrary bytes.
// Any input must give an index or a c10::Error; a crash, leak or UB report is a finding.
#include <cstdint>
#include <string>

#include "fuzz_file.h"
#include "q4/io/dat_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fuzz_file("dat", ".dat", data, size, [](const std::string& path) {
    q4::io::DatReader r(path);
    for (const auto& e : r.entries()) {
      if (e.nbytes <= (uint64_t{1} << 24)) (void)r.load(e);
    }
  });
}
