// A chat conversation over one Qwen3 model: the Qwen3 ChatML template, a KV cache kept across
// turns (each turn appends only its new tokens: the previous reply's closing <|im_end|>, "\n",
// the user turn and the generation prompt), text streamed as UTF-8 while tokens are decoded,
// the resolution of what `q4chat --model` names (a .dat, a run directory, an HF folder) and the
// loading of that model for inference (shared with q4eval).
#pragma once

#include <c10/util/Exception.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../tool_errors.h"
#include "q4/data/chat.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/sampling.h"
#include "q4/trainer/config/config.h"

namespace CLI {
class App;
class Option;
}  // namespace CLI

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
  // only; the tokenizer must have the ChatML tokens. `chat`: the template of each turn's prompt
  // (its generation prompt: enable_thinking). Earlier turns stay in the cache as generated, so a
  // reply's <think> block stays in the context, where a re-render by the qwen3 and 2507 Thinking
  // templates would drop it (docs/data.md "Chat templates").
  ChatSession(model::Qwen3Model& model, const data::Tokenizer& tokenizer,
              const model::SamplingParams& sampling, std::string system, int64_t max_new_tokens,
              const data::ChatOptions& chat = {});
  // One user turn: the reply is decoded and streamed to `on_text` piece by piece.
  TurnResult turn(const std::string& user,
                  const std::function<void(const std::string&)>& on_text = {});
  // Every token of the conversation: those in the cache plus the last reply's final token.
  const std::vector<int64_t>& history() const { return history_; }
  int64_t cached_tokens() const { return cache_.length; }

 private:
  model::Qwen3Model& model_;
  const data::Tokenizer& tok_;
  model::TokenSampler sampler_;
  std::string system_;
  int64_t max_new_tokens_;
  data::ChatOptions chat_;
  model::KvCache cache_;
  std::vector<int64_t> history_;
  std::vector<int64_t> last_reply_;  // tokens of the previous reply (the last one not cached)
  bool first_ = true;
};

using tools::InputError;

// Runs `fn`, turning the library errors it throws (c10::Error, trainer::ConfigError) into
// InputError: for the steps that read the user's files and options.
template <class F>
auto as_input(F&& fn) -> decltype(fn()) {
  return tools::as_input<trainer::ConfigError>(std::forward<F>(fn));
}

// The options that name a model, shared by q4chat and q4eval: --model, --config, --tokenizer,
// --system and --device.
struct ModelArgs {
  std::string model, config, tokenizer, system, device = "cpu";
  std::string chat_template;    // --chat-template (empty: the run's, else auto)
  std::string enable_thinking;  // --enable-thinking true|false (empty: the run's, else unset)
  std::string adapter;  // a PEFT LoRA adapter folder applied to the model (empty: none)
  const CLI::Option* system_option = nullptr;
  bool system_given() const;  // --system was on the command line (even empty)
};
void add_model_options(CLI::App& app, ModelArgs& args);

struct ModelPaths {
  std::string weights;        // .dat, or the folder when hf_folder
  std::string config;         // config.json
  std::string tokenizer;      // tokenizer.json
  std::string described;      // one line on how the paths were found
  bool hf_folder = false;     // weights is a Hugging Face folder (model::is_hf_folder)
  std::string system_prompt;  // a run directory's data.system_prompt (empty: none)
  // A run directory's data.chat_template and data.enable_thinking (else auto and unset).
  data::ChatTemplate chat_template = data::ChatTemplate::kAuto;
  std::optional<bool> enable_thinking;
  // The weights are a LoRA run's merged export: the PEFT adapter q4train wrote beside it (its
  // adapters are already in the weights; empty: not such an export).
  std::string merged_adapter;
};

// The chat template to render with: --chat-template / --enable-thinking, else the run's, else
// auto (the template of the tokenizer's folder, identified; qwen3-2507-instruct when it has
// none).
data::ChatOptions chat_options(const ModelArgs& args, const ModelPaths& paths);

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

// Inference options for `device` ("cpu" or "cuda"): nothing trainable, no checkpointing; fp32
// compute on the CPU, bf16 on CUDA (an error when no CUDA device is available).
model::ModelOptions inference_options(const std::string& device);

// The tokenizer of `paths`, after checking that its config and tokenizer are regular files of
// bounded size (the loaders read whole files: a FIFO or /dev/zero would never end).
data::Tokenizer load_tokenizer(const ModelPaths& paths);

struct LoadedModel {
  model::Qwen3Config config;
  std::unique_ptr<model::Qwen3Model> model;
  // With an adapter, one line on what was applied: the folder, rank, alpha, targets, LoRA
  // pairs and full tensors replaced (empty without one).
  std::string adapter_summary;
  model::AdapterConfig adapter_config;
  model::AdapterLoad adapter_load;
};

// The config and weights of `paths` (a .dat or a Hugging Face folder, model::load_dat_or_hf)
// with `opt`; `tokenizer`'s vocabulary must fit the config's vocab_size. NVFP4 linears hold
// dequantize(q), as inference computes them.
// With `adapter`, the PEFT LoRA adapter folder (model::read_adapter_config) on top: plain LoRA
// on the NVFP4 linears it names and its modules_to_save weights in place of the base's. An
// adapter on a LoRA run's merged export (paths.merged_adapter) is refused when it is that
// run's adapter or one for the same base: the export holds its adapters already.
LoadedModel load_model(const ModelPaths& paths, const data::Tokenizer& tokenizer,
                       const model::ModelOptions& opt, const std::string& adapter = "");

}  // namespace q4::chat
