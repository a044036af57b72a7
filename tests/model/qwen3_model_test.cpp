// Qwen3 model tests against the HF transformers fixture (tests/fixtures/qwen3_tiny.*, fp32,
// fake-quant STE on every linear): logits/loss/gradients through the library and through the
// q4grad binary, checkpointing on/off, chunked vs unchunked loss, tied-embedding and bf16-raw
// variants, trainable groups, padding/packing masks, export round trips, KV-cache generation;
// the fixture and generation on every backend (Qwen3Backend: cpu, cuda) and the CUDA training
// configuration and checkpointing memory (Qwen3ModelCuda, skipped without a GPU).
// Tolerances are the fixture's (tests/fixtures/README.md): logits/loss rtol 1e-4 atol 1e-5,
// gradients atol 1e-5 + rtol 1e-3 (fp32 reassociation across implementations).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <torch/cuda.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>

#include "generate_check.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/quant/nvfp4.h"
#include "q4/test/backends.h"
#include "q4/test/files.h"
#include "tiny_fixture.h"

#if Q4_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace q4::model {
namespace {

std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/q4model_" + std::to_string(::getpid()) + "_" + name;
}

ModelOptions fp32_all(bool checkpointing = true) {
  ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.grad_dtype = at::kFloat;
  o.trainable = TrainableSpec::everything();
  o.gradient_checkpointing = checkpointing;
  return o;
}

ModelInputs fixture_inputs(const DatReader& expected) {
  ModelInputs in;
  in.input_ids = expected.load("input_ids");
  in.labels = expected.load("labels");
  return in;
}

// max over elements of |a - e| - (atol + rtol |e|); <= 0 means within tolerance.
double excess(const at::Tensor& a, const at::Tensor& e, double rtol, double atol) {
  at::Tensor a32 = a.to(at::kFloat).cpu(), e32 = e.to(at::kFloat).cpu();
  return ((a32 - e32).abs() - (e32.abs() * rtol + atol)).max().item<double>();
}

// Where the tolerance is exceeded most: flat index, actual and expected value there.
std::string worst(const at::Tensor& a, const at::Tensor& e, double rtol, double atol) {
  at::Tensor a32 = a.to(at::kFloat).cpu().reshape({-1}), e32 = e.to(at::kFloat).cpu().reshape({-1});
  const int64_t i = ((a32 - e32).abs() - (e32.abs() * rtol + atol)).argmax().item<int64_t>();
  return "; worst at flat index " + std::to_string(i) + " of " + std::to_string(a32.numel()) +
         ": got " + std::to_string(a32[i].item<double>()) + ", expected " +
         std::to_string(e32[i].item<double>()) + ", max |expected| " +
         std::to_string(e32.abs().max().item<double>());
}

#define EXPECT_CLOSE(a, e, rtol, atol, what)                                                \
  do {                                                                                      \
    ASSERT_EQ((a).sizes(), (e).sizes()) << what;                                            \
    EXPECT_LE(excess((a), (e), (rtol), (atol)), 0.0)                                        \
        << what << ": max |diff| "                                                          \
        << ((a).to(at::kFloat).cpu() - (e).to(at::kFloat).cpu()).abs().max().item<double>() \
        << worst((a), (e), (rtol), (atol));                                                 \
  } while (0)

// Loss + backward; returns grads by parameter name (fp32, zeros when undefined).
std::map<std::string, at::Tensor> run_backward(Qwen3Model& m, const ModelInputs& in,
                                               at::Tensor* loss = nullptr) {
  m.zero_grad();
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  if (loss) *loss = lo.loss.detach();
  std::map<std::string, at::Tensor> g;
  for (const auto& p : m.parameters()) {
    g[p.name] = p.grad.defined() ? p.grad.to(at::kFloat) : at::Tensor();
  }
  return g;
}

// Tolerance of each op of the fp32 fixture run against the HF reference, per backend: the
// fixture's (tests/fixtures/README.md) on both. CUDA fp32 (no TF32 for matmul by default)
// reorders sums only, so it is held to the CPU bounds.
struct Tolerance {
  double rtol, atol;
};
struct FixtureTolerances {
  Tolerance logits, loss, grad;
};
const std::map<q4::test::Backend, FixtureTolerances> kFixtureFp32 = {
    {q4::test::Backend::kCpu, {{1e-4, 1e-5}, {1e-4, 1e-5}, {1e-3, 1e-5}}},
    {q4::test::Backend::kCuda, {{1e-4, 1e-5}, {1e-4, 1e-5}, {1e-3, 1e-5}}},
};

void check_against_fixture(
    Qwen3Model& m, const DatReader& expected,
    const FixtureTolerances& tol = kFixtureFp32.at(q4::test::Backend::kCpu)) {
  ModelInputs in = fixture_inputs(expected);
  {
    at::NoGradGuard ng;
    EXPECT_CLOSE(m.forward(in), expected.load("logits"), tol.logits.rtol, tol.logits.atol,
                 "logits");
  }
  at::Tensor loss;
  auto grads = run_backward(m, in, &loss);
  EXPECT_CLOSE(loss.reshape({1}), expected.load("loss"), tol.loss.rtol, tol.loss.atol, "loss");
  int n = 0;
  for (const auto& p : m.parameters()) {
    const std::string key = "grad." + p.name;
    ASSERT_NE(expected.find(key), nullptr) << key;
    ASSERT_TRUE(grads[p.name].defined()) << key;
    EXPECT_CLOSE(grads[p.name], expected.load(key), tol.grad.rtol, tol.grad.atol, key);
    ++n;
  }
  EXPECT_EQ(n, 25);  // embed + 2 x 11 + norm + lm_head
}

// The model on every backend (cpu, cuda), one body each.
class Qwen3Backend : public q4::test::BackendTest {};

// fp32 masters, compute and grads, with and without checkpointing, against the HF fixture.
TEST_P(Qwen3Backend, FixtureFp32) {
  const auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  for (bool ckpt : {true, false}) {
    SCOPED_TRACE(ckpt ? "checkpointing" : "no checkpointing");
    ModelOptions o = fp32_all(ckpt);
    o.device = device();
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    EXPECT_FALSE(m.tied());
    check_against_fixture(m, e, kFixtureFp32.at(GetParam()));
  }
}

TEST(Qwen3Model, CheckpointingGivesIdenticalGradients) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  Qwen3Model a = Qwen3Model::load(cfg, w, fp32_all(true));
  Qwen3Model b = Qwen3Model::load(cfg, w, fp32_all(false));
  at::Tensor la, lb;
  auto ga = run_backward(a, fixture_inputs(e), &la);
  auto gb = run_backward(b, fixture_inputs(e), &lb);
  EXPECT_TRUE(at::equal(la, lb));
  for (const auto& kv : ga) {
    // Recomputation replays the same fp32 ops on the same inputs (the down projection's
    // backward by hand: the same two products autograd forms): bitwise equal on CPU.
    EXPECT_TRUE(at::equal(kv.second, gb[kv.first])) << kv.first;
  }
}

// ModelOptions::mlp_chunk_tokens: the recompute (and the checkpointed forward) runs each
// layer's MLP block over row chunks of the 2 x 24 = 48 tokens. Chunk sizes that divide 48 and
// that do not (a short last chunk, down to one row), in models where every group trains and
// where the MLP's linears are frozen (only the norms and the embedding train), against the
// same model unchunked and without checkpointing.
//
// Tolerance: elementwise |chunked - unchunked| <= 1e-5·|unchunked| + 4e-6·max|unchunked| per
// tensor. Chunking changes only the order of fp32 sums: the MLP weights' gradients are summed
// over chunks instead of inside one GEMM, and GEMMs over fewer rows may block their sums
// differently; the ulp-sized changes then travel through the rest of the backward. An element
// that cancels to far below its tensor's scale keeps the absolute error of those sums, hence the
// second term: measured at most 1.2e-6·max (k_norm, 48 one-row chunks, LibTorch 2.x on 2 CPU
// threads). A chunk skipped in the recompute or in the forward fails it by orders of magnitude
// (tried: a sixth to a half of each MLP weight gradient goes missing, and the residual gradient
// or the output of those rows is wrong).
TEST(Qwen3Model, MlpChunkedRecomputeMatchesUnchunked) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  const ModelInputs in = fixture_inputs(e);
  TrainableSpec frozen_mlp;
  frozen_mlp.projections = false;
  frozen_mlp.norms = true;
  frozen_mlp.embeddings = true;
  for (const TrainableSpec& ts : {TrainableSpec::everything(), frozen_mlp}) {
    ModelOptions base = fp32_all(true);
    base.trainable = ts;
    Qwen3Model ref = Qwen3Model::load(cfg, w, base);
    at::Tensor lr;
    const auto gr = run_backward(ref, in, &lr);
    for (int64_t chunk : {16, 20, 7, 1, 47, 48}) {
      SCOPED_TRACE("chunk " + std::to_string(chunk) + (ts.projections ? "" : ", frozen MLP"));
      ModelOptions o = base;
      o.mlp_chunk_tokens = chunk;
      Qwen3Model m = Qwen3Model::load(cfg, w, o);
      at::Tensor lc;
      const auto gc = run_backward(m, in, &lc);
      EXPECT_CLOSE(lc, lr, 1e-5, 0.0, "loss");
      for (const auto& [name, want] : gr) {
        ASSERT_EQ(gc.at(name).defined(), want.defined()) << name;
        if (!want.defined()) continue;
        const double scale = want.abs().max().item<double>();
        EXPECT_CLOSE(gc.at(name), want, 1e-5, 4e-6 * scale, name);
      }
    }
  }
}

