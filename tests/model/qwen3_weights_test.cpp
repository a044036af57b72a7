// The Qwen3 model's weight files against the HF transformers fixture (tests/fixtures/qwen3_tiny.*):
// frozen NVFP4 linears computing with the file's values, the tied-embedding and bf16-raw
// variants, load errors, trainable groups, padding and packing masks, gradient dtypes, export
// round trips and the streaming export check, and plain precision (fake_quant off) against HF's
// plain fixture. Tolerances as in qwen3_model_test.cpp.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/quant/nvfp4.h"
#include "q4/test/files.h"
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

// Copies `src` into `dst`, dropping keys for which drop(key) is true and transforming tensors
// with conv(key, tensor, &type) (return undefined to keep the entry byte-exact).
template <class Drop, class Conv>
void rewrite_dat(const std::string& src, const std::string& dst, Drop drop, Conv conv,
                 std::vector<std::pair<std::string, at::Tensor>> extra = {}) {
  DatReader r(src);
  uint64_t n = extra.size();
  for (const auto& e : r.entries()) n += drop(e.key) ? 0 : 1;
  DatWriter w(dst, n);
  for (const auto& e : r.entries()) {
    if (drop(e.key)) continue;
    ElemType t = e.type;
    at::Tensor c = conv(e.key, r.load(e), &t);
    if (c.defined()) {
      w.add(e.key, c, t);
    } else {
      w.copy_from(r, e);
    }
  }
  for (const auto& kv : extra) w.add(kv.first, kv.second);
  w.commit();
}

// A frozen NVFP4 linear computes with the file's own values, dequantize(file), bit for bit, also
// in blocks that quantizing those values again would move (docs/design.md#nvfp4-arithmetic):
// here a file whose codes never reach the largest magnitude (6), as another quantizer may write
// them, so re-quantization picks other scales. A trained linear starts from the same values.
TEST(Qwen3Model, FrozenLinearsComputeWithTheFilesValues) {
  const std::string path = temp_path("frozen_values.dat");
  auto none = [](const std::string&) { return false; };
  auto cap_codes = [](const std::string& key, const at::Tensor& t, ElemType*) {
    if (key.size() < 6 || key.compare(key.size() - 6, 6, ".qdata") != 0) return at::Tensor();
    auto cap = [](const at::Tensor& c) {  // magnitude codes above 5 (value 3) become 5
      return at::bitwise_or(at::bitwise_and(c, 8), at::clamp_max(at::bitwise_and(c, 7), 5));
    };
    const at::Tensor b = t.to(at::kInt);
    const at::Tensor lo = cap(at::bitwise_and(b, 15)), hi = cap(at::bitwise_right_shift(b, 4));
    return at::bitwise_or(lo, at::bitwise_left_shift(hi, 4)).to(at::kByte);
  };
  rewrite_dat(kWeights, path, none, cap_codes);
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = fp32_all();
  o.trainable = TrainableSpec::nothing();
  DatReader r(path);
  Qwen3Model frozen = Qwen3Model::load(cfg, r, o);
  Qwen3Model trained = Qwen3Model::load(cfg, r, fp32_all());
  int64_t moved = 0, checked = 0;
  for (const auto& p : frozen.parameters()) {
    if (!p.quantized) continue;
    const at::Tensor deq =
        q4::quant::dequantize_nvfp4(r.load(p.name + ".qdata"), r.load(p.name + ".scale"));
    EXPECT_TRUE(at::equal(p.master, deq)) << p.name;
    EXPECT_TRUE(at::equal(trained.parameter(p.name).master, deq)) << p.name;
    moved += at::ne(q4::quant::fake_quant_nvfp4_forward(deq), deq).sum().item<int64_t>();
    ++checked;
  }
  EXPECT_GT(checked, 0);
  EXPECT_GT(moved, 0) << "no block moves on re-quantization: the test cannot tell the rules apart";
  std::filesystem::remove(path);
}

