// bench_model: rollout throughput, the sampling GRPO runs (model::sample_completions with the
// training forward's weights): --prompts prompts of --prompt-len random token ids, each sampled
// --generations times for exactly --new-tokens tokens (no stop ids, so every row runs the whole
// length, as the peer's min_new_tokens does), softmax at --temperature, top-k/top-p off unless
// given. The model is a config.json + .dat (q4dat init makes a random one), every parameter
// trainable (fake-quantized masters, as in a full fine-tune) unless --frozen, its forward
// weights kept for the rollout (Qwen3Model::InferenceWeights) unless --no-keep. Prints the
// device, the generated tokens/s of each of --repeats timed runs after one warm-up, and a
// RESULT {json} line with the median.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/model/sampling.h"

#if Q4_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

struct Args {
  std::string config, weights, device = "auto";
  int64_t prompts = 64, generations = 8, prompt_len = 128, new_tokens = 512;
  double temperature = 1.0, top_p = 1.0;
  int64_t top_k = 0;
  int repeats = 2;
  bool frozen = false, keep = true;
};

void usage() {
  std::printf(
      "usage: bench_model --config config.json --weights model.dat [--prompts 64]\n"
      "                   [--generations 8] [--prompt-len 128] [--new-tokens 512]\n"
      "                   [--temperature 1] [--top-k 0] [--top-p 1] [--repeats 2]\n"
      "                   [--frozen] [--no-keep] [--device auto|cuda|cpu]\n");
}

bool parse(int argc, char** argv, Args* a) {
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    const auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_model: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--config") a->config = val();
    else if (k == "--weights") a->weights = val();
    else if (k == "--device") a->device = val();
    else if (k == "--prompts") a->prompts = std::stoll(val());
    else if (k == "--generations") a->generations = std::stoll(val());
    else if (k == "--prompt-len") a->prompt_len = std::stoll(val());
    else if (k == "--new-tokens") a->new_tokens = std::stoll(val());
    else if (k == "--temperature") a->temperature = std::stod(val());
    else if (k == "--top-k") a->top_k = std::stoll(val());
    else if (k == "--top-p") a->top_p = std::stod(val());
    else if (k == "--repeats") a->repeats = std::stoi(val());
    else if (k == "--frozen") a->frozen = true;
    else if (k == "--no-keep") a->keep = false;
    else return false;
  }
  return !a->config.empty() && !a->weights.empty() && a->prompts > 0 && a->generations >= 2 &&
         a->prompt_len > 0 && a->new_tokens > 0 && a->repeats > 0;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void sync(const at::Device& d) {
  if (d.is_cuda()) torch::cuda::synchronize(d.index());
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  if (!parse(argc, argv, &a)) {
    usage();
    return 2;
  }
  const bool cuda = a.device == "cuda" || (a.device == "auto" && torch::cuda::is_available());
  const at::Device dev = cuda ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU);
  using namespace q4::model;
  const Qwen3Config cfg = Qwen3Config::from_json_file(a.config);
  ModelOptions o;
  o.device = dev;
  o.compute_dtype = cuda ? at::kBFloat16 : at::kFloat;
  o.master_dtype = cuda ? at::kHalf : at::kFloat;
  o.trainable = a.frozen ? TrainableSpec::nothing() : TrainableSpec::everything();
  o.gradient_checkpointing = false;
  const DatReader w(a.weights);
  Qwen3Model m = Qwen3Model::load(cfg, w, o);
  at::manual_seed(0);
  std::vector<std::vector<int64_t>> prompts(a.prompts);
  const at::Tensor ids = at::randint(0, cfg.vocab_size, {a.prompts, a.prompt_len}, at::kLong);
  for (int64_t p = 0; p < a.prompts; ++p) {
    const int64_t* row = ids[p].data_ptr<int64_t>();
    prompts[p].assign(row, row + a.prompt_len);
  }
  SamplingParams sp;
  sp.temperature = a.temperature;
  sp.top_k = a.top_k;
  sp.top_p = a.top_p;
  sp.max_new_tokens = a.new_tokens;
  sp.stop_ids = {};
  sp.seed = 1;
  const std::string name = cuda ? "cuda" : "cpu";
  std::vector<double> rates;
  int64_t kept = 0;
  for (int r = 0; r <= a.repeats; ++r) {
    Qwen3Model::InferenceWeights scope(m, a.keep ? int64_t{1} << 45 : 0);
    sync(dev);
    const auto t0 = std::chrono::steady_clock::now();
    const auto out = sample_completions(m, prompts, a.generations, sp);
    sync(dev);
    const double s = seconds_since(t0);
    int64_t tokens = 0;
    for (const auto& g : out) tokens += static_cast<int64_t>(g.tokens.size());
    kept = scope.bytes();
    std::printf("bench_model [%s] %s run: %lld rows x %lld new tokens in %.2f s = %.0f tok/s\n",
                name.c_str(), r == 0 ? "warm-up" : "timed", static_cast<long long>(out.size()),
                static_cast<long long>(a.new_tokens), s, tokens / s);
    std::fflush(stdout);
    if (r > 0) rates.push_back(tokens / s);
  }
  std::sort(rates.begin(), rates.end());
  const double median = rates[rates.size() / 2];
  double peak_gib = 0;
#if Q4_WITH_CUDA
  if (cuda) {
    const auto st = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    peak_gib = static_cast<double>(st.allocated_bytes[0].peak) / (1 << 30);
  }
#endif
  std::printf(
      "RESULT {\"tool\": \"q4train\", \"device\": \"%s\", \"rows\": %lld, \"prompt_len\": %lld, "
      "\"new_tokens\": %lld, \"tok_s\": %.1f, \"kept_weights_gib\": %.2f, \"peak_gib\": %.2f, "
      "\"trainable\": %s}\n",
      name.c_str(), static_cast<long long>(a.prompts * a.generations),
      static_cast<long long>(a.prompt_len), static_cast<long long>(a.new_tokens), median,
      static_cast<double>(kept) / (1 << 30), peak_gib, a.frozen ? "false" : "true");
  return 0;
}
