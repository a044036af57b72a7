// q4dat sub-commands. Each returns the process exit code; problems with what the user gave
// (arguments, input files, configs) are thrown as InputError (exit 2), everything else that
// throws is a runtime failure (exit 1). main.cpp owns the command line and the error mapping.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

#include "../tool_errors.h"

namespace q4::tools {

struct InfoOptions {
  std::string file;
  std::string config;  // optional config.json: the MoE summary and expert counts
  bool json = false;
};
int run_info(const InfoOptions& o);

struct QuantizeOptions {
  std::string in, out, match;
  int qdata_elem = 0;      // element type of the written .qdata entries: 0 (uint8) or 100 (e2m1)
  bool overwrite = false;  // OUT may replace an existing file
};
int run_quantize(const QuantizeOptions& o);

struct DequantizeOptions {
  std::string in, out;
  std::string dtype = "fp32";  // fp32 | fp16 | bf16
  bool overwrite = false;
};
int run_dequantize(const DequantizeOptions& o);

struct DiffOptions {
  std::string a, b;
  double atol = 0.0;
  bool quiet = false;  // only entries that differ, and the summary
};
int run_diff(const DiffOptions& o);  // 0 equal, 1 different (errors throw)

struct InitOptions {
  std::string config, out;
  std::string seed = "0";     // integer in [0, 2^63 - 1]
  std::string std = "0.02";   // number in (0, kMaxInitStd]
  std::string tied = "auto";  // auto | yes | no
  bool overwrite = false;
};
int run_init(const InitOptions& o);

struct ExportHfOptions {
  std::string in, out_dir, config;
  std::string format = "modelopt";  // modelopt | compressed-tensors
  std::string tokenizer_dir;        // tokenizer files + generation_config.json to copy
  bool raw_bf16 = false;            // embedding and norms as BF16 (default: the .dat's type)
  double max_shard_gb = 5.0;
  bool overwrite = false;  // replace the files of a folder that is not a q4train export
};
int run_export_hf(const ExportHfOptions& o);

struct ImportHfOptions {
  std::string in_dir, out;
  bool overwrite = false;  // OUT may replace an existing file (never one the import reads)
  bool dense = false;      // dense linears stay dense (HfImportOptions::keep_dense)
};
int run_import_hf(const ImportHfOptions& o);

}  // namespace q4::tools
