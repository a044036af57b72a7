// The preference losses against a direct fp64 computation from the log-probabilities: each
// pair's loss, its gradient with respect to the policy's chosen and rejected log-probabilities
// (derived by hand below, not by autograd) and the rewards, for DPO's sigmoid loss (with and
// without label smoothing), IPO and SimPO, in fp32 and fp64.
#include "q4/trainer/preference.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

using namespace q4::trainer;

namespace {

struct Direct {
  std::vector<double> loss, d_chosen, d_rejected, r_chosen, r_rejected;
};

double log_sigmoid(double x) { return x >= 0 ? -std::log1p(std::exp(-x)) : x - std::log1p(std::exp(x)); }
double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// L = -(1 - e) log s(b z) - e log s(-b z); dL/dz = -(1 - e) b s(-b z) + e b s(b z).
void sigmoid_form(double z, double b, double e, double* l, double* dz) {
  *l = -(1 - e) * log_sigmoid(b * z) - e * log_sigmoid(-b * z);
  *dz = -(1 - e) * b * sigmoid(-b * z) + e * b * sigmoid(b * z);
}

Direct direct(const std::vector<double>& c, const std::vector<double>& r,
              const std::vector<double>& nc, const std::vector<double>& nr,
              const std::vector<double>& rc, const std::vector<double>& rr,
              const PreferenceLossOptions& o) {
  Direct d;
  const double b = o.beta;
  for (size_t i = 0; i < c.size(); ++i) {
    double l = 0, dz = 0, zc = 0, zr = 0;  // z = zc - zr (- gamma / beta); dz/dc, dz/dr below
    double dzc = 1, dzr = 1;
    switch (o.kind) {
      case PreferenceLossKind::kSigmoid:
        zc = c[i] - rc[i];
        zr = r[i] - rr[i];
        sigmoid_form(zc - zr, b, o.label_smoothing, &l, &dz);
        break;
      case PreferenceLossKind::kIpo:
        zc = (c[i] - rc[i]) / nc[i];
        zr = (r[i] - rr[i]) / nr[i];
        l = std::pow(zc - zr - 1 / (2 * b), 2);
        dz = 2 * (zc - zr - 1 / (2 * b));
        dzc = 1 / nc[i];
        dzr = 1 / nr[i];
        break;
      case PreferenceLossKind::kSimpo:
        zc = c[i] / nc[i];
        zr = r[i] / nr[i];
        sigmoid_form(zc - zr - o.simpo_gamma / b, b, o.label_smoothing, &l, &dz);
        dzc = 1 / nc[i];
        dzr = 1 / nr[i];
        break;
    }
    d.loss.push_back(l);
    d.d_chosen.push_back(dz * dzc);
    d.d_rejected.push_back(-dz * dzr);
    d.r_chosen.push_back(b * zc);
    d.r_rejected.push_back(b * zr);
  }
  return d;
}

at::Tensor as(const std::vector<double>& v, at::ScalarType dt) {
  return at::tensor(v, at::TensorOptions().dtype(at::kDouble)).to(dt);
}

void expect_close(const at::Tensor& got, const std::vector<double>& want, double rtol,
                  const std::string& what) {
  const at::Tensor g = got.to(at::kDouble).cpu();
  ASSERT_EQ(g.numel(), static_cast<int64_t>(want.size())) << what;
  for (size_t i = 0; i < want.size(); ++i) {
    const double x = g[static_cast<int64_t>(i)].item<double>();
    EXPECT_NEAR(x, want[i], rtol * (std::fabs(want[i]) + 1e-3)) << what << " pair " << i;
  }
}

}  // namespace

