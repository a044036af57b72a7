// export_hf (hf_interop.h): .dat -> Hugging Face folder in the ModelOpt or compressed-tensors
// NVFP4 layout. The NVFP4 bytes are copied, never re-encoded; the global scale is 1.0 (ModelOpt
// weight_scale_2 scalar, compressed-tensors weight_global_scale [1], stored as the reciprocal,
// so 1.0 either way). lm_head leaves as BF16 (dequantized when the .dat stores it as NVFP4:
// exact, NVFP4 values have <= 5 significant bits); its block scales then go to a sidecar file
// outside the index so that import_hf can restore the .dat bytes exactly.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "hf_interop_impl.h"
#include "q4/io/atomic_file.h"
#include "q4/io/output_path.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"

namespace q4::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// One output tensor and how to produce its bytes.
struct OutTensor {
  SafetensorsWriter::Decl decl;
  enum class Src { kCopy, kConvert, kDequant, kOne } src;
  const DatEntry* entry = nullptr;  // kCopy / kConvert: the .dat entry
  DatNvfp4Pair pair{};              // kDequant: the pair
  // The rows written (of the entry or pair): one expert of a stacked expert matrix; -1: all.
  int64_t row0 = 0, rows = -1;
  uint64_t bytes() const { return SafetensorsWriter::tensor_bytes(decl); }
};

StDtype st_dtype_of(ElemType t) {
  switch (t) {
    case ElemType::kFloat16:
      return StDtype::kF16;
    case ElemType::kBFloat16:
      return StDtype::kBF16;
    case ElemType::kFloat32:
      return StDtype::kF32;
    default:
      TORCH_INTERNAL_ASSERT(false, "not a raw float type");
  }
}

void write_tensor(const DatReader& src, const OutTensor& t, SafetensorsWriter& w) {
  switch (t.src) {
    case OutTensor::Src::kOne: {
      const float one = 1.0f;
      w.append(&one, sizeof(one));
      return;
    }
    case OutTensor::Src::kCopy: {
      const DatEntry& e = *t.entry;
      uint64_t begin = e.offset, nbytes = e.nbytes;
      if (t.rows >= 0) {  // whole rows of a row-major entry
        const uint64_t row_bytes = e.nbytes / static_cast<uint64_t>(e.shape[0]);
        begin += static_cast<uint64_t>(t.row0) * row_bytes;
        nbytes = static_cast<uint64_t>(t.rows) * row_bytes;
      }
      std::vector<uint8_t> buf;
      const uint64_t chunk = uint64_t{64} << 20;
      for (uint64_t off = 0; off < nbytes; off += chunk) {
        const uint64_t n = std::min(chunk, nbytes - off);
        buf.resize(n);
        src.read_range(begin + off, n, buf.data());
        w.append(buf.data(), n);
      }
      return;
    }
    case OutTensor::Src::kConvert: {  // raw float -> another float type, row chunks
      const DatEntry& e = *t.entry;
      const int64_t all = e.shape.empty() ? 1 : e.shape[0];
      const int64_t cols = all ? e.numel() / std::max<int64_t>(all, 1) : 0;
      const int64_t step = std::max<int64_t>(1, kHfChunkElems / std::max<int64_t>(cols, 1));
      const uint64_t row_bytes = static_cast<uint64_t>(cols) * elem_size_bytes(e.type);
      const int64_t end = t.rows >= 0 ? t.row0 + t.rows : all;
      for (int64_t r0 = t.row0; r0 < end; r0 += step) {
        const int64_t n = std::min(step, end - r0);
        at::Tensor x = at::empty({n, cols}, at::TensorOptions().dtype(elem_scalar_type(e.type)));
        src.read_range(e.offset + static_cast<uint64_t>(r0) * row_bytes, x.nbytes(), x.data_ptr());
        w.append(x.to(st_storage_scalar_type(t.decl.dtype)).contiguous());
      }
      return;
    }
    case OutTensor::Src::kDequant: {  // NVFP4 pair -> BF16, row chunks (exact)
      const DatNvfp4Pair& p = t.pair;
      const DatEntry& q = src.entries()[p.qdata_index];
      const DatEntry& s = src.entries()[p.scale_index];
      const int64_t step = std::max<int64_t>(1, kHfChunkElems / p.cols);
      const int64_t end = t.rows >= 0 ? t.row0 + t.rows : p.rows;
      for (int64_t r0 = t.row0; r0 < end; r0 += step) {
        const int64_t n = std::min(step, end - r0);
        at::Tensor qd = at::empty({n, p.cols / 2}, at::TensorOptions().dtype(at::kByte));
        at::Tensor sc = at::empty({n, p.cols / 16}, at::TensorOptions().dtype(at::kByte));
        src.read_range(q.offset + static_cast<uint64_t>(r0 * p.cols / 2), qd.nbytes(),
                       qd.data_ptr());
        src.read_range(s.offset + static_cast<uint64_t>(r0 * p.cols / 16), sc.nbytes(),
                       sc.data_ptr());
        w.append(q4::quant::dequantize_nvfp4(qd, sc, at::kBFloat16).contiguous());
      }
      return;
    }
  }
}

