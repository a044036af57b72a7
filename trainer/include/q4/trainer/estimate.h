// Config -> library options, and the analytic memory budget printed by --dry-run and placed
// beside the measured values in the VRAM probe report. The model library's estimate_memory()
// supplies masters, frozen weights, gradients, activations and the loss chunk; the moments come
// from the optimizer's packed storage sizes for every trainable tensor.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/model/hf_interop.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_config.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config.h"

namespace q4::trainer {

// The config's enumerated settings as the libraries' own option types (auto settings are
// resolved before: Truncation::kAuto and HfExport::kNone have no library counterpart).
at::ScalarType to_scalar_type(Dtype d);
optim::StateMode to_optim(MomentState s);
optim::MasterRounding to_optim(MasterRounding r);
optim::LrScheduleKind to_optim(ScheduleKind k);
data::DataFormat to_data(DataFormat f);
data::OnError to_data(OnError e);
data::Truncation to_data(Truncation t);
model::HfFormat to_model(HfExport e);

model::TrainableSpec trainable_spec(const Config& c);
model::ModelOptions model_options(const Config& c);  // device, dtypes, trainable, checkpointing
optim::AdamWOptions adamw_options(const Config& c);

// Shape of one parameter as the model names it, with its trainability under `c`.
struct ParamShape {
  std::string name;
  std::vector<int64_t> shape;
  bool trainable = false;
  bool decay = true;  // weight decay applies (matrices yes, norms no)
};
// Every parameter of a Qwen3 model in the model library's order (Qwen3Model::parameters());
// `separate_lm_head`: lm_head is its own tensor.
std::vector<ParamShape> parameter_shapes(const model::Qwen3Config& mc, const Config& c,
                                         bool separate_lm_head);

struct MemoryBudget {
  int64_t masters_bytes = 0;      // trainable masters
  int64_t frozen_bytes = 0;       // frozen weights as the forward holds them
  int64_t gradients_bytes = 0;    // gradients of trainable masters
  int64_t moments_bytes = 0;      // AdamW m and v as stored (packed)
  int64_t activations_bytes = 0;  // saved activations + one layer's working set
  int64_t logits_bytes = 0;       // one chunk of fp32 logits and temporaries
  int64_t trainable_elements = 0;
  int64_t total_bytes() const {
    return masters_bytes + frozen_bytes + gradients_bytes + moments_bytes + activations_bytes +
           logits_bytes;
  }
  nlohmann::json to_json() const;
  std::string to_table() const;  // aligned "component  GiB" lines
};

// Budget for one micro-batch of train.batch_size x train.seq_len tokens.
MemoryBudget estimate_budget(const model::Qwen3Config& mc, const Config& c, bool separate_lm_head);

// Training FLOPs per token: 6 x (matmul parameters) + attention (12 x layers x seq_len x q_dim),
// as llm.c counts them (recomputation by checkpointing is not counted).
double train_flops_per_token(const model::Qwen3Config& mc, int64_t seq_len);

}  // namespace q4::trainer
