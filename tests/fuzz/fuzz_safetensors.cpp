// libFuzzer target: the safetensors reader (header JSON, offsets, dtypes) on arbitrary bytes,
// then every tensor small enough to load. Any input must give an index or a c10::Error; a
// crash, leak or UB report is a finding.
#include <cstdint>
#include <string>

#include "fuzz_file.h"
#include "q4/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return fuzz_file("st", ".safetensors", data, size, [](const std::string& path) {
    q4::io::SafetensorsFile st(path);
    for (const auto& t : st.tensors()) {
      if (t.nbytes <= (uint64_t{1} << 24)) (void)st.load(t);
    }
  });
}
