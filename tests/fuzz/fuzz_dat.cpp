// libFuzzer target: the .dat reader (index in one pass, then every payload) on arbitrary bytes.
// Any input must give an index or a c10::Error; a crash, leak or UB report is a finding.
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "q4/io/dat_file.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = "/tmp/q4_fuzz_dat_" + std::to_string(::getpid()) + ".dat";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    q4::io::DatReader r(path);
    for (const auto& e : r.entries()) {
      if (e.nbytes <= (uint64_t{1} << 24)) (void)r.load(e);
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
