// Export of the trained model (docs/trainer.md#export, docs/design.md#trainer-components): the
// .dat at output.export_path (the source file's untrained tensors copied, the trained ones
// re-quantized), its export record (the step, so an older checkpoint never replaces a newer
// export), the Hugging Face folder (output.hf_export) and the export check (the file read back
// as inference loads it, compared with the trained model's forward weights).
#pragma once

#include <cstdint>
#include <iosfwd>
#include <string>

#include "q4/model/qwen3.h"
#include "q4/trainer/plan/component_plans.h"

namespace q4::trainer {

class Exporter {
 public:
  Exporter(ExportPlan plan, std::ostream& out, std::ostream& err);

  // The model of `step` to output.export_path (nothing when export is off); `source_path`: the
  // .dat the untrained tensors come from. Errors (a failed write or check) propagate.
  void write(int64_t step, model::Qwen3Model& model, const std::string& source_path);
  // A periodic export (output.export_every): one that fails is a warning and training goes on;
  // the final one (step train.steps) is an error.
  void write_periodic(int64_t step, model::Qwen3Model& model, const std::string& source_path);

 private:
  void write_hf_folder(const std::string& dat_path);
  void write_adapter(const std::string& dat_path, model::Qwen3Model& model,
                     const std::string& source_path);
  void check(const std::string& path, model::Qwen3Model& model);

  const ExportPlan plan_;
  std::ostream& out_;
  std::ostream& err_;
};

}  // namespace q4::trainer