// Recompute by memory budget: only the first layer recomputes (the second keeps its graph), and
// the choice may change between steps on the same model.
TEST(Qwen3Model, RecomputingSomeLayersGivesIdenticalGradients) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ASSERT_EQ(cfg.num_hidden_layers, 2);
  ModelOptions first = fp32_all(true);
  first.recompute_layers = 1;
  EXPECT_TRUE(first.recomputes(0));
  EXPECT_FALSE(first.recomputes(1));
  Qwen3Model a = Qwen3Model::load(cfg, w, first);
  Qwen3Model b = Qwen3Model::load(cfg, w, fp32_all(false));
  at::Tensor la, lb;
  auto ga = run_backward(a, fixture_inputs(e), &la);
  auto gb = run_backward(b, fixture_inputs(e), &lb);
  EXPECT_TRUE(at::equal(la, lb));
  for (const auto& kv : ga) EXPECT_TRUE(at::equal(kv.second, gb[kv.first])) << kv.first;
  // Every layer recomputed, set on the loaded model.
  a.set_recompute(true, -1);
  EXPECT_TRUE(a.options().recomputes(1));
  a.zero_grad();
  at::Tensor lc;
  auto gc = run_backward(a, fixture_inputs(e), &lc);
  EXPECT_TRUE(at::equal(lc, lb));
  for (const auto& kv : gc) EXPECT_TRUE(at::equal(kv.second, gb[kv.first])) << kv.first;
  EXPECT_THROW(a.set_recompute(true, 3), c10::Error);  // more layers than the model has
  EXPECT_THROW(a.set_recompute(true, -2), c10::Error);
}

// Selective recompute: a recomputed layer may keep one block's activations and recompute only
// the other (ModelOptions::recompute_keep_attention / recompute_keep_mlp). Every combination of
// the two layers' modes (whole layer, attention kept, MLP kept, nothing recomputed) runs the
// same fp32 ops on the same inputs as no checkpointing: loss and gradients bitwise equal on
// the CPU, and with the in-backward hook each parameter is handed over once with that gradient.
// What recomputes is seen through the master fence, which runs at every read of a trainable
// master: once a step for a block that keeps its graph, twice (forward and recompute) for one
// that recomputes.
TEST(Qwen3Model, BlockRecomputeGivesIdenticalGradients) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ASSERT_EQ(cfg.num_hidden_layers, 2);
  const ModelInputs in = fixture_inputs(e);
  Qwen3Model ref = Qwen3Model::load(cfg, w, fp32_all(false));
  at::Tensor lref;
  const auto gref = run_backward(ref, in, &lref);
  using LR = LayerRecompute;
  struct Case {
    int64_t recompute_layers, keep_attention, keep_mlp;
    LR layer0, layer1;
  };
  const std::vector<Case> cases = {
      {-1, 0, 0, LR::kLayer, LR::kLayer},
      {-1, 1, 0, LR::kLayer, LR::kMlp},
      {-1, 0, 1, LR::kLayer, LR::kAttention},
      {-1, 2, 0, LR::kMlp, LR::kMlp},
      {-1, 0, 2, LR::kAttention, LR::kAttention},
      {-1, 1, 1, LR::kMlp, LR::kAttention},
      {1, 1, 0, LR::kMlp, LR::kNone},
      {1, 0, 1, LR::kAttention, LR::kNone},
  };
  std::set<std::pair<LR, LR>> seen;
  for (const Case& c : cases) {
    SCOPED_TRACE("recompute_layers " + std::to_string(c.recompute_layers) + ", keep attention " +
                 std::to_string(c.keep_attention) + ", keep MLP " + std::to_string(c.keep_mlp));
    ModelOptions o = fp32_all(true);
    o.recompute_layers = c.recompute_layers;
    o.recompute_keep_attention = c.keep_attention;
    o.recompute_keep_mlp = c.keep_mlp;
    EXPECT_EQ(o.layer_recompute(0, 2), c.layer0);
    EXPECT_EQ(o.layer_recompute(1, 2), c.layer1);
    seen.insert({c.layer0, c.layer1});
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    std::map<std::string, int> reads;
    m.set_master_fence([&](const Parameter* p) {
      if (p != nullptr) ++reads[p->name];
    });
    at::Tensor loss;
    const auto g = run_backward(m, in, &loss);
    EXPECT_TRUE(at::equal(loss, lref));
    for (const auto& [name, want] : gref) EXPECT_TRUE(at::equal(g.at(name), want)) << name;
    for (int64_t l = 0; l < 2; ++l) {
      const LR mode = l == 0 ? c.layer0 : c.layer1;
      const bool attn = mode == LR::kLayer || mode == LR::kAttention;
      const bool mlp = mode == LR::kLayer || mode == LR::kMlp;
      const std::string pre = "model.layers." + std::to_string(l) + ".";
      for (const char* a :
           {"input_layernorm", "self_attn.q_proj", "self_attn.k_norm", "self_attn.o_proj"}) {
        EXPECT_EQ(reads[pre + a + ".weight"], attn ? 2 : 1) << pre << a;
      }
      for (const char* f : {"post_attention_layernorm", "mlp.gate_proj", "mlp.down_proj"}) {
        EXPECT_EQ(reads[pre + f + ".weight"], mlp ? 2 : 1) << pre << f;
      }
    }
    m.set_master_fence(nullptr);
    // In-backward: every trainable parameter once, complete.
    std::map<std::string, int> calls;
    std::map<std::string, at::Tensor> got;
    m.set_grad_ready_hook([&](Parameter& p) {
      ++calls[p.name];
      got[p.name] = p.grad.clone();
    });
    m.zero_grad();
    m.begin_grad_step();
    m.loss(in).loss.backward();
    for (const auto& p : m.parameters()) {
      EXPECT_EQ(calls[p.name], 1) << p.name;
      EXPECT_TRUE(at::equal(got[p.name], gref.at(p.name))) << p.name;
    }
  }
  EXPECT_EQ(seen.size(), cases.size());
  // Set on a loaded model; more kept blocks than recomputed layers are refused.
  Qwen3Model m = Qwen3Model::load(cfg, w, fp32_all(true));
  m.set_recompute(true, -1, false, 1, 1);
  EXPECT_EQ(m.options().layer_recompute(0, 2), LR::kMlp);
  EXPECT_THROW(m.set_recompute(true, 1, false, 1, 1), c10::Error);
  EXPECT_THROW(m.set_recompute(true, -1, false, -1, 0), c10::Error);
  ModelOptions bad = fp32_all(true);
  bad.recompute_keep_mlp = 3;
  EXPECT_THROW(Qwen3Model::load(cfg, w, bad), c10::Error);
  bad.gradient_checkpointing = false;
  bad.recompute_keep_mlp = 1;
  EXPECT_THROW(Qwen3Model::load(cfg, w, bad), c10::Error);
}

// The MLP checkpoint chunks like the whole layer's (ModelOptions::mlp_chunk_tokens): with both
// layers keeping their attention block and recomputing the MLP in chunks of 20, 20 and 8
// tokens, against no checkpointing, to the tolerance of MlpChunkedRecomputeMatchesUnchunked.
TEST(Qwen3Model, ChunkedMlpCheckpointMatchesNoCheckpointing) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  const ModelInputs in = fixture_inputs(e);
  Qwen3Model ref = Qwen3Model::load(cfg, w, fp32_all(false));
  at::Tensor lref;
  const auto gref = run_backward(ref, in, &lref);
  ModelOptions o = fp32_all(true);
  o.recompute_keep_attention = 2;
  o.mlp_chunk_tokens = 20;
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  at::Tensor loss;
  const auto g = run_backward(m, in, &loss);
  EXPECT_CLOSE(loss, lref, 1e-5, 0.0, "loss");
  for (const auto& [name, want] : gref) {
    const double scale = want.abs().max().item<double>();
    EXPECT_CLOSE(g.at(name), want, 1e-5, 4e-6 * scale, name);
  }
}

