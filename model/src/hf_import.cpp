// import_hf (hf_interop.h): Hugging Face folder -> .dat in the shipped Qwen3 layout, walking the
// parameter table. Float linears are quantized with the NVFP4 rules in row chunks (bit-exact
// with `q4dat quantize`, which quantizes whole tensors: blocks never span rows); NVFP4 linears
// (ModelOpt weight/weight_scale/weight_scale_2, compressed-tensors weight_packed/weight_scale/
// weight_global_scale) are copied byte for byte when the global scale is 1, else the global scale
// is folded into each E4M3 block scale (RNE) and the blocks whose values changed are counted.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "hf_interop_impl.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "stored_layers.h"

namespace q4::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

bool is_float(StDtype t) { return t == StDtype::kF16 || t == StDtype::kBF16 || t == StDtype::kF32; }

ElemType elem_of(StDtype t) {
  return t == StDtype::kF16 ? ElemType::kFloat16
                            : (t == StDtype::kBF16 ? ElemType::kBFloat16 : ElemType::kFloat32);
}

int64_t rows_per_chunk(int64_t cols) {
  return std::max<int64_t>(1, kHfChunkElems / std::max<int64_t>(cols, 1));
}

std::string where(const SafetensorsModel::Ref& r) {
  return r.file->path() + ": tensor '" + r.tensor->name + "'";
}

// E2M1 codes (n, c) uint8 of values `v` (n, c) float that are exactly code x scale; the sign
// bit comes from v (so -0 gives code 8). Returns an undefined tensor when v is not exact.
at::Tensor exact_codes(const at::Tensor& v, const at::Tensor& scale_bits) {
  const int64_t n = v.size(0), c = v.size(1);
  at::Tensor s = q4::quant::e4m3_decode(scale_bits).repeat_interleave(16, 1);  // (n, c)
  at::Tensor d = at::where(s > 0, v / s, at::zeros_like(v)).abs();
  at::Tensor code = at::zeros({n, c}, at::TensorOptions().dtype(at::kByte));
  for (double t : {0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0}) code += d.ge(t).to(at::kByte);
  code += at::signbit(v).to(at::kByte) * 8;
  at::Tensor packed = code.slice(1, 1, c, 2) * 16 + code.slice(1, 0, c, 2);  // 2j low nibble
  at::Tensor back = q4::quant::dequantize_nvfp4(packed.contiguous(), scale_bits, at::kFloat);
  const bool same = at::equal(back, v) && at::equal(at::signbit(back), at::signbit(v));
  return same ? packed.contiguous() : at::Tensor();
}

struct Importer {
  const fs::path dir;
  const SafetensorsModel& st;
  DatWriter& w;
  HfImportReport& rep;
  bool from_q4train = false;
  bool keep_dense = false;  // HfImportOptions::keep_dense
  ElemType qdata_type = ElemType::kUInt8;
  std::set<std::string> used;
  q4::quant::BlockRule block_rule = q4::quant::BlockRule::kMax6;  // HfImportOptions::block_rule

  using Ref = SafetensorsModel::Ref;
  // An NVFP4 linear of the folder: codes, block scales, global scale (compressed-tensors stores
  // its reciprocal).
  struct Nvfp4Src {
    Ref q, s, g;
    bool ct;
  };
  // A linear as the folder stores it: NVFP4 tensors, or a dense weight; neither: missing.
  struct Stored {
    std::optional<Nvfp4Src> nvfp4;
    std::optional<Ref> weight;
    const Ref& first() const { return nvfp4 ? nvfp4->q : *weight; }
  };

  std::optional<Ref> take(const std::string& name) {
    auto r = st.find(name);
    if (r) used.insert(name);
    return r;
  }

