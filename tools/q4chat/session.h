// A chat conversation over one Qwen3 model: the Qwen3 ChatML template, a KV cache kept across
// turns (each turn appends only its new tokens: the previous reply's closing <|im_end|>, "\n",
// the user turn and the generation prompt), text streamed as UTF-8 while tokens are decoded,
// and the resolution of what `q4chat --model` names (a .dat, a run directory, an HF folder).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "sampling.h"

namespace q4::chat {

// Turns decoded bytes into printable UTF-8: complete characters come out as soon as they are
// complete, an incomplete trailing sequence waits for the next bytes (one character may span
// several tokens), invalid bytes become U+FFFD.
class Utf8Stream {
 public:
  std::string push(const std::string& bytes);  // printable text completed by `bytes`
  std::string finish();                        // what is left (incomplete -> U+FFFD)

 private:
  std::string pending_;
};

struct TurnResult {
  std::string text;             // the reply as printed (special tokens dropped)
  std::vector<int64_t> tokens;  // generated ids, the stop token included when one came
  bool stopped = false;         // ended on <|im_end|> / <|endoftext|>
  int64_t prompt_tokens = 0;    // tokens fed to the cache for this turn
};

class ChatSession {
 public:
  // `system`: optional system turn; `max_new_tokens` per reply. The model is used for inference
  // only; the tokenizer must have the ChatML tokens.
  ChatSession(model::Qwen3Model& model, const data::Tokenizer& tokenizer,
              const SamplingOptions& sampling, std::string system, int64_t max_new_tokens);
  // One user turn: the reply is decoded and streamed to `on_text` piece by piece.
  TurnResult turn(const std::string& user,
                  const std::function<void(const std::string&)>& on_text = {});
  // Every token of the conversation: those in the cache plus the last reply's final token.
  const std::vector<int64_t>& history() const { return history_; }
  int64_t cached_tokens() const { return cache_.length; }

 private:
  model::Qwen3Model& model_;
  const data::Tokenizer& tok_;
  Sampler sampler_;
  std::string system_;
  int64_t max_new_tokens_;
  model::KvCache cache_;
  std::vector<int64_t> history_;
  std::vector<int64_t> last_reply_;  // tokens of the previous reply (the last one not cached)
  bool first_ = true;
};

struct ModelPaths {
  std::string weights;        // .dat, or the folder when hf_folder
  std::string config;         // config.json
  std::string tokenizer;      // tokenizer.json
  std::string described;      // one line on how the paths were found
  bool hf_folder = false;     // weights is a Hugging Face folder (model::is_hf_folder)
  std::string system_prompt;  // a run directory's data.system_prompt (empty: none)
};

// `model`: a .dat file (config/tokenizer from the options, else config.json/tokenizer.json
// beside it), a q4train run directory (its export, model.config/model.tokenizer and
// data.system_prompt of its saved config.yaml), a Hugging Face folder (config.json,
// model.safetensors[.index.json], tokenizer.json: what q4train's output.hf_export writes), or a
// folder with config.json, tokenizer.json and one .dat. A checkpoint
// directory (step_XXXXXX) is refused with a message that says to use the run's export.
// Non-empty `config`/`tokenizer` override what was found. Errors name the path and what is
// missing.
ModelPaths resolve_model_paths(const std::string& model, const std::string& config,
                               const std::string& tokenizer);

}  // namespace q4::chat
