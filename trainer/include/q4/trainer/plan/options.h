// Library options from the run's resolved config: what the model, optimizer, schedule, data
// loader, batcher and HF export are built with. Settings the libraries define are their own
// enums in the config already; the three mappings left turn the config's own enums (a dtype
// name, a truncation or HF format after `auto`/`none` is resolved) into the libraries' types.
#pragma once

#include <cstdint>

#include "q4/data/dataset.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config/config.h"

namespace q4::trainer {

at::ScalarType to_scalar_type(Dtype d);
model::HfFormat to_model(HfExport e);  // never kNone

model::TrainableSpec trainable_spec(const Config& c);
model::ModelOptions model_options(const Config& c);  // device, dtypes, trainable, checkpointing
optim::AdamWOptions adamw_options(const Config& c);
// The LR schedule over a run of `steps` optimizer steps (the run plan's resolved length).
optim::LrScheduleOptions lr_schedule_options(const Config& c, int64_t steps);
data::DatasetOptions dataset_options(const Config& c);
// data.chat_template and data.enable_thinking; auto (a Config that parse_config did not resolve)
// resolved from the folder of model.tokenizer.
data::ChatOptions chat_options(const Config& c);
// Batcher settings of a run (training and the probe alike). On CUDA the batch's rows are laid
// end to end in one row (the varlen attention separates the examples) and shapes are kept
// stable: packed batches are always batch_size * seq_len long, unpacked ones are padded to a
// multiple of 64, so the allocator and the kernels see a handful of shapes.
data::BatcherOptions batcher_options(const Config& c, int64_t pad_id);

}  // namespace q4::trainer