  // The tensors of linear `name` (ModelOpt weight/weight_scale/weight_scale_2, compressed-tensors
  // weight_packed/weight_scale/weight_global_scale, or a dense weight), taken.
  Stored take_linear(const std::string& name) {
    const std::string m = module_of(name);
    auto packed = take(m + ".weight_packed");
    auto weight = take(name);
    auto scale = take(m + ".weight_scale");
    if (!packed && !(weight && weight->tensor->dtype == StDtype::kU8))
      return {std::nullopt, weight};
    const bool ct = packed.has_value();
    TORCH_CHECK(scale.has_value(), where(ct ? *packed : *weight), ": NVFP4 weight without its ", m,
                ".weight_scale");
    const std::string gname = m + (ct ? ".weight_global_scale" : ".weight_scale_2");
    auto g = take(gname);
    TORCH_CHECK(g.has_value(), where(ct ? *packed : *weight), ": NVFP4 weight without its ", gname);
    take(m + ".input_scale");  // W4A4 activation scale: not used by weight-only training
    take(m + ".input_global_scale");
    return {Nvfp4Src{ct ? *packed : *weight, *scale, *g, ct}, std::nullopt};
  }

  void check_float(const Ref& r, const std::vector<int64_t>& shape) const {
    const StTensor& t = *r.tensor;
    TORCH_CHECK(is_float(t.dtype), where(r), ": expected F16, BF16 or F32, got ",
                st_dtype_name(t.dtype));
    TORCH_CHECK(t.shape == shape, where(r), ": shape ", at::IntArrayRef(t.shape), ", expected ",
                at::IntArrayRef(shape));
  }

  // The shipped layout keeps raw tensors in fp16; a q4train export, or a dense import, keeps the
  // folder's types.
  ElemType raw_type(const StTensor& t) const {
    return from_q4train || keep_dense ? elem_of(t.dtype) : ElemType::kFloat16;
  }

