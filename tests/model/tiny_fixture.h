// The tiny Qwen3 fixture the model tests share (tests/fixtures/qwen3_tiny.*: config, weights and
// the HF transformers outputs they are checked against, fake-quantized and plain), seeded random
// inputs, and a relative error for comparing outputs.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace q4::model {

inline const std::string kFixtures = Q4_FIXTURES_DIR;
inline const std::string kConfig = kFixtures + "/qwen3_tiny.config.json";
inline const std::string kWeights = kFixtures + "/qwen3_tiny.weights.dat";
inline const std::string kExpected = kFixtures + "/qwen3_tiny.expected.dat";
// Plain precision (no quantization anywhere): masters moved off the NVFP4 grid, stored as raw
// fp32 entries under their HF names, and HF's outputs for them (make_plain_fixture.py).
inline const std::string kPlainExpected = kFixtures + "/qwen3_tiny.plain_expected.dat";
// The plain model at positions past 131,072 with the 2507 RoPE (make_far_positions_fixture.py).
inline const std::string kFarPositions = kFixtures + "/qwen3_tiny.far_positions.dat";
// The tiny Qwen3-MoE fixture (tests/fixtures/README.md): config, weights, the HF reference's
// outputs, and the same model as an HF folder.
inline const std::string kMoeConfig = kFixtures + "/qwen3_moe_tiny.config.json";
inline const std::string kMoeWeights = kFixtures + "/qwen3_moe_tiny.weights.dat";
inline const std::string kMoeExpected = kFixtures + "/qwen3_moe_tiny.expected.dat";
inline const std::string kMoeHf = kFixtures + "/qwen3_moe_tiny_hf";

// A model that only generates: nothing trainable, no checkpointing.
inline ModelOptions inference_options() {
  ModelOptions opt;
  opt.trainable = TrainableSpec::nothing();
  opt.gradient_checkpointing = false;
  return opt;
}

// The tiny config with normal(0, std) weights drawn from `seed` (Qwen3Model::random_init).
inline Qwen3Model tiny_random_model(uint64_t seed, const ModelOptions& opt = inference_options(),
                                    double std = 0.5) {
  return Qwen3Model::random_init(Qwen3Config::from_json_file(kConfig), opt, seed, std);
}

// (batch, len) random token ids below the vocabulary from `seed`, each its own label.
inline ModelInputs random_inputs(const Qwen3Config& cfg, int64_t batch, int64_t len,
                                 uint64_t seed) {
  at::Generator gen = at::detail::createCPUGenerator(seed);
  ModelInputs in;
  in.input_ids = at::randint(0, cfg.vocab_size, {batch, len}, gen, at::kLong);
  in.labels = in.input_ids.clone();
  return in;
}

// ||a - e|| / ||e|| in fp32 on the host.
inline double rel_err(const at::Tensor& a, const at::Tensor& e) {
  at::Tensor a32 = a.to(at::kFloat).cpu(), e32 = e.to(at::kFloat).cpu();
  return ((a32 - e32).norm() / e32.norm().clamp_min(1e-30)).item<double>();
}

}  // namespace q4::model
