// Shared check of the model tests (CPU and CUDA): greedy generation with the KV cache must pick,
// token for token, the argmax of a full forward (no cache) over the prompt plus the tokens
// generated so far. The full forward is the reference: it shares no cache code.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "q4/model/qwen3.h"

namespace q4::model::test {

// Generates `n` tokens after `prompt` (no stop ids) and checks each against the recomputed
// argmax; returns the generated ids.
inline std::vector<int64_t> expect_generate_matches_recompute(Qwen3Model& m,
                                                              const std::vector<int64_t>& prompt,
                                                              int n) {
  GenerateOptions g;
  g.max_new_tokens = n;
  g.stop_ids = {};
  const std::vector<int64_t> got = m.generate(prompt, g);
  EXPECT_EQ(got.size(), static_cast<size_t>(n));
  std::vector<int64_t> seq = prompt;
  at::NoGradGuard ng;
  for (size_t i = 0; i < got.size(); ++i) {
    ModelInputs in;
    in.input_ids = at::tensor(seq, at::kLong).unsqueeze(0);
    const int64_t tok = m.forward(in)[0][-1].argmax().item<int64_t>();
    EXPECT_EQ(got[i], tok) << "step " << i;
    seq.push_back(tok);
  }
  return got;
}

}  // namespace q4::model::test
