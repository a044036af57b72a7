// ChatSession, Utf8Stream and --model resolution (see session.h).
#include "session.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>
#include <sstream>

#include "q4/data/chat.h"
#include "q4/io/bounded_read.h"
#include "q4/io/host_heap.h"
#include "q4/model/hf_interop.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/rundir/run_dir.h"

namespace fs = std::filesystem;

namespace q4::chat {

namespace {

// Bounds of the JSON files a model load reads: a Qwen3 config.json is a few KB, tokenizer.json
// 11 MB.
constexpr size_t kMaxModelConfigBytes = size_t{16} << 20;
constexpr size_t kMaxTokenizerBytes = size_t{256} << 20;

constexpr const char* kReplacement = "\xEF\xBF\xBD";  // U+FFFD

// Length of the UTF-8 sequence starting with lead byte `c`, 0 when `c` cannot start one.
int sequence_length(unsigned char c) {
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return 2;
  if (c >= 0xE0 && c <= 0xEF) return 3;
  if (c >= 0xF0 && c <= 0xF4) return 4;
  return 0;
}

// Whether s[i..i+n) is a valid sequence (continuations, no overlong/surrogate/> U+10FFFF).
bool valid_sequence(const std::string& s, size_t i, int n) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  for (int k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return false;
  }
  if (n == 3 && b(0) == 0xE0 && b(1) < 0xA0) return false;   // overlong
  if (n == 3 && b(0) == 0xED && b(1) >= 0xA0) return false;  // surrogate
  if (n == 4 && b(0) == 0xF0 && b(1) < 0x90) return false;   // overlong
  if (n == 4 && b(0) == 0xF4 && b(1) >= 0x90) return false;  // > U+10FFFF
  return true;
}

// Whether s[i..) is a proper prefix of some valid sequence (wait for more bytes).
bool incomplete_prefix(const std::string& s, size_t i, int n) {
  const size_t have = s.size() - i;
  if (have >= static_cast<size_t>(n)) return false;
  for (size_t k = 1; k < have; ++k) {
    if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
  }
  return true;
}

std::string drain(std::string& pending, bool final) {
  std::string out;
  size_t i = 0;
  while (i < pending.size()) {
    const int n = sequence_length(static_cast<unsigned char>(pending[i]));
    if (n == 0) {
      out += kReplacement;
      ++i;
    } else if (i + n <= pending.size() && valid_sequence(pending, i, n)) {
      out.append(pending, i, n);
      i += n;
    } else if (!final && incomplete_prefix(pending, i, n)) {
      break;
    } else {
      out += kReplacement;
      ++i;
    }
  }
  pending.erase(0, i);
  return out;
}

}  // namespace

std::string Utf8Stream::push(const std::string& bytes) {
  pending_ += bytes;
  return drain(pending_, /*final=*/false);
}

std::string Utf8Stream::finish() {
  std::string out = drain(pending_, /*final=*/true);
  pending_.clear();
  return out;
}

ChatSession::ChatSession(model::Qwen3Model& model, const data::Tokenizer& tokenizer,
                         const model::SamplingParams& sampling, std::string system,
                         int64_t max_new_tokens, const data::ChatOptions& chat)
    : model_(model),
      tok_(tokenizer),
      sampler_(sampling),
      system_(std::move(system)),
      max_new_tokens_(max_new_tokens),
      chat_(chat),
      cache_(model.make_cache(1, 256)) {
  TORCH_CHECK(max_new_tokens > 0, "--max-new-tokens: expected > 0, got ", max_new_tokens);
}

