// Hugging Face export/import (hf_interop.h) on the tiny Qwen3 config: .dat -> HF (both layouts)
// -> .dat is byte-identical (quantized and tied lm_head, qdata elem 0 and 100, several shards);
// exported bytes equal the .dat's qdata/scale; a BF16 folder made here imports to the scalar
// NVFP4 reference bit-exactly and byte-identically to `q4dat quantize` of the same weights;
// global scales other than 1 are folded; NaN/negative scales and broken folders are errors.
#include "q4/model/hf_interop.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <nlohmann/json.hpp>

#include "q4/io/remove_tree.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "q4/test/files.h"
#include "temp_dir.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

using q4::test::read_text;

class HfInteropTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = q4::model::test::fresh_test_dir("q4_hf_");
    config_ = read_json(kConfig);
  }
  void TearDown() override { q4::io::remove_tree(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }
  Qwen3Config cfg(bool tied) const {
    json c = config_;
    c["tie_word_embeddings"] = tied;
    return Qwen3Config::from_json(c, "tiny");
  }

  // A .dat in the shipped layout with random weights: fp16 raw, NVFP4 linears.
  void write_dat(const std::string& p, bool lm_head, ElemType qtype, uint64_t seed) {
    const auto specs = qwen3_parameters(cfg(!lm_head), lm_head);
    uint64_t count = 0;
    for (const auto& s : specs) count += s.kind == ParamKind::kQuantizedLinear ? 2 : 1;
    at::Generator g = at::detail::createCPUGenerator(seed);
    DatWriter w(p, count);
    for (const auto& s : specs) {
      at::Tensor x = at::normal(0.0, 0.02, s.shape, g, at::TensorOptions().dtype(at::kFloat));
      if (s.kind == ParamKind::kQuantizedLinear) {
        w.add_nvfp4(s.name, q4::quant::quantize_nvfp4(x), qtype);
      } else {
        w.add(s.name, (s.kind == ParamKind::kRaw ? x + 1 : x).to(at::kHalf));
      }
    }
    w.commit();
  }
  fs::path dir_;
  json config_;
};

TEST_F(HfInteropTest, DatToHfToDatIsByteIdentical) {
  struct Case {
    bool lm_head;
    ElemType qtype;
    HfFormat fmt;
    uint64_t shard;
  };
  const Case cases[] = {{true, ElemType::kE2M1Packed, HfFormat::kModelOpt, kHfMaxShardBytes},
                        {true, ElemType::kUInt8, HfFormat::kCompressedTensors, kHfMaxShardBytes},
                        {false, ElemType::kUInt8, HfFormat::kModelOpt, 20000},
                        {false, ElemType::kE2M1Packed, HfFormat::kCompressedTensors, 20000}};
  for (size_t i = 0; i < std::size(cases); ++i) {
    const Case& c = cases[i];
    const std::string src = path("src" + std::to_string(i) + ".dat");
    write_dat(src, c.lm_head, c.qtype, 10 + i);
    json conf = config_;
    conf["tie_word_embeddings"] = !c.lm_head;
    HfExportOptions opt;
    opt.format = c.fmt;
    opt.max_shard_bytes = c.shard;
    const std::string out = path("hf" + std::to_string(i));
    const HfExportReport rep = export_hf(DatReader(src), conf, out, opt);
    EXPECT_EQ(rep.lm_head_dequantized, c.lm_head);
    EXPECT_EQ(rep.tied, !c.lm_head);
    EXPECT_EQ(rep.shards.size() > 1, c.shard < kHfMaxShardBytes) << i;
    const std::string back = path("back" + std::to_string(i) + ".dat");
    const HfImportReport irep = import_hf(out, back);
    EXPECT_EQ(irep.quantized, c.lm_head ? 0 : 1) << i;  // tied: lm_head from the embedding
    EXPECT_TRUE(irep.ignored.empty());
    if (c.lm_head) {
      EXPECT_EQ(read_text(src), read_text(back))
          << "case " << i << ": round trip not byte-identical";
    } else {
      // The tied .dat has no lm_head; the import adds the shipped layout's separate lm_head.
      const DatReader a(src), b(back);
      ASSERT_EQ(b.entries().size(), a.entries().size() + 2);
      for (size_t k = 0; k < a.entries().size(); ++k) {
        const DatEntry& ea = a.entries()[k];
        const DatEntry& eb = b.entries()[k];
        EXPECT_EQ(ea.key, eb.key);
        EXPECT_EQ(ea.type, eb.type) << ea.key;
        EXPECT_TRUE(at::equal(a.load(ea), b.load(eb))) << ea.key;
      }
      const auto lm = b.load_nvfp4(*b.find_nvfp4("lm_head.weight"));
      const auto ref = q4::quant::quantize_nvfp4_ref(a.load("model.embed_tokens.weight"));
      EXPECT_TRUE(at::equal(lm.qdata, ref.qdata));
      EXPECT_TRUE(at::equal(lm.scale, ref.scale));
    }
  }
}