// Per-token log-probabilities of the supervised labels (preference objectives) against the
// dense path: log_softmax of the full logits gathered at the same positions, and the gradients
// of a weighted sum of them (every row its own upstream gradient) against autograd through the
// full logits. Their plain sum is minus loss()'s summed cross-entropy.
TEST(Qwen3Model, TokenLogprobsMatchTheFullLogits) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = fp32_all(true);
  o.loss_chunk_tokens = 5;  // several chunks, a partial last one
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  ModelInputs in = fixture_inputs(e);
  in.labels.narrow(1, 3, 4).fill_(-100);  // some unsupervised positions
  const int64_t B = in.input_ids.size(0), T = in.input_ids.size(1);

  m.zero_grad();
  const Qwen3Model::TokenLogprobs tl = m.token_logprobs(in);
  const int64_t N = tl.positions.numel();
  ASSERT_GT(N, 10);
  const at::Tensor weights = at::randn({N}, at::make_generator<at::CPUGeneratorImpl>(5));
  (tl.logprobs * weights).sum().backward();
  std::map<std::string, at::Tensor> g_chunked;
  for (const auto& p : m.parameters()) g_chunked[p.name] = p.grad.clone();

  m.zero_grad();
  const at::Tensor logits = m.forward(in).reshape({B * T, -1});  // differentiable, dense
  const at::Tensor next =
      at::cat({in.labels.narrow(1, 1, T - 1), at::full({B, 1}, -100, in.labels.options())}, 1)
          .reshape({-1});
  const at::Tensor pos = next.ne(-100).nonzero().reshape({-1});
  EXPECT_TRUE(at::equal(pos, tl.positions));
  const at::Tensor dense = logits.log_softmax(1)
                               .index_select(0, pos)
                               .gather(1, next.index_select(0, pos).unsqueeze(1))
                               .squeeze(1);
  EXPECT_CLOSE(tl.logprobs.detach(), dense.detach(), 1e-5, 1e-5, "log-probabilities");
  (dense * weights).sum().backward();
  for (const auto& p : m.parameters()) {
    // The fixture tolerance for fp32 gradients (tests/fixtures/README.md): summation order.
    EXPECT_CLOSE(g_chunked[p.name], p.grad, 1e-3, 1e-5, "grad " + p.name);
  }
  // Their sum is minus the summed cross-entropy.
  const LossOutput lo = m.loss(in);
  EXPECT_NEAR(-tl.logprobs.sum().item<double>(), lo.loss_sum.item<double>(),
              1e-5 * std::fabs(lo.loss_sum.item<double>()));
}

TEST(Qwen3Model, Q4GradBinaryMatchesFixture) {
  const std::string bin = std::string(Q4_BIN_DIR) + "/q4grad";
  ASSERT_EQ(::access(bin.c_str(), X_OK), 0) << bin << " not built";
  for (const char* ckpt : {"on", "off"}) {
    const std::string out = temp_path(std::string("q4grad_") + ckpt + ".dat");
    const std::string cmd = bin + " --config " + kConfig + " --weights " + kWeights + " --inputs " +
                            kExpected + " --out " + out + " --checkpointing " + ckpt +
                            " > /dev/null";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
    DatReader got(out), e(kExpected);
    EXPECT_CLOSE(got.load("logits"), e.load("logits"), 1e-4, 1e-5, "logits");
    EXPECT_CLOSE(got.load("loss"), e.load("loss"), 1e-4, 1e-5, "loss");
    int n = 0;
    for (const auto& ent : e.entries()) {
      if (ent.key.rfind("grad.", 0) != 0) continue;
      EXPECT_CLOSE(got.load(ent.key), e.load(ent), 1e-3, 1e-5, ent.key);
      ++n;
    }
    EXPECT_EQ(n, 25);
    std::remove(out.c_str());
  }
}

TEST(Qwen3Model, Q4GradRejectsBadInput) {
  const std::string bin = std::string(Q4_BIN_DIR) + "/q4grad";
  const std::string cmd = bin + " --config " + kConfig + " --weights /nonexistent.dat --inputs " +
                          kExpected + " --out " + temp_path("bad.dat") + " 2> /dev/null";
  const int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 2);
}

// q4grad --out replaced any file, its own weights included: an input is refused whatever
// --overwrite says, an existing file without it, a FIFO always; nothing is loaded first.
TEST(Qwen3Model, Q4GradOutNeverReplacesAnInputOrAFile) {
  const std::string bin = std::string(Q4_BIN_DIR) + "/q4grad";
  const std::string weights = temp_path("grad_weights.dat"), notes = temp_path("notes.dat"),
                    fifo = temp_path("grad_fifo");
  std::remove(weights.c_str());
  std::remove(fifo.c_str());
  ASSERT_EQ(std::system(("cp " + kWeights + " " + weights).c_str()), 0);
  const std::string original = q4::test::read_text(weights);
  q4::test::write_text(notes, "precious");
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  const auto run = [&](const std::string& out, const std::string& flags) {
    const std::string cmd = "timeout 120 " + bin + " --config " + kConfig + " --weights " +
                            weights + " --inputs " + kExpected + " --out " + out + " " + flags +
                            " > /dev/null 2>&1";
    const int rc = std::system(cmd.c_str());
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
  };
  for (const char* flags : {"", "--overwrite"}) {
    EXPECT_EQ(run(weights, flags), 2) << flags;
    EXPECT_EQ(run(fifo, flags), 2) << flags;
  }
  EXPECT_TRUE(q4::test::read_text(weights) == original);
  EXPECT_EQ(run(notes, ""), 2);
  EXPECT_EQ(q4::test::read_text(notes), "precious");
  EXPECT_EQ(run(notes, "--overwrite"), 0);
  EXPECT_NE(q4::test::read_text(notes), "precious");
  for (const auto& p : {weights, notes, fifo}) std::remove(p.c_str());
}

TEST(Qwen3Model, ChunkedLossEqualsUnchunked) {
  DatReader w(kWeights), e(kExpected);
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelInputs in = fixture_inputs(e);
  ModelOptions o1 = fp32_all(false);
  o1.loss_chunk_tokens = 5;  // 48 rows -> 10 chunks, the last one partial
  ModelOptions o2 = fp32_all(false);
  o2.loss_chunk_tokens = 4096;  // one chunk
  Qwen3Model a = Qwen3Model::load(cfg, w, o1);
  Qwen3Model b = Qwen3Model::load(cfg, w, o2);
  at::Tensor la, lb;
  auto ga = run_backward(a, in, &la);
  auto gb = run_backward(b, in, &lb);
  // Chunking only changes fp32 summation order (per-row losses, lm_head's grad, and the matmul
  // blocking of the hidden-state grad, which then flows through both layers): a few ulps of
  // the summed terms, far inside the fixture's gradient tolerance (atol 1e-5).
  EXPECT_CLOSE(la, lb, 1e-6, 1e-7, "loss");
  for (const auto& kv : ga) EXPECT_CLOSE(kv.second, gb[kv.first], 1e-5, 1e-6, kv.first);

  // Against ATen's cross_entropy on full fp32 logits (the unchunked definition).
  at::Tensor logits;
  {
    at::NoGradGuard ng;
    logits = b.forward(in);  // (B, T, V)
  }
  const int64_t V = logits.size(2), T = logits.size(1);
  at::Tensor ref = at::cross_entropy_loss(logits.narrow(1, 0, T - 1).reshape({-1, V}),
                                          in.labels.narrow(1, 1, T - 1).reshape({-1}), {},
                                          at::Reduction::Mean, -100);
  EXPECT_CLOSE(la, ref, 1e-5, 1e-7, "loss vs cross_entropy");
}

TEST(Qwen3Model, ChunkedCrossEntropyGradientMatchesAutograd) {
  at::manual_seed(3);
  at::Tensor h = at::randn({13, 32}).requires_grad_(true);
  at::Tensor wt = at::randn({50, 32}).requires_grad_(true);
  at::Tensor y = at::randint(0, 50, {13}, at::kLong);
  y[2] = -100;
  y[7] = -100;
  auto [sum, count] = chunked_cross_entropy_sum(h, wt, y, 4);
  sum.backward();
  at::Tensor h2 = h.detach().clone().requires_grad_(true);
  at::Tensor w2 = wt.detach().clone().requires_grad_(true);
  at::Tensor ref = at::cross_entropy_loss(at::matmul(h2, w2.t()), y, {}, at::Reduction::Sum, -100);
  ref.backward();
  EXPECT_EQ(count.item<int64_t>(), 11);
  EXPECT_CLOSE(sum, ref, 1e-5, 1e-5, "sum");
  EXPECT_CLOSE(h.grad(), h2.grad(), 1e-5, 1e-6, "grad hidden");
  EXPECT_CLOSE(wt.grad(), w2.grad(), 1e-5, 1e-6, "grad weight");
}