// Refuses NaN (0x7F/0xFF) and negative (sign bit) block scales, naming the entry and block.
void check_scales(const DatReader& src, const DatNvfp4Pair& p) {
  const DatEntry& s = src.entries()[p.scale_index];
  const int64_t blocks_per_row = p.cols / 16;
  std::vector<uint8_t> buf;
  const uint64_t chunk = uint64_t{16} << 20;
  for (uint64_t off = 0; off < s.nbytes; off += chunk) {
    const uint64_t n = std::min(chunk, s.nbytes - off);
    buf.resize(n);
    src.read_range(s.offset + off, n, buf.data());
    for (uint64_t i = 0; i < n; ++i) {
      const uint8_t b = buf[i];
      if ((b & 0x80) == 0 && b != 0x7F) continue;
      const int64_t k = static_cast<int64_t>(off + i);
      TORCH_CHECK(false, src.path(), ": entry '", s.key, "': block scale at row ",
                  k / blocks_per_row, ", block ", k % blocks_per_row, " is ",
                  (b & 0x7F) == 0x7F ? "NaN" : "negative", " (byte 0x", "0123456789ABCDEF"[b >> 4],
                  "0123456789ABCDEF"[b & 15],
                  "); HF NVFP4 scales must be finite and >= 0, refusing to export");
    }
  }
}

void copy_file_atomic(const fs::path& from, const fs::path& to) {
  std::ifstream in(from, std::ios::binary);
  TORCH_CHECK(in.good(), from.string(), ": cannot open");
  std::string data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  io::write_file_atomic(to.string(), data);
}

bool has_q4train_metadata(const fs::path& file) {
  try {
    const SafetensorsFile f(file.string());
    const auto& m = f.metadata();
    return m.count(kHfMetaSource) && m.at(kHfMetaSource) == "q4train";
  } catch (const c10::Error&) {
    return false;  // unreadable: not known to be ours
  }
}

}  // namespace

bool is_q4train_hf_export(const std::string& dir) {
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string n = e.path().filename().string();
    const bool shard = n.rfind("model", 0) == 0 && n.size() > 12 &&
                       n.compare(n.size() - 12, 12, ".safetensors") == 0;
    if (shard && e.is_regular_file(ec) && has_q4train_metadata(e.path())) return true;
  }
  const fs::path hq = fs::path(dir) / "hf_quant_config.json";
  if (fs::is_regular_file(hq, ec)) {
    std::ifstream in(hq);
    const json j = json::parse(in, nullptr, /*allow_exceptions=*/false);
    if (j.is_object() && j.contains("producer") && j["producer"].is_object() &&
        j["producer"].value("name", "") == "q4train") {
      return true;
    }
  }
  return false;
}

