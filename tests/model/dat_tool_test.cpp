// q4dat end to end: runs the built tool (Q4_BIN_DIR/q4dat; test_model depends on it) on files
// generated here, and checks its output files against references: the scalar NVFP4 reference
// (quantize_nvfp4_ref / dequantize_nvfp4_ref) for converted entries, raw source bytes for copied
// ones, the tiny fixture's layout for init, and DatReader for info --json. Exit codes: 0 ok,
// 1 runtime failure or "files differ" (diff), 2 usage / bad input.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/io/dat_file.h"
#include "q4/model/qwen3_config.h"
#include "q4/quant/nvfp4.h"
#include "qwen3_check.h"
#include "temp_dir.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

using io::DatEntry;
using io::DatReader;
using io::DatWriter;
using io::ElemType;

const std::string kTool = std::string(Q4_BIN_DIR) + "/q4dat";

struct ToolRun {
  int code;
  std::string out, err;
};

std::string slurp(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class DatToolTest : public ::testing::Test {
 protected:
  void SetUp() override {
    struct stat st;
    if (::stat(kTool.c_str(), &st) != 0) GTEST_SKIP() << kTool << " not built";
    tmp_ = std::make_unique<test::ScopedTempDir>("q4_dattool_");
    ASSERT_TRUE(tmp_->ok());
    dir_ = tmp_->dir();
  }
  void TearDown() override { tmp_.reset(); }  // also removes the captured stdout/stderr
  // The directory's files other than the captured stdout/stderr of the tool.
  std::vector<std::string> list_dir() const {
    std::vector<std::string> out;
    for (const std::string& n : tmp_->list()) {
      if (n != "stdout" && n != "stderr") out.push_back(n);
    }
    return out;
  }
  std::string path(const std::string& n) const { return dir_ + "/" + n; }
  std::unique_ptr<test::ScopedTempDir> tmp_;
  bool exists(const std::string& n) const {
    struct stat st;
    return ::stat(path(n).c_str(), &st) == 0;
  }

  ToolRun q4dat(const std::string& args) {
    const std::string cmd = kTool + " " + args + " > " + path("stdout") + " 2> " + path("stderr");
    const int status = std::system(cmd.c_str());
    ToolRun r;
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    r.out = slurp(path("stdout"));
    r.err = slurp(path("stderr"));
    std::remove(path("stdout").c_str());
    std::remove(path("stderr").c_str());
    return r;
  }

  std::string dir_;
};

std::vector<uint8_t> payload(const DatReader& r, const DatEntry& e) {
  std::vector<uint8_t> b(e.nbytes);
  r.read_bytes(e, b.data());
  return b;
}

std::vector<uint8_t> header(const DatReader& r, const DatEntry& e) {
  std::vector<uint8_t> b(e.offset - e.header_offset);
  r.read_range(e.header_offset, b.size(), b.data());
  return b;
}

// One error line on stderr, nothing else.
void expect_one_line_error(const ToolRun& r, const std::string& needle) {
  EXPECT_EQ(r.err.find("q4dat: error: "), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << r.err;
  EXPECT_NE(r.err.find(needle), std::string::npos) << needle << " / " << r.err;
}

TEST_F(DatToolTest, InfoJsonMatchesTheIndex) {
  const std::string f = kFixtures + "/qwen3_tiny.weights.dat";
  const ToolRun r = q4dat("info " + f + " --json");
  ASSERT_EQ(r.code, 0) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  const DatReader dat(f);
  ASSERT_EQ(j["num_entries"], dat.entries().size());
  EXPECT_EQ(j["file_size_bytes"], dat.file_size_bytes());
  uint64_t payload_bytes = 0;
  for (size_t i = 0; i < dat.entries().size(); ++i) {
    const DatEntry& e = dat.entries()[i];
    const nlohmann::json& je = j["entries"][i];
    EXPECT_EQ(je["key"], e.key);
    EXPECT_EQ(je["type_code"], static_cast<uint32_t>(e.type));
    EXPECT_EQ(je["shape"].get<std::vector<int64_t>>(), e.shape);
    EXPECT_EQ(je["bytes"], e.nbytes);
    EXPECT_EQ(je["offset"], e.offset);
    payload_bytes += e.nbytes;
  }
  const Qwen3Config cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_tiny.config.json");
  // 7 linears per layer + lm_head, each (qdata + scale): 4 + 0.5 bits per parameter.
  EXPECT_EQ(j["nvfp4"].size(), 7u * cfg.num_hidden_layers + 1);
  for (const auto& p : j["nvfp4"]) EXPECT_DOUBLE_EQ(p["bits_per_param"].get<double>(), 4.5);
  EXPECT_EQ(j["nvfp4"][0]["name"], "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ(j["nvfp4"][0]["rows"], 64);
  EXPECT_EQ(j["nvfp4"][0]["cols"], 64);
  const auto& t = j["totals"];
  EXPECT_EQ(t["payload_bytes"], payload_bytes);
  EXPECT_EQ(t["header_bytes"], dat.file_size_bytes() - payload_bytes);
  EXPECT_EQ(t["nvfp4_parameters"], cfg.num_linear_parameters(true));
  EXPECT_EQ(t["parameters"], cfg.num_parameters(true));
  EXPECT_DOUBLE_EQ(t["nvfp4_bits_per_param"].get<double>(), 4.5);
  // fp16: embedding, 4 norms per layer, final norm.
  EXPECT_EQ(t["by_type"]["fp16"]["entries"], 2 + 4 * cfg.num_hidden_layers);

  const ToolRun text = q4dat("info " + f);
  ASSERT_EQ(text.code, 0);
  EXPECT_NE(text.out.find("lm_head.weight.scale"), std::string::npos);
  EXPECT_NE(text.out.find("4.500 bits/param"), std::string::npos);
}

// A float model file: two quantizable matrices (fp32, bf16), a matrix left dense, and entries
// of other types that must be copied byte-exactly.
struct Sample {
  at::Tensor x, y, z, emb, ids, mask;
};

Sample write_sample(const std::string& p) {
  at::manual_seed(7);
  Sample s;
  s.emb = (at::randn({8, 32}) * 0.1).to(at::kHalf);
  s.x = at::randn({48, 64}) * 0.02;
  s.x.index_put_({0, 0}, 0.3f);  // one outlier block
  s.y = (at::randn({16, 32}) * 3).to(at::kBFloat16);
  s.z = at::randn({4, 32});
  s.ids = at::arange(5, at::TensorOptions().dtype(at::kInt));
  s.mask = at::tensor({1, 0, 1}, at::TensorOptions().dtype(at::kByte)).to(at::kBool);
  DatWriter w(p, 6);
  w.add("model.embed_tokens.weight", s.emb);
  w.add("x.weight", s.x);
  w.add("y.weight", s.y);
  w.add("ids", s.ids);
  w.add("mask", s.mask);
  w.add("z.bias", s.z);
  w.commit();
  return s;
}

TEST_F(DatToolTest, QuantizeMatchesReferenceAndCopiesTheRest) {
  const Sample s = write_sample(path("in.dat"));
  const ToolRun r =
      q4dat("quantize " + path("in.dat") + " " + path("q.dat") + " --match '\\.weight$'");
  // embed also ends in .weight: fp16 [8, 32] is a 2-D float matrix with 32 % 16 == 0.
  ASSERT_EQ(r.code, 0) << r.err;
  const DatReader in(path("in.dat"));
  const DatReader q(path("q.dat"));
  const std::vector<std::string> keys = {"model.embed_tokens.weight.qdata",
                                         "model.embed_tokens.weight.scale",
                                         "x.weight.qdata",
                                         "x.weight.scale",
                                         "y.weight.qdata",
                                         "y.weight.scale",
                                         "ids",
                                         "mask",
                                         "z.bias"};
  ASSERT_EQ(q.entries().size(), keys.size());
  for (size_t i = 0; i < keys.size(); ++i) EXPECT_EQ(q.entries()[i].key, keys[i]);
  for (const auto& [name, t] : std::vector<std::pair<std::string, at::Tensor>>{
           {"model.embed_tokens.weight", s.emb}, {"x.weight", s.x}, {"y.weight", s.y}}) {
    const quant::Nvfp4Tensor ref = quant::quantize_nvfp4_ref(t);
    const DatEntry& qd = q.at(name + ".qdata");
    const DatEntry& sc = q.at(name + ".scale");
    EXPECT_EQ(qd.type, ElemType::kUInt8);  // default --qdata-elem 0
    EXPECT_EQ(sc.type, ElemType::kE4M3Scale);
    EXPECT_EQ(qd.shape, (std::vector<int64_t>{t.size(0), t.size(1) / 2}));
    EXPECT_EQ(sc.shape, (std::vector<int64_t>{t.size(0), t.size(1) / 16}));
    EXPECT_TRUE(at::equal(q.load(qd), ref.qdata)) << name;
    EXPECT_TRUE(at::equal(q.load(sc), ref.scale)) << name;
  }
  for (const char* k : {"ids", "mask", "z.bias"}) {
    EXPECT_EQ(header(q, q.at(k)), header(in, in.at(k))) << k;
    EXPECT_EQ(payload(q, q.at(k)), payload(in, in.at(k))) << k;
  }
  // --qdata-elem 100 writes e2m1-typed qdata with the same bytes.
  const ToolRun r100 = q4dat("quantize " + path("in.dat") + " " + path("q100.dat") +
                             " --match '^x\\.' --qdata-elem 100");
  ASSERT_EQ(r100.code, 0) << r100.err;
  const DatReader q100(path("q100.dat"));
  EXPECT_EQ(q100.at("x.weight.qdata").type, ElemType::kE2M1Packed);
  EXPECT_EQ(payload(q100, q100.at("x.weight.qdata")), payload(q, q.at("x.weight.qdata")));
  EXPECT_EQ(payload(q100, q100.at("y.weight")), payload(in, in.at("y.weight")));
}

TEST_F(DatToolTest, QuantizeDequantizeDiffWithinTheNvfp4Error) {
  const Sample s = write_sample(path("in.dat"));
  ASSERT_EQ(q4dat("quantize " + path("in.dat") + " " + path("q.dat") + " --match '^x\\.'").code, 0);
  const ToolRun d = q4dat("dequantize " + path("q.dat") + " " + path("d.dat") + " --dtype fp32");
  ASSERT_EQ(d.code, 0) << d.err;
  const DatReader in(path("in.dat"));
  const DatReader out(path("d.dat"));
  ASSERT_EQ(out.entries().size(), in.entries().size());
  for (size_t i = 0; i < in.entries().size(); ++i) {
    EXPECT_EQ(out.entries()[i].key, in.entries()[i].key);
  }
  const quant::Nvfp4Tensor ref = quant::quantize_nvfp4_ref(s.x);
  const at::Tensor deq = quant::dequantize_nvfp4_ref(ref.qdata, ref.scale);  // (48, 64) fp32
  EXPECT_TRUE(at::equal(out.load("x.weight"), deq));
  // The reference's own error; NVFP4 bounds it per block by one scale step (amax / 6, with
  // E4M3 rounding of the scale: x 1.07).
  const double err = (deq - s.x).abs().max().item<double>();
  const at::Tensor amax = s.x.abs().reshape({48, 4, 16}).amax(-1);
  EXPECT_LE(err, (amax / 6 * 1.07).max().item<double>());
  EXPECT_GT(err, 0.0);
  char tol[64];
  std::snprintf(tol, sizeof(tol), "%.9g", err * 1.0001);
  const ToolRun ok = q4dat("diff " + path("in.dat") + " " + path("d.dat") + " --atol " + tol);
  EXPECT_EQ(ok.code, 0) << ok.out;
  EXPECT_NE(ok.out.find("within    x.weight"), std::string::npos) << ok.out;
  std::snprintf(tol, sizeof(tol), "%.9g", err * 0.5);
  const ToolRun bad = q4dat("diff " + path("in.dat") + " " + path("d.dat") + " --atol " + tol);
  EXPECT_EQ(bad.code, 1) << bad.out;
  EXPECT_NE(bad.out.find("differs   x.weight"), std::string::npos) << bad.out;

  // bf16 output: the dense entry is the bf16 rounding of the same values.
  ASSERT_EQ(q4dat("dequantize " + path("q.dat") + " " + path("b.dat") + " --dtype bf16").code, 0);
  EXPECT_TRUE(at::equal(DatReader(path("b.dat")).load("x.weight"), deq.to(at::kBFloat16)));
}

TEST_F(DatToolTest, QuantizeRejectsBadTargetsAndWritesNothing) {
  write_sample(path("in.dat"));
  const std::string out = path("q.dat");
  struct Case {
    std::string match, needle;
  };
  for (const Case& c : std::vector<Case>{{"ids", "'ids'"},         // int32, 1-D
                                         {"^(x|mask)", "'mask'"},  // x is fine, mask bool
                                         {"nothing-matches", "matches no entry"},
                                         {"((", "invalid regular expression"}}) {
    const ToolRun r =
        q4dat("quantize " + path("in.dat") + " " + out + " --match '" + c.match + "'");
    EXPECT_EQ(r.code, 2) << c.match << ": " << r.err;
    expect_one_line_error(r, c.needle);
    EXPECT_EQ(list_dir(), std::vector<std::string>{"in.dat"}) << c.match;
  }
  // A matrix whose column count is not a multiple of 16, next to a valid match: nothing written.
  {
    DatWriter w(path("odd.dat"), 2);
    w.add("a.weight", at::randn({4, 32}));
    w.add("b.weight", at::randn({4, 24}));
    w.commit();
  }
  ToolRun r = q4dat("quantize " + path("odd.dat") + " " + out + " --match weight");
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "'b.weight'");
  EXPECT_FALSE(exists("q.dat"));
  // NaN weights are bad input: exit 2, nothing written, a pre-existing output untouched even
  // with --overwrite.
  {
    std::ofstream(out) << "keep";
    at::Tensor n = at::randn({4, 32});
    n.index_put_({2, 5}, std::nanf(""));
    DatWriter w(path("nan.dat"), 1);
    w.add("n.weight", n);
    w.commit();
  }
  r = q4dat("quantize " + path("nan.dat") + " " + out + " --match weight --overwrite");
  EXPECT_EQ(r.code, 2) << r.err;
  expect_one_line_error(r, "n.weight");
  EXPECT_EQ(slurp(out), "keep");
  EXPECT_EQ(list_dir(), (std::vector<std::string>{"in.dat", "nan.dat", "odd.dat", "q.dat"}));
  // Usage errors and corrupt input: exit 2. An unwritable output directory: runtime, exit 1.
  EXPECT_EQ(q4dat("quantize " + path("in.dat")).code, 2);
  EXPECT_EQ(q4dat("frobnicate").code, 2);
  std::ofstream(path("corrupt.dat")) << "\x05garbage";
  r = q4dat("info " + path("corrupt.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "corrupt.dat: entry 0");
  r = q4dat("quantize " + path("in.dat") + " " + path("no/such/dir/q.dat") + " --match '^x\\.'");
  EXPECT_EQ(r.code, 1) << r.err;
  expect_one_line_error(r, "no/such/dir");
}

// No sub-command replaces a file it was not told to: an existing OUT needs --overwrite, OUT
// may not be the input, and only regular files are written (a FIFO is refused, not opened).
TEST_F(DatToolTest, OutputsNeverReplaceAFileUnlessTold) {
  write_sample(path("in.dat"));
  const std::string in_bytes = slurp(path("in.dat"));
  ASSERT_EQ(q4dat("quantize " + path("in.dat") + " " + path("q.dat") + " --match '^x\\.'").code, 0);
  const std::string q_bytes = slurp(path("q.dat"));
  std::ofstream(path("user.dat")) << "the user's file";
  ToolRun r = q4dat("dequantize " + path("q.dat") + " " + path("user.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "--overwrite");
  EXPECT_EQ(slurp(path("user.dat")), "the user's file");
  r = q4dat("quantize " + path("in.dat") + " " + path("q.dat") + " --match '^y\\.'");
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "already exists");
  EXPECT_EQ(slurp(path("q.dat")), q_bytes);
  // The input as the output, even with --overwrite, and through another spelling of the path.
  r = q4dat("quantize " + path("in.dat") + " " + dir_ + "/./in.dat --match '^x\\.' --overwrite");
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "is also the input");
  EXPECT_EQ(slurp(path("in.dat")), in_bytes);
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0644), 0);
  r = q4dat("dequantize " + path("q.dat") + " " + path("fifo") + " --overwrite");
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "not a regular file");
  r = q4dat("init --config " + kFixtures + "/qwen3_tiny.config.json --out " + path("user.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "--out");
  EXPECT_EQ(slurp(path("user.dat")), "the user's file");
  // Told to: replaced.
  r = q4dat("dequantize " + path("q.dat") + " " + path("user.dat") + " --overwrite");
  EXPECT_EQ(r.code, 0) << r.err;
  EXPECT_NE(slurp(path("user.dat")), "the user's file");
  std::remove(path("fifo").c_str());
}

// A FIFO given as an input was opened and waited on forever (no writer): refused at once.
TEST_F(DatToolTest, InputFifosAreRefusedWithoutBlocking) {
  ASSERT_EQ(::mkfifo(path("fifo").c_str(), 0644), 0);
  ToolRun r = q4dat("info " + path("fifo"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "not a regular file");
  r = q4dat("init --config " + path("fifo") + " --out " + path("o.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "expected a regular file");
  r = q4dat("export-hf " + kFixtures + "/qwen3_tiny.weights.dat " + path("hf") + " --config " +
            path("fifo"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "expected a regular file");
  std::remove(path("fifo").c_str());
}

TEST_F(DatToolTest, DequantizeRejectsBrokenPairs) {
  {
    DatWriter w(path("orphan.dat"), 2);
    w.add("a.weight.scale", at::zeros({4, 2}, at::TensorOptions().dtype(at::kByte)),
          ElemType::kE4M3Scale);
    w.add("b", at::zeros({3}));
    w.commit();
  }
  ToolRun r = q4dat("dequantize " + path("orphan.dat") + " " + path("o.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "'a.weight.scale'");
  {
    DatWriter w(path("shape.dat"), 2);
    w.add("a.qdata", at::zeros({4, 16}, at::TensorOptions().dtype(at::kByte)),
          ElemType::kE2M1Packed);
    w.add("a.scale", at::zeros({4, 3}, at::TensorOptions().dtype(at::kByte)), ElemType::kE4M3Scale);
    w.commit();
  }
  r = q4dat("dequantize " + path("shape.dat") + " " + path("o.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "inconsistent");
  r = q4dat("dequantize " + path("orphan.dat") + " " + path("o.dat") + " --dtype fp64");
  EXPECT_EQ(r.code, 2);
  EXPECT_FALSE(exists("o.dat"));
}

TEST_F(DatToolTest, DiffExitCodes) {
  write_sample(path("a.dat"));
  const DatReader a(path("a.dat"));
  // Same content, one value changed, one entry dropped, two entries swapped.
  auto rewrite = [&](const std::string& name, auto&& body) {
    DatWriter w(path(name), body(nullptr));
    body(&w);
    w.commit();
  };
  rewrite("same.dat", [&](DatWriter* w) -> uint64_t {
    if (w)
      for (const DatEntry& e : a.entries()) w->copy_from(a, e);
    return a.entries().size();
  });
  rewrite("changed.dat", [&](DatWriter* w) -> uint64_t {
    if (w) {
      for (const DatEntry& e : a.entries()) {
        if (e.key == "z.bias") {
          at::Tensor z = a.load(e).clone();
          z.index_put_({1, 2}, z.index({1, 2}) + 0.125);
          w->add(e.key, z);
        } else {
          w->copy_from(a, e);
        }
      }
    }
    return a.entries().size();
  });
  rewrite("dropped.dat", [&](DatWriter* w) -> uint64_t {
    if (w)
      for (const DatEntry& e : a.entries())
        if (e.key != "ids") w->copy_from(a, e);
    return a.entries().size() - 1;
  });
  rewrite("swapped.dat", [&](DatWriter* w) -> uint64_t {
    if (w) {
      const auto& es = a.entries();
      for (size_t i = 0; i < es.size(); ++i) w->copy_from(a, es[i < 2 ? 1 - i : i]);
    }
    return a.entries().size();
  });
  EXPECT_EQ(q4dat("diff " + path("a.dat") + " " + path("same.dat")).code, 0);
  ToolRun r = q4dat("diff " + path("a.dat") + " " + path("changed.dat"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("differs   z.bias  max_abs_diff=0.125"), std::string::npos) << r.out;
  EXPECT_EQ(q4dat("diff " + path("a.dat") + " " + path("changed.dat") + " --atol 0.125").code, 0);
  EXPECT_EQ(q4dat("diff " + path("a.dat") + " " + path("changed.dat") + " --atol 0.12").code, 1);
  r = q4dat("diff " + path("a.dat") + " " + path("dropped.dat"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("only-A    ids"), std::string::npos) << r.out;
  r = q4dat("diff " + path("dropped.dat") + " " + path("a.dat"));
  EXPECT_NE(r.out.find("only-B    ids"), std::string::npos) << r.out;
  r = q4dat("diff " + path("a.dat") + " " + path("swapped.dat"));
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("different order"), std::string::npos) << r.out;
  r = q4dat("diff " + path("a.dat") + " " + path("missing.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "missing.dat");
  EXPECT_EQ(q4dat("diff " + path("a.dat")).code, 2);
  // A file with NVFP4 pairs against itself.
  const ToolRun q = q4dat("diff " + kFixtures + "/qwen3_tiny.weights.dat " + kFixtures +
                          "/qwen3_tiny.weights.dat");
  EXPECT_EQ(q.code, 0);
}

TEST_F(DatToolTest, NegativeZeroCodesCompareEqualByValue) {
  const at::Tensor scale = at::full({2, 2}, 0x38, at::TensorOptions().dtype(at::kByte));
  at::Tensor q1 = at::zeros({2, 16}, at::TensorOptions().dtype(at::kByte));
  at::Tensor q2 = q1.clone();
  q2.index_put_({1, 3}, 0x80);  // high nibble code 8: -0
  for (const auto& [name, qd] :
       {std::pair<std::string, at::Tensor>{"p1.dat", q1}, {"p2.dat", q2}}) {
    DatWriter w(path(name), 2);
    w.add("w.qdata", qd, ElemType::kE2M1Packed);
    w.add("w.scale", scale, ElemType::kE4M3Scale);
    w.commit();
  }
  const ToolRun r = q4dat("diff " + path("p1.dat") + " " + path("p2.dat"));
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("within    w.qdata  1 of 32 bytes differ"), std::string::npos) << r.out;
  q2.index_put_({1, 3}, 0x10);  // code 1: 0.5 * scale(1.0)
  {
    DatWriter w(path("p3.dat"), 2);
    w.add("w.qdata", q2, ElemType::kE2M1Packed);
    w.add("w.scale", scale, ElemType::kE4M3Scale);
    w.commit();
  }
  const ToolRun r3 = q4dat("diff " + path("p1.dat") + " " + path("p3.dat"));
  EXPECT_EQ(r3.code, 1);
  EXPECT_NE(r3.out.find("max_abs_diff=0.5"), std::string::npos) << r3.out;
}

TEST_F(DatToolTest, InitWritesTheShippedLayout) {
  const std::string cfg = kFixtures + "/qwen3_tiny.config.json";
  ToolRun r = q4dat("init --config " + cfg + " --out " + path("m.dat") + " --seed 11");
  ASSERT_EQ(r.code, 0) << r.err;
  const DatReader fixture(kFixtures + "/qwen3_tiny.weights.dat");
  const DatReader m(path("m.dat"));
  ASSERT_NO_FATAL_FAILURE(expect_same_entry_layout(m, fixture));
  EXPECT_EQ(m.file_size_bytes(), fixture.file_size_bytes());
  EXPECT_TRUE(at::equal(m.load("model.layers.1.self_attn.k_norm.weight"),
                        at::ones({16}, at::TensorOptions().dtype(at::kHalf))));
  EXPECT_TRUE(
      at::equal(m.load("model.norm.weight"), at::ones({64}, at::TensorOptions().dtype(at::kHalf))));
  // normal(0, 0.02): 24576 embedding values give the std within ~1%; allow 5%. Dequantized
  // NVFP4 adds ~10% relative noise in quadrature (+0.5% std); allow 5% there too.
  const double emb_std = m.load("model.embed_tokens.weight").to(at::kFloat).std().item<double>();
  EXPECT_NEAR(emb_std, 0.02, 0.001);
  const at::Tensor up =
      quant::dequantize_nvfp4_ref(m.load("model.layers.0.mlp.up_proj.weight.qdata"),
                                  m.load("model.layers.0.mlp.up_proj.weight.scale"));
  EXPECT_NEAR(up.std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(up.mean().item<double>(), 0.0, 0.001);  // 5.5 sigma of the sample mean
  // Seeded: same seed, same bytes; another seed, other weights; --std scales.
  ASSERT_EQ(q4dat("init --config " + cfg + " --out " + path("m2.dat") + " --seed 11").code, 0);
  EXPECT_EQ(slurp(path("m.dat")), slurp(path("m2.dat")));
  ASSERT_EQ(
      q4dat("init --config " + cfg + " --out " + path("m3.dat") + " --seed 12 --std 0.1").code, 0);
  const at::Tensor e3 = DatReader(path("m3.dat")).load("model.embed_tokens.weight").to(at::kFloat);
  EXPECT_NEAR(e3.std().item<double>(), 0.1, 0.005);
  // info on the result: 15 NVFP4 pairs at 4.5 bits.
  r = q4dat("info " + path("m.dat") + " --json");
  ASSERT_EQ(r.code, 0);
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["totals"]["nvfp4_pairs"], 15);
  EXPECT_DOUBLE_EQ(j["totals"]["nvfp4_bits_per_param"].get<double>(), 4.5);
}

TEST_F(DatToolTest, InitTiedVariants) {
  nlohmann::json c = nlohmann::json::parse(slurp(kFixtures + "/qwen3_tiny.config.json"));
  c["tie_word_embeddings"] = true;
  std::ofstream(path("tied.json")) << c.dump();
  // auto: shipped layout, lm_head stored quantized = quantized (fp16) embedding.
  ASSERT_EQ(q4dat("init --config " + path("tied.json") + " --out " + path("a.dat")).code, 0);
  const DatReader a(path("a.dat"));
  ASSERT_EQ(a.entries().size(), 40u);
  const quant::Nvfp4Tensor ref =
      quant::quantize_nvfp4_ref(a.load("model.embed_tokens.weight").to(at::kFloat));
  EXPECT_TRUE(at::equal(a.load("lm_head.weight.qdata"), ref.qdata));
  EXPECT_TRUE(at::equal(a.load("lm_head.weight.scale"), ref.scale));
  // yes: no lm_head entries.
  ASSERT_EQ(
      q4dat("init --config " + path("tied.json") + " --out " + path("y.dat") + " --tied yes").code,
      0);
  const DatReader y(path("y.dat"));
  EXPECT_EQ(y.entries().size(), 38u);
  EXPECT_EQ(y.find("lm_head.weight.qdata"), nullptr);
  // no: separate, independent lm_head.
  ASSERT_EQ(
      q4dat("init --config " + path("tied.json") + " --out " + path("n.dat") + " --tied no").code,
      0);
  const DatReader n(path("n.dat"));
  EXPECT_FALSE(at::equal(n.load("lm_head.weight.qdata"), ref.qdata));
  // yes contradicts an untied config; bad configs are input errors.
  ToolRun r = q4dat("init --config " + kFixtures + "/qwen3_tiny.config.json --out " +
                    path("x.dat") + " --tied yes");
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "tie_word_embeddings");
  c["hidden_size"] = 72;
  c["head_dim"] = 18;
  std::ofstream(path("odd.json")) << c.dump();
  r = q4dat("init --config " + path("odd.json") + " --out " + path("x.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "hidden_size = 72");
  c["rope_scaling"] = {{"type", "yarn"}};
  std::ofstream(path("yarn.json")) << c.dump();
  r = q4dat("init --config " + path("yarn.json") + " --out " + path("x.dat"));
  EXPECT_EQ(r.code, 2);
  expect_one_line_error(r, "rope_scaling");
  EXPECT_FALSE(exists("x.dat"));
}

}  // namespace
}  // namespace q4::model