TEST(Qwen3Model, TiedEmbeddingVariantMatchesUntiedRawHead) {
  // Tied: no lm_head in the file, tie_word_embeddings true. Reference: the same weights with an
  // explicit raw lm_head.weight = embed_tokens (untied). Logits must agree and the tied
  // embedding's gradient must be the sum of the untied embedding and lm_head gradients.
  const std::string tied_path = temp_path("tied.dat"), raw_path = temp_path("rawhead.dat");
  auto is_head = [](const std::string& k) { return k.rfind("lm_head.", 0) == 0; };
  auto keep = [](const std::string&, const at::Tensor&, ElemType*) { return at::Tensor(); };
  rewrite_dat(kWeights, tied_path, is_head, keep);
  DatReader w(kWeights);
  rewrite_dat(kWeights, raw_path, is_head, keep,
              {{"lm_head.weight", w.load("model.embed_tokens.weight")}});
  auto cfg = Qwen3Config::from_json_file(kConfig);
  auto cfg_tied = cfg;
  cfg_tied.tie_word_embeddings = true;

  DatReader rt(tied_path), rr(raw_path), e(kExpected);
  Qwen3Model tied = Qwen3Model::load(cfg_tied, rt, fp32_all());
  Qwen3Model untied = Qwen3Model::load(cfg, rr, fp32_all());
  EXPECT_TRUE(tied.tied());
  EXPECT_FALSE(untied.tied());
  EXPECT_FALSE(untied.parameter("lm_head.weight").quantized);
  EXPECT_EQ(tied.parameters().size(), untied.parameters().size() - 1);
  ModelInputs in = fixture_inputs(e);
  {
    at::NoGradGuard ng;
    EXPECT_CLOSE(tied.forward(in), untied.forward(in), 1e-6, 1e-6, "logits");
  }
  auto gt = run_backward(tied, in);
  auto gu = run_backward(untied, in);
  EXPECT_CLOSE(gt["model.embed_tokens.weight"],
               gu["model.embed_tokens.weight"] + gu["lm_head.weight"], 1e-5, 1e-7, "tied grad");
  EXPECT_CLOSE(gt["model.norm.weight"], gu["model.norm.weight"], 1e-5, 1e-7, "norm grad");

  // A file without lm_head under a config that says untied is an error naming the problem.
  try {
    Qwen3Model::load(cfg, rt, fp32_all());
    ADD_FAILURE() << "expected an error";
  } catch (const c10::Error& err) {
    EXPECT_NE(std::string(err.what()).find("tie_word_embeddings"), std::string::npos);
  }
  std::remove(tied_path.c_str());
  std::remove(raw_path.c_str());
}

TEST(Qwen3Model, Bf16RawWeightsVariantLoadsAndRuns) {
  const std::string path = temp_path("bf16raw.dat");
  auto none = [](const std::string&) { return false; };
  auto to_bf16 = [](const std::string&, const at::Tensor& t, ElemType* type) {
    if (*type != ElemType::kFloat16) return at::Tensor();
    *type = ElemType::kBFloat16;
    return t.to(at::kBFloat16);
  };
  rewrite_dat(kWeights, path, none, to_bf16);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader rb(path), r16(kWeights), e(kExpected);
  ModelOptions o = fp32_all();
  Qwen3Model mb = Qwen3Model::load(cfg, rb, o);
  Qwen3Model m16 = Qwen3Model::load(cfg, r16, o);
  // Masters hold the file's bf16 values exactly.
  EXPECT_TRUE(at::equal(mb.parameter("model.norm.weight").master,
                        rb.load("model.norm.weight").to(at::kFloat)));
  ModelInputs in = fixture_inputs(e);
  at::Tensor lb, l16;
  auto gb = run_backward(mb, in, &lb);
  run_backward(m16, in, &l16);
  // bf16 rounding of embeddings/norms (relative 2^-9) moves the loss by well under 1%.
  EXPECT_TRUE(std::isfinite(lb.item<double>()));
  EXPECT_CLOSE(lb, l16, 1e-2, 0.0, "loss bf16 vs fp16 weights");
  for (const auto& kv : gb) EXPECT_TRUE(kv.second.defined()) << kv.first;
  std::remove(path.c_str());
}