  // The rows of float tensor `r`, as `out`, appended to the open entry.
  void append_raw(const Ref& r, ElemType out) {
    const StTensor& t = *r.tensor;
    const int64_t rows = t.shape.empty() ? 1 : t.shape[0];
    const int64_t cols = t.numel() / std::max<int64_t>(rows, 1);
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk(cols)) {
      const int64_t n = std::min(rows_per_chunk(cols), rows - r0);
      at::Tensor x = r.file->load_rows(t, r0, n);
      at::Tensor y = x.to(elem_scalar_type(out));
      TORCH_CHECK(at::isfinite(y).all().item<bool>(), where(r), ": rows ", r0, "..", r0 + n - 1,
                  at::isfinite(x).all().item<bool>() ? " overflow fp16" : " hold NaN or Inf");
      w.append(y.contiguous());
    }
  }

  void raw(const ParamSpec& p, const Ref& r) {
    check_float(r, p.shape);
    const ElemType out = raw_type(*r.tensor);
    w.begin_streamed(p.name, out, p.shape);
    append_raw(r, out);
    ++rep.raw;
  }

  // Dense float rows -> NVFP4 with the reference rules, appended to the open pair.
  void append_quantized(const Ref& r) {
    const StTensor& t = *r.tensor;
    const int64_t rows = t.shape[0], cols = t.shape[1];
    for (int64_t r0 = 0; r0 < rows; r0 += rows_per_chunk(cols)) {
      const int64_t n = std::min(rows_per_chunk(cols), rows - r0);
      w.append_nvfp4(q4::quant::quantize_nvfp4(r.file->load_rows(t, r0, n), where(r), block_rule));
    }
  }

  // Dense float (rows, cols) -> NVFP4 pair with the reference rules.
  void quantize(const std::string& name, const Ref& r, const std::vector<int64_t>& shape) {
    check_float(r, shape);
    w.begin_nvfp4(name, shape[0], shape[1], qdata_type);
    append_quantized(r);
  }

  // BF16 lm_head of a q4train export with its sidecar scales: the exact original pair, if the
  // values are still code x scale (else nullopt and the caller quantizes).
  bool restore(const std::string& name, const Ref& r, const StTensor& sc,
               const SafetensorsFile& side, const std::vector<int64_t>& shape) {
    const StTensor& t = *r.tensor;
    if (t.shape != shape || sc.shape != std::vector<int64_t>{shape[0], shape[1] / 16} ||
        sc.dtype != StDtype::kF8E4M3 || !is_float(t.dtype)) {
      return false;
    }
    const int64_t rows = shape[0], cols = shape[1], step = rows_per_chunk(cols);
    for (int pass = 0; pass < 2; ++pass) {  // verify everything, then write
      if (pass == 1) w.begin_nvfp4(name, rows, cols, qdata_type);
      for (int64_t r0 = 0; r0 < rows; r0 += step) {
        const int64_t n = std::min(step, rows - r0);
        at::Tensor s = side.load_rows(sc, r0, n);
        at::Tensor q = exact_codes(r.file->load_rows(t, r0, n).to(at::kFloat), s);
        if (!q.defined()) return false;  // only possible in pass 0
        if (pass == 1) w.append_nvfp4({q, s});
      }
    }
    return true;
  }

  // Checks an NVFP4 source of dense shape `shape`; returns the multiplier its global scale puts
  // on every block (dequant = code * block scale * multiplier).
  float nvfp4_mult(const Nvfp4Src& src, const std::vector<int64_t>& shape) const {
    const Ref &q = src.q, &s = src.s, &g = src.g;
    const int64_t rows = shape[0], cols = shape[1];
    TORCH_CHECK(q.tensor->dtype == StDtype::kU8 &&
                    q.tensor->shape == (std::vector<int64_t>{rows, cols / 2}),
                where(q), ": expected U8 [", rows, ", ", cols / 2, "], got ",
                st_dtype_name(q.tensor->dtype), " ", at::IntArrayRef(q.tensor->shape));
    TORCH_CHECK(s.tensor->dtype == StDtype::kF8E4M3 &&
                    s.tensor->shape == (std::vector<int64_t>{rows, cols / 16}),
                where(s), ": expected F8_E4M3 [", rows, ", ", cols / 16, "] (group size 16), got ",
                st_dtype_name(s.tensor->dtype), " ", at::IntArrayRef(s.tensor->shape));
    TORCH_CHECK(g.tensor->dtype == StDtype::kF32 && g.tensor->numel() == 1, where(g),
                ": expected one F32 global scale, got ", st_dtype_name(g.tensor->dtype), " ",
                at::IntArrayRef(g.tensor->shape));
    const float gv = g.file->load(*g.tensor).reshape({}).item<float>();
    TORCH_CHECK(std::isfinite(gv) && gv > 0, where(g), ": global scale ", gv,
                " is not finite and positive");
    return src.ct ? 1.0f / gv : gv;
  }

  // The rows of an NVFP4 source appended to the open pair: copied when the multiplier is 1, else
  // the multiplier folded into each E4M3 block scale (RNE), the blocks it changed counted.
  void append_nvfp4(const Nvfp4Src& src, float mult) {
    const Ref &q = src.q, &s = src.s;
    const int64_t rows = q.tensor->shape[0], step = rows_per_chunk(q.tensor->shape[1] * 2);
    for (int64_t r0 = 0; r0 < rows; r0 += step) {
      const int64_t n = std::min(step, rows - r0);
      at::Tensor sb = s.file->load_rows(*s.tensor, r0, n);  // (n, cols/16) uint8
      const at::Tensor bad = (sb.bitwise_and(0x80).ne(0)) | sb.bitwise_and(0x7F).eq(0x7F);
      TORCH_CHECK(!bad.any().item<bool>(), where(s), ": NaN or negative block scale in rows ", r0,
                  "..", r0 + n - 1);
      if (mult != 1.0f) {
        const at::Tensor want = q4::quant::e4m3_decode(sb) * mult;  // fp32
        const at::Tensor folded = q4::quant::e4m3_encode(want.clamp(0, 448));
        rep.folded_blocks_changed += q4::quant::e4m3_decode(folded).ne(want).sum().item<int64_t>();
        sb = folded;
      }
      w.append_nvfp4({q.file->load_rows(*q.tensor, r0, n), sb});
    }
  }

  // NVFP4 source: copy when the global scale is 1, else fold it into the block scales.
  void nvfp4(const std::string& name, const Nvfp4Src& src, const std::vector<int64_t>& shape) {
    const float mult = nvfp4_mult(src, shape);
    w.begin_nvfp4(name, shape[0], shape[1], qdata_type);
    append_nvfp4(src, mult);
    ++(mult == 1.0f ? rep.copied_nvfp4 : rep.folded_nvfp4);
  }

  // One quantized linear of the shipped layout, from whichever form the folder stores it in: an
  // NVFP4 pair (ModelOpt or compressed-tensors), the embedding (a tied lm_head), a raw lm_head
  // kept raw, the exact pair of a q4train export's sidecar, or dense weights to quantize.
  void linear(const ParamSpec& p, bool tied, bool lm_head_raw) {
    std::error_code ec;
    const std::string m = module_of(p.name);
    if (p.group == ParamGroup::kLmHead && !st.find(p.name) && !st.find(m + ".weight_packed")) {
      // Tied checkpoint: the shipped layout still stores lm_head, quantized from the embedding.
      TORCH_CHECK(tied, dir.string(),
                  ": no lm_head.weight, but config.json has "
                  "tie_word_embeddings false");
      rep.lm_head_from_embedding = true;
      if (keep_dense) {
        raw(p, st.at("model.embed_tokens.weight"));
        return;
      }
      quantize(p.name, st.at("model.embed_tokens.weight"), p.shape);
      ++rep.quantized;
      return;
    }
    const Stored s = take_linear(p.name);
    if (s.nvfp4) {
      nvfp4(p.name, *s.nvfp4, p.shape);
      return;
    }
    const auto& weight = s.weight;
    TORCH_CHECK(weight.has_value(), dir.string(), ": missing tensor '", p.name, "' (shape ",
                at::IntArrayRef(p.shape), ")");
    if (keep_dense) {
      raw(p, *weight);
      return;
    }
    if (p.group == ParamGroup::kLmHead && lm_head_raw) {
      raw(p, *weight);
      rep.lm_head_raw = true;
      return;
    }
    if (p.group == ParamGroup::kLmHead && from_q4train &&
        fs::exists(dir / kHfLmHeadScaleFile, ec)) {
      const SafetensorsFile side((dir / kHfLmHeadScaleFile).string());
      const StTensor* sc = side.find("lm_head.weight_scale");
      if (sc != nullptr && restore(p.name, *weight, *sc, side, p.shape)) {
        ++rep.copied_nvfp4;
        return;
      }
    }
    quantize(p.name, *weight, p.shape);
    ++rep.quantized;
  }

  // A stacked expert matrix (qwen3_params.h) from the folder's per-expert tensors
  // mlp.experts.<e>.<proj>.weight, expert by expert into one entry, every expert checked before
  // anything is written. The experts of one matrix share one form (all NVFP4 or all dense).
  void experts(const ParamSpec& p, int64_t num_experts) {
    const std::vector<int64_t> shape = {p.shape[0] / num_experts, p.shape[1]};
    std::vector<Stored> src;
    std::vector<float> mult;
    for (int64_t e = 0; e < num_experts; ++e) {
      const std::string n = expert_tensor_name(p.name, e);
      Stored s = take_linear(n);
      TORCH_CHECK(s.nvfp4 || s.weight, dir.string(), ": missing tensor '", n, "' (expert ", e,
                  " of ", num_experts, ", shape ", at::IntArrayRef(shape), ")");
      TORCH_CHECK(e == 0 || s.nvfp4.has_value() == src[0].nvfp4.has_value(), where(s.first()),
                  s.nvfp4 ? ": NVFP4" : ": dense", " but expert 0 is ",
                  src[0].nvfp4 ? "NVFP4" : "dense", "; the experts of one layer share one form");
      if (s.nvfp4) {
        mult.push_back(nvfp4_mult(*s.nvfp4, shape));
      } else {
        check_float(*s.weight, shape);
        TORCH_CHECK(
            e == 0 || !keep_dense || s.weight->tensor->dtype == src[0].weight->tensor->dtype,
            where(*s.weight), ": ", st_dtype_name(s.weight->tensor->dtype), " but expert 0 is ",
            st_dtype_name(src[0].weight->tensor->dtype),
            "; a dense import keeps one element type per stacked matrix");
      }
      src.push_back(std::move(s));
    }
    if (src[0].nvfp4) {
      w.begin_nvfp4(p.name, p.shape[0], p.shape[1], qdata_type);
      for (int64_t e = 0; e < num_experts; ++e) append_nvfp4(*src[e].nvfp4, mult[e]);
      const bool folded = std::any_of(mult.begin(), mult.end(), [](float m) { return m != 1.0f; });
      ++(folded ? rep.folded_nvfp4 : rep.copied_nvfp4);
    } else if (keep_dense) {
      const ElemType out = raw_type(*src[0].weight->tensor);
      w.begin_streamed(p.name, out, p.shape);
      for (const Stored& s : src) append_raw(*s.weight, out);
      ++rep.raw;
    } else {
      w.begin_nvfp4(p.name, p.shape[0], p.shape[1], qdata_type);
      for (const Stored& s : src) append_quantized(*s.weight);
      ++rep.quantized;
    }
  }
};

