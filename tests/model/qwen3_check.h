// Checks the Qwen3 model tests share (qwen3_*_test.cpp, cuda/qwen3_cuda_test.cpp): the fp32
// options, the fixture's inputs, a loss + backward returning the gradients, an elementwise
// closeness check (EXPECT_CLOSE), the fixture's tolerances per backend, and a .dat's layout
// against another's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <string>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/test/backends.h"

namespace q4::model {

inline std::string temp_path(const std::string& name) {
  return ::testing::TempDir() + "/q4model_" + std::to_string(::getpid()) + "_" + name;
}

inline ModelOptions fp32_all(bool checkpointing = true) {
  ModelOptions o;
  o.master_dtype = at::kFloat;
  o.compute_dtype = at::kFloat;
  o.grad_dtype = at::kFloat;
  o.trainable = TrainableSpec::everything();
  o.gradient_checkpointing = checkpointing;
  return o;
}

inline ModelInputs fixture_inputs(const DatReader& expected) {
  ModelInputs in;
  in.input_ids = expected.load("input_ids");
  in.labels = expected.load("labels");
  return in;
}

// max over elements of |a - e| - (atol + rtol |e|); <= 0 means within tolerance.
inline double excess(const at::Tensor& a, const at::Tensor& e, double rtol, double atol) {
  at::Tensor a32 = a.to(at::kFloat).cpu(), e32 = e.to(at::kFloat).cpu();
  return ((a32 - e32).abs() - (e32.abs() * rtol + atol)).max().item<double>();
}

// Where the tolerance is exceeded most: flat index, actual and expected value there.
inline std::string worst_element(const at::Tensor& a, const at::Tensor& e, double rtol,
                                 double atol) {
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
        << worst_element((a), (e), (rtol), (atol));                                         \
  } while (0)

// Loss + backward; returns grads by parameter name (fp32, zeros when undefined).
inline std::map<std::string, at::Tensor> run_backward(Qwen3Model& m, const ModelInputs& in,
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
inline const std::map<q4::test::Backend, FixtureTolerances> kFixtureFp32 = {
    {q4::test::Backend::kCpu, {{1e-4, 1e-5}, {1e-4, 1e-5}, {1e-3, 1e-5}}},
    {q4::test::Backend::kCuda, {{1e-4, 1e-5}, {1e-4, 1e-5}, {1e-3, 1e-5}}},
};

// `got` holds the entries of `want` in the same order, with the same keys, types and shapes.
inline void expect_same_entry_layout(const DatReader& got, const DatReader& want) {
  ASSERT_EQ(got.entries().size(), want.entries().size());
  for (size_t i = 0; i < got.entries().size(); ++i) {
    const io::DatEntry& a = got.entries()[i];
    const io::DatEntry& b = want.entries()[i];
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.type, b.type) << a.key;
    EXPECT_EQ(a.shape, b.shape) << a.key;
  }
}

inline void check_against_fixture(
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

}  // namespace q4::model
