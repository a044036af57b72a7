// bench_optim: time of one PackedAdamW step on a Qwen3-4B-shaped parameter set (36 layers of
// q/k/v/o/gate/up/down + embed + lm_head = 4.41e9 parameters; fp16 masters, bf16 gradients), or
// with --model 30b-a3b a Qwen3-30B-A3B-shaped one (48 layers of q/k/v/o, the router and the
// three stacked expert matrices of 128 experts + embed + lm_head = 30.5e9 parameters), in
// each moment mode, against the HBM floor (bytes the step actually touches / 3.35 TB/s) and the
// step's peak extra device memory (CUDA allocator: peak during the step minus allocated before).
// --layers/--scale shrink the set for smoke tests on CPU. Every line names the device.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "q4/optim/adamw.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

namespace {

struct Args {
  std::string modes = "fp32,int8,4bit,nvfp4";
  std::string model = "4b";  // 4b or 30b-a3b
  int64_t layers = -1;       // -1: the model's
  int64_t scale = 1;         // every dimension divided by this (rounded up to a multiple of 16)
  int steps = 5;
  int warmup = 2;
  int64_t chunk_rows = 1024;
  std::string device = "auto";
  double hbm_tbps = 3.35;  // H100 SXM HBM3 peak
  std::string rounding = "stochastic";
  std::string arithmetic = "fast";  // CUDA int8/4-bit kernels: fast, exact or both
};

void usage() {
  std::printf(
      "usage: bench_optim [--modes fp32,int8,4bit,nvfp4] [--model 4b|30b-a3b] [--layers N]\n"
      "                   [--scale S] [--steps K]\n"
      "                   [--warmup W] [--chunk-rows R] [--device auto|cuda|cpu]\n"
      "                   [--hbm-tbps 3.35] [--rounding stochastic|nearest]\n"
      "                   [--arithmetic fast|exact|both]  (CUDA int8/4bit kernels)\n");
}

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    auto val = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "bench_optim: %s needs a value\n", k.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (k == "--modes") {
      a.modes = val();
    } else if (k == "--model") {
      a.model = val();
    } else if (k == "--layers") {
      a.layers = std::stoll(val());
    } else if (k == "--scale") {
      a.scale = std::stoll(val());
    } else if (k == "--steps") {
      a.steps = std::stoi(val());
    } else if (k == "--warmup") {
      a.warmup = std::stoi(val());
    } else if (k == "--chunk-rows") {
      a.chunk_rows = std::stoll(val());
    } else if (k == "--device") {
      a.device = val();
    } else if (k == "--hbm-tbps") {
      a.hbm_tbps = std::stod(val());
    } else if (k == "--rounding") {
      a.rounding = val();
    } else if (k == "--arithmetic") {
      a.arithmetic = val();
      if (a.arithmetic != "fast" && a.arithmetic != "exact" && a.arithmetic != "both") {
        std::fprintf(stderr, "bench_optim: --arithmetic must be fast, exact or both\n");
        std::exit(2);
      }
    } else if (k == "--help" || k == "-h") {
      usage();
      std::exit(0);
    } else {
      std::fprintf(stderr, "bench_optim: unknown option %s\n", k.c_str());
      usage();
      std::exit(2);
    }
  }
  if (a.model != "4b" && a.model != "30b-a3b") {
    std::fprintf(stderr, "bench_optim: --model must be 4b or 30b-a3b\n");
    std::exit(2);
  }
  if (a.layers < 0) a.layers = a.model == "4b" ? 36 : 48;
  if (a.layers < 0 || a.scale < 1 || a.steps < 1 || a.warmup < 0) {
    std::fprintf(stderr, "bench_optim: --layers >= 0, --scale >= 1, --steps >= 1 required\n");
    std::exit(2);
  }
  return a;
}

struct Shape {
  std::string name;
  int64_t rows, cols;
};

// The shapes of a Qwen3 model's linears as its parameter table holds them: attention, then the
// dense MLP or (experts > 0) the router and the three stacked expert matrices.
struct ModelShapes {
  int64_t hidden, q_dim, kv_dim, ffn, experts;
};
constexpr ModelShapes kQwen3_4b{2560, 4096, 1024, 9728, 0};
// Qwen3-30B-A3B: attention of 32/4 heads of 128, 128 experts of 768.
constexpr ModelShapes kQwen3_30b_a3b{2048, 4096, 512, 768, 128};