// Whether the folder stores linear `p` as dense floats (not an NVFP4 pair); a missing lm_head of
// a tied checkpoint comes from the (dense) embedding. A stacked expert matrix is stored as its
// experts: expert 0 says (experts() refuses mixed forms).
bool stored_dense(const SafetensorsModel& st, const Qwen3Config& cfg, const ParamSpec& p) {
  const std::string name = stacked_experts(cfg, p) ? expert_tensor_name(p.name, 0) : p.name;
  const std::string m = module_of(name);
  if (st.find(m + ".weight_packed")) return false;
  const auto w = st.find(name);
  if (w) return is_float(w->tensor->dtype);
  return p.group == ParamGroup::kLmHead;
}

// The number `s` starts with when digits (at most 9) and a '.' follow each other there, else -1.
int64_t leading_index(const std::string& s) {
  size_t n = 0;
  while (n < s.size() && n < 10 && std::isdigit(static_cast<unsigned char>(s[n]))) ++n;
  if (n == 0 || n > 9 || n >= s.size() || s[n] != '.') return -1;
  return std::stoll(s.substr(0, n));
}

// Every per-expert tensor of the folder belongs to a sparse layer and an expert below
// num_experts, and none is in another expert layout (transformers' fused 3-D in-memory tensors
// mlp.experts.gate_up_proj / down_proj): refused naming the tensor, before anything is written.
void check_expert_tensors(const SafetensorsModel& st, const Qwen3Config& cfg,
                          const std::string& cfg_name) {
  static const std::string kPrefix = "model.layers.", kExperts = ".mlp.experts.";
  for (const std::string& n : st.names()) {
    const size_t at = n.find(kExperts);
    if (n.compare(0, kPrefix.size(), kPrefix) != 0 || at == std::string::npos) continue;
    const std::string where_n = where(st.at(n));
    const int64_t layer = leading_index(n.substr(kPrefix.size()));
    const std::string rest = n.substr(at + kExperts.size());
    const int64_t e = leading_index(rest);
    if (layer < 0) continue;  // not a decoder layer's tensor: reported as ignored
    TORCH_CHECK(e >= 0, where_n,
                ": not a per-expert tensor (expected mlp.experts.<e>.<proj>.weight); fused or "
                "stacked expert tensors are not imported, save the model with per-expert tensors");
    TORCH_CHECK(cfg.is_moe_layer(layer), where_n, ": layer ", layer, " is dense in ", cfg_name,
                " (mlp_only_layers, decoder_sparse_step or num_experts), but the folder stores "
                "experts for it");
    TORCH_CHECK(e < cfg.moe.num_experts, where_n, ": expert ", e, ", but ", cfg_name,
                " has num_experts ", cfg.moe.num_experts);
  }
}

