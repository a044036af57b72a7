// libFuzzer target: the TSV / JSONL / text dataset parsers with the real Qwen3 tokenizer. The
// first byte picks the format (and on_error fail/skip, and a system prompt); the rest is the file.
// Errors must be c10::Error; crashes, UB and inconsistent examples are findings.
#include <c10/util/Exception.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>

#include "q4/data/dataset.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static const auto tok =
      std::make_unique<q4::data::Tokenizer>(q4::data::Tokenizer::from_file(Q4_TOKENIZER_PATH));
  const std::string content(reinterpret_cast<const char*>(data) + 1, size - 1);
  static const char* kNames[] = {"f.tsv", "f.jsonl", "f.txt"};
  q4::data::DatasetOptions o;
  o.on_error = (data[0] & 4) ? q4::data::OnError::kSkip : q4::data::OnError::kFail;
  if (data[0] & 8) o.system_prompt = "You are a test.";
  o.text_append_endoftext = (data[0] & 16) != 0;
  try {
    const auto ds = q4::data::load_dataset_from_string(content, kNames[data[0] % 3], *tok, o);
    for (const auto& e : ds.examples) {
      if (e.input_ids.size() != e.labels.size()) std::abort();
    }
  } catch (const c10::Error&) {
  }
  return 0;
}
