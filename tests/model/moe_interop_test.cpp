// Hugging Face import/export and q4dat for the mixture-of-experts Qwen3 (docs/interop.md#
// mixture-of-experts): a stacked expert matrix of the .dat (mlp.experts.gate_proj.weight, E·I
// rows) is the E per-expert tensors of a checkpoint (mlp.experts.<e>.gate_proj.weight).
// - transformers' own folder (tests/fixtures/qwen3_moe_tiny_hf, fp32) imported with --dense is the
//   fixture's .dat bit for bit; imported to NVFP4, each stacked pair is the reference quantization
//   of the stacked weights;
// - a q4dat-init NVFP4 .dat exported in the ModelOpt and compressed-tensors layouts (per-expert
//   tensors, routers and lm_head unquantized and listed as excluded) imports back byte-identical,
//   and a model loaded from the folder has the source's forward weights; a per-expert global
//   scale folds into that expert's blocks only;
// - bad folders (an expert missing, misshapen, past num_experts, in a dense layer, the fused 3-D
//   layout, no router) are refused naming the tensor, and write nothing;
// - q4dat info lists the experts and the MoE summary; q4dat init draws the router ~N(0, std).
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/io/remove_tree.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/model/safetensors.h"
#include "q4/quant/nvfp4.h"
#include "q4/test/files.h"
#include "qwen3_check.h"
#include "temp_dir.h"
#include "tiny_fixture.h"

