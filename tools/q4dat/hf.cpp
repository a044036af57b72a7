// q4dat export-hf / import-hf: thin command-line wrappers over q4::model::export_hf and
// import_hf (docs/interop.md). Problems with the inputs (files, config, tensors) are InputErrors.
#include <fmt/core.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common.h"
#include "q4/io/bounded_read.h"
#include "q4/model/hf_interop.h"
#include "q4dat.h"

namespace q4::tools {

namespace {
double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}
}  // namespace

int run_export_hf(const ExportHfOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  q4::model::HfExportOptions opt;
  const auto f = q4::model::hf_format_from_name(o.format);
  if (!f) {
    throw InputError("--format: expected one of " + q4::io::enum_choices<q4::model::HfFormat>() +
                     ", found " + o.format);
  }
  opt.format = *f;
  opt.tokenizer_dir = o.tokenizer_dir;
  opt.raw_bf16 = o.raw_bf16;
  opt.max_shard_bytes = static_cast<uint64_t>(o.max_shard_gb * 1e9);
  nlohmann::json config;
  {
    // A regular file of config.json size: a FIFO or /dev/zero is refused, not read forever.
    const std::string text =
        as_input([&] { return q4::io::read_regular_file(o.config, size_t{16} << 20, "--config"); });
    try {
      config = nlohmann::json::parse(text);
    } catch (const nlohmann::json::exception& e) {
      throw InputError(o.config + ": not valid JSON: " + e.what());
    }
  }
  opt.inputs = {{"--config", o.config}};
  opt.overwrite = o.overwrite;
  const auto rep = as_input([&] {
    q4::model::check_hf_export_dir(
        o.out_dir, {{"IN", o.in}, {"--config", o.config}, {"--tokenizer-dir", o.tokenizer_dir}},
        o.overwrite, "pass --overwrite");
    const q4::model::DatReader r(o.in);
    return q4::model::export_hf(r, config, o.out_dir, opt);
  });
  fmt::print(
      "{}: {} layout, {} NVFP4 linears, {} raw tensors{}, tie_word_embeddings {}, {} shard(s), "
      "{} payload bytes{}{}, {:.1f} s\n",
      o.out_dir, o.format, rep.quantized, rep.raw,
      rep.lm_head_dequantized ? " (lm_head dequantized to BF16)" : "", rep.tied ? "true" : "false",
      rep.shards.size(), rep.payload_bytes, rep.copied.empty() ? "" : ", copied ",
      fmt::format("{}", fmt::join(rep.copied, " ")), seconds_since(t0));
  return 0;
}

int run_import_hf(const ImportHfOptions& o) {
  const auto t0 = std::chrono::steady_clock::now();
  // Every file of the folder counts as an input: the .dat never lands on a shard, a config or a
  // tokenizer file, whatever the import reads.
  std::vector<std::string> inputs = {o.in_dir};
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(o.in_dir, ec)) {
    inputs.push_back(e.path().string());
  }
  check_output_file(o.out, inputs, o.overwrite);
  q4::model::HfImportOptions opt;
  opt.keep_dense = o.dense;
  const auto rep = as_input([&] { return q4::model::import_hf(o.in_dir, o.out, opt); });
  fmt::print(
      "{}: from {} checkpoint: {} linears quantized (NVFP4 rules), {} NVFP4 copied, {} NVFP4 "
      "with the global scale folded ({} blocks changed by E4M3 rounding), {} raw{}{}{}, {:.1f} s\n",
      o.out, rep.source_format, rep.quantized, rep.copied_nvfp4, rep.folded_nvfp4,
      rep.folded_blocks_changed, rep.raw,
      rep.lm_head_from_embedding ? ", lm_head from the tied embedding" : "",
      rep.lm_head_raw ? ", lm_head kept raw as exported" : "",
      rep.ignored.empty() ? "" : fmt::format(", {} tensors ignored", rep.ignored.size()),
      seconds_since(t0));
  return 0;
}

}  // namespace q4::tools
