// Qwen3 model tests against the HF transformers fixture (tests/fixtures/qwen3_tiny.*, fp32,
// fake-quant STE on every linear): logits/loss/gradients through the library and through the
// q4grad binary, checkpointing on/off and selective or chunked recompute, chunked vs unchunked
// loss, token log-probabilities, packed rows, the in-backward gradient hook, the master fence,
// and the fixture and KV-cache generation on every backend (Qwen3Backend: cpu, cuda). The file
// variants and export are in qwen3_weights_test.cpp, the memory estimate in
// qwen3_estimate_test.cpp, the CUDA training configuration in cuda/qwen3_cuda_test.cpp.
// Tolerances are the fixture's (tests/fixtures/README.md): logits/loss rtol 1e-4 atol 1e-5,
// gradients atol 1e-5 + rtol 1e-3 (fp32 reassociation across implementations).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
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
#include "qwen3_check.h"
#include "tiny_fixture.h"

namespace q4::model {
namespace {

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

}  // namespace
}  // namespace q4::model
