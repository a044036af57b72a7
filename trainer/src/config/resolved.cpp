// Values derived from the config that several components read (device, compute dtype, export
// path, recompute layers, in-backward updates).
#include <c10/util/Exception.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include "q4/io/bounded_read.h"
#include "q4/io/enum_names.h"
#include "q4/trainer/config/config.h"

namespace fs = std::filesystem;

#include "config/config_text.h"

namespace q4::trainer {
using namespace config_detail;

// ---------------------------------------------------------------------------------------------
// Derived settings

bool device_is_cuda(const Config& c) {
  const std::string& d = c.model.device;
  if (d == "cuda") return true;
  if (d.rfind("cuda:", 0) != 0) return false;
  int64_t idx = 0;
  return parse_int(d.substr(5), &idx) && idx >= 0;
}

Dtype resolved_compute_dtype(const Config& c) {
  switch (c.model.compute_dtype) {
    case DtypeOrAuto::kFp32:
      return Dtype::kFp32;
    case DtypeOrAuto::kBf16:
      return Dtype::kBf16;
    case DtypeOrAuto::kFp16:
      return Dtype::kFp16;
    case DtypeOrAuto::kAuto:
      break;
  }
  return device_is_cuda(c) ? Dtype::kBf16 : Dtype::kFp32;
}

bool resolved_packing(const Config& c, const ObjectiveNeeds& needs) {
  return c.data.packing && needs.packing_allowed;
}

std::string resolved_export_path(const Config& c) {
  const std::string& p = c.output.export_path;
  if (p == "none") return "";
  if (p.empty()) return (fs::path(c.output.dir) / "model.dat").string();
  fs::path path(p);
  if (path.is_absolute()) return path.string();
  return (fs::path(c.output.dir) / path).lexically_normal().string();
}

void set_recompute_layers(Config& c, int64_t n, int64_t num_layers, bool offload_layer_inputs,
                          int64_t keep_attention, int64_t keep_mlp) {
  c.train.offload_layer_inputs = n > 0 && offload_layer_inputs;
  c.train.recompute_keep_attention = n > 0 ? keep_attention : 0;
  c.train.recompute_keep_mlp = n > 0 ? keep_mlp : 0;
  if (n <= 0) {
    c.train.gradient_checkpointing = Recompute::kFalse;
    c.train.recompute_layers = -1;
  } else {
    c.train.gradient_checkpointing = Recompute::kTrue;
    c.train.recompute_layers = n >= num_layers ? -1 : n;
  }
}

int64_t resolved_mlp_chunk_tokens(const Config& c) {
  if (c.train.mlp_chunk_tokens.value) return *c.train.mlp_chunk_tokens.value;
  return c.train.batch_size * c.train.seq_len > kAutoMlpChunkAboveTokens ? kAutoMlpChunkTokens : 0;
}

bool in_backward_updates(const Config& c) {
  switch (c.optim.in_backward) {
    case InBackward::kTrue:
      return true;
    case InBackward::kFalse:
      return false;
    case InBackward::kAuto:
      break;
  }
  // Adapters: their gradients are small (nothing to free early), and the buffered step takes
  // their norm in a few multi-tensor launches instead of three launches per adapter tensor.
  // Several micro-batches a step: only with masters in host memory, whose summed gradients then
  // go to their updates without a round trip over PCIe (docs/optim.md, "In-backward updates").
  return device_is_cuda(c) && c.train.method != TrainMethod::kLora &&
         (c.train.grad_accum == 1 || c.optim.offload == Offload::kAll);
}

std::string point_config_at_run_dir(Config& c, const std::string& run_dir) {
  const fs::path old_dir = fs::absolute(c.output.dir).lexically_normal();
  const fs::path new_dir = fs::absolute(run_dir).lexically_normal();
  if (old_dir == new_dir) return "";
  const fs::path exp(c.output.export_path);
  if (exp.is_absolute()) {
    const fs::path rel = exp.lexically_normal().lexically_relative(old_dir);
    if (!rel.empty() && *rel.begin() != "..") c.output.export_path = rel.string();
  }
  c.output.dir = new_dir.string();
  return "note: --resume writes into " + new_dir.string() + "; the config's output.dir " +
         old_dir.string() + " is not used (--set output.dir=... writes elsewhere)";
}

}  // namespace q4::trainer