TEST(Qwen3Model, LoadErrorsNameKeyAndShapes) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  const std::string missing = temp_path("missing.dat"), bad = temp_path("badshape.dat");
  auto keep = [](const std::string&, const at::Tensor&, ElemType*) { return at::Tensor(); };
  rewrite_dat(
      kWeights, missing,
      [](const std::string& k) { return k == "model.layers.1.mlp.up_proj.weight.scale"; }, keep);
  rewrite_dat(
      kWeights, bad, [](const std::string&) { return false; },
      [](const std::string& k, const at::Tensor& t, ElemType*) {
        return k == "model.layers.0.self_attn.q_norm.weight" ? t.narrow(0, 0, 8).clone()
                                                             : at::Tensor();
      });
  auto expect_error = [&](const std::string& path, std::vector<std::string> needles) {
    DatReader r(path);
    try {
      Qwen3Model::load(cfg, r, ModelOptions{});
      ADD_FAILURE() << "expected an error for " << path;
    } catch (const c10::Error& err) {
      const std::string msg = err.what();
      for (const auto& n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
    }
  };
  expect_error(missing, {"model.layers.1.mlp.up_proj.weight", ".scale"});
  expect_error(bad, {"model.layers.0.self_attn.q_norm.weight", "[16]", "[8]"});
  std::remove(missing.c_str());
  std::remove(bad.c_str());
}

TEST(Qwen3Model, TrainableGroupsLimitGradients) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = fp32_all();
  o.trainable = TrainableSpec{};
  o.trainable.last_n_layers = 1;  // projections of layer 1 only
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  auto g = run_backward(m, fixture_inputs(e));
  int trainable = 0;
  for (const auto& p : m.parameters()) {
    const bool want =
        p.name.find("layers.1.") != std::string::npos && p.name.find("_proj.") != std::string::npos;
    EXPECT_EQ(p.trainable, want) << p.name;
    EXPECT_EQ(g[p.name].defined(), want) << p.name;
    trainable += want;
    if (!want) continue;
    // Frozen layers upstream do not change the gradient of a trainable one.
    EXPECT_CLOSE(g[p.name], e.load("grad." + p.name), 1e-3, 1e-5, p.name);
  }
  EXPECT_EQ(trainable, 7);
  EXPECT_EQ(m.trainable_parameters().size(), 7u);
  // Frozen quantized linears hold dequantize(file) in the compute dtype.
  const Parameter& q0 = m.parameter("model.layers.0.self_attn.q_proj.weight");
  EXPECT_FALSE(q0.trainable);
  EXPECT_EQ(q0.master.scalar_type(), at::kFloat);
  at::Tensor deq =
      q4::quant::dequantize_nvfp4(w.load("model.layers.0.self_attn.q_proj.weight.qdata"),
                                  w.load("model.layers.0.self_attn.q_proj.weight.scale"));
  EXPECT_TRUE(at::equal(q0.master, deq));

  ModelOptions o2 = fp32_all();
  o2.trainable = TrainableSpec::nothing();
  o2.trainable.layers = {0};
  o2.trainable.norms = true;
  Qwen3Model m2 = Qwen3Model::load(cfg, w, o2);
  std::vector<std::string> names;
  for (Parameter* p : m2.trainable_parameters()) names.push_back(p->name);
  EXPECT_EQ(names,
            (std::vector<std::string>{
                "model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight",
                "model.layers.0.input_layernorm.weight",
                "model.layers.0.post_attention_layernorm.weight", "model.norm.weight"}));
  ModelOptions bad = fp32_all();
  bad.trainable.layers = {2};
  EXPECT_THROW(Qwen3Model::load(cfg, w, bad), c10::Error);
}

