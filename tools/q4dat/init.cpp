// q4dat init: a random Qwen3 model in the layout of the shipped NVFP4 Qwen3-4B file (entries of
// the qwen3_params.h table: HF names, embed/norms fp16, every linear as .weight.qdata (e2m1, 100)
// + .weight.scale (e4m3, 101), order as in tests/fixtures/qwen3_tiny.weights.dat). Written
// streaming: each matrix is drawn in row chunks of ~4M values (normal(0, std), fp32), quantized
// chunk by chunk and appended, so memory stays O(chunk + one scale matrix) even for the 4B shapes.
// Chunk c of tensor k uses its own generator seeded from (seed, k, c): output is reproducible and
// independent of threading.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/core.h>

#include <chrono>

#include "../cli_number.h"
#include "common.h"
#include "q4/io/dat_file.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/qwen3_params.h"
#include "q4/quant/nvfp4.h"
#include "q4dat.h"

namespace q4::tools {

using q4::io::DatWriter;
using q4::io::ElemType;
using q4::model::Qwen3Config;

namespace {

constexpr int64_t kChunkValues = int64_t{1} << 22;

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

uint64_t fnv1a(const std::string& s) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001B3ull;
  return h;
}

class Init {
 public:
  Init(DatWriter& w, uint64_t seed, double std) : w_(w), seed_(seed), std_(std) {}

  // normal(0, std) rows [r0, r0 + n) of the (rows, cols) tensor identified by `seed_key`, fp32.
  at::Tensor draw(const std::string& seed_key, int64_t chunk, int64_t n, int64_t cols) const {
    const uint64_t s =
        splitmix64(seed_ ^ splitmix64(fnv1a(seed_key) + static_cast<uint64_t>(chunk)));
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s);
    return at::normal(0.0, std_, {n, cols}, gen, at::TensorOptions().dtype(at::kFloat));
  }

  static int64_t chunk_rows(int64_t cols) { return std::max<int64_t>(1, kChunkValues / cols); }

  // fp16 (rows, cols) matrix, streamed.
  void dense_fp16(const std::string& key, int64_t rows, int64_t cols) {
    w_.begin_streamed(key, ElemType::kFloat16, {rows, cols});
    const int64_t step = chunk_rows(cols);
    for (int64_t r0 = 0, c = 0; r0 < rows; r0 += step, ++c) {
      w_.append(draw(key, c, std::min(step, rows - r0), cols).to(at::kHalf));
    }
  }

  // NVFP4 (rows, cols) linear: key.qdata streamed, then key.scale. With round_fp16 the values are
  // rounded to fp16 before quantizing (a tied lm_head derived from the fp16 embedding).
  void linear(const std::string& key, int64_t rows, int64_t cols, const std::string& seed_key,
              bool round_fp16) {
    w_.begin_nvfp4(key, rows, cols, ElemType::kE2M1Packed);
    const int64_t step = chunk_rows(cols);
    for (int64_t r0 = 0, c = 0; r0 < rows; r0 += step, ++c) {
      const int64_t n = std::min(step, rows - r0);
      at::Tensor x = draw(seed_key, c, n, cols);  // (n, cols) fp32
      if (round_fp16) x = x.to(at::kHalf).to(at::kFloat);
      w_.append_nvfp4(q4::quant::quantize_nvfp4(x, key));  // (n, cols/2) + (n, cols/16)
    }
  }

  void ones_fp16(const std::string& key, int64_t n) {
    w_.add(key, at::ones({n}, at::TensorOptions().dtype(at::kHalf)));
  }

 private:
  DatWriter& w_;
  uint64_t seed_;
  double std_;
};

}  // namespace

int run_init(const InitOptions& o) {
  const Qwen3Config c = as_input([&] { return Qwen3Config::from_json_file(o.config); });
  for (const auto& [name, v] : {std::pair<const char*, int64_t>{"hidden_size", c.hidden_size},
                                {"intermediate_size", c.intermediate_size},
                                {"num_attention_heads * head_dim", c.q_dim()}}) {
    if (v % q4::quant::kNvfp4BlockSize != 0) {
      throw InputError(
          fmt::format("{}: {} = {} is not a multiple of {}, so the linears that "
                      "read it cannot be stored as NVFP4",
                      o.config, name, v, q4::quant::kNvfp4BlockSize));
    }
  }
  // fp16 embeddings overflow to Inf once a draw passes 65504 (std ~ 1e4 over 1e8 draws); far
  // below that, every NVFP4 block saturates at the largest E4M3 scale. 100 leaves room for
  // experiments and writes finite weights.
  const double std = parse_positive_arg("--std", o.std, 100.0);
  const auto seed = static_cast<uint64_t>(parse_int_arg("--seed", o.seed, 0, INT64_MAX));
  bool separate_lm_head = true;
  bool lm_head_from_embed = false;
  if (o.tied == "yes") {
    if (!c.tie_word_embeddings) {
      throw InputError(fmt::format("--tied yes: {} says tie_word_embeddings is false", o.config));
    }
    separate_lm_head = false;
  } else if (o.tied == "auto") {
    // The shipped file stores lm_head separately and quantized even though the model is tied:
    // with a tied config it is the quantized embedding, otherwise an independent matrix.
    lm_head_from_embed = c.tie_word_embeddings;
  } else if (o.tied != "no") {
    throw InputError("--tied: expected auto, yes or no, found " + o.tied);
  }

  check_output_file(o.out, {o.config}, o.overwrite, "--out");
  const auto t0 = std::chrono::steady_clock::now();
  const std::vector<q4::model::ParamSpec> specs = q4::model::qwen3_parameters(c, separate_lm_head);
  uint64_t count = 0;
  for (const auto& p : specs) count += p.kind == q4::model::ParamKind::kQuantizedLinear ? 2 : 1;
  DatWriter w(o.out, count);
  Init init(w, seed, std);
  const std::string embed = "model.embed_tokens.weight";
  for (const auto& p : specs) {
    switch (p.kind) {
      case q4::model::ParamKind::kEmbedding:
        init.dense_fp16(p.name, p.shape[0], p.shape[1]);  // (V, H)
        break;
      case q4::model::ParamKind::kRaw:
        if (p.group == q4::model::ParamGroup::kRouter) {
          init.dense_fp16(p.name, p.shape[0], p.shape[1]);  // (E, H) ~ N(0, std)
        } else {
          init.ones_fp16(p.name, p.shape[0]);  // an RMSNorm weight
        }
        break;
      case q4::model::ParamKind::kQuantizedLinear: {
        // A tied lm_head stored separately is the quantized (fp16-rounded) embedding.
        const bool from_embed = p.group == q4::model::ParamGroup::kLmHead && lm_head_from_embed;
        init.linear(p.name, p.shape[0], p.shape[1], from_embed ? embed : p.name, from_embed);
        break;
      }
    }
  }
  w.commit();
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("{}: {} entries, {} bytes, {} parameters, lm_head {}, {:.1f} s\n", o.out, count,
             w.bytes_written(), c.num_parameters(separate_lm_head),
             !separate_lm_head ? "tied (none stored)"
                               : (lm_head_from_embed ? "quantized embedding" : "independent"),
             secs);
  return 0;
}

}  // namespace q4::tools
