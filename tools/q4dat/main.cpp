// q4dat: command line for .dat files. `info` lists entries and NVFP4 bits per parameter,
// `quantize`/`dequantize` convert dense <-> NVFP4 pairs in place of the originals, `diff`
// compares two files entry by entry, `init` writes a random Qwen3 model in the shipped layout,
// `export-hf` / `import-hf` convert to and from Hugging Face folders (docs/interop.md).
// Exit codes: 0 ok, 1 runtime failure (diff: files differ), 2 usage or bad input.
#include <c10/util/Exception.h>
#include <fmt/core.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "../cli_number.h"
#include "../tool_main.h"
#include "common.h"
#include "q4dat.h"
#include "q4/io/host_heap.h"

namespace {

// A sub-command that writes the .dat OUT from its input: the input positional, OUT and
// --overwrite (an existing OUT is refused without it: check_output_file).
CLI::App* add_writer(CLI::App& app, const char* name, const char* about, const char* in_name,
                     std::string& in, const char* in_help, std::string& out, bool& overwrite) {
  CLI::App* c = app.add_subcommand(name, about);
  c->add_option(in_name, in, in_help)->required();
  c->add_option("OUT", out, "output .dat")->required();
  c->add_flag("--overwrite", overwrite, "replace OUT if it exists");
  return c;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace q4::tools;
  q4::io::keep_freed_host_blocks();  // every subcommand computes on the host (q4/io/host_heap.h)
  CLI::App app{"q4dat: inspect and transform .dat tensor files"};
  app.require_subcommand(1);

  InfoOptions info;
  auto* c_info =
      app.add_subcommand("info", "List entries (type, shape, bytes), totals, NVFP4 bits");
  c_info->add_option("FILE", info.file, ".dat file")->required();
  c_info->add_flag("--json", info.json, "Machine-readable output");
  c_info->add_option("--config", info.config,
                     "Qwen3 config.json: MoE summary (experts, top-k, sparse layers)");

  QuantizeOptions quant;
  auto* c_quant = add_writer(
      app, "quantize", "Replace each 2-D float entry whose key matches by KEY.qdata + KEY.scale",
      "IN", quant.in, "input .dat", quant.out, quant.overwrite);
  c_quant->add_option("--match", quant.match, "ECMAScript regex searched in each key")->required();
  c_quant->add_option("--qdata-elem", quant.qdata_elem, "element type of .qdata: 0 or 100")
      ->check(CLI::IsMember({0, 100}))
      ->capture_default_str();

  DequantizeOptions deq;
  auto* c_deq = add_writer(
      app, "dequantize", "Replace each X.qdata + X.scale pair by a dense X at the .qdata position",
      "IN", deq.in, "input .dat", deq.out, deq.overwrite);
  c_deq->add_option("--dtype", deq.dtype, "dtype of the dense entries")
      ->check(CLI::IsMember({"fp32", "fp16", "bf16"}))
      ->capture_default_str();

  DiffOptions diff;
  auto* c_diff = app.add_subcommand(
      "diff", "Compare entries; exit 0 when equal within --atol, 1 when not, 2 on error");
  c_diff->add_option("A", diff.a, "first .dat")->required();
  c_diff->add_option("B", diff.b, "second .dat")->required();
  c_diff->add_option("--atol", diff.atol, "absolute tolerance on values")
      ->check(CLI::Validator(check_nonnegative_arg, "FLOAT >= 0"))
      ->capture_default_str();
  c_diff->add_flag("--quiet,-q", diff.quiet, "print only entries that differ");

  InitOptions init;
  auto* c_init = app.add_subcommand("init", "Write a random Qwen3 model in the shipped layout");
  c_init->add_option("--config", init.config, "Qwen3 config.json")->required();
  c_init->add_option("--out", init.out, "output .dat")->required();
  c_init->add_option("--seed", init.seed, "RNG seed")->capture_default_str();
  c_init->add_option("--std", init.std, "std of the normal weights, (0, 100]")
      ->capture_default_str();
  c_init
      ->add_option("--tied", init.tied,
                   "lm_head: auto (shipped layout: separate, quantized), yes (none), no")
      ->check(CLI::IsMember({"auto", "yes", "no"}))
      ->capture_default_str();
  c_init->add_flag("--overwrite", init.overwrite, "replace --out if it exists");

  ExportHfOptions exp;
  auto* c_exp = app.add_subcommand(
      "export-hf", "Write a Hugging Face folder vLLM serves (NVFP4, lossless) from a .dat");
  c_exp->add_option("IN", exp.in, "input .dat")->required();
  c_exp->add_option("OUT_DIR", exp.out_dir, "output folder (created)")->required();
  c_exp->add_option("--config", exp.config, "the model's config.json")->required();
  c_exp
      ->add_option("--format", exp.format,
                   "NVFP4 checkpoint layout, or bf16: every tensor dense BF16 (no quantization)")
      ->check(CLI::IsMember({"modelopt", "compressed-tensors", "bf16"}))
      ->capture_default_str();
  c_exp->add_option("--tokenizer-dir", exp.tokenizer_dir,
                    "folder whose tokenizer files and generation_config.json are copied");
  c_exp->add_flag("--raw-bf16", exp.raw_bf16,
                  "embedding and norms as BF16 (default: kept in the .dat's type, lossless)");
  c_exp->add_flag("--overwrite", exp.overwrite,
                  "replace the files of an existing folder that is not a q4train export");
  c_exp->add_option("--max-shard-gb", exp.max_shard_gb, "largest shard, GB (1e9 bytes)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();

  ImportHfOptions imp;
  auto* c_imp = add_writer(
      app, "import-hf", "Write a .dat in the shipped Qwen3 layout from a Hugging Face folder",
      "HF_DIR", imp.in_dir, "folder with config.json and *.safetensors", imp.out, imp.overwrite);
  c_imp->add_flag("--dense", imp.dense,
                  "keep dense linears dense, in the folder's types (for plain-precision training)");

  run_tool("q4dat", app, argc, argv, [&] {
    if (c_info->parsed()) return run_info(info);
    if (c_quant->parsed()) return run_quantize(quant);
    if (c_deq->parsed()) return run_dequantize(deq);
    // diff's exit 1 means "the files differ": any error of its own is 2.
    if (c_diff->parsed()) return as_input<std::exception>([&] { return run_diff(diff); });
    if (c_init->parsed()) return run_init(init);
    if (c_exp->parsed()) return run_export_hf(exp);
    if (c_imp->parsed()) return run_import_hf(imp);
    return 2;
  });
}