TurnResult ChatSession::turn(const std::string& user,
                             const std::function<void(const std::string&)>& on_text) {
  const int64_t im_end = tok_.im_end_id();
  const int64_t eot = tok_.endoftext_id();
  std::vector<int64_t> ids;
  if (first_) {
    std::vector<data::Message> msgs;
    if (!system_.empty()) msgs.push_back({"system", system_});
    msgs.push_back({"user", user});
    const auto t = data::tokenize_chat(tok_, msgs, /*add_generation_prompt=*/true, chat_).input_ids;
    ids.assign(t.begin(), t.end());
  } else {
    // The previous reply's last token was sampled but not fed. It closes the reply when it is
    // <|im_end|>; after <|endoftext|> or a length cut the reply is closed here, as the chat
    // template renders a finished assistant turn.
    if (!last_reply_.empty() && last_reply_.back() != im_end && last_reply_.back() != eot) {
      ids.push_back(last_reply_.back());
    }
    ids.push_back(im_end);
    const auto t = tok_.encode(
        "\n" +
        data::render_chat(std::vector<data::Message>{data::Message{"user", user}}, true, chat_));
    ids.insert(ids.end(), t.begin(), t.end());
    // history_ holds the unfed last token; replace it by what is fed now.
    if (!last_reply_.empty()) history_.pop_back();
  }
  first_ = false;
  TurnResult r;
  r.prompt_tokens = static_cast<int64_t>(ids.size());
  Utf8Stream stream;
  std::vector<data::TokenId> run;  // decodable ids not yet turned into text
  auto emit = [&](const std::string& s) {
    if (s.empty()) return;
    r.text += s;
    if (on_text) on_text(s);
  };
  const auto on_token = [&](int64_t id) {
    if (id == im_end || id == eot) return true;
    if (id >= tok_.vocab_size()) {  // embedding rows without a token (Qwen3: 151669..151935)
      emit(stream.finish());
      emit("<id:" + std::to_string(id) + ">");
      return true;
    }
    emit(stream.push(tok_.decode({static_cast<data::TokenId>(id)}, /*skip_special=*/true)));
    return true;
  };
  const model::GenerationResult d = model::decode(model_, cache_, ids, sampler_, history_,
                                                  max_new_tokens_, {im_end, eot}, on_token);
  emit(stream.finish());
  r.tokens = d.tokens;
  r.stopped = d.finish == model::FinishReason::kStop;
  last_reply_ = d.tokens;
  return r;
}

ModelPaths resolve_model_paths(const std::string& model, const std::string& config,
                               const std::string& tokenizer) {
  TORCH_CHECK(!model.empty(), "--model: expected a .dat file, a run directory or a model folder");
  const fs::path p(model);
  TORCH_CHECK(fs::exists(p), "--model ", model, ": no such file or directory");
  ModelPaths r;
  if (fs::is_directory(p)) {
    if (const auto run = trainer::run_dir_model(model, "--model")) {
      r.weights = run->weights;
      r.config = run->config;
      r.tokenizer = run->chat.tokenizer;
      r.system_prompt = run->chat.system_prompt;
      r.chat_template = run->chat.chat_template;
      if (run->chat.enable_thinking != trainer::AutoBool::kAuto) {
        r.enable_thinking = run->chat.enable_thinking == trainer::AutoBool::kTrue;
      }
      r.described = "run directory " + model + " (config.yaml)";
    } else if (model::is_hf_folder(p.string())) {
      r.weights = p.string();
      r.hf_folder = true;
      r.config = (p / "config.json").string();
      r.tokenizer = (p / "tokenizer.json").string();
      r.described = "Hugging Face folder " + model;
    } else {
      std::vector<fs::path> dats;
      for (const auto& e : fs::directory_iterator(p)) {
        if (e.is_regular_file() && e.path().extension() == ".dat") dats.push_back(e.path());
      }
      TORCH_CHECK(dats.size() == 1, "--model ", model, ": expected a run directory (config.yaml) ",
                  "or a folder with config.json, tokenizer.json and exactly one .dat; found ",
                  dats.size(), " .dat files");
      r.weights = dats[0].string();
      r.config = (p / "config.json").string();
      r.tokenizer = (p / "tokenizer.json").string();
      r.described = "model folder " + model;
    }
  } else {
    r.weights = p.string();
    r.config = (p.parent_path() / "config.json").string();
    r.tokenizer = (p.parent_path() / "tokenizer.json").string();
    r.described = "weights file " + model;
  }
  // q4train writes a PEFT adapter beside a LoRA run's export only: that export is merged.
  if (!r.hf_folder) {
    const fs::path beside = trainer::adapter_dir(r.weights);
    if (fs::is_regular_file(beside / "adapter_config.json")) r.merged_adapter = beside.string();
  }
  if (!config.empty()) r.config = config;
  if (!tokenizer.empty()) r.tokenizer = tokenizer;
  TORCH_CHECK(fs::exists(r.config), "--model ", model, ": model config ", r.config,
              " not found; pass --config CONFIG.json");
  TORCH_CHECK(fs::exists(r.tokenizer), "--model ", model, ": tokenizer ", r.tokenizer,
              " not found; pass --tokenizer tokenizer.json");
  return r;
}

model::ModelOptions inference_options(const std::string& device) {
  model::ModelOptions opt;
  opt.trainable = model::TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  if (device == "cuda") {
    TORCH_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available");
    opt.device = at::Device(at::kCUDA, 0);
    opt.compute_dtype = at::kBFloat16;
  } else {
    io::keep_freed_host_blocks();  // CPU compute reuses its large blocks (q4/io/host_heap.h)
  }
  return opt;
}