// A named namespace: the unity build puts this file beside moe_test.cpp and hf_interop_test.cpp.
namespace q4::model::moe_interop {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kTool = std::string(Q4_BIN_DIR) + "/q4dat";

json read_json(const fs::path& p) {
  std::ifstream in(p);
  return json::parse(in);
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

class MoeInteropTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = q4::model::test::fresh_test_dir("q4_moeio_"); }
  void TearDown() override { q4::io::remove_tree(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }

  // Runs the built q4dat; returns its exit code, stdout in *out.
  int q4dat(const std::string& args, std::string* out = nullptr) {
    const std::string o = path("q4dat.out");
    const int status = std::system((kTool + " " + args + " > " + o + " 2>&1").c_str());
    if (out != nullptr) *out = q4::test::read_text(o);
    fs::remove(o);
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  }

  // An NVFP4 MoE model in the shipped layout (q4dat init of the tiny MoE config).
  std::string init_dat(const std::string& name, const std::string& seed = "3") {
    const std::string p = path(name);
    std::string out;
    EXPECT_EQ(q4dat("init --config " + kMoeConfig + " --out " + p + " --seed " + seed, &out), 0)
        << out;
    return p;
  }

  // A copy of the fixture HF folder whose tensors pass through `edit` (name, tensor) -> the
  // tensors to write in its place (empty: dropped); `extra` are added.
  std::string edited_folder(const std::string& name,
                            const std::function<std::vector<std::pair<std::string, at::Tensor>>(
                                const std::string&, const at::Tensor&)>& edit,
                            const std::vector<std::pair<std::string, at::Tensor>>& extra = {}) {
    const fs::path out = dir_ / name;
    fs::create_directories(out);
    fs::copy_file(fs::path(kMoeHf) / "config.json", out / "config.json");
    const SafetensorsFile in(kMoeHf + "/model.safetensors");
    std::vector<std::pair<std::string, at::Tensor>> ts;
    for (const auto& t : in.tensors()) {
      for (auto& nt : edit(t.name, in.load(t))) ts.push_back(nt);
    }
    for (const auto& nt : extra) ts.push_back(nt);
    std::vector<SafetensorsWriter::Decl> decls;
    for (const auto& [n, t] : ts) decls.push_back({n, StDtype::kF32, t.sizes().vec()});
    SafetensorsWriter w((out / "model.safetensors").string(), decls, in.metadata());
    for (const auto& nt : ts) w.append(nt.second.contiguous());
    w.commit();
    return out.string();
  }

  // import_hf's error for `folder`; the output .dat must not exist afterwards.
  std::string import_error(const std::string& folder) {
    const std::string err = error_of([&] { import_hf(folder, path("bad.dat")); });
    EXPECT_FALSE(fs::exists(path("bad.dat")));
    return err;
  }

  fs::path dir_;
};

// The line of `text` that holds `word` between spaces.
std::string line_of(const std::string& text, const std::string& word) {
  const size_t at = text.find(" " + word + " ");
  if (at == std::string::npos) return "";
  const size_t b = text.rfind('\n', at), e = text.find('\n', at);
  const size_t start = b == std::string::npos ? 0 : b + 1;
  return text.substr(start, e == std::string::npos ? e : e - start);
}

using Edit = std::vector<std::pair<std::string, at::Tensor>>;
Edit keep(const std::string& n, const at::Tensor& t) { return {{n, t}}; }
// The edit that drops the tensor `name` and keeps the others.
auto dropping(const std::string& name) {
  return
      [name](const std::string& n, const at::Tensor& t) { return n == name ? Edit{} : keep(n, t); };
}

TEST(MoeConfig, ReadsTransformersNumLocalExperts) {
  // transformers 5 saves the expert count as num_local_experts (the fixture folder does).
  const Qwen3Config c = Qwen3Config::from_json_file(kMoeHf + "/config.json");
  EXPECT_EQ(c.moe.num_experts, 8);
  json j = read_json(kMoeHf + "/config.json");
  j["num_experts"] = 16;
  const std::string err = error_of([&] { Qwen3Config::from_json(j, "c.json"); });
  EXPECT_NE(err.find("'num_local_experts'"), std::string::npos) << err;
  j["num_experts"] = 8;
  EXPECT_EQ(error_of([&] { Qwen3Config::from_json(j, "c.json"); }), "");
}

TEST_F(MoeInteropTest, DenseImportOfTransformersFolderIsTheFixture) {
  // Through the tool: q4dat import-hf --dense.
  std::string out;
  ASSERT_EQ(q4dat("import-hf " + kMoeHf + " " + path("dense.dat") + " --dense", &out), 0) << out;
  const DatReader ref(kMoeWeights), got(path("dense.dat"));
  ASSERT_EQ(got.entries().size(), ref.entries().size());
  for (const DatEntry& e : ref.entries()) {
    const DatEntry* g = got.find(e.key);
    ASSERT_NE(g, nullptr) << e.key;
    EXPECT_EQ(g->type, e.type) << e.key;
    EXPECT_EQ(g->shape, e.shape) << e.key;
    // Bit for bit: the same bytes.
    const at::Tensor a = got.load(*g).contiguous(), b = ref.load(e).contiguous();
    ASSERT_EQ(a.nbytes(), b.nbytes()) << e.key;
    EXPECT_EQ(std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()), 0) << e.key;
  }
  // Exported again (its fp32 kept: ModelOpt layout, dense experts listed as excluded), every
  // tensor is transformers' own, per expert.
  export_hf(got, read_json(kMoeConfig), path("again"), {});
  const SafetensorsModel a(path("again")), t(kMoeHf);
  EXPECT_EQ(a.names(), t.names());
  for (const std::string& n : t.names()) {
    const auto x = a.at(n), y = t.at(n);
    EXPECT_EQ(x.tensor->dtype, StDtype::kF32) << n;
    EXPECT_TRUE(at::equal(x.file->load(*x.tensor), y.file->load(*y.tensor))) << n;
  }
  const json ex = read_json(fs::path(path("again")) / "hf_quant_config.json");
  const json& mods = ex["quantization"]["exclude_modules"];
  EXPECT_NE(std::find(mods.begin(), mods.end(), "model.layers.2.mlp.experts.7.down_proj"),
            mods.end());
  // The quantizing import: each stacked pair is the reference quantization of the stacked weights.
  const HfImportReport rep = import_hf(kMoeHf, path("q.dat"));
  EXPECT_TRUE(rep.ignored.empty());
  EXPECT_EQ(rep.quantized, 4 * 3 + 3 + 3 + 3 + 1);  // attention, 2 sparse + 1 dense MLP, lm_head
  const DatReader q(path("q.dat"));
  for (const char* n : {"model.layers.0.mlp.experts.gate_proj.weight",
                        "model.layers.2.mlp.experts.down_proj.weight"}) {
    const auto pair = q.load_nvfp4(*q.find_nvfp4(n));
    const auto want = q4::quant::quantize_nvfp4_ref(ref.load(n));
    EXPECT_TRUE(at::equal(pair.qdata, want.qdata)) << n;
    EXPECT_TRUE(at::equal(pair.scale, want.scale)) << n;
  }
  EXPECT_EQ(q.find("model.layers.0.mlp.gate.weight")->type, ElemType::kFloat16);
}

