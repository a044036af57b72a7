// The run configuration: plain structs with defaults, parsed once from YAML. `--set key.path=value`
// edits the YAML tree before it is read, so overrides and files go through the same type checks.
// config_fields() is the single table of fields (key, doc, range, choices, aliases): the parser
// checks types, ranges and choices from it, the printer and configs/README.md are generated from
// it. Enumerated settings are typed enums from here on. Unknown keys (with a did-you-mean across
// sections), wrong types, out-of-range values and contradictory settings (validate_config) raise
// ConfigError naming the key path; main maps it to exit 2.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/io/enum_names.h"
#include "q4/model/qwen3.h"
#include "q4/model/qwen3_params.h"
#include "q4/optim/adamw.h"
#include "q4/optim/schedule.h"
#include "q4/trainer/config/objective_needs.h"

namespace q4::trainer {

// A user error (config, CLI, input files): main prints the message and exits with code 2.
class ConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Enumerated settings. Each parses from and prints as its YAML spelling (one spelling table per
// enum in config.cpp, listing the choices in the order the docs show them). A setting that a
// library defines is that library's enum: optim::StateMode (optim.state: fp32 | int8 | 4bit |
// nvfp4), optim::MasterRounding (stochastic | nearest), optim::LrScheduleKind (constant | linear
// | cosine), quant::BlockRule (quant.block_rule: max6 | 4over6), data::DataFormat (auto | tsv |
// jsonl | text), data::OnError (fail | skip), data::TextUnit (file | paragraph | line),
// data::Truncation (auto | cut_left | cut_right | drop | split); their to_string is the library's.
// The enums below are the config's own: settings with no library counterpart, or with an
// `auto`/`none` the trainer resolves first.
enum class InitKind { kFile, kRandom };                 // file | random
enum class Dtype { kFp16, kBf16, kFp32 };               // fp16 | bf16 | fp32
enum class DtypeOrAuto { kAuto, kFp32, kBf16, kFp16 };  // auto | fp32 | bf16 | fp16
// A switch the trainer may resolve itself: auto | true | false (optim.in_backward,
// train.gradient_checkpointing, lora.cache_base_weights).
enum class AutoBool { kAuto, kTrue, kFalse };
using InBackward = AutoBool;
using Recompute = AutoBool;
enum class Offload { kNone, kMoments, kAll };  // none | moments | all
// model.forward_weights: auto | sweep | codes | kept (model::ForwardWeights, or auto).
enum class ForwardWeightsOrAuto { kAuto, kSweep, kCodes, kKept };
using data::Truncation;
enum class ProgressStyle { kAuto, kBar, kLine };  // auto | bar | line
// none | modelopt | compressed-tensors
enum class HfExport { kNone, kModelOpt, kCompressedTensors, kBf16 };
enum class ObjectiveKind {
  kCrossEntropy,
  kDistill,
  kPreference,
  kGrpo
};                                                 // cross_entropy | distill |
                                                   // preference | grpo
enum class TrainMethod { kFull, kLora };           // full | lora
enum class Divergence { kForwardKl, kReverseKl };  // forward_kl | reverse_kl
// The preference losses (preference.h): DPO's sigmoid, IPO, and the reference-free SimPO.
enum class PreferenceLossKind { kSigmoid, kIpo, kSimpo };  // sigmoid | ipo | simpo
// A built-in verifier of reward.functions (docs/trainer.md#rewards).
// exact_match | last_number | regex | json | length
enum class RewardKind { kExactMatch, kLastNumber, kRegex, kJson, kLength };
// GRPO's aggregation of per-token losses (objectives/grpo.h), TRL's loss_type.
enum class GrpoLossType { kGrpo, kDrGrpo, kDapo };  // grpo | dr_grpo | dapo
// What a group's advantages are divided by (TRL's scale_rewards; true = group, false = none).
enum class ScaleRewards { kGroup, kBatch, kNone };  // group | batch | none

std::string to_string(InitKind v);
std::string to_string(Dtype v);
std::string to_string(DtypeOrAuto v);
std::string to_string(AutoBool v);
std::string to_string(Offload v);
std::string to_string(ForwardWeightsOrAuto v);
std::string to_string(data::DataFormat v);
std::string to_string(data::OnError v);
std::string to_string(data::TextUnit v);
std::string to_string(data::ChatTemplate v);
std::string to_string(ProgressStyle v);
std::string to_string(HfExport v);
std::string to_string(ObjectiveKind v);
std::string to_string(TrainMethod v);
std::string to_string(Divergence v);
std::string to_string(PreferenceLossKind v);
std::string to_string(RewardKind v);
std::string to_string(GrpoLossType v);
std::string to_string(ScaleRewards v);

// Which decoder layers a trainable group covers: every layer, none, the last N, or a list.
struct LayerSelection {
  enum class Kind { kAll, kNone, kLast, kList };
  Kind kind = Kind::kAll;
  int64_t last_n = 0;           // kLast: the last `last_n` layers
  std::vector<int64_t> layers;  // kList: layer indices (0-based)

  // "all", "none", "last:N" or a comma-separated index list ("0,3,5"); ConfigError otherwise.
  static LayerSelection parse(const std::string& text, const std::string& key);
  std::string to_string() const;  // inverse of parse
  // The selected indices for a model with `num_layers` layers, sorted ascending.
  std::vector<int64_t> resolve(int64_t num_layers) const;
};

// An integer setting the trainer may choose itself: `auto`, or a value within the field's range.
struct IntOrAuto {
  std::optional<int64_t> value;  // nullopt: auto
  bool is_auto() const { return !value.has_value(); }
  std::string to_string() const;  // "auto" or the integer
};

// A number setting with a default from elsewhere (e.g. the model's config.json): `auto`, or a
// value within the field's range.
struct FloatOrAuto {
  std::optional<double> value;  // nullopt: auto
  bool is_auto() const { return !value.has_value(); }
  std::string to_string() const;  // "auto" or the number
};

struct ModelConfig {
  std::string dir;                  // HF model directory holding config.json (and tokenizer.json)
  std::string config;               // config.json path; default <dir>/config.json
  std::string weights;              // NVFP4 .dat weights; required when init == "file"
  std::string tokenizer;            // tokenizer.json path; default <dir>/tokenizer.json
  InitKind init = InitKind::kFile;  // file: load `weights`; random: random init from `config`
  int64_t init_seed = 0;            // RNG seed of the random init
  bool quantize_lm_head = true;     // random init: store lm_head as NVFP4 (as the shipped file)
  bool fake_quant = true;  // NVFP4 linears train through the straight-through quantizer (QAT)
  Dtype master_dtype = Dtype::kFp16;               // dtype of trained master weights
  DtypeOrAuto compute_dtype = DtypeOrAuto::kAuto;  // auto: bf16 on cuda, fp32 on cpu
  std::string device = "cpu";                      // cpu | cuda | cuda:N
  DtypeOrAuto grad_dtype = DtypeOrAuto::kAuto;     // gradient storage
  double init_std = 0.02;                          // random init: std of linears and embeddings
  int64_t loss_chunk_tokens = 512;  // logits rows computed at once by the chunked loss
  // How a trained NVFP4 linear's forward weight is obtained (model::ForwardWeights): fake-
  // quantized by every forward (sweep), dequantized from device codes (codes) or kept as it is
  // (kept), the two latter refreshed after each update. auto: the fastest that fits the device
  // memory (RunPlan::with_forward_weights); sweep on the CPU, codes with optim.offload all.
  ForwardWeightsOrAuto forward_weights = ForwardWeightsOrAuto::kAuto;
  // Where a trained NVFP4 linear's master starts when loaded from NVFP4 codes
  // (model::MasterInit, docs/design.md#dithered-masters): on its code's value (codes), or moved
  // uniformly inside the code's rounding cell, seeded from train.seed (dither).
  model::MasterInit master_init = model::MasterInit::kCodes;
};

// The NVFP4 quantizer (docs/design.md#nvfp4-arithmetic).
struct QuantConfig {
  // Each 16-value block's scale: its amax to 6 (max6), or to 6 or 4, the lower squared error
  // (4over6); the forward, the codes kept for offloaded masters and the export all use it.
  quant::BlockRule block_rule = quant::BlockRule::kMax6;
};

struct TrainableConfig {
  LayerSelection layers;    // decoder layers whose projections (and norms) train
  bool projections = true;  // q/k/v/o/gate/up/down of the selected layers (NVFP4, STE), and
                            // a mixture-of-experts layer's experts
  bool router = true;       // a mixture-of-experts layer's router (16/32-bit, not quantized)
  bool norms = true;        // RMSNorm weights of the selected layers and the final norm
  bool lm_head = false;     // the output projection (vocab x hidden)
  bool embeddings = false;  // embed_tokens (vocab x hidden)
};

struct TrainConfig {
  ObjectiveKind objective = ObjectiveKind::kCrossEntropy;  // what the step minimizes
  // full: the selected weights train; lora: low-rank adapters on the NVFP4 linears (lora.*),
  // which stay frozen, plus the norms/lm_head/embeddings train.trainable selects.
  TrainMethod method = TrainMethod::kFull;
  TrainableConfig trainable;
  // Decoder layers recomputed in backward (docs/trainer.md#recompute-by-memory-budget): true
  // every layer (or the first train.recompute_layers), false none, auto (the default) as many
  // as the memory budget needs on CUDA (none on the CPU); resolved at start.
  Recompute gradient_checkpointing = Recompute::kAuto;
  int64_t recompute_layers = -1;  // with gradient_checkpointing true: the first N recompute; -1 all
  // With gradient_checkpointing true: of the recomputed layers, the last recompute_keep_mlp keep
  // their MLP block's activations (only the attention block recomputes) and the
  // recompute_keep_attention below them their attention block's (only the MLP recomputes).
  int64_t recompute_keep_attention = 0;
  int64_t recompute_keep_mlp = 0;
  // CUDA: recomputed layers keep their input in pinned host memory (long context); auto turns
  // it on when every layer recomputed is still over the budget.
  bool offload_layer_inputs = false;
  // Recomputed layers run their MLP over row chunks of this many tokens (docs/trainer.md#
  // recompute-by-memory-budget); 0: never; auto: resolved_mlp_chunk_tokens().
  IntOrAuto mlp_chunk_tokens;
  int64_t steps = 100;  // optimizer steps (resolved from epochs when that is set)
  // Passes over the training data instead of steps (0: steps decides). The trainer resolves it
  // to steps once the data is loaded (resolve_run_length in trainer.cpp, docs/trainer.md#epochs).
  double epochs = 0.0;
  int64_t batch_size = 4;           // rows (sequences) per micro-batch
  int64_t grad_accum = 1;           // micro-batches per optimizer step
  int64_t seq_len = 256;            // tokens per row (longer examples are truncated)
  int64_t seed = 1234;              // data order, dropout-free sampling, stochastic rounding
  double max_grad_norm = 1.0;       // global L2 clipping threshold; 0 disables clipping
  int64_t max_nonfinite_steps = 5;  // consecutive non-finite steps skipped before failing
  // Mixture-of-experts models: the load-balancing loss's weight (auto: config.json's
  // router_aux_loss_coef) and the router z-loss's (0: off); docs/model.md#mixture-of-experts.
  FloatOrAuto router_aux_loss_coef;
  double router_z_loss_coef = 0.0;
};

// train.objective: distill (docs/trainer.md#distillation). The teacher is frozen and computes in
// the run's compute dtype on its device; its NVFP4 linears hold dequantize(q).
// Bounds of the settings that scale logits, log-probabilities or losses: inside them every
// product, quotient and exponent of the fp32 loss math stays finite (docs/trainer.md, "Bounds").
// distill.temperature: logits / T with |logits| up to ~1e4 stays far below the fp32 maximum, and
// T^2 well above its smallest normal; above 100 every distribution is flat to fp32 precision.
inline constexpr double kMinDistillTemperature = 0.01, kMaxDistillTemperature = 100.0;
// preference.beta: beta x (a sequence log-probability sum, up to ~1e6 in magnitude), 1 / (2 beta)
// and simpo_gamma / beta all stay within 1e9; the gradients scale with beta.
inline constexpr double kMinPreferenceBeta = 1e-3, kMaxPreferenceBeta = 1e3;
// preference.simpo_gamma: the SimPO margin (papers use 0.3-1.6); |gamma| / beta <= 1e5.
inline constexpr double kMaxSimpoGamma = 100.0;
// preference.sft_weight: a multiple of a mean cross-entropy (TRL's rpo_alpha is about 1).
inline constexpr double kMaxSftWeight = 1e3;

struct DistillConfig {
  std::string teacher;         // .dat or Hugging Face folder (dense linears stay dense)
  std::string teacher_config;  // its config.json (default: the folder's, else model.config)
  double alpha = 1.0;          // loss = alpha * divergence + (1 - alpha) * cross-entropy
  double temperature = 1.0;    // both distributions at logits / temperature; divergence x T^2
  Divergence divergence = Divergence::kForwardKl;
  // Offline: the teacher's top-K log-probabilities of the training data, written once by
  // `q4train --write-teacher-topk` and read instead of running the teacher.
  std::string topk_file;
  int64_t topk = 64;  // K written by --write-teacher-topk
};

// train.objective: preference (docs/trainer.md#preference-tuning). data.files hold TRL preference
// records; the reference's log-probabilities are computed once, before the first step, and kept
// in <output.dir>/reference_logprobs.dat.
struct PreferenceConfig {
  PreferenceLossKind loss = PreferenceLossKind::kSigmoid;
  double beta = 0.1;             // the implicit reward's scale (TRL's beta)
  double label_smoothing = 0.0;  // sigmoid and simpo: the chance a label is flipped, [0, 0.5)
  double simpo_gamma = 0.5;      // simpo: the target reward margin, over beta
  // + sft_weight x the chosen answer's mean cross-entropy per pair (TRL's rpo_alpha); 0: none.
  double sft_weight = 0.0;
  // The reference model, a .dat or Hugging Face folder; empty: the starting model itself.
  std::string reference;
  std::string reference_config;  // its config.json (default: the folder's, else model.config)
};

// train.objective: grpo (docs/trainer.md#grpo). The keys are TRL's GRPOConfig names; data.files
// hold TRL prompt records (data/prompt_dataset.h), the rewards are the reward: section's.
// grpo.temperature: logits / T in sampling and in the loss (TRL), bounded as distill.temperature.
inline constexpr double kMinGrpoTemperature = 0.01, kMaxGrpoTemperature = 100.0;
struct GrpoConfig {
  int64_t num_generations = 8;          // completions per prompt (the group), >= 2
  int64_t max_completion_length = 256;  // tokens sampled per completion at most
  double temperature = 1.0;             // sampling and loss: softmax(logits / temperature)
  double top_p = 1.0;                   // nucleus sampling; 1: off
  int64_t top_k = 0;                    // keep the k most likely tokens; 0: off
  double beta = 0.0;     // KL coefficient to the reference (the starting model); 0: no reference
  double epsilon = 0.2;  // clip range below 1: ratio >= 1 - epsilon
  double epsilon_high = 0.0;  // clip range above 1 (DAPO's clip-higher); 0: epsilon
  GrpoLossType loss_type = GrpoLossType::kDapo;
  ScaleRewards scale_rewards = ScaleRewards::kGroup;
  int64_t num_iterations = 1;               // updates per generation batch (TRL's mu)
  bool mask_truncated_completions = false;  // completions without an end token do not train
};

// train.method: lora (docs/trainer.md#lora-adapters).
struct LoraConfig {
  int64_t rank = 16;
  double alpha = 32.0;   // the adapter's update is scaled by alpha / rank
  double dropout = 0.0;  // on the adapter's input (plain adapters only)
  // Short names from model::kLoraTargets; default: every decoder-layer projection.
  std::vector<std::string> targets = model::lora_projection_targets();
  // true: the forward computes with fake_quant(W + B·A·alpha/rank), so the merged NVFP4 export
  // is what was trained; false: plain LoRA, x·Wᵀ + (x·Aᵀ)·Bᵀ·alpha/rank.
  bool merge_aware = true;
  // Plain adapters: keep each adapted linear's frozen weight dequantized in the compute dtype
  // (2 bytes an element) instead of dequantizing it in every forward. auto: when no decoder
  // layer recomputes, whose graphs then hold those weights anyway.
  AutoBool cache_base_weights = AutoBool::kAuto;
};

// reward.functions entries and reward.command (docs/trainer.md#rewards): verifiable rewards,
// each scored per completion and summed with its weight.
struct RewardFunctionConfig {
  std::string name;  // unique among the functions; parse_config defaults it to the kind
  RewardKind kind = RewardKind::kExactMatch;
  double weight = 1.0;    // the total reward is the sum of weight x reward
  std::string field;      // exact_match, last_number: the example's field holding the answer
  bool normalize = true;  // exact_match: trim, ASCII case-fold, collapse whitespace runs
  // exact_match, last_number, json: a PCRE2 regex whose first capture group is the text checked
  // (its first match); no match: reward 0. Empty: the whole completion.
  std::string extract;
  std::string pattern;        // regex: reward 1 when the completion matches, else 0
  int64_t target_tokens = 0;  // length: completion tokens free of penalty
  // length: reward -min(1, penalty_per_token x tokens beyond target_tokens)
  double penalty_per_token = 0.001;
};

struct RewardConfig {
  std::vector<RewardFunctionConfig> functions;
  // A long-lived verifier: argv (argv[0] searched in PATH unless it holds a '/'), one JSON
  // request a line on its stdin, one number a line on its stdout. Empty: none.
  std::vector<std::string> command;
  double command_weight = 1.0;
  double command_timeout_s = 60.0;  // the longest wait for one batch's answers
  std::string command_dir;          // its working directory; parse_config: the config's dir
};

// Whether the reward.functions entry key `leaf` ("field", "pattern", ...) applies to `kind`.
bool reward_key_applies(RewardKind kind, const std::string& leaf);

struct ScheduleConfig {
  optim::LrScheduleKind kind = optim::LrScheduleKind::kConstant;  // after warmup
  int64_t warmup_steps = 0;                                       // linear warmup from 0 to lr
  double warmup_ratio = 0.0;  // warmup as a fraction of the run (resolved to warmup_steps)
  double min_lr_ratio = 0.0;  // final lr / lr for linear and cosine decay
};

struct OptimConfig {
  double lr = 1e-4;                                  // peak learning rate
  double beta1 = 0.9;                                // AdamW first-moment decay
  double beta2 = 0.999;                              // AdamW second-moment decay
  double eps = 1e-8;                                 // AdamW epsilon
  double weight_decay = 0.0;                         // decoupled weight decay
  optim::StateMode state = optim::StateMode::kInt8;  // moment storage
  int64_t chunk_rows = 1024;  // rows per optimizer chunk (bounds temporaries)
  // fp16/bf16 master write-back
  optim::MasterRounding master_rounding = optim::MasterRounding::kStochastic;
  // Apply each parameter's update inside the backward as soon as its gradient is complete and
  // free the gradient (no full-model gradient buffer). auto = on CUDA with grad_accum 1.
  // Clipping then uses the previous step's norm (docs/optim.md).
  InBackward in_backward = InBackward::kAuto;
  // moments: on CUDA the moments live in pinned host memory, updated there over PCIe by the
  // same kernels (bit-identical results, no device memory for them, a slower update). all: the
  // trained NVFP4 linears' masters too, the GPU keeping their NVFP4 codes for the forward
  // (ModelOptions::offload_masters); with grad_accum > 1 their gradients add up in pinned host
  // memory as well.
  Offload offload = Offload::kNone;
  ScheduleConfig schedule;
};

struct DataConfig {
  std::vector<std::string> files;  // training files (TSV prompt<TAB>answer, JSONL, text)
  std::vector<std::string>
      eval_files;              // held-out files for validation loss (same formats as files)
  double eval_fraction = 0.0;  // hold out this fraction of training examples for validation loss
  data::DataFormat format = data::DataFormat::kAuto;  // auto: by extension
  std::string system_prompt;                          // optional system turn before every example
  // Chat template of conversations (docs/data.md "Chat templates"). auto: the model folder's
  // template identified (its folder: that of model.tokenizer); 2507 Instruct when it has none.
  // parse_config resolves auto, so the saved config.yaml names the template the run used.
  data::ChatTemplate chat_template = data::ChatTemplate::kAuto;
  AutoBool enable_thinking = AutoBool::kAuto;  // HF's enable_thinking; auto: unset (thinking on)
  bool shuffle = true;                         // reshuffle each epoch (seeded by train.seed)
  bool packing = true;        // pack several examples into one seq_len row (best fit)
  int64_t pack_window = 256;  // packing: examples considered for each row
  data::OnError on_error = data::OnError::kFail;     // malformed lines
  Truncation truncation = Truncation::kAuto;         // examples over seq_len
  data::TextUnit text_unit = data::TextUnit::kFile;  // text files: file, paragraph or line
};

struct EvalConfig {
  std::vector<std::string> prompts;  // user prompts answered greedily
  int64_t every = 0;                 // evaluate every N steps (0: only before and after)
  int64_t max_new_tokens = 32;       // generation length limit
  bool at_start = true;              // evaluate before the first step
  bool at_end = true;                // evaluate after the last step
};

struct OutputConfig {
  std::string dir = "runs/run";  // run directory (config, logs, metrics, checkpoints, export)
  std::string export_path;       // exported .dat; default <dir>/model.dat; "none" disables
  int64_t export_every = 0;      // also export every N steps (0: only at the end)
  int64_t checkpoint_every = 0;  // also checkpoint every N steps (0: by time only)
  // Checkpoint every N minutes of training (0: by steps only); with either cadence on, the last
  // step is checkpointed too. Both 0: checkpoints only on a stop signal or a failed export.
  double checkpoint_minutes = 30.0;
  int64_t keep = 2;           // newest complete checkpoints kept
  bool verify_export = true;  // reload the export and check it generates the same answers
  // Also write a Hugging Face folder vLLM serves next to the .dat (<export .dat minus .dat>-hf):
  // none | modelopt | compressed-tensors (docs/interop.md).
  HfExport hf_export = HfExport::kNone;
  // Plain precision: trained NVFP4 linears exported as fp16 tensors (the full-precision model)
  // instead of their post-training quantization.
  bool export_dense = false;
};

struct GuardConfig {
  double max_gpu_gb = 0.0;  // stop (exit 3) when reserved or device-used memory passes it; 0 off
};

struct LogConfig {
  int64_t every = 1;                      // log line every N steps
  std::string metrics = "metrics.jsonl";  // metrics file name inside output.dir ("" disables)
  ProgressStyle progress = ProgressStyle::kAuto;  // progress bar on a terminal or log lines
  bool tensorboard = true;                        // TensorBoard events.out.tfevents.* in output.dir
  bool report = true;  // output.dir/report.html, rewritten at evals and the end
};

struct Config {
  ModelConfig model;
  QuantConfig quant;
  TrainConfig train;
  OptimConfig optim;
  DataConfig data;
  EvalConfig eval;
  OutputConfig output;
  GuardConfig guard;
  LogConfig log;
  DistillConfig distill;
  PreferenceConfig preference;
  GrpoConfig grpo;
  LoraConfig lora;
  RewardConfig reward;
  std::string source;  // where the config came from (file path), for messages
};

// How a model's prompts are rendered: model.tokenizer (whose folder resolves an auto template),
// data.system_prompt, data.chat_template and data.enable_thinking. The evaluator's, and a run
// directory's when another tool loads it.
struct ChatSettings {
  std::string tokenizer, system_prompt;
  data::ChatTemplate chat_template = data::ChatTemplate::kAuto;
  AutoBool enable_thinking = AutoBool::kAuto;
};
inline ChatSettings chat_settings(const Config& c) {
  return {c.model.tokenizer, c.data.system_prompt, c.data.chat_template, c.data.enable_thinking};
}

// One field of the config tree, as seen by parser, printer and docs.
using FieldPtr =
    std::variant<std::string*, int64_t*, double*, bool*, std::vector<std::string>*, LayerSelection*,
                 IntOrAuto*, FloatOrAuto*, InitKind*, Dtype*, DtypeOrAuto*, optim::StateMode*,
                 optim::MasterRounding*, AutoBool*, Offload*, optim::LrScheduleKind*,
                 data::DataFormat*, data::OnError*, data::TextUnit*, data::ChatTemplate*,
                 Truncation*, ProgressStyle*, HfExport*, ObjectiveKind*, TrainMethod*, Divergence*,
                 PreferenceLossKind*, RewardKind*, std::vector<RewardFunctionConfig>*,
                 GrpoLossType*, ScaleRewards*, quant::BlockRule*,
                 ForwardWeightsOrAuto*, model::MasterInit*>;

// The allowed values of a numeric field: optional bounds, each inclusive or exclusive. Every
// float field must also be finite.
struct Range {
  std::optional<double> min, max;
  bool min_exclusive = false, max_exclusive = false;

  static Range at_least(double v) { return {v, std::nullopt, false, false}; }
  static Range above(double v) { return {v, std::nullopt, true, false}; }
  // [lo, hi) when hi_exclusive, else [lo, hi].
  static Range between(double lo, double hi, bool hi_exclusive) {
    return {lo, hi, false, hi_exclusive};
  }
  bool contains(double v) const;
  bool empty() const { return !min && !max; }
  std::string to_string() const;  // ">= 1", "> 0", "[0, 1)"; "" when unbounded
};

struct FieldRef {
  std::string key;                   // dotted path, e.g. "train.steps"
  FieldPtr ptr;                      // the member inside a Config
  std::string doc;                   // one line
  Range range;                       // int and float fields: allowed values (empty: any)
  bool is_path = false;              // input path resolved against the config file's directory
  std::vector<std::string> aliases;  // other names people use for it (learning_rate for lr)
  // Enumerated fields: the YAML spellings in the documented order (from the enum); else empty.
  std::vector<std::string> choices() const;
  std::string type_name() const;  // "int", "float", "bool", "string", "path", "list of paths", ...
};

// Every field of `c`, in the documented order.
std::vector<FieldRef> config_fields(Config& c);
// The dotted key of every field (e.g. for docs checks and did-you-mean).
std::vector<std::string> config_keys();
// The keys of one reward.functions entry, keyed by their leaf name ("kind", "weight", ...).
std::vector<FieldRef> reward_function_fields(RewardFunctionConfig& f);

// A `--set key.path=value` edit; the value is parsed as YAML (so `[a, b]` is a list).
struct Override {
  std::string key;
  std::string value;
};
Override parse_override(const std::string& text);  // "a.b=c"; ConfigError when malformed

// Cross-field rules a layer above adds to validate_config (the objectives' rules,
// objectives/registry.h validate_objective_config).
using ConfigRules = std::function<void(const Config&)>;

// Parses YAML text (source_name for messages), applies overrides, reads and validates
// (validate_config, then `more_rules`; their errors name the file). Relative input paths in the
// text resolve against `base_dir`, those from overrides against the CWD.
Config parse_config(const std::string& yaml_text, const std::string& source_name,
                    const std::string& base_dir, const std::vector<Override>& overrides = {},
                    const ConfigRules& more_rules = nullptr);
// Reads `path` and calls parse_config with its directory as base_dir.
Config load_config(const std::string& path, const std::vector<Override>& overrides = {},
                   const ConfigRules& more_rules = nullptr);

// The table's per-field ranges again (parse_config has checked them with line numbers; this
// covers configs built or edited in code) and the cross-field rules but the objectives' own
// (validate_objective_config); ConfigError naming the key. parse_config calls it.
void validate_config(const Config& c);

// Settings that differ from their defaults but do not apply to this run (lora.* without
// train.method lora, distill.* and preference.* under another objective, a sigmoid/SimPO-only
// setting under ipo, simpo_gamma without simpo, lora.cache_base_weights with merge-aware
// adapters): one warning line listing the keys and why, or "" when there are none. A setting
// that would change what the run computes if it applied (distill.teacher, preference.reference)
// is refused by validate_objective_config instead. `needs`: the run's objective's (its
// sections' settings apply).
std::string ignored_settings_warning(const Config& c, const ObjectiveNeeds& needs);

// The resolved config as YAML (every field, defaults included; train.steps is left out while
// train.epochs sets the run length); parse_config(to_yaml(c)) == c.
std::string config_to_yaml(const Config& c);

// Closest known key to `key`, or "" if none is close enough to be a useful suggestion. Matches
// the full path and the last component across all sections by edit distance ("train.lr" ->
// "optim.lr", top-level "warmup_steps" -> "optim.schedule.warmup_steps"), and the aliases of
// the field table ("optim.learning_rate" -> "optim.lr").
std::string did_you_mean(const std::string& key, const std::vector<std::string>& known);

// The markdown field reference of configs/README.md (one table per section: key, type, default,
// allowed values, doc), generated from config_fields().
std::string config_reference_markdown();
// `readme` with the text between its generated-reference markers replaced by
// config_reference_markdown(); ConfigError when the markers are missing.
std::string splice_config_reference(const std::string& readme);

// Derived settings.
Dtype resolved_compute_dtype(const Config& c);      // auto resolved: bf16 on cuda, fp32 on cpu
std::string resolved_export_path(const Config& c);  // "" when export is disabled
// data.packing as the run applies it: only where the objective allows packing (preference pairs
// are never packed).
bool resolved_packing(const Config& c, const ObjectiveNeeds& needs);
bool device_is_cuda(const Config& c);
// Whether the run applies optimizer updates inside the backward (optim.in_backward resolved).
bool in_backward_updates(const Config& c);
// train.gradient_checkpointing, train.recompute_layers, train.offload_layer_inputs and the kept
// blocks set to recompute the first `n` of `num_layers` decoder layers (0: none, num_layers:
// every one), their inputs offloaded or not, `keep_attention` and `keep_mlp` of them keeping one
// block's activations; how auto is resolved.
void set_recompute_layers(Config& c, int64_t n, int64_t num_layers,
                          bool offload_layer_inputs = false, int64_t keep_attention = 0,
                          int64_t keep_mlp = 0);
// `--resume DIR` writes into DIR's run directory (docs/trainer.md#resume): sets output.dir to
// `run_dir` and moves an absolute output.export_path that lay inside the old output.dir along
// with it (a relative one follows by itself). Returns a one-line note when output.dir changed,
// "" otherwise. Not called when the user set output.dir explicitly with --set.
std::string point_config_at_run_dir(Config& c, const std::string& run_dir);
// train.mlp_chunk_tokens with auto resolved: chunks of kAutoMlpChunkTokens when a micro-batch
// (train.batch_size x train.seq_len) has more than kAutoMlpChunkAboveTokens tokens, else 0.
int64_t resolved_mlp_chunk_tokens(const Config& c);
// The numbers, at Qwen3-4B shapes (H 2560, I 9728, bf16; model/src/memory_estimate.cpp): a
// chunk's MLP working set (its graph less the input rows it views, and the three SwiGLU
// gradients) is 119 KiB a token, 0.93 GiB for 8192 tokens, and chunking adds 0.37 GiB of fp32
// gradient sums and one chunk's gradients for the MLP weights. The attention block's backward
// step (67 KiB a token beyond the graph both steps hold) is then the layer's larger step from
// 2.3 chunks on, ~19k tokens: smaller chunks save nothing more there, larger ones would stay the
// peak to proportionally longer sequences. At 16,384 tokens the unchunked MLP step is 2.1 GiB and
// chunks would save 0.9 GiB of it, less the 0.37 GiB, with the MLP backward's GEMMs split; at
// 131,072 they save 8.4 GiB. Up to 16,384 tokens (the shipped recipes' batches) the MLP is one
// pass, whose CPU fp32 gradients are bit-identical to no recompute.
constexpr int64_t kAutoMlpChunkTokens = 8192;
constexpr int64_t kAutoMlpChunkAboveTokens = 16384;

}  // namespace q4::trainer

// The YAML spellings of the config's own enums, in the order the docs list the choices; the
// libraries' enums (state mode, rounding, schedule, data format, on_error) bring their tables.
Q4_ENUM_NAMES(q4::trainer::InitKind, {"file", q4::trainer::InitKind::kFile},
              {"random", q4::trainer::InitKind::kRandom});
Q4_ENUM_NAMES(q4::trainer::Dtype, {"fp16", q4::trainer::Dtype::kFp16},
              {"bf16", q4::trainer::Dtype::kBf16}, {"fp32", q4::trainer::Dtype::kFp32});
Q4_ENUM_NAMES(q4::trainer::DtypeOrAuto, {"auto", q4::trainer::DtypeOrAuto::kAuto},
              {"fp32", q4::trainer::DtypeOrAuto::kFp32}, {"bf16", q4::trainer::DtypeOrAuto::kBf16},
              {"fp16", q4::trainer::DtypeOrAuto::kFp16});
Q4_ENUM_NAMES(q4::trainer::AutoBool, {"auto", q4::trainer::AutoBool::kAuto},
              {"true", q4::trainer::AutoBool::kTrue}, {"false", q4::trainer::AutoBool::kFalse});
Q4_ENUM_NAMES(q4::trainer::Offload, {"none", q4::trainer::Offload::kNone},
              {"moments", q4::trainer::Offload::kMoments}, {"all", q4::trainer::Offload::kAll});
Q4_ENUM_NAMES(q4::trainer::ForwardWeightsOrAuto, {"auto", q4::trainer::ForwardWeightsOrAuto::kAuto},
              {"sweep", q4::trainer::ForwardWeightsOrAuto::kSweep},
              {"codes", q4::trainer::ForwardWeightsOrAuto::kCodes},
              {"kept", q4::trainer::ForwardWeightsOrAuto::kKept});
Q4_ENUM_NAMES(q4::trainer::ProgressStyle, {"auto", q4::trainer::ProgressStyle::kAuto},
              {"bar", q4::trainer::ProgressStyle::kBar},
              {"line", q4::trainer::ProgressStyle::kLine});
Q4_ENUM_NAMES(q4::trainer::HfExport, {"none", q4::trainer::HfExport::kNone},
              {"modelopt", q4::trainer::HfExport::kModelOpt},
              {"compressed-tensors", q4::trainer::HfExport::kCompressedTensors},
              {"bf16", q4::trainer::HfExport::kBf16});
Q4_ENUM_NAMES(q4::trainer::ObjectiveKind,
              {"cross_entropy", q4::trainer::ObjectiveKind::kCrossEntropy},
              {"distill", q4::trainer::ObjectiveKind::kDistill},
              {"preference", q4::trainer::ObjectiveKind::kPreference},
              {"grpo", q4::trainer::ObjectiveKind::kGrpo});
Q4_ENUM_NAMES(q4::trainer::TrainMethod, {"full", q4::trainer::TrainMethod::kFull},
              {"lora", q4::trainer::TrainMethod::kLora});
Q4_ENUM_NAMES(q4::trainer::Divergence, {"forward_kl", q4::trainer::Divergence::kForwardKl},
              {"reverse_kl", q4::trainer::Divergence::kReverseKl});
Q4_ENUM_NAMES(q4::trainer::PreferenceLossKind,
              {"sigmoid", q4::trainer::PreferenceLossKind::kSigmoid},
              {"ipo", q4::trainer::PreferenceLossKind::kIpo},
              {"simpo", q4::trainer::PreferenceLossKind::kSimpo});
Q4_ENUM_NAMES(q4::trainer::RewardKind, {"exact_match", q4::trainer::RewardKind::kExactMatch},
              {"last_number", q4::trainer::RewardKind::kLastNumber},
              {"regex", q4::trainer::RewardKind::kRegex}, {"json", q4::trainer::RewardKind::kJson},
              {"length", q4::trainer::RewardKind::kLength});
Q4_ENUM_NAMES(q4::trainer::GrpoLossType, {"grpo", q4::trainer::GrpoLossType::kGrpo},
              {"dr_grpo", q4::trainer::GrpoLossType::kDrGrpo},
              {"dapo", q4::trainer::GrpoLossType::kDapo});
// TRL also takes the booleans: true is group, false is none (printed back as group / none).
Q4_ENUM_NAMES(q4::trainer::ScaleRewards, {"group", q4::trainer::ScaleRewards::kGroup},
              {"batch", q4::trainer::ScaleRewards::kBatch},
              {"none", q4::trainer::ScaleRewards::kNone},
              {"true", q4::trainer::ScaleRewards::kGroup},
              {"false", q4::trainer::ScaleRewards::kNone});