void check_hf_export_dir(const std::string& out_dir,
                         const std::vector<std::pair<std::string, std::string>>& inputs,
                         bool overwrite, const std::string& overwrite_hint) {
  const fs::path out(out_dir);
  std::error_code ec;
  TORCH_CHECK(!fs::exists(out, ec) || fs::is_directory(out, ec), out_dir,
              ": exists and is not a folder; the HF export needs a folder");
  for (const auto& [what, path] : inputs) {
    if (path.empty()) continue;
    const std::string relation = io::output_input_relation(out_dir, path);
    TORCH_CHECK(relation != "is" && relation != "holds", out_dir, ": the HF export folder ",
                relation, " the input ", what, " (", path,
                "); exporting there would replace it, choose another folder");
  }
  if (overwrite || !fs::is_directory(out, ec) || fs::is_empty(out, ec)) return;
  TORCH_CHECK(is_q4train_hf_export(out.string()), out_dir,
              ": the folder exists, is not empty and is not a q4train HF export; exporting there "
              "would replace its files, choose another folder",
              overwrite_hint.empty() ? "" : " or " + overwrite_hint);
}

std::optional<HfFormat> hf_format_from_name(const std::string& name) {
  return io::enum_from_name<HfFormat>(name);
}

const char* hf_format_name(HfFormat f) { return io::enum_name(f); }

