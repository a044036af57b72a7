// q4gen: greedy generation with a KV cache from a Qwen3 .dat, token ids in, token ids out (one
// comma-separated line). Text goes through the tokenizer elsewhere (q4tok / the trainer).
// Inference only: every weight frozen, compute fp32 on CPU, bf16 on CUDA unless --dtype says.
// Exit codes: 0 ok, 2 usage/config/input error, 1 runtime.
#include <ATen/ATen.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "../cli_number.h"
#include "../tool_main.h"
#include "q4/io/host_heap.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace {

constexpr int64_t kMaxNewTokens = int64_t{1} << 20;

std::vector<int64_t> parse_ids(const std::string& s, const char* what) {
  std::vector<int64_t> ids;
  std::stringstream ss(s);
  std::string tok;
  while (std::getline(ss, tok, ',')) {
    const auto b = tok.find_first_not_of(" \t");
    const auto e = tok.find_last_not_of(" \t");
    TORCH_CHECK(b != std::string::npos, what, ": empty token id in '", s, "'");
    tok = tok.substr(b, e - b + 1);
    size_t used = 0;
    int64_t v = 0;
    try {
      v = std::stoll(tok, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    TORCH_CHECK(used == tok.size() && v >= 0, what, ": expected non-negative integer ids, got '",
                tok, "'");
    ids.push_back(v);
  }
  return ids;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4gen: greedy KV-cache generation from token ids"};
  std::string config, weights, prompt, device = "cpu", dtype, stop;
  std::string max_new = "64";
  app.add_option("--config", config, "Qwen3 config.json")->required();
  app.add_option("--weights", weights, "weights .dat")->required();
  app.add_option("--prompt-ids", prompt, "comma-separated prompt token ids")->required();
  app.add_option("--max-new-tokens", max_new, "tokens to generate at most (default 64)");
  app.add_option("--stop-ids", stop, "comma-separated stop ids (default 151645,151643)");
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--dtype", dtype, "compute dtype fp32|bf16|fp16 (default fp32 cpu, bf16 cuda)")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}));
  // Every library call reads the user's config, weights or ids: its errors are input errors.
  q4::tools::run_tool(
      "q4gen", app, argc, argv,
      [&] {
        using namespace q4::model;
        ModelOptions opt;
        opt.trainable = TrainableSpec::nothing();
        if (device == "cuda") {
          TORCH_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available");
          opt.device = at::Device(at::kCUDA, 0);
          opt.compute_dtype = at::kBFloat16;
        } else {
          q4::io::keep_freed_host_blocks();  // CPU compute (q4/io/host_heap.h)
        }
        if (dtype == "fp32") opt.compute_dtype = at::kFloat;
        if (dtype == "bf16") opt.compute_dtype = at::kBFloat16;
        if (dtype == "fp16") opt.compute_dtype = at::kHalf;
        GenerateOptions gen;
        gen.max_new_tokens =
            q4::tools::parse_int_arg("--max-new-tokens", max_new, 0, kMaxNewTokens);
        if (!stop.empty()) gen.stop_ids = parse_ids(stop, "--stop-ids");
        const std::vector<int64_t> ids = parse_ids(prompt, "--prompt-ids");
        Qwen3Config cfg = Qwen3Config::from_json_file(config);
        DatReader reader(weights);
        Qwen3Model model = Qwen3Model::load(cfg, reader, opt);
        const std::vector<int64_t> out = model.generate(ids, gen);
        for (size_t i = 0; i < out.size(); ++i) std::cout << (i ? "," : "") << out[i];
        std::cout << "\n";
        return 0;
      },
      /*library_error_code=*/2);
}
