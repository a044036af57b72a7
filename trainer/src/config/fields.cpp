// The config's field table (key, doc, range, choices, aliases) and the value types it reads:
// ranges, layer selections, enum spellings.
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

std::string to_string(InitKind v) { return enum_name(v); }
std::string to_string(Dtype v) { return enum_name(v); }
std::string to_string(DtypeOrAuto v) { return enum_name(v); }
std::string to_string(AutoBool v) { return enum_name(v); }
std::string to_string(Offload v) { return enum_name(v); }
std::string to_string(ForwardWeightsOrAuto v) { return enum_name(v); }
std::string to_string(data::DataFormat v) { return enum_name(v); }
std::string to_string(data::OnError v) { return enum_name(v); }
std::string to_string(data::TextUnit v) { return enum_name(v); }
std::string to_string(data::ChatTemplate v) { return enum_name(v); }
std::string to_string(ProgressStyle v) { return enum_name(v); }
std::string to_string(HfExport v) { return enum_name(v); }
std::string to_string(ObjectiveKind v) { return enum_name(v); }
std::string to_string(TrainMethod v) { return enum_name(v); }
std::string to_string(Divergence v) { return enum_name(v); }
std::string to_string(PreferenceLossKind v) { return enum_name(v); }
std::string to_string(RewardKind v) { return enum_name(v); }
std::string to_string(GrpoLossType v) { return enum_name(v); }
std::string to_string(ScaleRewards v) { return enum_name(v); }

// ---------------------------------------------------------------------------------------------
// Range, FieldRef

bool Range::contains(double v) const {
  if (min && (min_exclusive ? !(v > *min) : !(v >= *min))) return false;
  if (max && (max_exclusive ? !(v < *max) : !(v <= *max))) return false;
  return true;
}

std::string Range::to_string() const {
  if (min && max) {
    return std::string(min_exclusive ? "(" : "[") + fmt_double(*min) + ", " + fmt_double(*max) +
           (max_exclusive ? ")" : "]");
  }
  if (min) return std::string(min_exclusive ? "> " : ">= ") + fmt_double(*min);
  if (max) return std::string(max_exclusive ? "< " : "<= ") + fmt_double(*max);
  return "";
}

std::vector<std::string> FieldRef::choices() const {
  return std::visit(
      [](auto* p) -> std::vector<std::string> {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_enum_v<T>) {
          return enum_names<T>();
        } else {
          return {};
        }
      },
      ptr);
}

std::string FieldRef::type_name() const {
  return std::visit(
      [&](auto* p) -> std::string {
        using T = std::remove_pointer_t<decltype(p)>;
        if constexpr (std::is_same_v<T, std::string>) return is_path ? "path" : "string";
        if constexpr (std::is_same_v<T, int64_t>) return "int";
        if constexpr (std::is_same_v<T, double>) return "float";
        if constexpr (std::is_same_v<T, bool>) return "bool";
        if constexpr (std::is_same_v<T, std::vector<std::string>>) {
          return is_path ? "list of paths" : "list of strings";
        }
        if constexpr (std::is_same_v<T, LayerSelection>) return "layers";
        if constexpr (std::is_same_v<T, IntOrAuto>) return "int or auto";
        if constexpr (std::is_same_v<T, FloatOrAuto>) return "float or auto";
        if constexpr (std::is_same_v<T, std::vector<RewardFunctionConfig>>) {
          return "list of reward functions";
        }
        if constexpr (std::is_enum_v<T>) return "enum";
        return "";
      },
      ptr);
}

std::string IntOrAuto::to_string() const { return value ? std::to_string(*value) : "auto"; }
std::string FloatOrAuto::to_string() const { return value ? fmt_float(*value) : "auto"; }

// ---------------------------------------------------------------------------------------------
// LayerSelection