TEST(Qwen3Model, PaddingAndPackingMasks) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = fp32_all();
  o.trainable = TrainableSpec::nothing();
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  at::NoGradGuard ng;
  at::Tensor ids = e.load("input_ids");  // (2, 24)
  at::Tensor a = ids[0].narrow(0, 0, 10).unsqueeze(0), b = ids[1].narrow(0, 0, 14).unsqueeze(0);
  ModelInputs ia, ib;
  ia.input_ids = a;
  ib.input_ids = b;
  at::Tensor la = m.forward(ia)[0], lb = m.forward(ib)[0];
  // Right padding: row 0 = a + 4 pads, row 1 = b.
  ModelInputs pad;
  pad.input_ids = at::zeros({2, 14}, at::kLong);
  pad.input_ids[0].narrow(0, 0, 10).copy_(a[0]);
  pad.input_ids[1].copy_(b[0]);
  pad.attention_mask = at::ones({2, 14}, at::kLong);
  pad.attention_mask[0].narrow(0, 10, 4).zero_();
  at::Tensor lp = m.forward(pad);
  EXPECT_CLOSE(lp[0].narrow(0, 0, 10), la, 1e-5, 1e-5, "padded row 0");
  EXPECT_CLOSE(lp[1], lb, 1e-5, 1e-5, "row 1");
  EXPECT_TRUE(at::isfinite(lp).all().item<bool>());
  // Packing: [a | b] in one row with segment ids 1/2 and positions restarting at 0.
  ModelInputs pk;
  pk.input_ids = at::cat({a, b}, 1);
  pk.segment_ids = at::cat({at::full({1, 10}, 1, at::kLong), at::full({1, 14}, 2, at::kLong)}, 1);
  pk.position_ids = at::cat({at::arange(10, at::kLong), at::arange(14, at::kLong)}).unsqueeze(0);
  at::Tensor lk = m.forward(pk)[0];
  EXPECT_CLOSE(lk.narrow(0, 0, 10), la, 1e-5, 1e-5, "packed segment 1");
  EXPECT_CLOSE(lk.narrow(0, 10, 14), lb, 1e-5, 1e-5, "packed segment 2");
}

TEST(Qwen3Model, GradDtypesAgainstFp32) {
  // Gradient storage dtypes on the fixture (masters fp32, compute fp32): bf16 storage keeps
  // every nonzero fp32 gradient nonzero and within bf16's relative rounding (2^-9, plus
  // accumulation of a few terms -> 1e-2 bound). Also at loss/4096 (the gradient scale of a
  // 4096-token mean): fp16 storage then flushes gradients to zero, bf16 does not.
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelInputs in = fixture_inputs(e);
  auto grads_for = [&](at::ScalarType gd, double scale) {
    ModelOptions o = fp32_all(false);
    o.grad_dtype = gd;
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    LossOutput lo = m.loss(in);
    (lo.loss * scale).backward();
    std::vector<at::Tensor> g;
    for (const auto& p : m.parameters()) g.push_back(p.grad.to(at::kFloat).reshape({-1}));
    return at::cat(g);
  };
  for (double scale : {1.0, 1.0 / 4096}) {
    at::Tensor ref = grads_for(at::kFloat, scale);
    at::Tensor bf = grads_for(at::kBFloat16, scale);
    at::Tensor hf = grads_for(at::kHalf, scale);
    const double ref_zero = ref.eq(0).to(at::kDouble).mean().item<double>();
    const double bf_zero = bf.eq(0).to(at::kDouble).mean().item<double>();
    const double hf_zero = hf.eq(0).to(at::kDouble).mean().item<double>();
    const double bf_rel = ((bf - ref).norm() / ref.norm()).item<double>();
    const double hf_rel = ((hf - ref).norm() / ref.norm()).item<double>();
    RecordProperty(
        "scale_" + std::to_string(scale) + "_zero_fp32_bf16_fp16",
        std::to_string(ref_zero) + " " + std::to_string(bf_zero) + " " + std::to_string(hf_zero));
    RecordProperty("scale_" + std::to_string(scale) + "_relerr_bf16_fp16",
                   std::to_string(bf_rel) + " " + std::to_string(hf_rel));
    EXPECT_EQ(bf_zero, ref_zero) << "scale " << scale;
    EXPECT_LT(bf_rel, 1e-2) << "scale " << scale;
    if (scale < 1.0) {
      EXPECT_GT(hf_zero, ref_zero) << "fp16 grads should underflow at this scale";
    }
  }
}

