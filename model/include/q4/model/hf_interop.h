// Hugging Face interop (docs/design.md#interoperability-and-scale): export of a .dat to a folder
// vLLM serves (ModelOpt or compressed-tensors NVFP4 layout, lossless: every weight / weight_scale
// byte is the .dat's qdata / scale byte; global scales 1.0), and import of an HF folder
// (BF16/FP16/FP32, or either NVFP4 layout) into the shipped .dat layout. Both stream tensor by
// tensor (row chunks for conversions), so memory stays about one tensor; both walk the Qwen3
// parameter table.
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "q4/io/enum_names.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace q4::model {

// The layout of an exported folder: NVFP4 linears in ModelOpt's or compressed-tensors' layout
// (lossless), or every tensor dense BF16 (NVFP4 linears dequantized, exactly; raw tensors
// rounded to BF16; no quantization config: transformers and serving stacks load it as an
// unquantized model).
enum class HfFormat { kModelOpt, kCompressedTensors, kBf16 };
// "modelopt" | "compressed-tensors" | "bf16"; nullopt otherwise.
std::optional<HfFormat> hf_format_from_name(const std::string& name);
const char* hf_format_name(HfFormat f);

// Shards are cut below this many payload bytes (HF's default 5 GB).
inline constexpr uint64_t kHfMaxShardBytes = 5'000'000'000;

struct HfExportOptions {
  HfFormat format = HfFormat::kModelOpt;
  // Folder (or a file in it, e.g. tokenizer.json) whose tokenizer files and
  // generation_config.json are copied; empty: none.
  std::string tokenizer_dir;
  uint64_t max_shard_bytes = kHfMaxShardBytes;
  // Raw tensors (embedding, norms, unquantized linears) as BF16. Default false: kept in the
  // .dat's float type (lossless; vLLM casts to its serving dtype on load).
  bool raw_bf16 = false;
  // The caller's other inputs, as (what, path) pairs (e.g. {"--config", ".../config.json"}): the
  // output folder may neither be nor hold any of them (the .dat and tokenizer_dir are added).
  std::vector<std::pair<std::string, std::string>> inputs;
  // Replace the files of an existing folder that is not an earlier q4train export.
  bool overwrite = false;
};

// The checks export_hf makes before writing, for callers that check their outputs up front:
// `out_dir` is a folder or a new path; it is none of `inputs` ((what, path) pairs, files or
// folders) and holds none of them; and when it exists and is not empty it is an earlier q4train
// export (safetensors metadata or hf_quant_config.json producer) unless `overwrite`. Errors name
// the folder and the input; `overwrite_hint` (e.g. "pass --overwrite") ends the message about
// a foreign folder when the caller has such a switch.
void check_hf_export_dir(const std::string& out_dir,
                         const std::vector<std::pair<std::string, std::string>>& inputs,
                         bool overwrite, const std::string& overwrite_hint = "");
// Whether `dir` holds a q4train export (a model*.safetensors whose metadata names q4train, or
// an hf_quant_config.json whose producer is q4train).
bool is_q4train_hf_export(const std::string& dir);

struct HfExportReport {
  int64_t quantized = 0;             // NVFP4 linears written in the quantized layout
  int64_t raw = 0;                   // raw tensors (embedding, norms, unquantized linears)
  bool lm_head_dequantized = false;  // the .dat's NVFP4 lm_head written as BF16
  bool tied = false;                 // no lm_head in the .dat: tie_word_embeddings true
  std::vector<std::string> shards;
  std::vector<std::string> copied;  // tokenizer / generation config files
  uint64_t payload_bytes = 0;
};

// `config`: the model's config.json (parsed); its fields are kept, tie_word_embeddings,
// torch_dtype and quantization_config are set. Errors (missing or ill-shaped parameters, NaN
// or negative block scales, an output folder that check_hf_export_dir refuses) name the .dat
// and the key or the folder; nothing is written before the checks pass, and each file is
// written atomically.
HfExportReport export_hf(const DatReader& src, const nlohmann::json& config,
                         const std::string& out_dir, const HfExportOptions& opt);

struct HfImportReport {
  std::string source_format;          // "dense", "modelopt" or "compressed-tensors"
  int64_t quantized = 0;              // linears quantized from float weights (NVFP4 rules)
  int64_t copied_nvfp4 = 0;           // NVFP4 linears copied losslessly (global scale 1)
  int64_t folded_nvfp4 = 0;           // NVFP4 linears whose global scale was folded into the blocks
  int64_t folded_blocks_changed = 0;  // blocks whose values the E4M3 rounding changed
  int64_t raw = 0;
  std::vector<std::string> ignored;     // tensors of the folder that are not Qwen3 parameters
  bool lm_head_from_embedding = false;  // tied checkpoint: lm_head quantized from the embedding
  bool lm_head_raw = false;  // a q4train export of a raw lm_head: kept raw in its exported type
};

// Whether `path` is a folder with config.json and model.safetensors(.index.json).
bool is_hf_folder(const std::string& path);

// Writes `out_dat` in the shipped Qwen3 .dat layout (fp16 embedding and norms, NVFP4 pairs with
// qdata element type 0 and scale 101, lm_head stored separately even when tied). A folder written
// by export_hf is read back with its original element types (its __metadata__ says so; a raw
// lm_head stays raw, an NVFP4 one is restored from the sidecar scales), so .dat -> HF -> .dat is
// byte-identical. `out_dat` is none of the files read (error naming both).
struct HfImportOptions {
  // Dense float linears stay dense (raw entries in the folder's element type, no NVFP4
  // quantization), and so do the embedding and norms: what plain-precision training from a
  // full-precision folder needs. NVFP4 linears of the folder are still copied as pairs.
  bool keep_dense = false;
  // The block rule of the float linears' quantization (ModelOptions::block_rule).
  q4::quant::BlockRule block_rule = q4::quant::BlockRule::kMax6;
};
HfImportReport import_hf(const std::string& hf_dir, const std::string& out_dat,
                         const HfImportOptions& opt = {});

// The model in `path` for a tool that loads one: a .dat file as Qwen3Model::load reads it, or a
// Hugging Face folder (is_hf_folder) imported by import_hf into a temporary .dat in the system
// temp folder, which is deleted once the model is in memory or the load fails.
Qwen3Model load_dat_or_hf(const Qwen3Config& cfg, const std::string& path, const ModelOptions& opt,
                          const HfImportOptions& import = {});

}  // namespace q4::model

Q4_ENUM_NAMES(q4::model::HfFormat, {"modelopt", q4::model::HfFormat::kModelOpt},
              {"compressed-tensors", q4::model::HfFormat::kCompressedTensors},
              {"bf16", q4::model::HfFormat::kBf16});