std::vector<Shape> model_shapes(const ModelShapes& m, int64_t layers, int64_t scale) {
  auto d = [&](int64_t x) { return std::max<int64_t>(16, ((x / scale + 15) / 16) * 16); };
  const int64_t H = d(m.hidden), F = d(m.ffn), E = std::max<int64_t>(m.experts, 1);
  std::vector<Shape> s;
  s.push_back({"embed_tokens", d(151936), H});
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "layers." + std::to_string(l) + ".";
    s.push_back({p + "q_proj", d(m.q_dim), H});
    s.push_back({p + "k_proj", d(m.kv_dim), H});
    s.push_back({p + "v_proj", d(m.kv_dim), H});
    s.push_back({p + "o_proj", H, d(m.q_dim)});
    const std::string ffn = p + (m.experts > 0 ? "experts." : "");
    if (m.experts > 0) s.push_back({p + "router", E, H});
    s.push_back({ffn + "gate_proj", E * F, H});
    s.push_back({ffn + "up_proj", E * F, H});
    s.push_back({ffn + "down_proj", E * H, F});
  }
  s.push_back({"lm_head", d(151936), H});
  return s;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (start <= s.size()) {
    const size_t comma = s.find(',', start);
    const std::string item = s.substr(start, comma == std::string::npos ? comma : comma - start);
    if (!item.empty()) out.push_back(item);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return out;
}

// The device --device names (auto: CUDA when available) and its name for the output lines;
// nullopt (after a message) when it cannot be used.
struct Device {
  at::Device device{at::kCPU};
  bool cuda = false;
  std::string name = "cpu";
  void sync() const {
    if (cuda) torch::cuda::synchronize();
  }
};
std::optional<Device> pick_device(const Args& args) {
  Device d;
  if (args.device == "cuda") {
    d.cuda = true;
  } else if (args.device == "auto") {
    d.cuda = torch::cuda::is_available();
  } else if (args.device != "cpu") {
    std::fprintf(stderr, "bench_optim: --device must be auto, cuda or cpu\n");
    return std::nullopt;
  }
  if (d.cuda && !torch::cuda::is_available()) {
    std::fprintf(stderr, "bench_optim: --device cuda but no CUDA GPU is available\n");
    return std::nullopt;
  }
#if Q4_WITH_CUDA
  if (d.cuda) d.name = at::cuda::getCurrentDeviceProperties()->name;
#else
  if (d.cuda) {
    std::fprintf(stderr, "bench_optim: built without CUDA kernels (-DQ4_ENABLE_CUDA=ON)\n");
    return std::nullopt;
  }
#endif
  if (d.cuda) d.device = at::Device(at::kCUDA, 0);
  return d;
}

// Same-run baseline: the device's achieved copy bandwidth (read + write bytes / time of a large
// copy_), so each step can also be put against a floor measured on this card. TB/s.
double copy_bandwidth_tbps(const Device& d, int64_t total) {
  const int64_t elems = std::min<int64_t>(int64_t{1} << 30, std::max<int64_t>(total, 1 << 20));
  at::Tensor src = at::empty({elems}, at::TensorOptions().device(d.device).dtype(at::kHalf));
  at::Tensor dst = at::empty_like(src);
  src.fill_(1.0);
  for (int w = 0; w < 2; ++w) dst.copy_(src);
  d.sync();
  const int reps = 5;
  const auto c0 = std::chrono::steady_clock::now();
  for (int r = 0; r < reps; ++r) dst.copy_(src);
  d.sync();
  const double sec =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - c0).count() / reps;
  const double tbps = 2.0 * static_cast<double>(src.nbytes()) / sec / 1e12;
  std::printf("[%s] baseline: copy_ of %.2f GB: %.3f ms = %.3f TB/s (read + write)\n",
              d.name.c_str(), src.nbytes() / 1e9, sec * 1e3, tbps);
  return tbps;
}

// Mean milliseconds of `steps` calls of fn, synchronized.
template <class F>
double mean_ms(const Device& d, int steps, F&& fn) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int s = 0; s < steps; ++s) fn();
  d.sync();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
         steps;
}

// Peak extra memory of one step: the CUDA allocator's peak over what was allocated before, or
// the CPU step's scratch arena.
int64_t step_extra_bytes(const Device& d, q4::optim::PackedAdamW& opt,
                         const std::vector<at::Tensor>& grads) {
#if Q4_WITH_CUDA
  if (d.cuda) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(0);
    const auto before = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    opt.step(grads);
    d.sync();
    const auto after = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
    return after.allocated_bytes[0].peak - before.allocated_bytes[0].current;
  }
#endif
  opt.release_scratch();
  opt.step(grads);
  return opt.scratch_peak_bytes();
}

struct ModeResult {
  double step_ms = 0;
};