data::Tokenizer load_tokenizer(const ModelPaths& paths) {
  io::check_regular_file(paths.config, kMaxModelConfigBytes, "model config");
  io::check_regular_file(paths.tokenizer, kMaxTokenizerBytes, "tokenizer");
  return data::Tokenizer::from_file(paths.tokenizer);
}

LoadedModel load_model(const ModelPaths& paths, const data::Tokenizer& tokenizer,
                       const model::ModelOptions& opt, const std::string& adapter) {
  LoadedModel r;
  r.config = model::Qwen3Config::from_json_file(paths.config);
  TORCH_CHECK(tokenizer.vocab_size() <= r.config.vocab_size, "tokenizer ", paths.tokenizer, " has ",
              tokenizer.vocab_size(), " tokens but ", paths.config, " has vocab_size ",
              r.config.vocab_size);
  if (adapter.empty()) {
    r.model =
        std::make_unique<model::Qwen3Model>(model::load_dat_or_hf(r.config, paths.weights, opt));
    return r;
  }
  const model::AdapterConfig ac = model::read_adapter_config(adapter);
  if (!paths.merged_adapter.empty()) {
    std::error_code ec;
    const bool own = fs::equivalent(adapter, paths.merged_adapter, ec);
    const std::string base = model::read_adapter_config(paths.merged_adapter).base_model;
    TORCH_CHECK(!own && (base.empty() || ac.base_model != base), "--adapter ", adapter, ": ",
                paths.weights, " is a LoRA run's merged export (its adapter ", paths.merged_adapter,
                " is already in it); pass --model ", paths.weights,
                " without --adapter, or apply the adapter to its base model",
                ac.base_model.empty() ? std::string() : " (" + ac.base_model + ")");
  }
  r.model = std::make_unique<model::Qwen3Model>(
      model::load_dat_or_hf(r.config, paths.weights, model::with_adapter(opt, ac)));
  const model::AdapterLoad applied = r.model->load_adapter(adapter);
  std::string targets;
  for (const auto& t : ac.lora.targets) targets += (targets.empty() ? "" : ",") + t;
  std::ostringstream line;
  line << "adapter " << adapter << ": rank " << ac.lora.rank << ", alpha " << ac.lora.alpha
       << ", targets " << targets << "; " << applied.lora_pairs << " LoRA pairs (plain), "
       << applied.full_tensors << " full tensors replaced (modules_to_save)";
  r.adapter_summary = line.str();
  r.adapter_config = ac;
  r.adapter_load = applied;
  return r;
}

data::ChatOptions chat_options(const ModelArgs& args, const ModelPaths& paths) {
  data::ChatOptions o;
  const data::ChatTemplate t =
      args.chat_template.empty()
          ? paths.chat_template
          : io::parse_enum<data::ChatTemplate>(args.chat_template, "--chat-template");
  o.chat_template = data::resolve_chat_template(t, data::tokenizer_folder(paths.tokenizer));
  o.enable_thinking = paths.enable_thinking;
  if (!args.enable_thinking.empty()) o.enable_thinking = args.enable_thinking == "true";
  return o;
}

bool ModelArgs::system_given() const { return system_option && system_option->count() > 0; }

void add_model_options(CLI::App& app, ModelArgs& args) {
  app.add_option("--model", args.model,
                 "a .dat file, a q4train run directory, a Hugging Face folder or a model folder")
      ->required();
  app.add_option("--config", args.config, "Qwen3 config.json (default: found from --model)");
  app.add_option("--tokenizer", args.tokenizer, "tokenizer.json (default: found from --model)");
  args.system_option = app.add_option("--system", args.system,
                                      "system prompt (default: a run's data.system_prompt)");
  app.add_option("--chat-template", args.chat_template,
                 "qwen3, qwen3-2507-instruct, qwen3-2507-thinking or auto (default: a run's "
                 "data.chat_template, else auto: the model folder's template)")
      ->check(CLI::IsMember(io::enum_names<data::ChatTemplate>()));
  app.add_option("--enable-thinking", args.enable_thinking,
                 "true or false: HF's enable_thinking (default: a run's data.enable_thinking, "
                 "else unset: thinking on)")
      ->check(CLI::IsMember({"true", "false"}));
  app.add_option("--device", args.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--adapter", args.adapter,
                 "a PEFT LoRA adapter folder to apply (q4train's <export>-adapter, or peft's)");
}

}  // namespace q4::chat
