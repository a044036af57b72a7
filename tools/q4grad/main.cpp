// q4grad: parity tool. Loads a Qwen3 .dat with fp32 masters, every parameter trainable and
// straight-through fake-quant on every quantized linear, runs one forward and backward on
// input_ids/labels from IN.dat, and writes logits, loss and grad.<HF name> (all fp32) to OUT.dat
// for comparison with HF transformers. --adapter DIR applies a PEFT LoRA folder (plain LoRA, its
// linears frozen: zero gradients), for comparison with peft (scripts/bench/lora.sh). OUT is
// checked before anything loads: never one of the inputs (docs/reliability.md#inputs-and-outputs),
// a regular file or a new path in a writable directory, and an existing file only with
// --overwrite. Exit codes: 0 ok, 2 usage/config/input error, 1 runtime.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <torch/cuda.h>

#include <CLI/CLI.hpp>
#include <filesystem>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

#include "../tool_main.h"
#include "q4/io/output_path.h"
#include "q4/model/dat_file.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"

namespace {

struct Args {
  std::string config, weights, inputs, out;
  std::string checkpointing = "on";
  std::string adapter;  // a PEFT LoRA folder applied (plain LoRA); its linears stay frozen
  std::string device = "cpu";
  bool overwrite = false;
};

// --out before anything loads: not an input (whatever --overwrite says), writable, and an
// existing file only with --overwrite.
void check_out(const Args& a) {
  using q4::tools::InputError;
  const std::vector<std::pair<const char*, std::string>> inputs = {{"--config", a.config},
                                                                   {"--weights", a.weights},
                                                                   {"--inputs", a.inputs},
                                                                   {"--adapter", a.adapter}};
  for (const auto& [option, path] : inputs) {
    const std::string rel = q4::io::output_input_relation(a.out, path);
    if (!rel.empty()) {
      throw InputError("--out " + a.out + " " + rel + " the input " + option + " " + path +
                       "; write to another file");
    }
  }
  if (const std::string why = q4::io::output_file_problem(a.out); !why.empty()) {
    throw InputError("--out " + a.out + " " + why + "; q4grad writes a regular file there");
  }
  std::error_code ec;
  if (!a.overwrite && std::filesystem::exists(a.out, ec)) {
    throw InputError("--out " + a.out + " already exists; pass --overwrite to replace it");
  }
}

int run(const Args& a) {
  using namespace q4::model;
  check_out(a);
  at::Device device(at::kCPU);
  if (a.device == "cuda") {
    TORCH_CHECK(torch::cuda::is_available(), "--device cuda: no CUDA device is available");
    device = at::Device(at::kCUDA, 0);
  }
  Qwen3Config cfg = Qwen3Config::from_json_file(a.config);
  DatReader weights(a.weights);
  DatReader inputs(a.inputs);

  ModelOptions opt;
  opt.master_dtype = at::kFloat;
  opt.compute_dtype = at::kFloat;
  opt.grad_dtype = at::kFloat;
  opt.device = device;
  // With an adapter only its A and B train, as in a LoRA run: the base is frozen and computes
  // with dequantize(file) (docs/design.md#training-numerics).
  opt.trainable = a.adapter.empty() ? TrainableSpec::everything() : TrainableSpec::nothing();
  opt.gradient_checkpointing = a.checkpointing == "on";
  if (!a.adapter.empty()) opt = with_adapter(opt, read_adapter_config(a.adapter));
  Qwen3Model model = Qwen3Model::load(cfg, weights, opt);
  if (!a.adapter.empty()) model.load_adapter(a.adapter);

  ModelInputs in;
  in.input_ids = inputs.load("input_ids");
  in.labels = inputs.load("labels");
  TORCH_CHECK(in.input_ids.scalar_type() == at::kLong && in.input_ids.dim() == 2, a.inputs,
              ": input_ids must be int64 [B, T], got ", in.input_ids.sizes());
  TORCH_CHECK(in.labels.scalar_type() == at::kLong && in.labels.sizes() == in.input_ids.sizes(),
              a.inputs, ": labels must be int64 shaped like input_ids ", in.input_ids.sizes(),
              ", got ", in.labels.sizes());

  at::Tensor logits;
  {
    at::NoGradGuard no_grad;
    logits = model.forward(in).to(at::kFloat).cpu().contiguous();  // (B, T, V)
  }
  LossOutput lo = model.loss(in);
  lo.loss.backward();

  const auto& params = model.parameters();
  DatWriter w(a.out, 2 + params.size());
  w.add("logits", logits);
  w.add("loss", lo.loss.detach().to(at::kFloat).cpu().reshape({1}));
  for (const Parameter& p : params) {
    // An adapted linear is frozen (no master: its codes are (rows, cols/2)): a zero gradient.
    const auto shape = p.master.defined()
                           ? p.master.sizes().vec()
                           : std::vector<int64_t>{p.qdata.size(0), 2 * p.qdata.size(1)};
    at::Tensor g =
        p.grad.defined() ? p.grad.to(at::kFloat).cpu().contiguous() : at::zeros(shape, at::kFloat);
    w.add("grad." + p.name, g);
  }
  w.commit();
  std::cout << "q4grad: loss " << lo.loss.item<float>() << " over " << lo.num_tokens.item<int64_t>()
            << " supervised tokens; wrote " << a.out << " (" << params.size()
            << " gradients, checkpointing " << a.checkpointing << ", " << device.str() << ")\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"q4grad: fp32 forward+backward of a Qwen3 .dat for parity checks"};
  Args a;
  app.add_option("--config", a.config, "Qwen3 config.json")->required();
  app.add_option("--weights", a.weights, "weights .dat")->required();
  app.add_option("--inputs", a.inputs, ".dat with int64 input_ids and labels [B, T]")->required();
  app.add_option("--out", a.out, "output .dat (logits, loss, grad.<name>)")->required();
  app.add_option("--checkpointing", a.checkpointing, "per-layer gradient checkpointing")
      ->check(CLI::IsMember({"on", "off"}));
  app.add_flag("--overwrite", a.overwrite, "replace --out if it exists");
  app.add_option("--device", a.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--adapter", a.adapter,
                 "a PEFT LoRA adapter folder: x·Wᵀ + (x·Aᵀ)·Bᵀ·alpha/r, the base frozen and "
                 "only the adapters' gradients written");
  // Every library call reads the user's config, weights or inputs: its errors are input errors.
  q4::tools::run_tool(
      "q4grad", app, argc, argv, [&] { return run(a); },
      /*library_error_code=*/2);
}