TEST(Qwen3Model, ExportUntrainedIsByteIdentical) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights);
  for (at::ScalarType md : {at::kHalf, at::kFloat}) {
    ModelOptions o = fp32_all();
    o.master_dtype = md;
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    const std::string out = temp_path("export_same.dat");
    m.export_to(w, out);
    EXPECT_EQ(q4::test::read_text(out), q4::test::read_text(kWeights)) << c10::toString(md);
    std::remove(out.c_str());
  }
}

TEST(Qwen3Model, ExportTrainedReloadsToSteWeights) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = fp32_all();
  o.master_dtype = at::kHalf;
  o.trainable = TrainableSpec::everything();
  o.trainable.last_n_layers = 1;  // layer 0 stays frozen: its entries must be copied
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  run_backward(m, fixture_inputs(e));
  {
    at::NoGradGuard ng;
    for (Parameter* p : m.trainable_parameters()) {
      // A large step so that most NVFP4 codes move (lr * sign(grad) of ~10% of the weight rms).
      const double rms = p->master.to(at::kFloat).pow(2).mean().sqrt().item<double>();
      p->master.sub_((p->grad.sign() * (0.1 * rms)).to(p->master.scalar_type()));
    }
  }
  const std::string out = temp_path("export_trained.dat");
  m.export_to(w, out);
  DatReader r(out);
  ASSERT_NO_FATAL_FAILURE(expect_same_entry_layout(r, w));
  for (size_t i = 0; i < r.entries().size(); ++i) {
    const DatEntry& a = r.entries()[i];
    if (a.key.find("layers.0.") != std::string::npos) {
      EXPECT_TRUE(at::equal(r.load(a), w.load(w.entries()[i]))) << a.key << " must be byte-exact";
    }
  }
  ModelOptions o2 = o;
  Qwen3Model re = Qwen3Model::load(cfg, r, o2);
  int changed = 0;
  for (Parameter* p : m.trainable_parameters()) {
    const Parameter& q = re.parameter(p->name);
    at::Tensor expect = p->quantized ? q4::quant::fake_quant_nvfp4_forward(p->master) : p->master;
    EXPECT_TRUE(at::equal(q.master, expect)) << p->name;
    changed += !at::equal(r.load(p->quantized ? p->name + ".qdata" : p->name),
                          w.load(p->quantized ? p->name + ".qdata" : p->name));
  }
  EXPECT_GT(changed, 5);
  std::remove(out.c_str());
}

// The streaming export check: after changing every trainable master (fp32 masters, so raw
// tensors must be rounded to the file's fp16), an export reproduces the trained forward weights:
// raw tensors exactly at their stored precision, NVFP4 linears exactly up to fake-quant's rare
// non-idempotent blocks; a tampered export is reported with its element count. With bf16
// compute a raw master is compared as the file holds it (rounded to fp16 once), not rounded to
// bf16 and then to fp16.
TEST(Qwen3Model, CompareForwardWeightsAfterExport) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights);
  for (const at::ScalarType cd : {at::kFloat, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(cd));
    ModelOptions opt = fp32_all();
    opt.compute_dtype = cd;
    Qwen3Model m = Qwen3Model::load(cfg, w, opt);
    at::Generator gen = at::detail::createCPUGenerator(17);
    {
      at::NoGradGuard ng;
      for (auto* p : m.trainable_parameters()) {
        p->master.add_(at::randn(p->master.sizes(), gen) * 1e-3);
      }
    }
    const std::string out = temp_path("compare_export.dat");
    m.export_to(w, out);
    const auto differ = m.compare_forward_weights(DatReader(out));
    int64_t quantized_differ = 0;
    for (const auto& d : differ) {
      const std::string name = d.substr(0, d.find(' '));
      const bool quantized = m.parameter(name).quantized;
      EXPECT_TRUE(quantized) << "raw tensor differs beyond its stored precision: " << d;
      quantized_differ += quantized;
    }
    EXPECT_LE(quantized_differ, 2) << "fake-quant re-application should move few tensors";
    // Row ranges of a few rows (every tensor split into many) give the same verdict.
    EXPECT_EQ(m.compare_forward_weights(DatReader(out), /*chunk_elems=*/100), differ);
    // An unrelated model (the untouched source) differs in every changed tensor.
    Qwen3Model fresh = Qwen3Model::load(cfg, w, opt);
    EXPECT_GE(fresh.compare_forward_weights(DatReader(out)).size(),
              m.trainable_parameters().size() / 2);
    std::remove(out.c_str());
  }
}

