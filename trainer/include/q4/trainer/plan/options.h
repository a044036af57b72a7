// Library options from the run's resolved config: what the model, optimizer, schedule, data
// loader, batcher and HF export are built with. Settings the libraries define are their own
// enums in the config already; the three mappings left turn the config's own enums (a dtype
// name, a truncation or HF format after `auto`/`none` is resolved) into the libraries' types.
#pragma once

#include <cstdint>
#include <string>

#include "q4/data/dataset.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config/config.h"
#include "q4/trainer/rundir/run_dir.h"

namespace q4::trainer {

at::ScalarType to_scalar_type(Dtype d);
model::HfFormat to_model(HfExport e);  // never kNone

// Which decoder layers recompute in backward (train.gradient_checkpointing resolved; auto stays
// unresolved until the memory is known: recompute_auto).
struct RecomputePlan {
  bool recompute_auto = false;  // auto, not resolved yet (CUDA: decided once the model loads)
  bool enabled = false;         // some layer recomputes
  int64_t layers = -1;          // the first N recompute; -1 every one
  bool offload_layer_inputs = false;
  int64_t keep_attention = 0;
  int64_t keep_mlp = 0;

  // The first `n` of `num_layers` decoder layers recompute (0: none; num_layers or more: every
  // one), their inputs offloaded or not, `keep_attention` and `keep_mlp` of them keeping one
  // block's activations (what set_recompute_layers writes into a config).
  static RecomputePlan first(int64_t n, int64_t num_layers, bool offload_layer_inputs = false,
                             int64_t keep_attention = 0, int64_t keep_mlp = 0);
};

// train.gradient_checkpointing and its companions as configured (auto: recompute_auto on CUDA,
// where the run decides once the model loads; the CPU recomputes nothing).
RecomputePlan configured_recompute(const Config& c);

model::TrainableSpec trainable_spec(const Config& c);
// Device, dtypes, trainable, checkpointing: the recompute as configured (configured_recompute),
// or `recompute` (a plan's, or a choice the estimate tries).
model::ModelOptions model_options(const Config& c);
model::ModelOptions model_options(const Config& c, const RecomputePlan& recompute);
optim::AdamWOptions adamw_options(const Config& c);
// The LR schedule over a run of `steps` optimizer steps (the run plan's resolved length).
optim::LrScheduleOptions lr_schedule_options(const Config& c, int64_t steps);
data::DatasetOptions dataset_options(const Config& c);
// data.chat_template and data.enable_thinking; auto (a Config that parse_config did not resolve)
// resolved from the folder of model.tokenizer.
data::ChatOptions chat_options(const Config& c);
// The same from a model's chat settings.
data::ChatOptions chat_options(const ChatSettings& chat);
// Batcher settings of a run (training and the probe alike). On CUDA the batch's rows are laid
// end to end in one row (the varlen attention separates the examples) and shapes are kept
// stable: packed batches are always batch_size * seq_len long, unpacked ones are padded to a
// multiple of 64, so the allocator and the kernels see a handful of shapes.
// `group` rows stay together (2: a preference pair), packed when `pack` (DataPlan).
data::BatcherOptions batcher_options(const Config& c, int64_t pad_id, bool pack, int64_t group);
// The run directory's paths and the run's inputs (rundir/run_dir.h), the export path resolved.
RunPaths run_paths(const Config& c);

}  // namespace q4::trainer