TEST(Qwen3Model, SupervisedRowsLossEqualsFullLogitsLoss) {
  // loss() sends only the supervised rows through the lm_head. Reference: the full (B, T, V)
  // logits of forward() (same weight taps) and ATen's cross_entropy over every shifted position
  // with ignore_index -100, mean over supervised positions; both back-propagated into the
  // parameters. Label sets: the fixture's, a sparse one (a few positions per row, one row with
  // none, the first and last shifted positions included) and an empty one (loss 0, zero grads).
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = fp32_all(false);
  o.loss_chunk_tokens = 3;  // several chunks, the last one partial, for the gathered rows too
  Qwen3Model m = Qwen3Model::load(Qwen3Config::from_json_file(kConfig), w, o);
  const ModelInputs base = fixture_inputs(e);
  const int64_t B = base.input_ids.size(0), T = base.input_ids.size(1);  // (2, 24)
  at::Tensor sparse = at::full({B, T}, -100, at::kLong);
  for (int64_t t : {int64_t{1}, int64_t{6}, int64_t{7}, int64_t{13}, T - 1})
    sparse[0][t] = base.input_ids[0][t];
  at::Tensor none = at::full({B, T}, -100, at::kLong);
  int checked = 0;
  for (const at::Tensor& labels : {base.labels, sparse, none}) {
    ModelInputs in = base;
    in.labels = labels;
    at::Tensor loss;
    auto got = run_backward(m, in, &loss);

    m.zero_grad();
    at::Tensor logits = m.forward(in);  // (B, T, V)
    const int64_t V = logits.size(2);
    at::Tensor y = labels.narrow(1, 1, T - 1).reshape({-1});
    at::Tensor ref_sum = at::cross_entropy_loss(logits.narrow(1, 0, T - 1).reshape({-1, V}), y, {},
                                                at::Reduction::Sum, -100);
    const int64_t n = y.ne(-100).sum().item<int64_t>();
    at::Tensor ref = ref_sum / static_cast<double>(std::max<int64_t>(n, 1));
    ref.backward();
    // Gathering changes only the fp32 summation order (chunk boundaries, lm_head's grad
    // accumulation): a few ulps, as in ChunkedLossEqualsUnchunked.
    EXPECT_CLOSE(loss, ref.detach(), 1e-6, 1e-7, "loss, " << n << " supervised");
    if (n == 0) {
      EXPECT_EQ(loss.item<float>(), 0.0f);
    }
    for (const auto& p : m.parameters()) {
      at::Tensor a = got[p.name], r = p.grad;
      ASSERT_TRUE(a.defined() || r.defined() || n == 0) << p.name;
      if (!a.defined()) a = at::zeros_like(p.master, at::kFloat);
      if (!r.defined()) r = at::zeros_like(p.master, at::kFloat);
      EXPECT_CLOSE(a, r.to(at::kFloat), 1e-5, 1e-6, p.name << ", " << n << " supervised");
      if (n == 0) {
        EXPECT_EQ(a.abs().max().item<float>(), 0.0f) << p.name;
      }
    }
    ++checked;
  }
  EXPECT_EQ(checked, 3);
}

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
  ASSERT_EQ(r.entries().size(), w.entries().size());
  for (size_t i = 0; i < r.entries().size(); ++i) {
    const DatEntry& a = r.entries()[i];
    const DatEntry& b = w.entries()[i];
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.type, b.type) << a.key;
    EXPECT_EQ(a.shape, b.shape) << a.key;
    const bool layer0 = a.key.find("layers.0.") != std::string::npos;
    if (layer0) {
      EXPECT_TRUE(at::equal(r.load(a), w.load(b))) << a.key << " must be byte-exact";
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

// optim.offload: all on CUDA: a trained NVFP4 linear costs its codes on the device (9/16 byte an
// element) and its master on the host; with accumulation its gradient is not carried on the
// device (pinned host buffer), so the buffered update holds only the other gradients.
TEST(Qwen3Model, MemoryEstimateWithOffloadedMasters) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = fp32_all();
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.grad_dtype = std::nullopt;
  o.device = at::Device(at::kCUDA, 0);
  int64_t linear = 0, other = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, true)) {
    (p.kind == ParamKind::kQuantizedLinear ? linear : other) += p.numel();
  }
  GradientLifetime accum;
  accum.accumulation_steps = 4;
  const MemoryEstimate resident = estimate_memory(cfg, o, 2, 64, true, accum);
  o.offload_masters = true;
  const MemoryEstimate off = estimate_memory(cfg, o, 2, 64, true, accum);
  EXPECT_EQ(resident.master_bytes, 2 * (linear + other));
  EXPECT_EQ(off.master_bytes, linear / 2 + linear / 16 + 2 * other);
  EXPECT_EQ(off.host_bytes - resident.host_bytes, 2 * linear + 2 * linear);  // master + bf16 grads
  ASSERT_NE(off.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  EXPECT_EQ(resident.phase(MemoryPhaseKind::kOptimizerStep)->grad_bytes, 2 * (linear + other));
  EXPECT_EQ(off.phase(MemoryPhaseKind::kOptimizerStep)->grad_bytes, 2 * other);
  EXPECT_LT(off.total_bytes(), resident.total_bytes());
  // The device staging the step adds those gradients up through is held for the whole run.
  GradientLifetime staged = accum;
  staged.host_staging_bytes = int64_t{1} << 20;
  const MemoryEstimate off_staged = estimate_memory(cfg, o, 2, 64, true, staged);
  for (const MemoryPhaseKind k : {MemoryPhaseKind::kForward, MemoryPhaseKind::kLayerBackward,
                                  MemoryPhaseKind::kOptimizerStep}) {
    EXPECT_EQ(off_staged.phase(k)->grad_bytes - off.phase(k)->grad_bytes, staged.host_staging_bytes)
        << memory_phase_name(k);
  }
  // Updated inside the last micro-batch's backward, the sums are carried as for the buffered
  // update until then; no optimizer step phase follows.
  GradientLifetime in_backward = accum;
  in_backward.applied_in_backward = true;
  const MemoryEstimate off_ib = estimate_memory(cfg, o, 2, 64, true, in_backward);
  EXPECT_EQ(off_ib.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  for (const MemoryPhaseKind k : {MemoryPhaseKind::kForward, MemoryPhaseKind::kLayerBackward}) {
    EXPECT_EQ(off_ib.phase(k)->grad_bytes, off.phase(k)->grad_bytes) << memory_phase_name(k);
  }
  ModelOptions on_device = o;  // resident masters: their gradients never leave the device
  on_device.offload_masters = false;
  EXPECT_EQ(estimate_memory(cfg, on_device, 2, 64, true, staged).total_bytes(),
            resident.total_bytes());
  // On the CPU nothing moves.
  o.device = at::kCPU;
  o.compute_dtype = at::kFloat;
  ModelOptions cpu_resident = o;
  cpu_resident.offload_masters = false;
  EXPECT_EQ(estimate_memory(cfg, o, 2, 64, true, accum).total_bytes(),
            estimate_memory(cfg, cpu_resident, 2, 64, true, accum).total_bytes());
}

// The analytic estimate's options for a CUDA run in bf16 with fp16 masters, everything trained
// (no device is needed to estimate).
ModelOptions cuda_bf16_everything() {
  ModelOptions o;
  o.master_dtype = at::kHalf;
  o.compute_dtype = at::kBFloat16;
  o.device = at::Device(at::kCUDA, 0);
  o.trainable = TrainableSpec::everything();
  return o;
}

// Plain adapters with their frozen weights kept dequantized (cache_adapted_weights): 2 bytes a
// frozen adapted element for the whole run. Without recompute every layer's graph holds those
// weights at the peak anyway (the same tensors then), so the peak does not move; with recompute
// it grows by what was kept.
TEST(Qwen3Model, MemoryEstimateOfCachedAdaptedWeights) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  ModelOptions o = cuda_bf16_everything();
  o.trainable = TrainableSpec::nothing();
  o.lora.rank = 4;
  o.lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  o.lora.merge_aware = false;
  int64_t adapted = 0;
  for (const ParamSpec& p : qwen3_parameters(cfg, true)) {
    if (o.lora.adapts(p, o.trainable, cfg.num_hidden_layers)) adapted += p.numel();
  }
  ASSERT_GT(adapted, 0);
  for (const bool recompute : {false, true}) {
    o.gradient_checkpointing = recompute;
    o.cache_adapted_weights = false;
    const MemoryEstimate plain = estimate_memory(cfg, o, 2, 64, true);
    o.cache_adapted_weights = true;
    const MemoryEstimate kept = estimate_memory(cfg, o, 2, 64, true);
    EXPECT_EQ(kept.frozen_bytes - plain.frozen_bytes, 2 * adapted);
    if (recompute) {
      EXPECT_GT(kept.total_bytes(), plain.total_bytes());
    } else {
      EXPECT_EQ(kept.total_bytes(), plain.total_bytes());
    }
    o.lora.merge_aware = true;  // merge-aware adapters keep nothing
    const MemoryEstimate merged = estimate_memory(cfg, o, 2, 64, true);
    o.cache_adapted_weights = false;
    EXPECT_EQ(estimate_memory(cfg, o, 2, 64, true).total_bytes(), merged.total_bytes());
    o.lora.merge_aware = false;
  }
}