namespace {

// Every output tensor, planned (and the inputs checked) before anything is written.
struct ExportPlan {
  std::vector<OutTensor> tensors;
  std::vector<std::string> unquantized;  // modules left dense (exclude_modules / ignore)
  std::vector<std::string> routers;      // MoE routers (mlp.gate), never quantized
  std::optional<DatNvfp4Pair> lm_head_pair;
  std::optional<ElemType> qdata_type;
  bool mixed_qdata = false;
};

// An NVFP4 pair: its bytes copied as the layout names them, or dequantized to BF16 (a dense
// export, and lm_head, which vLLM loads unquantized). A stacked expert matrix (`experts` > 0)
// leaves as its experts' tensors (mlp.experts.<e>.<proj>.*), each a row range of the pair.
void plan_nvfp4(const DatReader& src, const ParamSpec& p, const DatNvfp4Pair& pair,
                const std::string& where, HfFormat format, int64_t experts, ExportPlan* plan,
                HfExportReport* rep) {
  const bool ct = format == HfFormat::kCompressedTensors;
  TORCH_CHECK(p.kind == ParamKind::kQuantizedLinear, where,
              " is stored as NVFP4 but is not a linear weight");
  TORCH_CHECK(std::vector<int64_t>({pair.rows, pair.cols}) == p.shape, where, ": NVFP4 shape [",
              pair.rows, ", ", pair.cols, "], expected ", at::IntArrayRef(p.shape));
  check_scales(src, pair);
  const DatEntry& qe = src.entries()[pair.qdata_index];
  const DatEntry& se = src.entries()[pair.scale_index];
  const int64_t parts = std::max<int64_t>(experts, 1), rows = pair.rows / parts;
  const auto name_of = [&](int64_t e) { return experts ? expert_tensor_name(p.name, e) : p.name; };
  if (format == HfFormat::kBf16 || p.group == ParamGroup::kLmHead) {
    for (int64_t e = 0; e < parts; ++e) {
      OutTensor t{
          {name_of(e), StDtype::kBF16, {rows, pair.cols}}, OutTensor::Src::kDequant, nullptr, pair};
      t.row0 = e * rows;
      t.rows = rows;
      plan->tensors.push_back(t);
    }
    if (format != HfFormat::kBf16) {
      // vLLM loads no quantized lm_head: dequantized (exactly) to BF16.
      plan->lm_head_pair = pair;
      rep->lm_head_dequantized = true;
    }
    ++rep->raw;
    return;
  }
  if (plan->qdata_type && *plan->qdata_type != qe.type) plan->mixed_qdata = true;
  plan->qdata_type = qe.type;
  for (int64_t e = 0; e < parts; ++e) {
    const std::string m = module_of(name_of(e));
    OutTensor q{{ct ? m + ".weight_packed" : m + ".weight", StDtype::kU8, {rows, qe.shape[1]}},
                OutTensor::Src::kCopy,
                &qe};
    OutTensor sc{
        {m + ".weight_scale", StDtype::kF8E4M3, {rows, se.shape[1]}}, OutTensor::Src::kCopy, &se};
    q.row0 = sc.row0 = e * rows;
    q.rows = sc.rows = rows;
    plan->tensors.push_back(q);
    plan->tensors.push_back(sc);
    if (ct) {
      plan->tensors.push_back(
          {{m + ".weight_global_scale", StDtype::kF32, {1}}, OutTensor::Src::kOne});
    } else {
      plan->tensors.push_back({{m + ".weight_scale_2", StDtype::kF32, {}}, OutTensor::Src::kOne});
    }
  }
  ++rep->quantized;
}

ExportPlan plan_export(const DatReader& src, const Qwen3Config& cfg, bool has_lm_head,
                       const HfExportOptions& opt, HfExportReport* rep) {
  const bool dense = opt.format == HfFormat::kBf16;
  ExportPlan plan;
  for (const ParamSpec& p : qwen3_parameters(cfg, has_lm_head)) {
    const std::string where = src.path() + ": parameter " + p.name;
    const auto pair = src.find_nvfp4(p.name);
    const DatEntry* raw = src.find(p.name);
    TORCH_CHECK(!(pair && raw), where, " is stored both raw and as an NVFP4 pair");
    TORCH_CHECK(pair || raw, where, " is missing (expected ", p.name, " raw or ", p.name,
                ".qdata/.scale, shape ", at::IntArrayRef(p.shape), ")");
    const int64_t experts = stacked_experts(cfg, p);
    if (pair) {
      plan_nvfp4(src, p, *pair, where, opt.format, experts, &plan, rep);
      continue;
    }
    TORCH_CHECK(raw->type == ElemType::kFloat16 || raw->type == ElemType::kBFloat16 ||
                    raw->type == ElemType::kFloat32,
                where, ": expected element type fp16, bf16 or fp32, got ",
                elem_type_name(raw->type));
    TORCH_CHECK(raw->shape == p.shape, where, ": shape ", at::IntArrayRef(raw->shape),
                ", expected ", at::IntArrayRef(p.shape));
    const StDtype dt = opt.raw_bf16 || dense ? StDtype::kBF16 : st_dtype_of(raw->type);
    const auto how =
        dt == st_dtype_of(raw->type) ? OutTensor::Src::kCopy : OutTensor::Src::kConvert;
    if (experts == 0) {
      plan.tensors.push_back({{p.name, dt, p.shape}, how, raw});
    }
    for (int64_t e = 0; e < experts; ++e) {  // a dense stacked expert matrix: its experts' rows
      const int64_t rows = p.shape[0] / experts;
      OutTensor t{{expert_tensor_name(p.name, e), dt, {rows, p.shape[1]}}, how, raw};
      t.row0 = e * rows;
      t.rows = rows;
      plan.tensors.push_back(t);
    }
    if (p.kind == ParamKind::kQuantizedLinear && p.group != ParamGroup::kLmHead) {
      for (int64_t e = 0; e < std::max<int64_t>(experts, 1); ++e) {
        plan.unquantized.push_back(module_of(experts ? expert_tensor_name(p.name, e) : p.name));
      }
    }
    if (p.group == ParamGroup::kRouter) plan.routers.push_back(module_of(p.name));
    ++rep->raw;
  }
  return plan;
}

// Creates `out_dir` and removes the files of an earlier export into it that this one does not
// rewrite. Only the modelopt layout has an hf_quant_config.json; a loader reads one it finds
// before config.json's quantization_config, so an earlier modelopt export's goes before any
// shard (`drop_quant_config`).
void prepare_out_dir(const std::string& out_dir, bool drop_quant_config) {
  std::error_code ec;
  fs::create_directories(out_dir, ec);
  TORCH_CHECK(!ec, out_dir, ": cannot create the output folder: ", ec.message());
  for (const auto& f : fs::directory_iterator(out_dir)) {
    const std::string n = f.path().filename().string();
    if (n.rfind("model", 0) == 0 && n.size() > 12 && n.substr(n.size() - 12) == ".safetensors") {
      fs::remove(f.path());
    }
  }
  fs::remove(fs::path(out_dir) / kHfLmHeadScaleFile);
  if (drop_quant_config) fs::remove(fs::path(out_dir) / "hf_quant_config.json");
}

// The shards (consecutive tensors, each shard below max_shard_bytes, a larger tensor alone),
// the lm_head's scale sidecar and the index.
void write_weights(const DatReader& src, const ExportPlan& plan, const std::string& out_dir,
                   uint64_t max_shard_bytes, HfExportReport* rep) {
  std::vector<std::vector<size_t>> shards(1);
  uint64_t shard_bytes = 0;
  for (size_t i = 0; i < plan.tensors.size(); ++i) {
    const uint64_t b = plan.tensors[i].bytes();
    if (!shards.back().empty() && shard_bytes + b > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(i);
    shard_bytes += b;
    rep->payload_bytes += b;
  }
  std::map<std::string, std::string> meta = {{"format", "pt"}, {kHfMetaSource, "q4train"}};
  if (plan.qdata_type && !plan.mixed_qdata) {
    meta[kHfMetaQdataElem] = std::to_string(static_cast<uint32_t>(*plan.qdata_type));
  }
  json weight_map = json::object();
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = shards.size() == 1 ? "model.safetensors"
                                                : fmt::format("model-{:05d}-of-{:05d}.safetensors",
                                                              s + 1, shards.size());
    std::vector<SafetensorsWriter::Decl> decls;
    for (size_t i : shards[s]) {
      decls.push_back(plan.tensors[i].decl);
      weight_map[plan.tensors[i].decl.name] = name;
    }
    SafetensorsWriter w((fs::path(out_dir) / name).string(), decls, meta);
    for (size_t i : shards[s]) write_tensor(src, plan.tensors[i], w);
    w.commit();
    rep->shards.push_back(name);
  }
  if (plan.lm_head_pair) {
    // Sidecar outside the index (vLLM and transformers load only indexed files): the block
    // scales that make the BF16 lm_head an exact NVFP4 pair again on import.
    const DatEntry& se = src.entries()[plan.lm_head_pair->scale_index];
    OutTensor t{{"lm_head.weight_scale", StDtype::kF8E4M3, se.shape}, OutTensor::Src::kCopy, &se};
    SafetensorsWriter w((fs::path(out_dir) / kHfLmHeadScaleFile).string(), {t.decl}, meta);
    write_tensor(src, t, w);
    w.commit();
  }
  json index = {{"metadata", {{"total_size", rep->payload_bytes}}}, {"weight_map", weight_map}};
  io::write_file_atomic((fs::path(out_dir) / "model.safetensors.index.json").string(),
                        index.dump(2) + "\n");
}

// config.json's quantization_config for `format` (modelopt: hf_quant_config.json written too);
// null for a dense export. `excluded`: lm_head and every linear the .dat stores unquantized;
// `routers`: the MoE routers, excluded too (ModelOpt by module name, compressed-tensors by the
// pattern "re:.*mlp.gate$", as the NVFP4 releases of Qwen3-MoE list them).
json quantization_config(HfFormat format, const std::vector<std::string>& excluded,
                         const std::vector<std::string>& routers, const std::string& out_dir) {
  if (format == HfFormat::kBf16) return json();  // no quantization: a plain BF16 model
  if (format != HfFormat::kCompressedTensors) {
    json exclude = excluded;
    for (const std::string& r : routers) exclude.push_back(r);
    const json q = {{"quant_algo", "W4A16_NVFP4"},
                    {"group_size", 16},
                    {"kv_cache_quant_algo", nullptr},
                    {"exclude_modules", exclude}};
    json hq = {{"producer", {{"name", "q4train"}, {"version", "1"}}}, {"quantization", q}};
    io::write_file_atomic((fs::path(out_dir) / "hf_quant_config.json").string(), hq.dump(2) + "\n");
    json qc = hq;
    qc["quant_method"] = "modelopt";
    return qc;
  }
  json ignore = excluded;
  if (!routers.empty()) ignore.push_back("re:.*mlp.gate$");
  json weights = {{"num_bits", 4},
                  {"type", "float"},
                  {"strategy", "tensor_group"},
                  {"group_size", 16},
                  {"symmetric", true},
                  {"dynamic", false},
                  {"actorder", nullptr},
                  {"block_structure", nullptr},
                  {"observer", "minmax"},
                  {"observer_kwargs", json::object()}};
  return {{"quant_method", "compressed-tensors"},
          {"format", "nvfp4-pack-quantized"},
          {"quantization_status", "compressed"},
          {"global_compression_ratio", nullptr},
          {"kv_cache_scheme", nullptr},
          {"sparsity_config", json::object()},
          {"ignore", ignore},
          {"config_groups",
           {{"group_0",
             {{"targets", {"Linear"}},
              {"weights", weights},
              {"input_activations", nullptr},
              {"output_activations", nullptr},
              {"format", "nvfp4-pack-quantized"}}}}}};
}

// The tokenizer files found in `tokenizer_dir` (a folder, or a file in it), copied beside.
void copy_tokenizer(const std::string& tokenizer_dir, const std::string& out_dir,
                    HfExportReport* rep) {
  std::error_code ec;
  fs::path dir = tokenizer_dir;
  if (fs::is_regular_file(dir, ec)) dir = dir.parent_path();
  TORCH_CHECK(fs::is_directory(dir, ec), tokenizer_dir, ": tokenizer folder not found");
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                        "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
                        "generation_config.json"}) {
    if (!fs::is_regular_file(dir / f, ec)) continue;
    copy_file_atomic(dir / f, fs::path(out_dir) / f);
    rep->copied.push_back(f);
  }
}

}  // namespace