TEST_F(HfInteropTest, ExportedBytesAndConfigs) {
  write_dat(path("a.dat"), true, ElemType::kUInt8, 3);
  const DatReader r(path("a.dat"));
  for (HfFormat f : {HfFormat::kModelOpt, HfFormat::kCompressedTensors}) {
    const bool ct = f == HfFormat::kCompressedTensors;
    const fs::path out = dir_ / hf_format_name(f);
    HfExportOptions opt;
    opt.format = f;
    export_hf(r, config_, out.string(), opt);
    const SafetensorsModel m(out.string());
    const std::string q = ct ? ".weight_packed" : ".weight";
    int64_t linears = 0;
    for (const auto& p : r.nvfp4_pairs(true)) {
      if (p.name == "lm_head.weight") continue;
      const std::string mod = p.name.substr(0, p.name.size() - 7);
      const auto t = m.at(mod + q);
      const auto s = m.at(mod + ".weight_scale");
      const auto g = m.at(mod + (ct ? ".weight_global_scale" : ".weight_scale_2"));
      const auto want = r.load_nvfp4(p);
      EXPECT_EQ(t.tensor->dtype, StDtype::kU8);
      EXPECT_EQ(s.tensor->dtype, StDtype::kF8E4M3);
      EXPECT_TRUE(at::equal(t.file->load(*t.tensor), want.qdata)) << p.name;
      EXPECT_TRUE(at::equal(s.file->load(*s.tensor), want.scale)) << p.name;
      EXPECT_EQ(g.tensor->dtype, StDtype::kF32);
      EXPECT_EQ(g.tensor->shape, ct ? std::vector<int64_t>{1} : std::vector<int64_t>{});
      EXPECT_EQ(g.file->load(*g.tensor).reshape({}).item<float>(), 1.0f);
      ++linears;
    }
    EXPECT_EQ(linears, 7 * cfg(false).num_hidden_layers);
    // lm_head: BF16, exactly the dequantized pair.
    const auto lm = m.at("lm_head.weight");
    EXPECT_EQ(lm.tensor->dtype, StDtype::kBF16);
    const auto lp = r.load_nvfp4(*r.find_nvfp4("lm_head.weight"));
    EXPECT_TRUE(at::equal(lm.file->load(*lm.tensor).to(at::kFloat),
                          q4::quant::dequantize_nvfp4_ref(lp.qdata, lp.scale)));
    const json c = read_json(out / "config.json");
    EXPECT_EQ(c["tie_word_embeddings"], false);
    const json& qc = c["quantization_config"];
    if (ct) {
      EXPECT_EQ(qc["quant_method"], "compressed-tensors");
      EXPECT_EQ(qc["format"], "nvfp4-pack-quantized");
      EXPECT_EQ(qc["ignore"], json::array({"lm_head"}));
      const json& w = qc["config_groups"]["group_0"]["weights"];
      EXPECT_EQ(w["num_bits"], 4);
      EXPECT_EQ(w["type"], "float");
      EXPECT_EQ(w["strategy"], "tensor_group");
      EXPECT_EQ(w["group_size"], 16);
      EXPECT_TRUE(qc["config_groups"]["group_0"]["input_activations"].is_null());
      EXPECT_FALSE(fs::exists(out / "hf_quant_config.json"));
    } else {
      const json hq = read_json(out / "hf_quant_config.json");
      EXPECT_EQ(hq["quantization"]["quant_algo"], "W4A16_NVFP4");
      EXPECT_EQ(hq["quantization"]["group_size"], 16);
      EXPECT_TRUE(hq["quantization"]["kv_cache_quant_algo"].is_null());
      EXPECT_EQ(hq["quantization"]["exclude_modules"], json::array({"lm_head"}));
      EXPECT_EQ(qc["quant_method"], "modelopt");
      EXPECT_EQ(qc["quantization"], hq["quantization"]);
    }
  }
}

