// Export, HF folder and export check; see exporter.h.
#include "q4/trainer/output/exporter.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>

#include "q4/model/dat_file.h"
#include "q4/model/hf_interop.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/rundir/export_check.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/metrics.h"
#include "q4/trainer/runtime/nvtx.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {

Exporter::Exporter(ExportPlan plan, std::ostream& out, std::ostream& err)
    : plan_(std::move(plan)), out_(out), err_(err) {}

void Exporter::write_periodic(int64_t step, model::Qwen3Model& model,
                              const std::string& source_path) {
  if (step == plan_.steps) return write(step, model, source_path);
  try {
    write(step, model, source_path);
  } catch (const std::exception& e) {
    const c10::Error* ce = dynamic_cast<const c10::Error*>(&e);
    err_ << "warning: export at step " << step
         << " failed, training goes on: " << (ce ? ce->what_without_backtrace() : e.what()) << "\n";
  }
}

void Exporter::write(int64_t step, model::Qwen3Model& model, const std::string& source_path) {
  const std::string& path = plan_.path;
  if (path.empty()) return;
  // Never over a newer export (a periodic export of a resumed older checkpoint, say).
  check_export_not_newer(path, step, plan_.overwrite, /*unknown_is_error=*/false, plan_.output_dir);
  NvtxRange r("export");
  const auto t0 = Clock::now();
  {
    model::DatReader source(source_path);
    model.export_to(source, path, plan_.export_dense);
  }
  record_export_step(path, step, plan_.output_dir);
  out_ << fmt::format("export step {} -> {} ({:.1f} s)\n", step, path, ms_since(t0) / 1000.0);
  if (plan_.lora) write_adapter(path, model, source_path);
  write_hf_folder(path);
  if (!plan_.verify_export) return;
  check(path, model);
  plan_.guard.check("after the export check");
}

// Reads the export back as inference would load it and compares, tensor by tensor, the weights
// its forward would use with the trained model's: equal weights, equal answers, without a
// second model in device memory.
void Exporter::check(const std::string& path, model::Qwen3Model& model) {
  const auto t1 = Clock::now();
  const auto differ = model.compare_forward_weights(model::DatReader(path));
  const auto n = static_cast<int64_t>(model.parameters().size());
  // Trained NVFP4 tensors may differ in a few re-quantized blocks (export_check.h).
  const auto requantized = [&](const std::string& name) {
    for (const auto& p : model.parameters()) {
      // A trained NVFP4 tensor, or an adapted one (its merge is quantized the same way).
      if (p.name == name) return p.quantized && (p.trainable || p.lora_a != nullptr);
    }
    return false;
  };
  const auto report = summarize_export_check(differ, n, requantized, ms_since(t1) / 1000.0);
  for (const auto& line : report.lines) out_ << line << "\n";
  if (!report.failures.empty()) {
    throw std::runtime_error(
        fmt::format("export check failed: {} tensor(s) of {} differ from the trained model beyond "
                    "re-quantization (listed above)",
                    report.failures.size(), path));
  }
}

// train.method lora: the adapters as a PEFT folder next to the merged .dat, and for plain
// adapters how much their merge changed in requantization.
void Exporter::write_adapter(const std::string& dat_path, model::Qwen3Model& model,
                             const std::string& source_path) {
  const std::string dir = adapter_dir(dat_path);
  // The base: model.dir, else model.weights, else the random init's .dat the run started from.
  std::string base = plan_.model_dir.empty() ? plan_.model_weights : plan_.model_dir;
  if (base.empty()) base = source_path;
  model.export_adapter(dir, base);
  int64_t full = 0;  // trained beside the adapters: in the folder as modules_to_save
  int64_t adapted = 0;  // a stacked expert projection counts once
  for (const auto& p : model.parameters()) {
    full += p.trainable ? 1 : 0;
    adapted += p.lora_a != nullptr ? 1 : 0;
  }
  out_ << fmt::format("adapter (PEFT) -> {} ({} LoRA pairs, {} full tensors as modules_to_save)\n",
                      dir, adapted, full);
  if (plan_.lora_merge_aware) {
    out_ << fmt::format(
        "merge-aware LoRA: the merged export is the trained model; the adapter on its base "
        "(peft, or --adapter) computes W + B·A·alpha/rank unrounded, {:.1f}% of the adapters' "
        "update (RMS) away from it\n",
        100.0 * model.merged_requantization_error());
  } else {
    out_ << fmt::format(
        "plain LoRA: the merged NVFP4 export is W + B·A·alpha/rank requantized (what the export "
        "check compares with); that rounding is {:.1f}% of the adapters' update (RMS), which "
        "lora.merge_aware: true trains through\n",
        100.0 * model.merged_requantization_error());
  }
}

// output.hf_export: the exported .dat also as a Hugging Face folder next to it.
void Exporter::write_hf_folder(const std::string& dat_path) {
  if (plan_.hf_export == HfExport::kNone) return;
  const auto t0 = Clock::now();
  const std::string dir = hf_export_dir(dat_path);
  model::HfExportOptions o;
  o.format = to_model(plan_.hf_export);
  o.tokenizer_dir = fs::path(plan_.tokenizer).parent_path().string();
  std::ifstream in(plan_.model_config);
  const auto config = nlohmann::json::parse(in);
  const auto rep = model::export_hf(model::DatReader(dat_path), config, dir, o);
  out_ << fmt::format("hf export ({}) -> {} ({} shard(s), {:.1f} s); serve with: vllm serve {}\n",
                      to_string(plan_.hf_export), dir, rep.shards.size(), ms_since(t0) / 1000.0,
                      dir);
}

}  // namespace q4::trainer
