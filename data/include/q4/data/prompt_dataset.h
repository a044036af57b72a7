// Prompts for online training (GRPO, docs/data.md#prompts): TRL's prompt-only format, one record
// per JSONL line or JSON-array element, {"prompt": "..."} (a user turn) or {"prompt": [messages]}
// (a conversation, optionally with "tools"), plus any other fields ("answer", "solution", ...),
// which are kept as JSON and handed to the reward functions as TRL hands its dataset columns.
// Each prompt is rendered with the chat template and its generation prompt, so a completion
// continues it as the model's next assistant turn. Errors name the file and line (or, with
// OnError::kSkip, are counted in the summary).
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"

namespace q4::data {

struct PromptRecord {
  std::vector<TokenId> prompt_ids;  // the rendered prompt, ending with the generation prompt
  std::string prompt_text;          // that rendering as text
  nlohmann::ordered_json prompt;    // the record's "prompt" as written (a string or messages)
  nlohmann::ordered_json fields;    // every other field of the record, in its order
  bool conversational = false;      // "prompt" was a list of messages
  int64_t source_line = 0;          // 1-based line where the record starts
};

struct PromptDataset {
  std::vector<PromptRecord> prompts;
  LoadSummary summary;  // examples counts prompts, tokens their tokens; no supervised tokens
};

// Uses options.system_prompt (a system turn before every prompt without one), options.chat and
// options.on_error / skip_hint; the format is JSON (JSONL or one JSON array) whatever the
// extension.
PromptDataset load_prompt_dataset(const std::string& path, const Tokenizer& tokenizer,
                                  const DatasetOptions& options = {});
PromptDataset load_prompt_dataset_from_string(const std::string& content, const std::string& name,
                                              const Tokenizer& tokenizer,
                                              const DatasetOptions& options = {});

}  // namespace q4::data