TEST_F(HfInteropTest, RefusesNanAndNegativeScales) {
  for (uint8_t bad : {uint8_t{0x7F}, uint8_t{0xB8}}) {
    write_dat(path("a.dat"), true, ElemType::kUInt8, 4);
    // Patch one scale byte of layer 0's q_proj in place.
    const DatReader r(path("a.dat"));
    const auto p = *r.find_nvfp4("model.layers.0.self_attn.q_proj.weight");
    const uint64_t off = r.entries()[p.scale_index].offset + 6;  // 4 blocks per row
    {
      std::fstream f(path("a.dat"), std::ios::in | std::ios::out | std::ios::binary);
      f.seekp(static_cast<std::streamoff>(off));
      f.put(static_cast<char>(bad));
    }
    try {
      export_hf(DatReader(path("a.dat")), config_, path("out"), {});
      ADD_FAILURE() << "exported a scale byte " << int(bad);
    } catch (const c10::Error& e) {
      const std::string m = e.what_without_backtrace();
      EXPECT_NE(m.find("model.layers.0.self_attn.q_proj.weight.scale"), std::string::npos) << m;
      EXPECT_NE(m.find(bad == 0x7F ? "NaN" : "negative"), std::string::npos) << m;
      EXPECT_NE(m.find("row 1, block 2"), std::string::npos) << m;
    }
    EXPECT_FALSE(fs::exists(path("out") + "/model.safetensors"));
  }
}

// A BF16 checkpoint as HF writes it (raw tensors fp16 here so that `q4dat quantize` of the same
// weights, which copies raw entries, can be compared byte for byte).
TEST_F(HfInteropTest, Bf16FolderMatchesReferenceAndQuantizeTool) {
  const Qwen3Config c = cfg(false);
  const auto specs = qwen3_parameters(c, true);
  at::Generator g = at::detail::createCPUGenerator(7);
  std::vector<SafetensorsWriter::Decl> decls;
  std::vector<at::Tensor> values;
  uint64_t dense_count = 0;
  for (const auto& s : specs) {
    at::Tensor x = at::normal(0.0, 0.05, s.shape, g, at::TensorOptions().dtype(at::kFloat));
    if (s.kind == ParamKind::kRaw) x = x + 1;
    const bool lin = s.kind == ParamKind::kQuantizedLinear;
    x = x.to(lin ? at::kBFloat16 : at::kHalf);
    decls.push_back({s.name, lin ? StDtype::kBF16 : StDtype::kF16, s.shape});
    values.push_back(x);
    ++dense_count;
  }
  const fs::path hf = dir_ / "bf16";
  fs::create_directories(hf);
  {
    SafetensorsWriter w((hf / "model.safetensors").string(), decls);
    for (const auto& v : values) w.append(v);
    w.commit();
    std::ofstream(hf / "config.json") << config_.dump();
  }
  const HfImportReport rep = import_hf(hf.string(), path("imported.dat"));
  EXPECT_EQ(rep.source_format, "dense");
  EXPECT_EQ(rep.quantized, 7 * c.num_hidden_layers + 1);
  const DatReader imp(path("imported.dat"));
  for (size_t i = 0; i < specs.size(); ++i) {
    if (specs[i].kind != ParamKind::kQuantizedLinear) {
      EXPECT_EQ(imp.at(specs[i].name).type, ElemType::kFloat16);
      continue;
    }
    const auto pair = imp.find_nvfp4(specs[i].name);
    ASSERT_TRUE(pair.has_value()) << specs[i].name;
    EXPECT_EQ(imp.entries()[pair->qdata_index].type, ElemType::kUInt8);
    const auto q = imp.load_nvfp4(*pair);
    const auto ref = q4::quant::quantize_nvfp4_ref(values[i]);
    EXPECT_TRUE(at::equal(q.qdata, ref.qdata)) << specs[i].name;
    EXPECT_TRUE(at::equal(q.scale, ref.scale)) << specs[i].name;
  }

  // The same weights as a dense .dat, quantized by the tool.
  {
    DatWriter w(path("dense.dat"), dense_count);
    for (size_t i = 0; i < specs.size(); ++i) w.add(specs[i].name, values[i]);
    w.commit();
  }
  const std::string tool = std::string(Q4_BIN_DIR) + "/q4dat";
  if (!fs::exists(tool)) GTEST_SKIP() << tool << " not built";
  const std::string cmd = tool + " quantize " + path("dense.dat") + " " + path("tool.dat") +
                          " --match '_proj|lm_head' --qdata-elem 0 > /dev/null";
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  EXPECT_EQ(read_text(path("tool.dat")), read_text(path("imported.dat")));
}