LayerSelection LayerSelection::parse(const std::string& text, const std::string& key) {
  const std::string t = trim(text);
  LayerSelection sel;
  if (t == "all") {
    sel.kind = Kind::kAll;
    return sel;
  }
  if (t == "none") {
    sel.kind = Kind::kNone;
    return sel;
  }
  if (t.rfind("last:", 0) == 0) {
    int64_t n = 0;
    if (!parse_int(trim(t.substr(5)), &n) || n < 1) {
      throw ConfigError("config key " + key + ": expected last:N with N >= 1, found '" + t + "'");
    }
    sel.kind = Kind::kLast;
    sel.last_n = n;
    return sel;
  }
  sel.kind = Kind::kList;
  for (const auto& part : split(t, ',')) {
    int64_t idx = 0;
    if (!parse_int(trim(part), &idx)) {
      throw ConfigError("config key " + key +
                        ": expected all, none, last:N or a list of layer indices, found '" + t +
                        "'");
    }
    sel.layers.push_back(idx);
  }
  return sel;
}

std::string LayerSelection::to_string() const {
  switch (kind) {
    case Kind::kAll:
      return "all";
    case Kind::kNone:
      return "none";
    case Kind::kLast:
      return "last:" + std::to_string(last_n);
    case Kind::kList: {
      std::string out;
      for (size_t i = 0; i < layers.size(); ++i) out += (i ? "," : "") + std::to_string(layers[i]);
      return out;
    }
  }
  return "";
}