TEST_F(MoeInteropTest, Nvfp4RoundTripInBothLayouts) {
  const std::string src = init_dat("src.dat");
  const json config = read_json(kMoeConfig);
  const Qwen3Config cfg = Qwen3Config::from_json(config, "moe");
  // Inference options: a trainable master's forward re-quantizes the dequantized weights, and
  // quantize(dequantize(q)) is not always q (docs/interop.md); no property of the files here.
  ModelOptions opt = fp32_all(false);
  opt.trainable = TrainableSpec::nothing();
  const Qwen3Model m = Qwen3Model::load(cfg, DatReader(src), opt);
  for (HfFormat f : {HfFormat::kModelOpt, HfFormat::kCompressedTensors}) {
    SCOPED_TRACE(hf_format_name(f));
    const bool ct = f == HfFormat::kCompressedTensors;
    const fs::path out = dir_ / hf_format_name(f);
    HfExportOptions eo;
    eo.format = f;
    eo.max_shard_bytes = 100000;  // experts spread over several shards
    const HfExportReport rep = export_hf(DatReader(src), config, out.string(), eo);
    EXPECT_GT(rep.shards.size(), 1u);
    const SafetensorsModel st(out.string());
    const std::string q = ct ? ".weight_packed" : ".weight";
    EXPECT_FALSE(st.find("model.layers.0.mlp.experts.gate_proj" + q));
    for (int e = 0; e < 8; ++e) {
      const std::string m0 = "model.layers.2.mlp.experts." + std::to_string(e) + ".down_proj";
      const auto w = st.find(m0 + q);
      ASSERT_TRUE(w) << m0;
      EXPECT_EQ(w->tensor->shape, (std::vector<int64_t>{64, 16}));
      EXPECT_TRUE(st.find(m0 + (ct ? ".weight_global_scale" : ".weight_scale_2")));
    }
    EXPECT_FALSE(st.find("model.layers.0.mlp.experts.8.up_proj" + q));
    // Exported expert bytes are the .dat's rows of the stacked pair.
    const DatReader d(src);
    const auto pair = d.load_nvfp4(*d.find_nvfp4("model.layers.0.mlp.experts.up_proj.weight"));
    const auto r5 = st.at("model.layers.0.mlp.experts.5.up_proj" + q);
    EXPECT_TRUE(at::equal(r5.file->load(*r5.tensor), pair.qdata.slice(0, 5 * 32, 6 * 32)));
    // The router stays raw (the .dat's fp16), and the quantization config excludes it.
    EXPECT_EQ(st.at("model.layers.0.mlp.gate.weight").tensor->dtype, StDtype::kF16);
    const json qc = read_json(out / "config.json")["quantization_config"];
    if (ct) {
      const json ig = qc["ignore"];
      EXPECT_NE(std::find(ig.begin(), ig.end(), "re:.*mlp.gate$"), ig.end()) << ig.dump();
      EXPECT_NE(std::find(ig.begin(), ig.end(), "lm_head"), ig.end()) << ig.dump();
    } else {
      const json ex = read_json(out / "hf_quant_config.json")["quantization"]["exclude_modules"];
      for (const char* r : {"lm_head", "model.layers.0.mlp.gate", "model.layers.2.mlp.gate"}) {
        EXPECT_NE(std::find(ex.begin(), ex.end(), r), ex.end()) << r << " " << ex.dump();
      }
      EXPECT_EQ(std::find(ex.begin(), ex.end(), "model.layers.1.mlp.gate"), ex.end());
    }
    EXPECT_EQ(read_json(out / "config.json")["num_experts"], 8);
    // Import: byte-identical to the source.
    const std::string back = path(std::string("back_") + hf_format_name(f) + ".dat");
    const HfImportReport irep = import_hf(out.string(), back);
    EXPECT_TRUE(irep.ignored.empty());
    EXPECT_EQ(irep.copied_nvfp4, 4 * 3 + 3 * 3 + 1);  // lm_head from the sidecar
    EXPECT_EQ(q4::test::read_text(src), q4::test::read_text(back)) << "not byte-identical";
    // A model loaded from the folder computes the source model's forward weights.
    const Qwen3Model h = load_dat_or_hf(cfg, out.string(), opt);
    for (const auto& d : m.compare_forward_weights(DatReader(back))) ADD_FAILURE() << d;
    for (const auto& d : h.compare_forward_weights(DatReader(src))) ADD_FAILURE() << d;
  }
}