// keep_dense: a dense folder imports with every tensor raw, in the folder's element type and
// values (no NVFP4 pair); a tied checkpoint's lm_head is the embedding, raw too.
TEST_F(HfInteropTest, DenseImportKeepsDenseLinears) {
  for (const bool tied : {false, true}) {
    const Qwen3Config c = cfg(tied);
    const auto specs = qwen3_parameters(c, /*include_lm_head=*/!tied);
    at::Generator g = at::detail::createCPUGenerator(11);
    std::vector<SafetensorsWriter::Decl> decls;
    std::map<std::string, at::Tensor> values;
    for (const auto& s : specs) {
      const bool lin = s.kind == ParamKind::kQuantizedLinear;
      const at::Tensor x = at::normal(0.0, 0.05, s.shape, g, at::TensorOptions().dtype(at::kFloat))
                               .to(lin ? at::kBFloat16 : at::kHalf);
      decls.push_back({s.name, lin ? StDtype::kBF16 : StDtype::kF16, s.shape});
      values[s.name] = x;
    }
    const fs::path hf = dir_ / (tied ? "tied" : "untied");
    fs::create_directories(hf);
    {
      SafetensorsWriter w((hf / "model.safetensors").string(), decls);
      for (const auto& s : specs) w.append(values.at(s.name));
      w.commit();
      json conf = config_;
      conf["tie_word_embeddings"] = tied;
      std::ofstream(hf / "config.json") << conf.dump();
    }
    HfImportOptions opt;
    opt.keep_dense = true;
    const std::string out = path(tied ? "tied.dat" : "untied.dat");
    const HfImportReport rep = import_hf(hf.string(), out, opt);
    EXPECT_EQ(rep.quantized, 0);
    EXPECT_EQ(rep.lm_head_from_embedding, tied);
    const DatReader imp(out);
    EXPECT_TRUE(imp.nvfp4_pairs(/*strict=*/true).empty());
    for (const auto& s : qwen3_parameters(c, /*include_lm_head=*/true)) {
      const at::Tensor want =
          values.at(s.name == "lm_head.weight" && tied ? "model.embed_tokens.weight" : s.name);
      const at::Tensor got = imp.load(s.name);
      EXPECT_EQ(got.scalar_type(), want.scalar_type()) << s.name;
      EXPECT_TRUE(at::equal(got, want)) << s.name;
    }
  }
}

// NVFP4 checkpoints whose global scale is not 1: the scale is folded into the blocks.
TEST_F(HfInteropTest, FoldsGlobalScales) {
  write_dat(path("a.dat"), true, ElemType::kUInt8, 5);
  for (HfFormat f : {HfFormat::kModelOpt, HfFormat::kCompressedTensors}) {
    const bool ct = f == HfFormat::kCompressedTensors;
    HfExportOptions opt;
    opt.format = f;
    const fs::path out = dir_ / hf_format_name(f);
    export_hf(DatReader(path("a.dat")), config_, out.string(), opt);
    // Rewrite the one shard with global scale 2 (ModelOpt: x2; compressed-tensors stores the
    // reciprocal: 0.5 means x2 too). Doubling an E4M3 scale is exact unless it saturates.
    const SafetensorsFile in((out / "model.safetensors").string());
    std::vector<SafetensorsWriter::Decl> decls;
    for (const auto& t : in.tensors()) decls.push_back({t.name, t.dtype, t.shape});
    {
      SafetensorsWriter w((out / "model.safetensors").string(), decls, in.metadata());
      for (const auto& t : in.tensors()) {
        const bool global =
            t.name.find(ct ? "weight_global_scale" : "weight_scale_2") != std::string::npos;
        w.append(global ? at::full(t.shape, ct ? 0.5f : 2.0f) : in.load(t));
      }
      w.commit();
    }
    const HfImportReport rep = import_hf(out.string(), path("folded.dat"));
    EXPECT_EQ(rep.folded_nvfp4, 7 * cfg(false).num_hidden_layers);
    const DatReader a(path("a.dat")), b(path("folded.dat"));
    int64_t changed = 0;
    for (const auto& p : a.nvfp4_pairs(true)) {
      if (p.name == "lm_head.weight") continue;
      const auto qa = a.load_nvfp4(p);
      const auto qb = b.load_nvfp4(*b.find_nvfp4(p.name));
      EXPECT_TRUE(at::equal(qa.qdata, qb.qdata)) << p.name;  // codes never change
      const at::Tensor want = q4::quant::e4m3_decode(qa.scale) * 2;
      const at::Tensor got = q4::quant::e4m3_decode(qb.scale);
      changed += got.ne(want).sum().item<int64_t>();
      EXPECT_TRUE(at::equal(
          got, at::minimum(want, at::full_like(want, 448)).where(got.eq(want) | want.gt(448), got)))
          << p.name;
    }
    EXPECT_EQ(rep.folded_blocks_changed, changed);
  }
}