TEST(PreferenceLoss, EveryKindMatchesADirectFp64Computation) {
  // Six pairs: answers of 3-40 tokens, log-probabilities of about -1.5 a token, references near
  // the policy; pair 4 has the policy far ahead of the reference (a saturated sigmoid).
  const std::vector<double> nc = {12, 3, 40, 7, 25, 9}, nr = {10, 30, 5, 7, 22, 14};
  std::vector<double> c, r, rc, rr;
  for (size_t i = 0; i < nc.size(); ++i) {
    c.push_back(-1.5 * nc[i] + 0.7 * static_cast<double>(i) - 1.1);
    r.push_back(-1.6 * nr[i] - 0.4 * static_cast<double>(i) + 0.3);
    rc.push_back(c.back() + (i == 4 ? -60.0 : 0.9 - 0.35 * static_cast<double>(i)));
    rr.push_back(r.back() + 0.2 * static_cast<double>(i) - 0.5);
  }
  struct Case {
    PreferenceLossKind kind;
    double beta, smoothing;
  };
  for (const Case k : {Case{PreferenceLossKind::kSigmoid, 0.1, 0.0},
                       Case{PreferenceLossKind::kSigmoid, 0.5, 0.1},
                       Case{PreferenceLossKind::kIpo, 0.1, 0.0},
                       Case{PreferenceLossKind::kIpo, 0.6, 0.0},
                       Case{PreferenceLossKind::kSimpo, 2.0, 0.0},
                       Case{PreferenceLossKind::kSimpo, 2.5, 0.15}}) {
    PreferenceLossOptions o;
    o.kind = k.kind;
    o.beta = k.beta;
    o.label_smoothing = k.smoothing;
    const Direct want = direct(c, r, nc, nr, rc, rr, o);
    for (at::ScalarType dt : {at::kFloat, at::kDouble}) {
      const std::string what = std::string(q4::io::enum_name(k.kind)) + " beta " +
                               std::to_string(k.beta) + " smoothing " +
                               std::to_string(k.smoothing) + (dt == at::kFloat ? " fp32" : " fp64");
      PreferencePairs p;
      p.chosen_logps = as(c, dt).requires_grad_(true);
      p.rejected_logps = as(r, dt).requires_grad_(true);
      p.chosen_tokens = as(nc, at::kLong);
      p.rejected_tokens = as(nr, at::kLong);
      if (k.kind != PreferenceLossKind::kSimpo) {
        p.ref_chosen_logps = as(rc, dt);
        p.ref_rejected_logps = as(rr, dt);
      }
      const PreferenceLossOutput out = preference_loss(p, o);
      out.losses.sum().backward();
      const double rtol = dt == at::kFloat ? 2e-5 : 1e-12;
      expect_close(out.losses, want.loss, rtol, what + " loss");
      expect_close(p.chosen_logps.grad(), want.d_chosen, rtol, what + " d/d chosen");
      expect_close(p.rejected_logps.grad(), want.d_rejected, rtol, what + " d/d rejected");
      expect_close(out.chosen_rewards, want.r_chosen, rtol, what + " chosen reward");
      expect_close(out.rejected_rewards, want.r_rejected, rtol, what + " rejected reward");
      EXPECT_FALSE(out.chosen_rewards.requires_grad()) << what;
    }
  }
}

TEST(PreferenceLoss, MistakesNameTheField) {
  auto message = [](const PreferencePairs& p, const PreferenceLossOptions& o) {
    try {
      preference_loss(p, o);
    } catch (const c10::Error& e) {
      return std::string(e.what_without_backtrace());
    }
    return std::string("no error");
  };
  PreferencePairs p;
  p.chosen_logps = at::zeros({3});
  p.rejected_logps = at::zeros({3});
  p.chosen_tokens = at::ones({3});
  p.rejected_tokens = at::ones({3});
  PreferenceLossOptions o;
  EXPECT_NE(message(p, o).find("ref_chosen_logps must be (3)"), std::string::npos);
  o.kind = PreferenceLossKind::kSimpo;  // reference-free
  EXPECT_EQ(message(p, o), "no error");
  o.beta = 0;
  EXPECT_NE(message(p, o).find("preference.beta"), std::string::npos);
  o.beta = 1;
  o.label_smoothing = 0.5;
  EXPECT_NE(message(p, o).find("preference.label_smoothing"), std::string::npos);
  o.label_smoothing = 0;
  p.rejected_tokens = at::ones({2});
  EXPECT_NE(message(p, o).find("rejected_tokens must be (3)"), std::string::npos);
}