// Plain precision (fake_quant off): an NVFP4 linear computes with its master as it is. Reference:
// the same weights stored raw (fp32 entries, no NVFP4 pair), which load() never fake-quantizes.
// After a linear's master moves off the NVFP4 grid, the plain model's loss and gradients equal the
// raw model's bit for bit, and the straight-through model's loss differs (it rounds the master).
TEST(Qwen3Model, PlainPrecisionComputesWithTheMasters) {
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  const ModelInputs in = fixture_inputs(e);
  const std::string moved = "model.layers.1.mlp.down_proj.weight";
  const at::Tensor noise =
      at::randn({64, 192}, at::make_generator<at::CPUGeneratorImpl>(3), at::kFloat) * 1e-3;
  // The fixture with every NVFP4 pair dequantized to a raw fp32 entry.
  const std::string raw_path = temp_path("plain_raw.dat");
  {
    const auto pairs = w.nvfp4_pairs(/*strict=*/true);
    io::DatWriter out(raw_path, w.entries().size() - pairs.size());
    for (const auto& p : pairs) {
      const quant::Nvfp4Tensor q = w.load_nvfp4(p);
      out.add(p.name, quant::dequantize_nvfp4(q.qdata, q.scale, at::kFloat));
    }
    auto ends_with = [](const std::string& s, const std::string& tail) {
      return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
    };
    for (const auto& entry : w.entries()) {
      if (!ends_with(entry.key, io::kDatQdataSuffix) &&
          !ends_with(entry.key, io::kDatScaleSuffix)) {
        out.copy_from(w, entry);
      }
    }
    out.commit();
  }
  ModelOptions plain = fp32_all(), ste = fp32_all();
  plain.fake_quant = false;
  Qwen3Model a = Qwen3Model::load(cfg, w, plain);
  Qwen3Model b = Qwen3Model::load(cfg, w, ste);
  Qwen3Model raw = Qwen3Model::load(cfg, DatReader(raw_path), ste);
  for (Qwen3Model* m : {&a, &b, &raw}) {
    for (auto& p : m->parameters()) {
      if (p.name == moved) p.master.add_(noise);
    }
  }
  at::Tensor la, lb, lraw;
  const auto ga = run_backward(a, in, &la);
  const auto graw = run_backward(raw, in, &lraw);
  run_backward(b, in, &lb);
  EXPECT_TRUE(at::equal(la, lraw)) << la.item<double>() << " vs " << lraw.item<double>();
  EXPECT_FALSE(at::equal(la, lb));
  for (const auto& [name, g] : graw) {
    ASSERT_TRUE(g.defined()) << name;
    EXPECT_TRUE(at::equal(ga.at(name), g)) << name;
  }
  std::remove(raw_path.c_str());
}

// How close `a` is to the reference `e`, for the test's record: max |a - e|, ||a - e|| / ||e||
// and the largest share of the tolerance used, max |a - e| / (atol + rtol |e|).
struct Closeness {
  double max_abs = 0, rel = 0, tol_used = 0;
  void add(const at::Tensor& a, const at::Tensor& e, double rtol, double atol) {
    at::Tensor d = (a.to(at::kDouble).cpu() - e.to(at::kDouble).cpu()).abs();
    max_abs = std::max(max_abs, d.max().item<double>());
    rel = std::max(rel, rel_err(a, e));
    tol_used = std::max(tol_used,
                        (d / (e.to(at::kDouble).cpu().abs() * rtol + atol)).max().item<double>());
  }
  std::string str() const {
    char buf[96];
    std::snprintf(buf, sizeof(buf), "max_abs %.3g rel %.3g tol_used %.3g", max_abs, rel, tol_used);
    return buf;
  }
};