HfExportReport export_hf(const DatReader& src, const json& config, const std::string& out_dir,
                         const HfExportOptions& opt) {
  std::vector<std::pair<std::string, std::string>> inputs = opt.inputs;
  inputs.emplace_back("weights", src.path());
  inputs.emplace_back("tokenizer folder", opt.tokenizer_dir);
  check_hf_export_dir(out_dir, inputs, opt.overwrite);
  const Qwen3Config cfg = Qwen3Config::from_json(config, "config.json");
  const bool has_lm_head = src.find("lm_head.weight") != nullptr ||
                           src.find(std::string("lm_head.weight") + kDatQdataSuffix) != nullptr;
  TORCH_CHECK(has_lm_head || cfg.tie_word_embeddings, src.path(),
              ": no lm_head.weight(.qdata) entry, but the config has tie_word_embeddings false");
  const bool dense = opt.format == HfFormat::kBf16;
  HfExportReport rep;
  rep.tied = !has_lm_head;

  const ExportPlan plan = plan_export(src, cfg, has_lm_head, opt, &rep);
  prepare_out_dir(out_dir, opt.format == HfFormat::kCompressedTensors || dense);
  write_weights(src, plan, out_dir, opt.max_shard_bytes, &rep);

  // Quantization settings: lm_head and every linear the .dat stores unquantized stay dense.
  std::vector<std::string> excluded = {"lm_head"};
  excluded.insert(excluded.end(), plan.unquantized.begin(), plan.unquantized.end());
  const json qc = quantization_config(opt.format, excluded, plan.routers, out_dir);
  json out_cfg = config;
  out_cfg["tie_word_embeddings"] = rep.tied;
  out_cfg["torch_dtype"] = "bfloat16";
  if (dense) {
    out_cfg.erase("quantization_config");
  } else {
    out_cfg["quantization_config"] = qc;
  }
  io::write_file_atomic((fs::path(out_dir) / "config.json").string(), out_cfg.dump(2) + "\n");

  if (!opt.tokenizer_dir.empty()) copy_tokenizer(opt.tokenizer_dir, out_dir, &rep);
  return rep;
}

}  // namespace q4::model