TEST_F(MoeInteropTest, Bf16ExportIsTheDequantizedExperts) {
  const std::string src = init_dat("src.dat", "4");
  HfExportOptions opt;
  opt.format = HfFormat::kBf16;
  const fs::path out = dir_ / "bf16";
  export_hf(DatReader(src), read_json(kMoeConfig), out.string(), opt);
  const SafetensorsModel st(out.string());
  const DatReader d(src);
  const auto pair = d.load_nvfp4(*d.find_nvfp4("model.layers.2.mlp.experts.gate_proj.weight"));
  const at::Tensor all = q4::quant::dequantize_nvfp4(pair.qdata, pair.scale, at::kBFloat16);
  for (int e = 0; e < 8; ++e) {
    const auto r = st.at("model.layers.2.mlp.experts." + std::to_string(e) + ".gate_proj.weight");
    EXPECT_TRUE(at::equal(r.file->load(*r.tensor), all.slice(0, e * 32, (e + 1) * 32))) << e;
  }
  // The dense import of it keeps the stacked experts dense (bf16), expert e at its rows.
  import_hf(out.string(), path("dense.dat"), HfImportOptions{true});
  const DatReader b(path("dense.dat"));
  EXPECT_TRUE(at::equal(b.load("model.layers.2.mlp.experts.gate_proj.weight"), all));
}

TEST_F(MoeInteropTest, ModeloptGlobalScaleFoldsPerExpert) {
  const std::string src = init_dat("src.dat", "5");
  const fs::path out = dir_ / "mo";
  export_hf(DatReader(src), read_json(kMoeConfig), out.string(), {});
  // Expert 3 of layer 0's gate_proj gets global scale 2: only its rows' block scales double.
  const std::string g = "model.layers.0.mlp.experts.3.gate_proj.weight_scale_2";
  const fs::path shard = out / "model.safetensors";
  {
    const SafetensorsFile in(shard.string());
    std::vector<SafetensorsWriter::Decl> decls;
    for (const auto& t : in.tensors()) decls.push_back({t.name, t.dtype, t.shape});
    std::vector<at::Tensor> data;
    for (const auto& t : in.tensors())
      data.push_back(t.name == g ? at::full(t.shape, 2.0f) : in.load(t));
    SafetensorsWriter w(shard.string(), decls, in.metadata());
    for (const auto& x : data) w.append(x);
    w.commit();
  }
  const HfImportReport rep = import_hf(out.string(), path("f.dat"));
  EXPECT_EQ(rep.folded_nvfp4, 1);
  const DatReader a(src), b(path("f.dat"));
  const std::string n = "model.layers.0.mlp.experts.gate_proj.weight";
  const auto pa = a.load_nvfp4(*a.find_nvfp4(n)), pb = b.load_nvfp4(*b.find_nvfp4(n));
  EXPECT_TRUE(at::equal(pa.qdata, pb.qdata));
  const at::Tensor sa = q4::quant::e4m3_decode(pa.scale), sb = q4::quant::e4m3_decode(pb.scale);
  EXPECT_TRUE(at::equal(sb.slice(0, 0, 96), sa.slice(0, 0, 96)));
  EXPECT_TRUE(at::equal(sb.slice(0, 128), sa.slice(0, 128)));
  const at::Tensor want = (sa.slice(0, 96, 128) * 2).clamp_max(448);
  EXPECT_TRUE(
      at::equal(sb.slice(0, 96, 128), q4::quant::e4m3_decode(q4::quant::e4m3_encode(want))));
}