// Records the closeness of `m`'s logits, loss and gradients to the fixture `expected` (what the
// report quotes; check_against_fixture() asserts the tolerances).
void record_closeness(Qwen3Model& m, const DatReader& expected) {
  const ModelInputs in = fixture_inputs(expected);
  Closeness logits, loss, grads;
  {
    at::NoGradGuard ng;
    logits.add(m.forward(in), expected.load("logits"), 1e-4, 1e-5);
  }
  at::Tensor l;
  const auto g = run_backward(m, in, &l);
  loss.add(l.reshape({1}), expected.load("loss"), 1e-4, 1e-5);
  for (const auto& [name, t] : g) grads.add(t, expected.load("grad." + name), 1e-3, 1e-5);
  ::testing::Test::RecordProperty("logits", logits.str());
  ::testing::Test::RecordProperty("loss", loss.str());
  ::testing::Test::RecordProperty("grads", grads.str());
}

// Plain precision against Hugging Face transformers (tests/fixtures/qwen3_tiny.plain_expected.dat,
// made by make_plain_fixture.py: every linear's master moved off the NVFP4 grid, fp32, no
// quantization anywhere). The NVFP4 file loaded with fake_quant off, its masters replaced by the
// fixture's, gives HF's logits, loss and gradients within the fixture tolerances; the
// straight-through model with the same masters rounds them back to the grid and does not.
TEST(Qwen3Model, PlainPrecisionMatchesHfFixture) {
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kPlainExpected);
  ModelOptions plain = fp32_all(), ste = fp32_all();
  plain.fake_quant = false;
  Qwen3Model a = Qwen3Model::load(cfg, w, plain);
  Qwen3Model b = Qwen3Model::load(cfg, w, ste);
  for (Qwen3Model* m : {&a, &b}) {
    at::NoGradGuard ng;
    int n = 0, quantized = 0;
    for (auto& p : m->parameters()) {
      ASSERT_TRUE(p.trainable) << p.name;
      ASSERT_NE(e.find(p.name), nullptr) << p.name;
      const at::Tensor master = e.load(p.name);
      ASSERT_EQ(master.scalar_type(), at::kFloat) << p.name;
      ASSERT_EQ(master.sizes(), p.master.sizes()) << p.name;
      p.master.copy_(master);
      ++n;
      quantized += p.quantized;
    }
    EXPECT_EQ(n, 25);
    EXPECT_EQ(quantized, 15);  // 2 x 7 linears + lm_head: the NVFP4 pairs of the file
  }
  check_against_fixture(a, e);
  record_closeness(a, e);
  at::NoGradGuard ng;
  const at::Tensor ste_logits = b.forward(fixture_inputs(e));
  EXPECT_GT(excess(ste_logits, e.load("logits"), 1e-4, 1e-5), 0.0);
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.3g",
                (ste_logits - e.load("logits")).abs().max().item<double>());
  RecordProperty("ste_logits_max_abs_diff", buf);
}

// The same fixture read as a dense model: its 25 raw fp32 masters are the weights (the other
// entries are not Qwen3 parameters and load() ignores them), and raw linears are never
// fake-quantized, whatever fake_quant says.
TEST(Qwen3Model, PlainFixtureAsDenseWeightsMatchesHf) {
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader e(kPlainExpected);
  for (bool fake_quant : {true, false}) {
    SCOPED_TRACE(fake_quant ? "fake_quant on" : "fake_quant off");
    ModelOptions o = fp32_all();
    o.fake_quant = fake_quant;
    Qwen3Model m = Qwen3Model::load(cfg, e, o);
    for (const auto& p : m.parameters()) EXPECT_FALSE(p.quantized) << p.name;
    check_against_fixture(m, e);
  }
}

}  // namespace
}  // namespace q4::model