// ModelOptions::mlp_chunk_tokens in the estimate, at Qwen3-4B shapes on CUDA (bf16 varlen
// path) with one sequence of 131,072 tokens, every layer recomputed with its input on the host
// and in-backward updates: the layer backward is the peak phase. Unchunked its largest step is
// the MLP block's, which holds the recomputed MLP graph (2H + 3I values and an fp32 norm scale
// per token) and three (tokens, I) SwiGLU gradients beside two boundary gradients. Chunked, the
// attention block's backward is the larger step: hs's gradient, hs and the incoming gradient
// (3 boundaries) with FlashAttention-2's working tensors (4 q_dim + 2 kv_dim values with GQA,
// an fp32 q_dim accumulator and NH fp32 softmax sums per token). Per token the layer backward
// loses (2H + 3I)·2 + 4 + 3I·2 - H·2 - attention work bytes, exactly; the gradients gain the
// MLP taps' seeds (every MLP weight, bf16) in place of the held down-projection seed. The
// checkpointed forward's transient drops from the MLP's (2H + 3I) values per token to the
// attention block's (H + 2 q_dim + 2 kv_dim). A layer of no more tokens than a chunk is not
// chunked.
TEST(Qwen3Model, MemoryEstimateOfChunkedMlpRecompute) {
  const auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  ModelOptions o = cuda_bf16_everything();
  o.offload_layer_inputs = true;
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const int64_t T = 131072, H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), NH = cfg.num_attention_heads;
  auto estimate = [&](int64_t chunk, int64_t tokens) {
    ModelOptions c = o;
    c.mlp_chunk_tokens = chunk;
    return estimate_memory(cfg, c, 1, tokens, true, ib);
  };
  const MemoryEstimate whole = estimate(0, T), chunked = estimate(8192, T);
  const MemoryPhase* lb_whole = whole.phase(MemoryPhaseKind::kLayerBackward);
  const MemoryPhase* lb_chunked = chunked.phase(MemoryPhaseKind::kLayerBackward);
  ASSERT_NE(lb_whole, nullptr);
  ASSERT_NE(lb_chunked, nullptr);
  EXPECT_EQ(whole.phases[whole.peak_phase].kind, MemoryPhaseKind::kLayerBackward);
  EXPECT_EQ(chunked.phases[chunked.peak_phase].kind, MemoryPhaseKind::kLayerBackward);
  const int64_t attention_work = 2 * (4 * QD + 2 * KVD) + 4 * QD + 4 * NH;
  const int64_t saved_per_token = (2 * H + 3 * I) * 2 + 4 + 3 * I * 2 - H * 2 - attention_work;
  EXPECT_EQ(lb_whole->activation_bytes - lb_chunked->activation_bytes, T * saved_per_token);
  EXPECT_GT(saved_per_token * T, int64_t{8} << 30);  // 8.4 GiB of a 21.9 GiB phase
  const int64_t mlp_taps = 3 * H * I + H, down = H * I;
  EXPECT_EQ(lb_chunked->grad_bytes - lb_whole->grad_bytes, 2 * (mlp_taps - down));
  EXPECT_LT(chunked.total_bytes(), whole.total_bytes() - (int64_t{8} << 30));
  // While the attention step is the larger one, the chunk size does not change the peak; a chunk
  // of half the sequence makes the MLP step the larger one again.
  EXPECT_EQ(estimate(4096, T).total_bytes(), chunked.total_bytes());
  EXPECT_GT(estimate(65536, T).total_bytes(), chunked.total_bytes());
  // The checkpointed forward's transient.
  EXPECT_EQ(whole.phase(MemoryPhaseKind::kForward)->activation_bytes -
                chunked.phase(MemoryPhaseKind::kForward)->activation_bytes,
            T * 2 * ((2 * H + 3 * I) - (H + 2 * QD + 2 * KVD)));
  EXPECT_EQ(estimate(8192, 8192).total_bytes(), estimate(0, 8192).total_bytes());
  EXPECT_LT(estimate(8192, 16384).total_bytes(), estimate(0, 16384).total_bytes());
}

// Kept blocks in the estimate (Qwen3-4B shapes, CUDA bf16, 4 x 1024 tokens, everything
// trainable): a recomputed layer keeping its attention block holds that block's graph and
// weights and hs besides its input; keeping its MLP block, that block's graph (hs included) and
// weights. Those are layer_keep_costs' bytes, exactly what the saved activations behind the loss
// grow by; with offloaded inputs, a layer keeping its attention block keeps its input on the
// device as well. The multiply-adds: q/k/v/o projections plus causal attention over 1024-token
// rows, and the MLP's gate and up.
TEST(Qwen3Model, MemoryEstimateOfKeptBlocks) {
  const auto cfg = Qwen3Config::from_json_file(kFixtures + "/qwen3_4b.config.json");
  ModelOptions o = cuda_bf16_everything();
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const int64_t L = cfg.num_hidden_layers, H = cfg.hidden_size, I = cfg.intermediate_size;
  const int64_t QD = cfg.q_dim(), KVD = cfg.kv_dim(), B = 4, T = 1024;
  const LayerKeepCosts costs = layer_keep_costs(cfg, o, B, T, true, L - 1);
  const int64_t attn_per_token =
      2 * (H + 3 * QD + 3 * KVD) + 4 * (1 + 2 * cfg.num_attention_heads + cfg.num_key_value_heads);
  const int64_t attn_weights = H * QD + 2 * H * KVD + QD * H;
  EXPECT_EQ(costs.attention.kept_bytes, B * T * (attn_per_token + 2 * H) + 2 * attn_weights);
  EXPECT_EQ(costs.mlp.kept_bytes, B * T * (2 * (2 * H + 3 * I) + 4) + 2 * 3 * H * I);
  EXPECT_DOUBLE_EQ(costs.attention.saved_macs,
                   static_cast<double>(B * T) * (attn_weights + QD * (T + 1)));
  EXPECT_DOUBLE_EQ(costs.mlp.saved_macs, static_cast<double>(B * T) * 2 * H * I);
  auto behind_loss = [&](int64_t keep_attention, int64_t keep_mlp, bool offload) {
    ModelOptions k = o;
    k.recompute_keep_attention = keep_attention;
    k.recompute_keep_mlp = keep_mlp;
    k.offload_layer_inputs = offload;
    return estimate_memory(cfg, k, B, T, true, ib);
  };
  auto acts = [](const MemoryEstimate& e) {
    return e.phase(MemoryPhaseKind::kLossBackward)->activation_bytes;
  };
  const MemoryEstimate all = behind_loss(0, 0, false);
  EXPECT_EQ(acts(behind_loss(1, 0, false)) - acts(all), costs.attention.kept_bytes);
  EXPECT_EQ(acts(behind_loss(0, 1, false)) - acts(all), costs.mlp.kept_bytes);
  EXPECT_EQ(acts(behind_loss(3, 5, false)) - acts(all),
            3 * costs.attention.kept_bytes + 5 * costs.mlp.kept_bytes);
  // Offloaded inputs: the layer keeping its attention block keeps its input on the device.
  ModelOptions off = o;
  off.offload_layer_inputs = true;
  const LayerKeepCosts off_costs = layer_keep_costs(cfg, off, B, T, true, L - 1);
  EXPECT_EQ(off_costs.attention.kept_bytes, costs.attention.kept_bytes + B * T * H * 2);
  const MemoryEstimate all_off = behind_loss(0, 0, true), keep_off = behind_loss(1, 1, true);
  EXPECT_EQ(acts(keep_off) - acts(all_off),
            off_costs.attention.kept_bytes + off_costs.mlp.kept_bytes);
  EXPECT_EQ(all_off.host_bytes - keep_off.host_bytes, B * T * H * 2);
  // Every block kept raises the estimate, up to keeping every layer whole.
  int64_t prev = all.total_bytes();
  for (int64_t k = 1; k <= L; ++k) {
    const int64_t t = behind_loss(k, 0, false).total_bytes();
    EXPECT_GT(t, prev) << k;
    prev = t;
  }
  ModelOptions none = o;
  none.gradient_checkpointing = false;
  EXPECT_LT(prev, estimate_memory(cfg, none, B, T, true, ib).total_bytes());
  EXPECT_THROW(behind_loss(L, 1, false), c10::Error);  // more kept blocks than layers
}