// One state mode (exact or fast block arithmetic): warm-up, peak memory, timed steps, the norm
// pass alone, and the line that puts the step against the traffic floors.
ModeResult bench_mode(const Args& args, const Device& d, const std::vector<Shape>& shapes,
                      const std::vector<at::Tensor>& masters, const std::vector<at::Tensor>& grads,
                      const std::string& mode_name, bool exact, double copy_tbps, double fp32_ms) {
  q4::optim::AdamWOptions o;
  o.cuda_exact_arithmetic = exact;
  o.lr = 1e-5;
  o.weight_decay = 0.01;
  o.state_mode = q4::optim::parse_state_mode(mode_name);
  o.rounding = q4::optim::parse_master_rounding(args.rounding);
  o.chunk_rows = args.chunk_rows;
  q4::optim::PackedAdamW opt(o);
  for (size_t i = 0; i < shapes.size(); ++i) opt.add_param(shapes[i].name, masters[i]);
  for (int w = 0; w < args.warmup; ++w) opt.step(grads);
  d.sync();
  const int64_t extra_bytes = step_extra_bytes(d, opt, grads);
  ModeResult r;
  r.step_ms = mean_ms(d, args.steps, [&] { opt.step(grads); });
  const double norm_ms = mean_ms(d, args.steps, [&] { q4::optim::global_grad_norm(grads); });
  const q4::optim::StepTraffic t = opt.step_traffic(at::kBFloat16);
  const double floor_ms = static_cast<double>(t.total()) / (args.hbm_tbps * 1e12) * 1e3;
  const double copy_floor_ms = static_cast<double>(t.total()) / (copy_tbps * 1e12) * 1e3;
  const std::string vs_fp32 = fp32_ms > 0 && mode_name != "fp32"
                                  ? " vs fp32 " + std::to_string(r.step_ms / fp32_ms) + "x"
                                  : "";
  std::printf(
      "[%s] mode=%-5s state=%.3f GB  step=%.2f ms (norm pass %.2f ms)  traffic=%.3f GB  "
      "floor=%.2f ms @ %.2f TB/s  step/floor=%.2fx  step/copy-floor=%.2fx  %s=%.1f MB%s\n",
      d.name.c_str(), (mode_name + (exact ? "/exact" : "")).c_str(), opt.state_bytes() / 1e9,
      r.step_ms, norm_ms, t.total() / 1e9, floor_ms, args.hbm_tbps, r.step_ms / floor_ms,
      r.step_ms / copy_floor_ms, d.cuda ? "peak_extra" : "scratch_peak", extra_bytes / 1e6,
      vs_fp32.c_str());
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  const Args args = parse(argc, argv);
  try {
    const std::optional<Device> dev = pick_device(args);
    if (!dev) return args.device == "auto" || args.device == "cpu" || args.device == "cuda" ? 1 : 2;
    const Device& d = *dev;
    const std::vector<Shape> shapes =
        model_shapes(args.model == "4b" ? kQwen3_4b : kQwen3_30b_a3b, args.layers, args.scale);
    std::vector<at::Tensor> masters, grads;
    int64_t total = 0;
    {
      at::NoGradGuard ng;
      for (const Shape& s : shapes) {
        masters.push_back((at::randn({s.rows, s.cols}, at::TensorOptions().device(d.device)) * 0.02)
                              .to(at::kHalf));
        grads.push_back((at::randn({s.rows, s.cols}, at::TensorOptions().device(d.device)) * 1e-3)
                            .to(at::kBFloat16));
        total += s.rows * s.cols;
      }
    }
    d.sync();
    std::printf(
        "[%s] bench_optim: %s, %zu tensors, %.4g parameters (layers %lld, scale 1/%lld), fp16 "
        "masters, bf16 grads, %d timed steps after %d warm-up\n",
        d.name.c_str(), args.model.c_str(), shapes.size(), static_cast<double>(total),
        static_cast<long long>(args.layers), static_cast<long long>(args.scale), args.steps,
        args.warmup);
    const double copy_tbps = copy_bandwidth_tbps(d, total);
    double fp32_ms = 0.0;
    std::vector<std::pair<std::string, bool>> runs;  // (mode, exact arithmetic)
    for (const std::string& mode_name : split(args.modes)) {
      const bool block = mode_name == "int8" || mode_name == "4bit";
      if (block && args.arithmetic != "fast") runs.emplace_back(mode_name, true);
      if (!block || args.arithmetic != "exact") runs.emplace_back(mode_name, false);
    }
    for (const auto& [mode_name, exact] : runs) {
      const ModeResult r =
          bench_mode(args, d, shapes, masters, grads, mode_name, exact, copy_tbps, fp32_ms);
      if (mode_name == "fp32") fp32_ms = r.step_ms;
    }
    return 0;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "bench_optim: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_optim: %s\n", e.what());
    return 1;
  }
}
