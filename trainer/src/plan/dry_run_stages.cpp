// --dry-run's resolution stages; see dry_run_stages.h.
#include "q4/trainer/plan/dry_run_stages.h"

#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <optional>

#include "q4/model/hf_interop.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"

namespace q4::trainer {
namespace {

// The device memory the run plans with: guard.max_gpu_gb (0 here: the budget is the guard's),
// or this machine's GPU's free memory; none without either (or on the CPU).
std::optional<int64_t> planned_free_bytes(const Config& c) {
  if (!device_is_cuda(c)) return std::nullopt;
  if (c.guard.max_gpu_gb > 0) return 0;
  try {
    check_device_available(c);
    const auto snap = memory_snapshot(at::Device(c.model.device));
    return snap.device_total_bytes.value_or(0) - snap.device_used_bytes.value_or(0);
  } catch (const ConfigError&) {
  }
  return std::nullopt;
}

}  // namespace

RunPlan dry_run_data(const RunPlan& plan, const model::Qwen3Config& mc, std::ostream& out) {
  const Config& c = plan.config();
  const DataPlan& dp = plan.data();
  const auto tok = as_input_error("model.tokenizer",
                                  [&] { return data::Tokenizer::from_file(c.model.tokenizer); });
  if (tok.vocab_size() > mc.vocab_size) {
    throw ConfigError(
        fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                    c.model.tokenizer, tok.vocab_size(), c.model.config, mc.vocab_size));
  }
  std::vector<data::Example> examples;
  for (const auto& f : c.data.files) {
    for (auto& e : load_examples(c, dp.paired_records, f, tok, "data.files", "", out, out)) {
      examples.push_back(std::move(e));
    }
  }
  if (examples.empty()) throw ConfigError(no_examples_message(c));
  auto val = hold_out(&examples, c.data.eval_fraction, c.train.seed, dp.group_size);
  for (const auto& f : c.data.eval_files) {
    for (auto& e :
         load_examples(c, dp.paired_records, f, tok, "data.eval_files", "validation ", out, out)) {
      val.push_back(std::move(e));
    }
  }
  const auto options = batcher_options(c, tok.endoftext_id(), dp.packing, dp.group_size);
  const data::Batcher batcher = as_input_error(truncation_keys(c, "data.files"), [&] {
    return data::Batcher(std::move(examples), options);
  });
  const auto& ts = batcher.truncation_stats();
  out << fmt::format("truncation to train.seq_len {} ({}): {}\n", c.train.seq_len,
                     describe(c.data.truncation), ts.to_string());
  const std::string warn = data::truncation_warning(ts, c.train.seq_len, c.data.truncation,
                                                    "train.seq_len", "data.truncation");
  if (!warn.empty()) out << "warning: " << warn << "\n";
  if (!val.empty()) {
    auto bo = options;
    bo.shuffle = false;
    const auto n = val.size();
    const data::Batcher vb = as_input_error(truncation_keys(c, "data.eval_files"),
                                            [&] { return data::Batcher(std::move(val), bo); });
    out << fmt::format("validation: {} example{}, {} kept\n", n, n == 1 ? "" : "s",
                       vb.num_examples());
    report_truncation(c, vb.truncation_stats(), "validation ", out, out);
  }
  std::string notes;
  const RunPlan resolved = plan.with_length(batcher.batches_per_epoch(), 1, &notes);
  out << notes;
  const int64_t steps = resolved.steps(), accum = resolved.grad_accum();
  const int64_t bpe = batcher.batches_per_epoch();
  out << fmt::format(
      "data: {} examples in {} row{}{} and {} micro-batch{} per epoch; {} step{} of {} "
      "micro-batch{} = {:.2f} epochs\n",
      batcher.num_examples(), batcher.rows_per_epoch(), batcher.rows_per_epoch() == 1 ? "" : "s",
      dp.packing ? " (packed)" : "", bpe, bpe == 1 ? "" : "es", steps, steps == 1 ? "" : "s", accum,
      accum == 1 ? "" : "es", static_cast<double>(steps * accum) / static_cast<double>(bpe));
  return resolved;
}

namespace {

// Cards a CUDA run is commonly planned for (GB as sold: A100/H100 80 GB, H200 141 GB).
constexpr double kCommonCardsGb[] = {80.0, 141.0};

// No GPU here and no guard.max_gpu_gb: whether the estimate fits each common card, and what
// would when it does not (advise_placements with the card's memory as the budget).
std::string common_cards_note(const RunPlan& plan, const model::Qwen3Config& mc,
                              bool separate_lm_head) {
  std::string s =
      "memory: no GPU here and guard.max_gpu_gb unset (set it to the card's GB to plan for "
      "yours); on common cards:";
  for (const double gb : kCommonCardsGb) {
    Config card = plan.config();
    card.guard.max_gpu_gb = gb;
    const PlacementAdvice a =
        advise_placements(mc, card, separate_lm_head, 0, plan.objective_needs());
    s += fmt::format("\n  {:.0f} GB: estimate {:.1f} GiB, {}", gb, to_gib(a.config_bytes),
                     a.config_fits
                         ? fmt::format("fits ({:.1f} GiB usable)", to_gib(a.budget.usable_bytes))
                         : "over; " + a.summary());
  }
  return s;
}

}  // namespace