TEST_F(HfInteropTest, BrokenFoldersAreErrorsNamingTheTensor) {
  write_dat(path("a.dat"), true, ElemType::kUInt8, 6);
  const fs::path out = dir_ / "m";
  export_hf(DatReader(path("a.dat")), config_, out.string(), {});
  json c = read_json(out / "config.json");
  c["quantization_config"]["quantization"]["quant_algo"] = "INT4_AWQ";
  fs::remove(out / "hf_quant_config.json");
  std::ofstream(out / "config.json") << c.dump();
  try {
    import_hf(out.string(), path("x.dat"));
    ADD_FAILURE() << "imported INT4_AWQ";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("INT4_AWQ"), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(path("x.dat")));
  EXPECT_THROW(import_hf(path("nope"), path("x.dat")), c10::Error);
  EXPECT_FALSE(is_hf_folder(path("a.dat")));
  EXPECT_TRUE(is_hf_folder(out.string()));
}

// bf16: every tensor dense BF16 under its HF name (NVFP4 linears dequantized exactly, raw tensors
// converted), no quantization config, no sidecar; an NVFP4 export's hf_quant_config.json left in
// the same folder is removed.
TEST_F(HfInteropTest, Bf16ExportIsTheDequantizedModel) {
  write_dat(path("a.dat"), true, ElemType::kUInt8, 5);
  const DatReader r(path("a.dat"));
  const fs::path out = dir_ / "bf16";
  HfExportOptions opt;
  export_hf(r, config_, out.string(), opt);  // modelopt first: its files must not survive
  ASSERT_TRUE(fs::exists(out / "hf_quant_config.json"));
  opt.format = HfFormat::kBf16;
  const HfExportReport rep = export_hf(r, config_, out.string(), opt);
  EXPECT_EQ(rep.quantized, 0);
  const SafetensorsModel m(out.string());
  const auto specs = qwen3_parameters(cfg(false), /*include_lm_head=*/true);
  EXPECT_EQ(m.names().size(), specs.size());
  for (const auto& s : specs) {
    const auto t = m.at(s.name);
    EXPECT_EQ(t.tensor->dtype, StDtype::kBF16) << s.name;
    const at::Tensor got = t.file->load(*t.tensor).to(at::kFloat);
    if (const auto pair = r.find_nvfp4(s.name)) {
      const auto q = r.load_nvfp4(*pair);
      EXPECT_TRUE(at::equal(got, q4::quant::dequantize_nvfp4_ref(q.qdata, q.scale))) << s.name;
    } else {
      EXPECT_TRUE(at::equal(got, r.load(s.name).to(at::kBFloat16).to(at::kFloat))) << s.name;
    }
  }
  const json c = read_json(out / "config.json");
  EXPECT_FALSE(c.contains("quantization_config"));
  EXPECT_EQ(c["torch_dtype"], "bfloat16");
  EXPECT_FALSE(fs::exists(out / "hf_quant_config.json"));
  EXPECT_FALSE(fs::exists(out / "q4train_lm_head_scale.safetensors"));
  EXPECT_EQ(hf_format_from_name("bf16"), HfFormat::kBf16);
}

// compressed-tensors over an earlier modelopt export of the same folder: the modelopt
// hf_quant_config.json (which a loader would read before config.json) does not survive.
TEST_F(HfInteropTest, CompressedTensorsExportRemovesAModeloptQuantConfig) {
  write_dat(path("a.dat"), true, ElemType::kUInt8, 5);
  const DatReader r(path("a.dat"));
  const fs::path out = dir_ / "reexport";
  HfExportOptions opt;
  export_hf(r, config_, out.string(), opt);
  ASSERT_TRUE(fs::exists(out / "hf_quant_config.json"));
  opt.format = HfFormat::kCompressedTensors;
  export_hf(r, config_, out.string(), opt);
  EXPECT_FALSE(fs::exists(out / "hf_quant_config.json"));
  const json c = read_json(out / "config.json");
  EXPECT_EQ(c["quantization_config"]["quant_method"], "compressed-tensors");
}

}  // namespace
}  // namespace q4::model