json read_json(const fs::path& p) {
  std::ifstream in(p);
  TORCH_CHECK(in.good(), p.string(), ": cannot open");
  try {
    return json::parse(in);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, p.string(), ": not valid JSON: ", e.what());
  }
}

// Which layout the folder's linears use: "dense", "modelopt" or "compressed-tensors" (NVFP4,
// group size 16, only).
std::string source_format(const fs::path& dir, const json& config) {
  const std::string hf_dir = dir.string();
  std::error_code ec;
  enum class Src { kDense, kModelOpt, kCt } fmt = Src::kDense;
  const json qc = config.value("quantization_config", json());
  const std::string method = qc.is_object() ? qc.value("quant_method", "") : "";
  const std::string cfg_name = (dir / "config.json").string();
  if (method.rfind("modelopt", 0) == 0 || fs::exists(dir / "hf_quant_config.json", ec)) {
    json q = fs::exists(dir / "hf_quant_config.json", ec)
                 ? read_json(dir / "hf_quant_config.json").value("quantization", json())
                 : qc.value("quantization", qc);
    const std::string algo = q.is_object() ? q.value("quant_algo", "") : "";
    TORCH_CHECK(algo == "NVFP4" || algo == "W4A16_NVFP4", hf_dir, ": ModelOpt quant_algo '", algo,
                "' is not supported (expected NVFP4 or "
                "W4A16_NVFP4)");
    TORCH_CHECK(q.value("group_size", 16) == 16, hf_dir, ": ModelOpt group_size ",
                q.value("group_size", 16), " (expected 16)");
    fmt = Src::kModelOpt;
  } else if (method == "compressed-tensors") {
    const std::string f = qc.value("format", "");
    TORCH_CHECK(f == "nvfp4-pack-quantized", cfg_name, ": quantization_config.format '", f,
                "' is not supported (expected nvfp4-pack-quantized)");
    fmt = Src::kCt;
  } else {
    TORCH_CHECK(method.empty(), cfg_name, ": quantization_config.quant_method '", method,
                "' is not supported (expected none, modelopt or compressed-tensors)");
  }
  return fmt == Src::kDense ? "dense" : (fmt == Src::kModelOpt ? "modelopt" : "compressed-tensors");
}