std::vector<int64_t> LayerSelection::resolve(int64_t num_layers) const {
  std::vector<int64_t> out;
  switch (kind) {
    case Kind::kAll:
      for (int64_t i = 0; i < num_layers; ++i) out.push_back(i);
      break;
    case Kind::kNone:
      break;
    case Kind::kLast:
      if (last_n > num_layers) {
        throw ConfigError(
            "config key train.trainable.layers: last:" + std::to_string(last_n) +
            " selects more layers than the model has (model.config: " + std::to_string(num_layers) +
            " decoder layer" + (num_layers == 1 ? "" : "s") +
            "); use last:1 to last:" + std::to_string(num_layers) + " or all");
      }
      for (int64_t i = num_layers - last_n; i < num_layers; ++i) out.push_back(i);
      break;
    case Kind::kList:
      for (int64_t i : layers) {
        if (i < 0 || i >= num_layers) {
          throw ConfigError("config key train.trainable.layers: layer " + std::to_string(i) +
                            " is out of range for a model with " + std::to_string(num_layers) +
                            " layers");
        }
        out.push_back(i);
      }
      std::sort(out.begin(), out.end());
      break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The field list

std::vector<FieldRef> config_fields(Config& c) {
  // field(key, member, doc, range, aliases): aliases are other names people use for the field
  // (Hugging Face TrainingArguments and the like); did_you_mean() suggests the field for them.
  auto field = [](std::string key, FieldPtr ptr, std::string doc, Range range = {},
                  std::vector<std::string> aliases = {}) {
    FieldRef f;
    f.key = std::move(key);
    f.ptr = ptr;
    f.doc = std::move(doc);
    f.range = range;
    f.aliases = std::move(aliases);
    return f;
  };
  auto path = [&](std::string key, FieldPtr ptr, std::string doc) {
    FieldRef f = field(std::move(key), ptr, std::move(doc));
    f.is_path = true;
    return f;
  };
  using R = Range;
  return {
      path("model.dir", &c.model.dir, "HF model directory holding config.json and tokenizer.json"),
      path("model.config", &c.model.config, "config.json path (default <dir>/config.json)"),
      path("model.weights", &c.model.weights,
           "NVFP4 .dat weights or a Hugging Face model folder (required when init is file)"),
      path("model.tokenizer", &c.model.tokenizer,
           "tokenizer.json path (default <dir>/tokenizer.json)"),
      field("model.init", &c.model.init, "file: load weights; random: random init from config"),
      field("model.init_seed", &c.model.init_seed, "seed of the random init"),
      field("model.quantize_lm_head", &c.model.quantize_lm_head,
            "random init: store lm_head as NVFP4 like the shipped checkpoint"),
      field("model.fake_quant", &c.model.fake_quant,
            "NVFP4 linears compute with fake-quantized masters and train straight through the "
            "quantizer (QAT); false: plain precision, the masters as they are (the NVFP4 export "
            "is then the trained model's post-training quantization)"),
      field("model.master_dtype", &c.model.master_dtype, "dtype of the trained master weights", {},
            {"dtype", "torch_dtype"}),
      field("model.compute_dtype", &c.model.compute_dtype,
            "activation/matmul dtype (auto: bf16 on cuda, fp32 on cpu; fp16 needs cuda)", {},
            {"bf16", "fp16", "precision"}),
      field("model.device", &c.model.device, "cpu, cuda or cuda:N"),
      field("model.grad_dtype", &c.model.grad_dtype,
            "gradient storage (auto: fp32 with fp32 masters, else bf16)"),
      // Qwen3 uses 0.02. Above 1, products of random weights overflow fp16 masters and bf16
      // activations within a layer or two, and the run fails later on "bad weights" that the
      // init made.
      field("model.init_std", &c.model.init_std, "random init: std of linears and embeddings",
            Range{0.0, 1.0, true, false}, {"initializer_range"}),
      field("model.loss_chunk_tokens", &c.model.loss_chunk_tokens,
            "logit rows computed at once by the chunked cross-entropy", R::at_least(1)),
      field("model.forward_weights", &c.model.forward_weights,
            "how a trained NVFP4 linear gets its forward weight fake_quant(master), the same "
            "bits each way: sweep fake-quantizes the master in every forward and recompute; "
            "codes keeps its NVFP4 codes on the GPU (0.56 bytes a weight) and kept the "
            "compute-dtype weight itself (2 bytes), both refreshed right after each update; "
            "auto: kept, else codes, else sweep, the first whose memory estimate fits the GPU "
            "with the recompute chosen (sweep on the CPU; codes with optim.offload all)"),
      field("model.master_init", &c.model.master_init,
            "where a trained NVFP4 linear's master starts when loaded from NVFP4 codes: codes, "
            "on its code's value; dither, moved uniformly inside the code's rounding cell "
            "(seeded from train.seed), so the forward is unchanged but small updates flip codes "
            "in proportion to their size (docs/design.md#dithered-masters); needs "
            "model.fake_quant, not with train.method lora"),
      field("quant.block_rule", &c.quant.block_rule,
            "each 16-value block's NVFP4 scale: max6 maps its largest magnitude to 6 (the "
            "standard); 4over6 also tries 4 and keeps the scale with the lower squared error "
            "(the file format is unchanged); used by the fake quantizer, the codes of offloaded "
            "masters, merge-aware adapters and the export alike"),
      field("train.objective", &c.train.objective,
            "what training minimizes: cross_entropy on the labels, distill (a teacher's "
            "distribution, distill.*), preference (chosen over rejected answers, preference.*) "
            "or grpo (sampled completions scored by rewards, grpo.* and reward.*)"),
      field("train.method", &c.train.method,
            "full: the selected weights train; lora: low-rank adapters on the NVFP4 linears "
            "(lora.*), which stay frozen"),
      field("train.trainable.layers", &c.train.trainable.layers,
            "decoder layers that train: all, none, last:N or a list of indices"),
      field("train.trainable.projections", &c.train.trainable.projections,
            "q/k/v/o/gate/up/down linears of the selected layers train (fake-quantized, STE)"),
      field("train.trainable.router", &c.train.trainable.router,
            "mixture-of-experts models: the routers (mlp.gate, 16/32-bit, never quantized) of "
            "the selected layers train, pulled by the loss and the load-balancing loss (full "
            "fine-tuning only: LoRA freezes them)"),
      field("train.trainable.norms", &c.train.trainable.norms,
            "RMSNorm weights of the selected layers and the final norm train"),
      field("train.trainable.lm_head", &c.train.trainable.lm_head, "the output projection trains"),
      field("train.trainable.embeddings", &c.train.trainable.embeddings, "embed_tokens trains"),
      field("train.gradient_checkpointing", &c.train.gradient_checkpointing,
            "recompute decoder layers in backward (less activation memory): auto = as many as "
            "the GPU memory budget needs (guard.max_gpu_gb, else the free memory; none on the "
            "CPU), true = every layer (or train.recompute_layers), false = none",
            {}, {"activation_checkpointing"}),
      field("train.recompute_layers", &c.train.recompute_layers,
            "with gradient_checkpointing true: the first N decoder layers recompute, the others "
            "keep their activations (-1: every layer)",
            R::at_least(-1)),
      field("train.recompute_keep_attention", &c.train.recompute_keep_attention,
            "with gradient_checkpointing true: this many of the recomputed layers (below those of "
            "recompute_keep_mlp) keep their attention block's activations and recompute only "
            "the MLP block",
            R::at_least(0)),
      field("train.recompute_keep_mlp", &c.train.recompute_keep_mlp,
            "with gradient_checkpointing true: the last this many recomputed layers keep their "
            "MLP block's activations and recompute only the attention block",
            R::at_least(0)),
      field("train.offload_layer_inputs", &c.train.offload_layer_inputs,
            "CUDA: recomputed layers keep their input in pinned host memory instead of the GPU "
            "(long context); gradient_checkpointing auto turns it on when the budget needs it"),
      field("train.mlp_chunk_tokens", &c.train.mlp_chunk_tokens,
            "recomputed layers run their MLP block over row chunks of this many of the "
            "micro-batch's tokens (less memory at long context; 0: one pass; auto: 8192 when "
            "batch_size x seq_len is over 16384, else 0)",
            R::at_least(0)),
      field("train.steps", &c.train.steps, "optimizer steps (leave out when train.epochs is set)",
            R::at_least(0), {"max_steps", "num_steps", "total_steps", "iters"}),
      // Upper bound: a safety net against absurd settings; 1e6 passes over any data is never
      // intended, and steps computed from it stay far inside int64.
      field("train.epochs", &c.train.epochs,
            "passes over the training data instead of train.steps (0: use train.steps); steps = "
            "ceil(epochs x micro-batches per epoch / (grad_accum x ranks))",
            R::between(0, 1e6, false), {"num_train_epochs", "num_epochs"}),
      // Rows per micro-batch. Every row is an int64 [seq_len] input of the batcher and a
      // [seq_len, hidden] activation per layer: 4096 rows of the shortest useful rows already
      // exceed one GPU, and a larger value is a typo that would reach the allocator as a raw
      // out-of-memory error instead of this key.
      field("train.batch_size", &c.train.batch_size, "rows (sequences) per micro-batch",
            R::between(1, 4096, false),
            {"micro_batch_size", "per_device_train_batch_size", "train_batch_size"}),
      field("train.grad_accum", &c.train.grad_accum, "micro-batches per optimizer step",
            R::at_least(1), {"gradient_accumulation_steps", "accumulation_steps"}),
      // Tokens per row: at most Qwen3-2507's native context (262,144 positions); the RoPE
      // tables, masks and activations are sized by it.
      field("train.seq_len", &c.train.seq_len,
            "tokens per row (longer examples are truncated per data.truncation)",
            R::between(2, 262144, false),
            {"max_seq_length", "max_seq_len", "seq_length", "max_length", "block_size"}),
      field("train.seed", &c.train.seed, "seed of data order and stochastic rounding"),
      field("train.max_grad_norm", &c.train.max_grad_norm, "global gradient-norm clip; 0 disables",
            R::at_least(0), {"grad_clip", "clip_grad_norm", "gradient_clipping"}),
      field("train.max_nonfinite_steps", &c.train.max_nonfinite_steps,
            "consecutive non-finite steps skipped before the run fails", R::at_least(0)),
      field("train.router_aux_loss_coef", &c.train.router_aux_loss_coef,
            "mixture-of-experts models: the weight of the routers' load-balancing loss in the "
            "loss (auto: config.json's router_aux_loss_coef; 0 leaves it out)",
            R::between(0, 1e3, false)),
      field("train.router_z_loss_coef", &c.train.router_z_loss_coef,
            "mixture-of-experts models: the weight of the router z-loss, the mean over tokens and "
            "MoE layers of logsumexp(router logits)^2 (ST-MoE; 0: off)",
            R::between(0, 1e3, false)),
      field("optim.lr", &c.optim.lr, "peak learning rate", R::above(0), {"learning_rate"}),
      field("optim.beta1", &c.optim.beta1, "AdamW first-moment decay", R::between(0, 1, true),
            {"adam_beta1"}),
      field("optim.beta2", &c.optim.beta2, "AdamW second-moment decay", R::between(0, 1, true),
            {"adam_beta2"}),
      field("optim.eps", &c.optim.eps, "AdamW epsilon", R::above(0), {"adam_epsilon"}),
      field("optim.weight_decay", &c.optim.weight_decay, "decoupled weight decay", R::at_least(0)),
      field("optim.state", &c.optim.state, "moment storage format", {},
            {"optim_bits", "state_dtype", "moment_dtype"}),
      field("optim.offload", &c.optim.offload,
            "none; moments: on CUDA the AdamW moments live in pinned host memory (no GPU "
            "memory for them; the update runs at PCIe speed; same results); all: the trained "
            "NVFP4 linears' masters too (the GPU keeps their 4-bit codes)"),
      field("optim.in_backward", &c.optim.in_backward,
            "update each parameter inside the backward and free its gradient (with grad_accum "
            "> 1: inside the last micro-batch's backward, from the summed gradient); clipping "
            "then uses the previous step's norm (auto: CUDA, full fine-tuning, grad_accum 1 or "
            "optim.offload all)"),
      field("optim.chunk_rows", &c.optim.chunk_rows,
            "rows per optimizer chunk (bounds temporaries)", R::at_least(1)),
      field("optim.master_rounding", &c.optim.master_rounding,
            "how updates are written back to fp16/bf16 masters", {}, {"rounding"}),
      field("optim.schedule.kind", &c.optim.schedule.kind, "learning-rate schedule after warmup",
            {}, {"lr_scheduler_type", "lr_scheduler", "scheduler"}),
      field("optim.schedule.warmup_steps", &c.optim.schedule.warmup_steps,
            "linear warmup steps from 0 to lr", R::at_least(0),
            {"warmup", "num_warmup_steps", "lr_warmup_steps"}),
      field("optim.schedule.warmup_ratio", &c.optim.schedule.warmup_ratio,
            "warmup as a fraction of the run instead of warmup_steps: round(ratio x steps)",
            R::between(0, 1, true), {"warmup_fraction"}),
      field("optim.schedule.min_lr_ratio", &c.optim.schedule.min_lr_ratio,
            "final lr / lr for linear and cosine decay", R::between(0, 1, false),
            {"min_lr", "final_lr_ratio"}),
      path("data.files", &c.data.files, "training files (TSV prompt<TAB>answer, JSONL, text)"),
      path("data.eval_files", &c.data.eval_files,
           "held-out files for validation loss (same formats as files)"),
      field("data.eval_fraction", &c.data.eval_fraction,
            "hold out this fraction of training examples for validation loss",
            R::between(0, 0.5, true), {"validation_split", "val_fraction", "eval_split"}),
      field("data.format", &c.data.format, "file format (auto: by extension)"),
      field("data.system_prompt", &c.data.system_prompt,
            "optional system turn before every example", {}, {"system"}),
      field("data.chat_template", &c.data.chat_template,
            "chat template: qwen3 (hybrid thinking), qwen3-2507-instruct, qwen3-2507-thinking, "
            "or auto (the model folder's, identified; qwen3-2507-instruct when it has none)",
            {}, {"template"}),
      field("data.enable_thinking", &c.data.enable_thinking,
            "HF's enable_thinking for the qwen3 template's generation prompt (auto: unset, "
            "thinking on)"),
      field("data.shuffle", &c.data.shuffle, "reshuffle every epoch (seeded by train.seed)"),
      field("data.packing", &c.data.packing,
            "pack several examples into one seq_len row (best fit; false: one example per row)", {},
            {"pack"}),
      field("data.pack_window", &c.data.pack_window,
            "packing: examples considered when filling a row", R::at_least(1)),
      field("data.on_error", &c.data.on_error, "malformed data lines: fail or skip"),
      field("data.truncation", &c.data.truncation,
            "examples longer than train.seq_len (auto: plain text split into windows, every "
            "token trained; conversations and prompt/answer records cut_left)"),
      field("data.text_unit", &c.data.text_unit,
            "what one example of a text file is: the whole file, each paragraph (blank lines "
            "separate them) or each line"),
      field("eval.prompts", &c.eval.prompts, "user prompts answered greedily"),
      field("eval.every", &c.eval.every, "evaluate every N steps (0: only before and after)",
            R::at_least(0), {"eval_steps", "eval_interval"}),
      // The KV cache of an eval answer is sized by prompt + max_new_tokens (Qwen3-4B: 144 KiB
      // per token, so 32,768 tokens is 4.5 GiB); 32,768 is twice the longest answer the
      // Qwen3-2507 model card suggests, and an unbounded value became a terabyte allocation.
      field("eval.max_new_tokens", &c.eval.max_new_tokens, "generation length limit",
            R::between(1, 32768, false), {"max_tokens"}),
      field("eval.at_start", &c.eval.at_start, "evaluate before the first step"),
      field("eval.at_end", &c.eval.at_end, "evaluate after the last step"),
      field("output.dir", &c.output.dir,
            "run directory (config, metrics, eval, checkpoints, export)", {}, {"output_dir"}),
      field("output.export_path", &c.output.export_path,
            "exported .dat (default <dir>/model.dat; relative to dir; none disables)"),
      field("output.export_every", &c.output.export_every,
            "also export every N steps (0: at the end)", R::at_least(0)),
      field("output.checkpoint_every", &c.output.checkpoint_every,
            "also checkpoint every N steps (0: by output.checkpoint_minutes only)", R::at_least(0),
            {"save_steps", "checkpoint_interval"}),
      field("output.checkpoint_minutes", &c.output.checkpoint_minutes,
            "checkpoint every N minutes of training, and the last step (0 with checkpoint_every 0: "
            "only on SIGINT/SIGTERM)",
            R::at_least(0)),
      field("output.keep", &c.output.keep, "newest complete checkpoints kept", R::at_least(1),
            {"save_total_limit", "keep_checkpoints"}),
      field("output.verify_export", &c.output.verify_export,
            "read the export back and check its forward weights equal the trained model's, tensor "
            "by tensor"),
      field("output.hf_export", &c.output.hf_export,
            "also write a Hugging Face folder at <export .dat minus .dat>-hf: NVFP4 in the "
            "modelopt or compressed-tensors layout (vLLM serves it), or bf16 (dense, the "
            "export's NVFP4 linears dequantized exactly)"),
      field("output.export_dense", &c.output.export_dense,
            "model.fake_quant false: write the trained NVFP4 linears as fp16 tensors (the "
            "full-precision model) instead of their NVFP4 quantization"),
      field("guard.max_gpu_gb", &c.guard.max_gpu_gb,
            "stop (exit 3) when reserved or device-used GPU memory passes this many GB; 0 off",
            R::at_least(0)),
      field("lora.rank", &c.lora.rank, "train.method lora: rank of each adapter", R::at_least(1),
            {"r", "lora_r"}),
      field("lora.alpha", &c.lora.alpha, "the adapter's update is scaled by alpha / rank",
            R::above(0), {"lora_alpha"}),
      field("lora.dropout", &c.lora.dropout, "dropout on the adapter's input (only 0 is supported)",
            R::at_least(0), {"lora_dropout"}),
      field("lora.targets", &c.lora.targets,
            "adapted linears: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, "
            "experts (a mixture-of-experts layer's experts, one adapter each; all in the "
            "train.trainable.layers), lm_head",
            {}, {"target_modules"}),
      field("lora.merge_aware", &c.lora.merge_aware,
            "true: train through the quantization of the merged weight (the merged NVFP4 export "
            "is what was trained); false: plain LoRA on the 4-bit weight"),
      field("lora.cache_base_weights", &c.lora.cache_base_weights,
            "plain adapters: keep the adapted linears' frozen weights dequantized in the compute "
            "dtype (2 bytes an element) instead of dequantizing them in every forward; auto: when "
            "no decoder layer recomputes"),
      path("distill.teacher", &c.distill.teacher,
           "train.objective distill: the teacher, a .dat, Hugging Face folder or q4train run "
           "directory (its export; frozen, compute dtype, same device; dense linears stay "
           "dense)"),
      path("distill.teacher_config", &c.distill.teacher_config,
           "the teacher's config.json (default: the folder's config.json, a run directory's "
           "model.config, else model.config)"),
      field("distill.alpha", &c.distill.alpha,
            "loss = alpha x divergence + (1 - alpha) x cross-entropy on the labels",
            R::between(0, 1, false)),
      // Bounded so that logits / T and T^2 stay finite in fp32 (config.h).
      field("distill.temperature", &c.distill.temperature,
            "softmax temperature of both models; the divergence is scaled by T^2",
            R::between(kMinDistillTemperature, kMaxDistillTemperature, false), {"kd_temperature"}),
      field("distill.divergence", &c.distill.divergence,
            "KL(teacher || student) (forward_kl, mass-covering) or KL(student || teacher) "
            "(reverse_kl, mode-seeking)"),
      path("distill.topk_file", &c.distill.topk_file,
           "offline distillation: the teacher's top-K log-probabilities of the training data "
           "(written by q4train --write-teacher-topk), read instead of running the teacher"),
      // One (rows, K) id and log-probability table per written token: K = 65,536 would be 2.5x
      // the full-vocabulary logits of the model itself.
      field("distill.topk", &c.distill.topk, "tokens per position that --write-teacher-topk keeps",
            R::between(1, 4096, false)),
      field("preference.loss", &c.preference.loss,
            "sigmoid (DPO), ipo, or simpo (reference-free, per-token averages)"),
      field("preference.beta", &c.preference.beta,
            "scale of the implicit reward beta x (log pi - log ref)",
            R::between(kMinPreferenceBeta, kMaxPreferenceBeta, false)),
      field("preference.label_smoothing", &c.preference.label_smoothing,
            "sigmoid and simpo: the assumed chance that a pair's labels are flipped",
            R::between(0, 0.5, true)),
      field("preference.simpo_gamma", &c.preference.simpo_gamma,
            "simpo: the target reward margin (divided by beta in the loss)",
            R::between(-kMaxSimpoGamma, kMaxSimpoGamma, false), {"gamma_beta_ratio"}),
      field("preference.sft_weight", &c.preference.sft_weight,
            "adds this x the chosen answer's mean cross-entropy per pair (TRL's rpo_alpha)",
            R::between(0, kMaxSftWeight, false), {"rpo_alpha"}),
      path("preference.reference", &c.preference.reference,
           "the reference model, a .dat, Hugging Face folder or q4train run directory (default: "
           "the starting model); "
           "its log-probabilities are computed once before training"),
      path("preference.reference_config", &c.preference.reference_config,
           "the reference's config.json (default: the folder's config.json, a run directory's "
           "model.config, else model.config)"),
      field("reward.functions", &c.reward.functions,
            "built-in verifiers, each a mapping {name, kind, weight, ...}: exact_match, "
            "last_number, regex, json, length (keys: reward.functions[].*)"),
      field("reward.command", &c.reward.command,
            "a long-lived verifier program (argv): one JSON request a line on stdin, one number a "
            "line on stdout (docs/trainer.md#rewards)"),
      field("reward.command_weight", &c.reward.command_weight,
            "the command's reward enters the total times this weight"),
      // A day: any one batch that takes longer is a hung verifier, not a slow one.
      field("reward.command_timeout_s", &c.reward.command_timeout_s,
            "the longest wait, in seconds, for the answers to one batch's requests",
            Range{0.0, 86400.0, true, false}),
      path("reward.command_dir", &c.reward.command_dir,
           "the command's working directory (default: the config file's directory)"),
      // TRL's GRPOConfig names (docs/trainer.md#grpo).
      field("grpo.num_generations", &c.grpo.num_generations,
            "train.objective grpo: completions sampled per prompt, the group whose rewards set "
            "each completion's advantage",
            R::between(2, 4096, false)),
      field("grpo.max_completion_length", &c.grpo.max_completion_length,
            "tokens sampled per completion at most; prompt + completion must fit train.seq_len",
            R::at_least(1)),
      // Bounded as distill.temperature: logits / T stays finite in fp32.
      field("grpo.temperature", &c.grpo.temperature,
            "sampling and loss: softmax(logits / temperature), as TRL",
            R::between(kMinGrpoTemperature, kMaxGrpoTemperature, false)),
      field("grpo.top_p", &c.grpo.top_p, "nucleus sampling (1: off)", Range{0.0, 1.0, true, false}),
      field("grpo.top_k", &c.grpo.top_k, "sample from the k most likely tokens (0: off)",
            R::at_least(0)),
      field("grpo.beta", &c.grpo.beta,
            "KL coefficient to the reference (the starting model, k3 estimator); 0: no reference "
            "model is kept",
            R::between(0, kMaxPreferenceBeta, false)),
      field("grpo.epsilon", &c.grpo.epsilon,
            "clipping: the ratio pi / pi_old is clipped below at 1 - epsilon",
            R::between(0, 1, false)),
      field("grpo.epsilon_high", &c.grpo.epsilon_high,
            "clipping above at 1 + epsilon_high (DAPO's clip-higher; 0: epsilon)",
            R::between(0, 100, false)),
      field("grpo.loss_type", &c.grpo.loss_type,
            "grpo: mean over each completion's tokens, then over completions; dr_grpo: sum / "
            "(completions x max_completion_length); dapo: sum / tokens of the batch"),
      field("grpo.scale_rewards", &c.grpo.scale_rewards,
            "advantages divided by the reward std of the group, of the batch, or not at all "
            "(TRL's true = group, false = none)"),
      field("grpo.num_iterations", &c.grpo.num_iterations,
            "updates per generation batch (TRL's mu); the ratio to the sampling policy matters "
            "from the second",
            R::between(1, 1024, false)),
      field("grpo.mask_truncated_completions", &c.grpo.mask_truncated_completions,
            "completions that reach max_completion_length without an end token do not train"),
      field("log.every", &c.log.every, "log line every N steps", R::at_least(1),
            {"logging_steps", "log_interval"}),
      field("log.metrics", &c.log.metrics, "metrics file inside output.dir (empty disables)"),
      field("log.progress", &c.log.progress,
            "auto: progress bar on a terminal, log lines otherwise; bar; line"),
      field("log.tensorboard", &c.log.tensorboard,
            "write TensorBoard event files (events.out.tfevents.*) into output.dir"),
      field("log.report", &c.log.report,
            "write output.dir/report.html (SVG plots, eval answers) at each eval and at the end"),
  };
}

std::vector<FieldRef> reward_function_fields(RewardFunctionConfig& f) {
  auto field = [](std::string key, FieldPtr ptr, std::string doc, Range range = {}) {
    FieldRef r;
    r.key = std::move(key);
    r.ptr = ptr;
    r.doc = std::move(doc);
    r.range = range;
    return r;
  };
  return {
      field("name", &f.name,
            "unique name, logged as rewards/<name>/mean (default: the kind); letters, digits, "
            "_ . -"),
      field("kind", &f.kind, "the verifier (required)"),
      field("weight", &f.weight, "the total reward is the sum of weight x reward"),
      field("field", &f.field,
            "exact_match, last_number: the example's field holding the reference answer"),
      field("normalize", &f.normalize,
            "exact_match: compare trimmed, ASCII case-folded, whitespace runs as one space"),
      field("extract", &f.extract,
            "exact_match, last_number, json: PCRE2 regex whose first group (first match) is the "
            "text checked; no match scores 0"),
      field("pattern", &f.pattern, "regex: PCRE2 regex; 1 when the completion matches, else 0"),
      field("target_tokens", &f.target_tokens, "length: completion tokens free of penalty",
            Range::at_least(0)),
      // Above 1 a single token past the target already takes the whole penalty.
      field("penalty_per_token", &f.penalty_per_token,
            "length: reward -min(1, penalty_per_token x tokens beyond target_tokens)",
            Range{0.0, 1.0, true, false}),
  };
}

bool reward_key_applies(RewardKind kind, const std::string& leaf) {
  if (leaf == "name" || leaf == "kind" || leaf == "weight") return true;
  switch (kind) {
    case RewardKind::kExactMatch:
      return leaf == "field" || leaf == "normalize" || leaf == "extract";
    case RewardKind::kLastNumber:
      return leaf == "field" || leaf == "extract";
    case RewardKind::kJson:
      return leaf == "extract";
    case RewardKind::kRegex:
      return leaf == "pattern";
    case RewardKind::kLength:
      return leaf == "target_tokens" || leaf == "penalty_per_token";
  }
  return false;
}

std::vector<std::string> config_keys() {
  Config c;
  std::vector<std::string> keys;
  for (const auto& f : config_fields(c)) keys.push_back(f.key);
  return keys;
}

}  // namespace q4::trainer