TEST(Qwen3Model, RandomInitAndMemoryEstimate) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  cfg.tie_word_embeddings = true;
  ModelOptions o = fp32_all();
  o.master_dtype = at::kHalf;
  o.grad_dtype = std::nullopt;  // default: bf16 for fp16 masters
  Qwen3Model m = Qwen3Model::random_init(cfg, o, 7, 0.02);
  EXPECT_TRUE(m.tied());
  ModelInputs in;
  in.input_ids = at::randint(0, cfg.vocab_size, {2, 8}, at::kLong);
  in.labels = in.input_ids.clone();
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  // Random logits over V classes: loss near log(V).
  EXPECT_NEAR(lo.loss.item<double>(), std::log(static_cast<double>(cfg.vocab_size)), 0.5);
  EXPECT_EQ(lo.num_tokens.item<int64_t>(), 14);
  for (Parameter* p : m.trainable_parameters()) EXPECT_TRUE(p->grad.defined()) << p->name;
  EXPECT_EQ(m.num_trainable_elements(), cfg.num_parameters(false));

  MemoryEstimate est = estimate_memory(cfg, o, 2, 8, false);
  EXPECT_EQ(est.master_bytes, cfg.num_parameters(false) * 2);
  EXPECT_EQ(est.grad_buffer_bytes, cfg.num_parameters(false) * 2);  // bf16 grads by default
  EXPECT_EQ(est.frozen_bytes, 0);
  // Buffered updates (the default lifetime): the whole buffer in the optimizer step; the total
  // is the persistent terms plus the largest phase.
  const MemoryPhase* step = est.phase(MemoryPhaseKind::kOptimizerStep);
  ASSERT_NE(step, nullptr);
  EXPECT_EQ(step->grad_bytes, est.grad_buffer_bytes);
  int64_t largest = 0;
  for (const auto& p : est.phases) largest = std::max(largest, p.total_bytes());
  EXPECT_EQ(est.phases[est.peak_phase].total_bytes(), largest);
  EXPECT_EQ(est.total_bytes(), est.master_bytes + est.frozen_bytes + largest);
  // In-backward updates: no optimizer phase and never more than the buffered path.
  GradientLifetime ib;
  ib.applied_in_backward = true;
  const MemoryEstimate est_ib = estimate_memory(cfg, o, 2, 8, false, ib);
  EXPECT_EQ(est_ib.phase(MemoryPhaseKind::kOptimizerStep), nullptr);
  EXPECT_LE(est_ib.total_bytes(), est.total_bytes());
  ModelOptions nock = o;
  nock.gradient_checkpointing = false;
  Qwen3Config deep = cfg;
  deep.num_hidden_layers = 36;
  // The loss backward's activations: checkpointed, they grow by one layer input per layer;
  // without checkpointing, by a whole layer's graph.
  auto loss_acts = [](const Qwen3Config& c, const ModelOptions& mo) {
    return estimate_memory(c, mo, 4, 1024, false)
        .phase(MemoryPhaseKind::kLossBackward)
        ->activation_bytes;
  };
  const auto a2 = loss_acts(cfg, o);
  const auto a36 = loss_acts(deep, o);
  EXPECT_EQ(a36 - a2, 34 * 4 * 1024 * cfg.hidden_size * 4);
  EXPECT_GT(loss_acts(deep, nock), 4 * a36);
  // Recomputing the first N layers: each layer that keeps its activations adds the difference
  // between its graph and its checkpointed input, so the estimate falls step by step from no
  // recompute (N = 0) to every layer (N = 36).
  int64_t prev = estimate_memory(deep, nock, 4, 1024, false).total_bytes();
  const int64_t per_layer = (loss_acts(deep, nock) - a36) / 36;
  for (int64_t n : {1, 10, 35}) {
    ModelOptions part = o;
    part.recompute_layers = n;
    const int64_t t = estimate_memory(deep, part, 4, 1024, false).total_bytes();
    EXPECT_LT(t, prev) << n;
    prev = t;
    // The saved activations behind the loss: exactly 36 - n layer graphs more than all-recomputed.
    EXPECT_EQ(loss_acts(deep, part) - a36, (36 - n) * per_layer) << n;
  }
  EXPECT_LT(estimate_memory(deep, o, 4, 1024, false).total_bytes(), prev);
}

// Two examples packed into one row (segments, restarted positions, the second example's first
// label ignored, cu_seqlens given) against the same examples as two unpacked rows: the summed
// loss and every gradient agree to fp32 rounding (the masked path; cu_seqlens is only a hint
// on the CPU). The tolerance covers summation order only.
TEST(Qwen3Model, PackedLossAndGradientsEqualUnpacked) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = fp32_all();
  at::Tensor ids = e.load("input_ids");  // (2, 24)
  at::Tensor a = ids[0].narrow(0, 0, 10), b = ids[1].narrow(0, 0, 14);
  auto labels_of = [](const at::Tensor& x) {
    at::Tensor l = x.clone();
    l[0] = -100;
    return l;
  };
  ModelInputs un;
  un.input_ids = at::full({2, 14}, 0, at::kLong);
  un.input_ids[0].narrow(0, 0, 10).copy_(a);
  un.input_ids[1].copy_(b);
  un.labels = at::full({2, 14}, -100, at::kLong);
  un.labels[0].narrow(0, 0, 10).copy_(labels_of(a));
  un.labels[1].copy_(labels_of(b));
  un.attention_mask = at::zeros({2, 14}, at::kLong);
  un.attention_mask[0].narrow(0, 0, 10).fill_(1);
  un.attention_mask[1].fill_(1);
  ModelInputs pk;
  pk.input_ids = at::cat({a, b, at::zeros({4}, at::kLong)}).unsqueeze(0);  // (1, 28), 4 pads
  pk.labels = at::cat({labels_of(a), labels_of(b), at::full({4}, -100, at::kLong)}).unsqueeze(0);
  pk.segment_ids = at::cat({at::full({10}, 1, at::kLong), at::full({14}, 2, at::kLong),
                            at::zeros({4}, at::kLong)})
                       .unsqueeze(0);
  pk.position_ids =
      at::cat({at::arange(10, at::kLong), at::arange(14, at::kLong), at::zeros({4}, at::kLong)})
          .unsqueeze(0);
  pk.cu_seqlens = at::tensor(std::vector<int32_t>{0, 10, 24, 28}, at::kInt);
  pk.max_seqlen = 14;
  auto run = [&](const ModelInputs& in) {
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    EXPECT_FALSE(m.uses_varlen_attention(in));  // CPU: always the masked path
    LossOutput lo = m.loss(in);
    EXPECT_EQ(lo.num_tokens.item<int64_t>(), 9 + 13);
    lo.loss_sum.backward();
    std::map<std::string, at::Tensor> g;
    for (const auto& p : m.parameters()) g[p.name] = p.grad.clone();
    g["loss_sum"] = lo.loss_sum.detach().reshape({1});
    return g;
  };
  const auto gu = run(un), gp = run(pk);
  // Element-wise rtol, plus an atol of ~30 fp32 ulps of the tensor's largest value: the two
  // layouts sum in different orders (GEMM shapes, the thread split), and an element far below its
  // tensor's scale (a cancellation) keeps only the absolute error of those sums. Measured with
  // LibTorch 2.11 and 16 threads (H100 host): embed_tokens' worst element -0.006468
  // vs -0.006470 (|diff| 4.5e-6) where the largest |value| is 6.35; with 1 or 4 threads, or
  // LibTorch 1.13, within 1e-6.
  for (const auto& [name, t] : gu) {
    const double scale = std::max(1.0, t.abs().max().item<double>());
    EXPECT_CLOSE(gp.at(name), t, 1e-4, 2e-6 * scale, name);
  }
}

