// The fuzz targets of file readers: the input is written to a per-process scratch file and the
// reader opens it by path, as users' files are opened.
#pragma once

#include <c10/util/Exception.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <string>

// Writes data to /tmp/q4_fuzz_<tag>_<pid><suffix> and calls read(path); a c10::Error is the
// reader refusing the input (expected), anything else escapes to libFuzzer as a finding.
template <class Read>
int fuzz_file(const char* tag, const char* suffix, const uint8_t* data, size_t size, Read&& read) {
  static const std::string path =
      std::string("/tmp/q4_fuzz_") + tag + "_" + std::to_string(::getpid()) + suffix;
  FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return 0;
  std::fwrite(data, 1, size, f);
  std::fclose(f);
  try {
    read(path);
  } catch (const c10::Error&) {
  }
  return 0;
}
