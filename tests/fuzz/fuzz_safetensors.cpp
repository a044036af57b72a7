// libFuzzer target: the safetensors reader (header JSON, offsets, dtypes) on arbitrary bytes,
// then every tensor small enough to load. Any input must give an index or a c10::Error; a
// crash, leak or UB report is a finding.
#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

#include "q4/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path =
      "/tmp/q4_fuzz_st_" + std::to_string(::getpid()) + ".safetensors";
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    q4::io::SafetensorsFile st(path);
    for (const auto& t : st.tensors()) {
      if (t.nbytes <= (uint64_t{1} << 24)) (void)st.load(t);
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