// The in-backward hook hands over every trainable parameter exactly once per backward, with the
// same gradient the buffered run leaves in Parameter::grad, and frees it afterwards; with and
// without checkpointing (where the taps enter the graph only in the recompute), and with the
// recompute's MLP in row chunks (each MLP weight's gradient summed over 3 chunks of 20, 20 and 8
// tokens before its tap delivers it once).
TEST(Qwen3Model, GradReadyHookDeliversEachCompleteGradientOnce) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  const ModelInputs in = fixture_inputs(e);
  for (const int64_t mode : {0, 1, 2}) {
    ModelOptions o = fp32_all(/*checkpointing=*/mode != 2);
    if (mode == 1) o.mlp_chunk_tokens = 20;
    SCOPED_TRACE(mode == 0 ? "checkpointing" : mode == 1 ? "chunked MLP" : "no checkpointing");
    Qwen3Model ref = Qwen3Model::load(cfg, w, o);
    const auto want = run_backward(ref, in);
    Qwen3Model m = Qwen3Model::load(cfg, w, o);
    std::map<std::string, at::Tensor> got;
    std::map<std::string, int> calls;
    m.set_grad_ready_hook([&](Parameter& p) {
      ++calls[p.name];
      got[p.name] = p.grad.to(at::kFloat).clone();
    });
    for (int round = 0; round < 2; ++round) {  // the counts reset between steps
      calls.clear();
      m.begin_grad_step();
      m.loss(in).loss.backward();
      for (const auto& p : m.parameters()) {
        if (!p.trainable) continue;
        EXPECT_EQ(calls[p.name], 1) << p.name;
        EXPECT_FALSE(p.grad.defined()) << p.name << ": freed after the hook";
        EXPECT_TRUE(at::equal(got[p.name], want.at(p.name))) << p.name;
      }
    }
  }
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

// The master fence (data parallelism waits there for masters still being broadcast) runs before
// every read of a trainable master. Here the fence is what delivers each updated master, copied
// from a reference model only when the fence asks for it: the loss, gradients (checkpointing
// recomputes the layers), generation, export and export check then equal the reference model's
// bit for bit, which they could not if anything read a master before its fence. Frozen masters
// (the norms here) never reach it, and a forward asks per parameter, never for all at once.
TEST(Qwen3Model, MasterFenceRunsBeforeEveryMasterRead) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  const ModelInputs in = fixture_inputs(e);
  ModelOptions opt = fp32_all(/*checkpointing=*/true);
  opt.trainable.norms = false;
  Qwen3Model ref = Qwen3Model::load(cfg, w, opt);
  Qwen3Model m = Qwen3Model::load(cfg, w, opt);
  std::map<std::string, Parameter*> late;  // m's trainable parameters, by name
  for (Parameter* p : m.trainable_parameters()) late[p->name] = p;
  ASSERT_LT(late.size(), m.parameters().size()) << "the test needs frozen parameters";
  std::set<std::string> in_flight;       // not yet delivered to m
  std::map<std::string, int> per_param;  // fence(&p) calls
  int all_calls = 0;                     // fence(nullptr) calls
  const auto deliver = [&](const std::string& name) {
    if (in_flight.erase(name) == 0) return;
    late.at(name)->master.copy_(ref.parameter(name).master);
  };
  m.set_master_fence([&](const Parameter* p) {
    if (p != nullptr) {
      ASSERT_TRUE(late.count(p->name)) << p->name << ": a frozen master reached the fence";
      ++per_param[p->name];
      deliver(p->name);
      return;
    }
    ++all_calls;
    for (const auto& kv : late) deliver(kv.first);
  });
  at::Generator gen = at::detail::createCPUGenerator(23);
  // The reference takes an update that m receives only through its fence.
  const auto update = [&] {
    at::NoGradGuard ng;
    for (Parameter* p : ref.trainable_parameters()) {
      p->master.add_(at::randn(p->master.sizes(), gen) * 1e-3);
      in_flight.insert(p->name);
    }
    per_param.clear();
    all_calls = 0;
  };

  update();
  m.zero_grad();
  ref.zero_grad();
  const LossOutput lm = m.loss(in);
  lm.loss.backward();
  const LossOutput lr = ref.loss(in);
  lr.loss.backward();
  EXPECT_TRUE(in_flight.empty()) << "the forward used every trainable master";
  EXPECT_EQ(all_calls, 0) << "a forward waits per parameter";
  EXPECT_EQ(per_param.size(), late.size());
  EXPECT_TRUE(at::equal(lm.loss, lr.loss));
  for (const auto& kv : late) {
    EXPECT_TRUE(at::equal(kv.second->grad, ref.parameter(kv.first).grad)) << kv.first;
  }

  update();
  const std::vector<int64_t> prompt = {1, 5, 9, 2};
  EXPECT_EQ(m.generate(prompt, {6, {}}), ref.generate(prompt, {6, {}}));
  EXPECT_TRUE(in_flight.empty());
  EXPECT_EQ(all_calls, 0);

  update();
  const std::string out_m = temp_path("fence_m.dat"), out_ref = temp_path("fence_ref.dat");
  ref.export_to(w, out_ref);
  m.export_to(w, out_m);
  EXPECT_EQ(all_calls, 1);
  EXPECT_EQ(q4::test::read_text(out_m), q4::test::read_text(out_ref));

  update();
  EXPECT_EQ(m.compare_forward_weights(DatReader(out_ref)),
            ref.compare_forward_weights(DatReader(out_ref)));
  EXPECT_EQ(all_calls, 1);

  for (const auto& accessor : {0, 1, 2}) {
    update();
    if (accessor == 0) (void)m.parameters();
    if (accessor == 1) (void)m.trainable_parameters();
    if (accessor == 2) (void)m.parameter("model.norm.weight");
    EXPECT_TRUE(in_flight.empty()) << "accessor " << accessor;
    EXPECT_EQ(all_calls, 1) << "accessor " << accessor;
  }
  m.set_master_fence(nullptr);
  for (const auto& kv : late) {
    EXPECT_TRUE(at::equal(kv.second->master, ref.parameter(kv.first).master)) << kv.first;
  }
  std::remove(out_m.c_str());
  std::remove(out_ref.c_str());
}

// Options of the generation check per backend: the CPU defaults; fp32 on CUDA. Tolerance of a
// prefill over a non-empty cache against the full forward: 1e-5 on the CPU (the same ops in the
// same order); 1e-4 on CUDA (cuBLAS may pick other kernels for 9 rows than for 16).
ModelOptions generation_options(q4::test::Backend b) {
  ModelOptions o = b == q4::test::Backend::kCuda ? fp32_all() : ModelOptions{};
  o.device = q4::test::device_of(b);
  o.trainable = TrainableSpec::nothing();
  return o;
}
const std::map<q4::test::Backend, double> kCachedPrefillTolerance = {
    {q4::test::Backend::kCpu, 1e-5}, {q4::test::Backend::kCuda, 1e-4}};

TEST_P(Qwen3Backend, KvCacheGenerationMatchesFullRecompute) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  Qwen3Model m = Qwen3Model::load(cfg, w, generation_options(GetParam()));
  at::Tensor ids = e.load("input_ids");
  std::vector<int64_t> prompt(ids.data_ptr<int64_t>(), ids.data_ptr<int64_t>() + 9);
  const std::vector<int64_t> got = test::expect_generate_matches_recompute(m, prompt, 12);
  ASSERT_EQ(got.size(), 12u);
  // Stop tokens end generation and are returned.
  GenerateOptions g;
  g.max_new_tokens = 12;
  g.stop_ids = {got[3]};
  std::vector<int64_t> stopped = m.generate(prompt, g);
  EXPECT_EQ(stopped, std::vector<int64_t>(got.begin(), got.begin() + 4));

  // Prefill of several tokens on top of a non-empty cache (causal mask offset).
  KvCache cache = m.make_cache(1, 24);
  ModelInputs p1, p2, full;
  p1.input_ids = ids.narrow(1, 0, 7).narrow(0, 0, 1);
  p2.input_ids = ids.narrow(1, 7, 9).narrow(0, 0, 1);
  full.input_ids = ids.narrow(1, 0, 16).narrow(0, 0, 1);
  m.forward(p1, &cache);
  at::Tensor l2 = m.forward(p2, &cache);
  EXPECT_EQ(cache.length, 16);
  const double tol = kCachedPrefillTolerance.at(GetParam());
  EXPECT_CLOSE(l2, m.forward(full).narrow(1, 7, 9), tol, tol, "cached prefill");
}