// The output replaces none of the files read (config, quantization config, index, shards,
// sidecar) nor the folder.
void check_output_is_no_input(const fs::path& dir, const SafetensorsModel& st,
                              const std::string& out_dat) {
  std::error_code ec;
  {
    std::vector<fs::path> inputs = {dir, dir / "config.json", dir / "hf_quant_config.json",
                                    dir / "model.safetensors.index.json", dir / kHfLmHeadScaleFile};
    for (const auto& f : st.files()) inputs.emplace_back(f->path());
    const fs::path out = fs::weakly_canonical(fs::absolute(out_dat), ec);
    for (const fs::path& in : inputs) {
      if (!fs::exists(in, ec)) continue;
      TORCH_CHECK(out != fs::weakly_canonical(fs::absolute(in), ec), out_dat,
                  ": the output is the input ", in.string(),
                  " of this import; writing it would replace the input, choose another path");
    }
  }
}

}  // namespace

bool is_hf_folder(const std::string& path) {
  std::error_code ec;
  const fs::path d(path);
  return fs::is_directory(d, ec) && fs::is_regular_file(d / "config.json", ec) &&
         (fs::is_regular_file(d / "model.safetensors", ec) ||
          fs::is_regular_file(d / "model.safetensors.index.json", ec));
}

HfImportReport import_hf(const std::string& hf_dir, const std::string& out_dat,
                         const HfImportOptions& opt) {
  const fs::path dir(hf_dir);
  TORCH_CHECK(is_hf_folder(hf_dir), hf_dir,
              ": not a Hugging Face model folder (expected config.json and model.safetensors or "
              "model.safetensors.index.json)");
  const std::string cfg_name = (dir / "config.json").string();
  const json config = read_json(cfg_name);
  const Qwen3Config cfg = Qwen3Config::from_json(config, cfg_name);
  HfImportReport rep;
  rep.source_format = source_format(dir, config);
  std::error_code ec;

  const SafetensorsModel st(hf_dir);
  check_output_is_no_input(dir, st, out_dat);
  // An export of ours carries its .dat element types; anything else gets the shipped layout.
  const auto& meta = st.files().front()->metadata();
  const bool from_q4train = meta.count(kHfMetaSource) && meta.at(kHfMetaSource) == "q4train";
  int64_t stored_layers = 0;
  for (const std::string& n : st.names()) stored_layers = count_stored_layer(n, stored_layers);
  TORCH_CHECK(stored_layers == cfg.num_hidden_layers, hf_dir, " stores ", stored_layers,
              " decoder layers but ", cfg_name, " has num_hidden_layers ", cfg.num_hidden_layers,
              "; the config and the weights must describe the same model");
  check_expert_tensors(st, cfg, cfg_name);
  const std::vector<ParamSpec> specs = qwen3_parameters(cfg, /*include_lm_head=*/true);
  // A q4train export without the lm_head sidecar came from a .dat that stored lm_head raw: it
  // comes back raw in its exported type, not quantized (4-bit would change the model's outputs).
  const auto lm_head = st.find("lm_head.weight");
  const bool lm_head_raw = from_q4train && lm_head && is_float(lm_head->tensor->dtype) &&
                           !fs::exists(dir / kHfLmHeadScaleFile, ec);
  uint64_t count = 0;
  for (const ParamSpec& p : specs) {
    const bool pair = p.kind == ParamKind::kQuantizedLinear &&
                      !(p.group == ParamGroup::kLmHead && lm_head_raw) &&
                      !(opt.keep_dense && stored_dense(st, cfg, p));
    count += pair ? 2 : 1;
  }
  DatWriter w(out_dat, count);
  Importer im{dir, st, w, rep, false, false, ElemType::kUInt8, {}};
  im.from_q4train = from_q4train;
  im.keep_dense = opt.keep_dense;
  im.block_rule = opt.block_rule;
  if (from_q4train && meta.count(kHfMetaQdataElem) && meta.at(kHfMetaQdataElem) == "100") {
    im.qdata_type = ElemType::kE2M1Packed;
  }

  for (const ParamSpec& p : specs) {
    if (p.kind != ParamKind::kQuantizedLinear) {
      auto r = im.take(p.name);
      TORCH_CHECK(r.has_value(), hf_dir, ": missing tensor '", p.name, "' (shape ",
                  at::IntArrayRef(p.shape), ")");
      im.raw(p, *r);
      continue;
    }
    if (const int64_t experts = stacked_experts(cfg, p)) {
      im.experts(p, experts);
      continue;
    }
    im.linear(p, cfg.tie_word_embeddings, lm_head_raw);
  }
  for (const std::string& n : st.names()) {
    if (!im.used.count(n)) rep.ignored.push_back(n);
  }
  w.commit();
  return rep;
}

Qwen3Model load_dat_or_hf(const Qwen3Config& cfg, const std::string& path, const ModelOptions& opt,
                          const HfImportOptions& import) {
  if (!is_hf_folder(path)) return Qwen3Model::load(cfg, DatReader(path), opt);
  static std::atomic<int64_t> seq{0};
  struct TempDat {
    std::string path;
    ~TempDat() {
      std::error_code ec;
      fs::remove(path, ec);
    }
  } imported{(fs::temp_directory_path() /
              ("q4_import_" + std::to_string(::getpid()) + "_" + std::to_string(seq++) + ".dat"))
                 .string()};
  import_hf(path, imported.path, import);
  return Qwen3Model::load(cfg, DatReader(imported.path), opt);
}

}  // namespace q4::model
