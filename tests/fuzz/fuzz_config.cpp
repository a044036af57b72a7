// libFuzzer target: YAML config loading (parse, --set style override, validation, round trip).
// Any input must parse or raise ConfigError; other exceptions, crashes and UB are findings.
#include <cstdint>
#include <string>

#include "q4/trainer/config/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  try {
    const q4::trainer::Config c = q4::trainer::parse_config(text, "fuzz.yaml", "/base");
    // What parses must print and parse back.
    (void)q4::trainer::parse_config(q4::trainer::config_to_yaml(c), "roundtrip.yaml", "/base");
    (void)q4::trainer::resolved_export_path(c);
  } catch (const q4::trainer::ConfigError&) {
  }
  try {
    (void)q4::trainer::parse_override(text);
  } catch (const q4::trainer::ConfigError&) {
  }
  return 0;
}