// Long context: positions 131,060..131,083 and 262,120..262,143 with Qwen3-4B-Instruct-2507's
// RoPE (theta 5e6, 262,144 positions) against transformers at the same positions
// (qwen3_tiny.far_positions.dat), plain precision, fp32: the RoPE phases (fp32 products of the
// position and the inverse frequency, as transformers forms them) and everything after them.
TEST_P(Qwen3Backend, FarPositionsMatchHf) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), masters(kPlainExpected), e(kFarPositions);
  cfg.rope_theta = e.load("rope_theta").item<double>();
  cfg.max_position_embeddings = 262144;
  ASSERT_EQ(cfg.rope_theta, 5e6);
  ModelOptions o = fp32_all();
  o.fake_quant = false;
  o.device = device();
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  {
    at::NoGradGuard ng;
    for (auto& p : m.parameters()) p.master.copy_(masters.load(p.name));
  }
  ModelInputs in = fixture_inputs(e);
  in.position_ids = e.load("position_ids");
  ASSERT_EQ(in.position_ids.max().item<int64_t>(), 262143);
  ASSERT_EQ(in.position_ids[0][0].item<int64_t>(), 131060);
  const FixtureTolerances tol = kFixtureFp32.at(GetParam());
  {
    at::NoGradGuard ng;
    const at::Tensor logits = m.forward(in);
    EXPECT_CLOSE(logits, e.load("logits"), tol.logits.rtol, tol.logits.atol, "logits");
    // The positions are used: RoPE is relative, so the same tokens at stride 2 from the same
    // start give other logits.
    ModelInputs stretched = in;
    const at::Tensor start = in.position_ids.narrow(1, 0, 1);
    stretched.position_ids = start + 2 * (in.position_ids - start);
    EXPECT_GT((m.forward(stretched).cpu() - e.load("logits")).abs().max().item<double>(), 1e-3);
  }
  at::Tensor loss;
  auto grads = run_backward(m, in, &loss);
  EXPECT_CLOSE(loss.reshape({1}), e.load("loss"), tol.loss.rtol, tol.loss.atol, "loss");
  for (const auto& p : m.parameters()) {
    EXPECT_CLOSE(grads[p.name], e.load("grad." + p.name), tol.grad.rtol, tol.grad.atol,
                 "grad." + p.name);
  }
}

Q4_INSTANTIATE_BACKENDS(Qwen3Backend);

// ---------------------------------------------------------------------------------------------
// CUDA only: the training configuration (fp16 masters, bf16 compute and grads) against the
// fixture, and the checkpointing memory claim (peak grows with one layer input per layer).
// Every test skips without a GPU.
#define SKIP_WITHOUT_CUDA() \
  if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA device"

// fp32_all (everything trainable, checkpointing) on the GPU in the given dtypes.
ModelOptions cuda_options(at::ScalarType master, at::ScalarType compute, at::ScalarType grad) {
  ModelOptions o = fp32_all();
  o.device = at::Device(at::kCUDA, 0);
  o.master_dtype = master;
  o.compute_dtype = compute;
  o.grad_dtype = grad;
  return o;
}

struct RunResult {
  at::Tensor logits, loss;
  std::map<std::string, at::Tensor> grads;
};

RunResult run_fixture(Qwen3Model& m, const DatReader& e) {
  ModelInputs in;
  in.input_ids = e.load("input_ids");
  in.labels = e.load("labels");
  RunResult r;
  {
    at::NoGradGuard ng;
    r.logits = m.forward(in).to(at::kFloat).cpu();
  }
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  r.loss = lo.loss.detach().cpu().reshape({1});
  for (const auto& p : m.parameters()) r.grads[p.name] = p.grad.to(at::kFloat).cpu();
  return r;
}

TEST(Qwen3ModelCuda, FixtureBf16Compute) {
  SKIP_WITHOUT_CUDA();
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  Qwen3Model m = Qwen3Model::load(cfg, w, cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16));
  RunResult r = run_fixture(m, e);
  // bf16 keeps 8 significant bits (relative rounding 2^-9 ~ 0.2%) at every op boundary; two
  // layers of ~10 rounded ops plus the bf16 logits matmul give a few tenths of a percent per
  // activation, growing in the backward. Bounds: loss within 1% relative; logits within 2% of
  // their norm (relative L2); every gradient tensor within 5% relative L2 (norm gradients,
  // sums over all tokens, are the most sensitive).
  EXPECT_LT(rel_err(r.loss, e.load("loss")), 1e-2);
  EXPECT_LT(rel_err(r.logits, e.load("logits")), 2e-2);
  for (const auto& kv : r.grads) {
    EXPECT_LT(rel_err(kv.second, e.load("grad." + kv.first)), 5e-2) << kv.first;
  }
}

#if Q4_WITH_CUDA
int64_t peak_step_bytes(int64_t layers, bool ckpt, int64_t recompute_layers = -1,
                        bool offload = false) {
  auto cfg = Qwen3Config::from_json_file(kConfig);
  cfg.hidden_size = 256;
  cfg.intermediate_size = 768;
  cfg.num_hidden_layers = layers;
  cfg.num_attention_heads = 8;
  cfg.num_key_value_heads = 4;
  cfg.head_dim = 32;
  cfg.max_position_embeddings = 1024;
  ModelOptions o = cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16);
  o.gradient_checkpointing = ckpt;
  o.recompute_layers = recompute_layers;
  o.offload_layer_inputs = offload;
  o.trainable = TrainableSpec::nothing();  // no grads: measure activations only
  o.trainable.embeddings = true;           // ... but still a backward through every layer
  Qwen3Model m = Qwen3Model::random_init(cfg, o, 1, 0.02);
  ModelInputs in;
  in.input_ids = at::randint(0, cfg.vocab_size, {4, 512}, at::kLong);
  in.labels = in.input_ids.clone();
  torch::cuda::synchronize();
  const auto base = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].current;
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  LossOutput lo = m.loss(in);
  lo.loss.backward();
  torch::cuda::synchronize();
  const auto peak = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
  return peak - base;
}
#endif

// Recomputed layers with their inputs in pinned host memory: bit-identical loss and gradients,
// and the peak no longer grows with the layer count by a layer input each.
TEST(Qwen3ModelCuda, OffloadedLayerInputsGiveIdenticalGradients) {
  SKIP_WITHOUT_CUDA();
  auto cfg = Qwen3Config::from_json_file(kConfig);
  DatReader w(kWeights), e(kExpected);
  ModelOptions o = cuda_options(at::kHalf, at::kBFloat16, at::kBFloat16);
  o.trainable = TrainableSpec::everything();
  Qwen3Model a = Qwen3Model::load(cfg, w, o);
  o.offload_layer_inputs = true;
  Qwen3Model b = Qwen3Model::load(cfg, w, o);
  at::Tensor la, lb;
  auto ga = run_backward(a, fixture_inputs(e), &la);
  auto gb = run_backward(b, fixture_inputs(e), &lb);
  EXPECT_TRUE(at::equal(la.cpu(), lb.cpu()));
  for (const auto& kv : ga) EXPECT_TRUE(at::equal(kv.second.cpu(), gb[kv.first].cpu())) << kv.first;
#if Q4_WITH_CUDA
  const int64_t boundary = 4 * 512 * 256 * 2;
  const int64_t on8 = peak_step_bytes(8, true, -1, true), on2 = peak_step_bytes(2, true, -1, true);
  RecordProperty("peak_offload_L2_L8", std::to_string(on2) + " " + std::to_string(on8));
  EXPECT_LT(on8 - on2, 2 * boundary);
#endif
}

TEST(Qwen3ModelCuda, CheckpointingPeakGrowsByOneLayerInput) {
  SKIP_WITHOUT_CUDA();
#if Q4_WITH_CUDA
  const int64_t boundary = 4 * 512 * 256 * 2;  // one bf16 layer input (B, T, H)
  const int64_t ck2 = peak_step_bytes(2, true), ck8 = peak_step_bytes(8, true);
  const int64_t no2 = peak_step_bytes(2, false), no8 = peak_step_bytes(8, false);
  RecordProperty("peak_ckpt_L2_L8", std::to_string(ck2) + " " + std::to_string(ck8));
  RecordProperty("peak_nockpt_L2_L8", std::to_string(no2) + " " + std::to_string(no8));
  // 6 more layers with checkpointing: 6 saved layer inputs (+ allocator rounding slack of one
  // more); without it each layer keeps ~20 activation tensors.
  EXPECT_LE(ck8 - ck2, 7 * boundary);
  EXPECT_GT(no8 - no2, 5 * (ck8 - ck2));
  // Recomputing the first 4 of 8: between the two, about half-way.
  const int64_t half8 = peak_step_bytes(8, true, 4);
  RecordProperty("peak_recompute4_L8", std::to_string(half8));
  EXPECT_GT(half8, ck8 + (no8 - ck8) / 4);
  EXPECT_LT(half8, no8 - (no8 - ck8) / 4);
#else
  GTEST_SKIP() << "built without Q4_WITH_CUDA (no allocator statistics)";
#endif
}

}  // namespace
}  // namespace q4::model

namespace q4::model {
namespace {

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