RunPlan plan_memory(const RunPlan& plan, const model::Qwen3Config& mc, bool separate_lm_head,
                    std::string* recompute_note, std::string* fit_note) {
  const Config& c = plan.config();
  const std::optional<int64_t> free_bytes = planned_free_bytes(c);
  RunPlan resolved = plan;
  if (plan.recompute().recompute_auto) {
    if (free_bytes) {
      resolved = plan.with_recompute(mc, separate_lm_head, *free_bytes, recompute_note);
    } else {
      *recompute_note =
          "gradient checkpointing auto: decided at start from the GPU's free memory (no usable "
          "GPU here); estimated below with every layer recomputed";
    }
  } else if (free_bytes) {
    const PlacementAdvice a =
        advise_placements(mc, c, separate_lm_head, *free_bytes, plan.objective_needs());
    *fit_note = fmt::format("memory: estimate {:.1f} GiB {} {:.1f} GiB usable of {:.1f} GiB {}{}",
                            to_gib(a.config_bytes), a.config_fits ? "within" : "OVER",
                            to_gib(a.budget.usable_bytes), to_gib(a.budget.budget_bytes),
                            a.budget.source, a.config_fits ? "" : "; " + a.summary());
  }
  if (free_bytes) {
    std::string line;
    resolved = resolved.with_forward_weights(mc, separate_lm_head, *free_bytes, &line);
    if (!line.empty()) *recompute_note += (recompute_note->empty() ? "" : "\n") + line;
  }
  if (device_is_cuda(c) && !free_bytes) *fit_note = common_cards_note(plan, mc, separate_lm_head);
  return resolved;
}

DryRunModel dry_run_model(const RunPlan& plan) {
  const Config& c = plan.config();
  DryRunModel m;
  m.config = load_model_config(c);
  as_input_error("train.trainable", [&] {
    trainable_spec(c).validate(m.config.num_hidden_layers);
    return 0;
  });
  m.separate_lm_head = c.model.init == InitKind::kFile ? true : !m.config.tie_word_embeddings;
  return m;
}

std::string dry_run_model_lines(const RunPlan& plan, const DryRunModel& model,
                                const std::string& recompute_note) {
  const Config& c = plan.config();
  const model::Qwen3Config& mc = model.config;
  std::string s = fmt::format(
      "dry run: {} layers, hidden {}, intermediate {}, vocab {}; device {}, "
      "masters {}, compute {}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size, c.model.device,
      to_string(c.model.master_dtype), to_string(resolved_compute_dtype(c)));
  s += fmt::format("micro-batch {} x {} tokens, grad_accum {}, {} steps; optimizer state {}\n",
                   c.train.batch_size, c.train.seq_len, plan.grad_accum(), plan.steps(),
                   to_string(c.optim.state));
  if (!recompute_note.empty()) s += recompute_note + "\n";
  if (const auto moe = moe_summary(mc, c, model.separate_lm_head); !moe.empty()) s += moe + "\n";
  if (const auto lora = lora_summary(mc, c, model.separate_lm_head); !lora.empty()) {
    s += lora + "\n";
  }
  if (const auto note = moe_lora_note(mc, c); !note.empty()) s += "note: " + note + "\n";
  return s;
}

std::string dry_run_files_and_config(const RunPlan& plan) {
  const Config& c = plan.config();
  std::string s;
  if (c.model.init == InitKind::kFile && model::is_hf_folder(c.model.weights)) {
    s += fmt::format("weights: Hugging Face folder {} (imported at load)\n", c.model.weights);
  } else if (c.model.init == InitKind::kFile) {
    s += fmt::format("weights file: {} ({:.3f} GiB)\n", c.model.weights,
                     to_gib(static_cast<int64_t>(std::filesystem::file_size(c.model.weights))));
  }
  if (const auto left = plan.run_dir_leftovers(); !left.empty()) {
    s += "note: output.dir " + c.output.dir + " is not empty (" + join_names(left, 4) +
         "): a fresh run there needs --overwrite (or --resume to continue)\n";
  }
  return s + "resolved config:\n" + config_to_yaml(c);
}

}  // namespace q4::trainer