TEST_F(MoeInteropTest, MissingExpertIsRefusedNamingIt) {
  const std::string bad = "model.layers.0.mlp.experts.5.up_proj.weight";
  const std::string err = import_error(edited_folder("missing", dropping(bad)));
  EXPECT_NE(err.find("missing tensor '" + bad + "' (expert 5 of 8"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, MisshapenExpertIsRefusedNamingIt) {
  const std::string bad = "model.layers.2.mlp.experts.3.gate_proj.weight";
  const std::string err =
      import_error(edited_folder("shape", [&](const std::string& n, const at::Tensor& t) {
        return n == bad ? Edit{{n, t.slice(0, 0, 31)}} : keep(n, t);
      }));
  EXPECT_NE(err.find("'" + bad + "': shape [31, 64], expected [32, 64]"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, ExpertPastNumExpertsIsRefusedNamingIt) {
  const std::string bad = "model.layers.0.mlp.experts.8.down_proj.weight";
  const std::string err = import_error(edited_folder("extra", keep, {{bad, at::zeros({64, 32})}}));
  EXPECT_NE(err.find("'" + bad + "': expert 8, but"), std::string::npos) << err;
  EXPECT_NE(err.find("num_experts 8"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, ExpertsOfADenseLayerAreRefusedNamingThem) {
  const std::string bad = "model.layers.1.mlp.experts.0.down_proj.weight";
  const std::string err = import_error(edited_folder("dense", keep, {{bad, at::zeros({64, 32})}}));
  EXPECT_NE(err.find("'" + bad + "': layer 1 is dense"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, FusedExpertLayoutIsRefusedNamingIt) {
  const std::string bad = "model.layers.0.mlp.experts.gate_up_proj";
  const std::string err =
      import_error(edited_folder("fused", keep, {{bad, at::zeros({8, 64, 64})}}));
  EXPECT_NE(err.find("'" + bad + "': not a per-expert tensor"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, MissingRouterIsRefusedNamingIt) {
  const std::string bad = "model.layers.2.mlp.gate.weight";
  const std::string err = import_error(edited_folder("router", dropping(bad)));
  EXPECT_NE(err.find("missing tensor '" + bad + "' (shape [8, 64])"), std::string::npos) << err;
}

TEST_F(MoeInteropTest, InfoListsExpertsAndInitDrawsTheRouter) {
  const std::string src = init_dat("src.dat", "7");
  std::string out;
  ASSERT_EQ(q4dat("info " + src, &out), 0) << out;
  EXPECT_NE(
      line_of(out, "model.layers.0.mlp.experts.gate_proj.weight").find("[8 experts x 32, 64]"),
      std::string::npos)
      << out;
  EXPECT_NE(
      line_of(out, "model.layers.2.mlp.experts.down_proj.weight").find("[8 experts x 64, 32]"),
      std::string::npos)
      << out;
  EXPECT_NE(line_of(out, "model.layers.1.mlp.gate_proj.weight").find("  [192, 64]"),
            std::string::npos)
      << out;
  ASSERT_EQ(q4dat("info " + src + " --config " + kMoeConfig, &out), 0) << out;
  EXPECT_NE(out.find("MoE: 8 experts, top-2, 2 of 3 layers sparse (0, 2)"), std::string::npos)
      << out;
  ASSERT_EQ(q4dat("info " + src + " --json --config " + kMoeConfig, &out), 0) << out;
  const json j = json::parse(out);
  EXPECT_EQ(j["moe"]["num_experts"], 8);
  EXPECT_EQ(j["moe"]["sparse_layers"], json({0, 2}));
  int stacked = 0;
  for (const auto& p : j["nvfp4"]) {
    const bool experts = p["name"].get<std::string>().find(".mlp.experts.") != std::string::npos;
    EXPECT_EQ(p.contains("experts"), experts) << p.dump();
    if (experts) {
      EXPECT_EQ(p["experts"], 8);
      ++stacked;
    }
  }
  EXPECT_EQ(stacked, 6);
  // The router: fp16 (E, H), ~N(0, std 0.02); 512 draws.
  const DatReader d(src);
  const DatEntry* r = d.find("model.layers.0.mlp.gate.weight");
  ASSERT_NE(r, nullptr);
  EXPECT_EQ(r->type, ElemType::kFloat16);
  EXPECT_EQ(r->shape, (std::vector<int64_t>{8, 64}));
  const at::Tensor x = d.load(*r).to(at::kFloat);
  EXPECT_LT(std::abs(x.mean().item<double>()), 0.004);
  EXPECT_NEAR(x.std().item<double>(), 0.02, 0.003);
}

}  // namespace
}  // namespace q4::model::moe_interop
