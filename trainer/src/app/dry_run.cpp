// --dry-run: what a run checks before its first step, without loading weights, and the memory
// estimate (see trainer.h).
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <optional>

#include "q4/model/hf_interop.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/objectives/preference.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/app/trainer.h"

namespace fs = std::filesystem;

namespace q4::trainer {

int run_dry_run(const Config& config, std::ostream& out, bool overwrite) {
  RunPlan plan(config, RunOptions{});
  const Config& c = plan.config();
  if (const std::string note = plan.clip_warmup(); !note.empty()) out << note << "\n";
  if (const std::string w = ignored_settings_warning(c); !w.empty()) out << w << "\n";
  check_input_files(c, /*need_data=*/plan.steps() > 0);
  check_output_paths(c, overwrite);
  const auto mc = load_model_config(c);
  as_input_error("train.trainable", [&] {
    trainable_spec(c).validate(mc.num_hidden_layers);
    return 0;
  });
  // The frozen models the run loads (a teacher only without distill.topk_file), their files and
  // vocabularies checked as the run checks them before loading them.
  const bool trains = plan.steps() > 0;
  if (trains && c.train.objective == ObjectiveKind::kDistill && !c.distill.teacher.empty() &&
      c.distill.topk_file.empty()) {
    check_frozen_model_config(c, teacher_spec(c), mc.vocab_size);
  }
  if (trains && c.train.objective == ObjectiveKind::kPreference &&
      c.preference.loss != PreferenceLossKind::kSimpo && !c.preference.reference.empty()) {
    check_frozen_model_config(c, reference_spec(c), mc.vocab_size);
  }
  // The data as the run reads it: the real tokenizer, every file, the validation split, the
  // truncation policy and the batcher's packing (which sizes an epoch); no weights.
  if (plan.steps() > 0) {
    const auto tok = as_input_error("model.tokenizer",
                                    [&] { return data::Tokenizer::from_file(c.model.tokenizer); });
    if (tok.vocab_size() > mc.vocab_size) {
      throw ConfigError(
          fmt::format("model.tokenizer {} has {} tokens but model.config {} has vocab_size {}",
                      c.model.tokenizer, tok.vocab_size(), c.model.config, mc.vocab_size));
    }
    std::vector<data::Example> examples;
    for (const auto& f : c.data.files) {
      for (auto& e : load_examples(c, f, tok, "data.files", "", out, out)) {
        examples.push_back(std::move(e));
      }
    }
    if (examples.empty()) throw ConfigError(no_examples_message(c));
    const int64_t group = c.train.objective == ObjectiveKind::kPreference ? 2 : 1;
    auto val = hold_out(&examples, c.data.eval_fraction, c.train.seed, group);
    for (const auto& f : c.data.eval_files) {
      for (auto& e : load_examples(c, f, tok, "data.eval_files", "validation ", out, out)) {
        val.push_back(std::move(e));
      }
    }
    const data::Batcher batcher = as_input_error(truncation_keys(c, "data.files"), [&] {
      return data::Batcher(std::move(examples), batcher_options(c, tok.endoftext_id()));
    });
    const auto& ts = batcher.truncation_stats();
    out << fmt::format("truncation to train.seq_len {} ({}): {}\n", c.train.seq_len,
                       describe(c.data.truncation), ts.to_string());
    const std::string warn = data::truncation_warning(ts, c.train.seq_len, c.data.truncation,
                                                      "train.seq_len", "data.truncation");
    if (!warn.empty()) out << "warning: " << warn << "\n";
    if (!val.empty()) {
      auto bo = batcher_options(c, tok.endoftext_id());
      bo.shuffle = false;
      const auto n = val.size();
      const data::Batcher vb = as_input_error(truncation_keys(c, "data.eval_files"),
                                              [&] { return data::Batcher(std::move(val), bo); });
      out << fmt::format("validation: {} example{}, {} kept\n", n, n == 1 ? "" : "s",
                         vb.num_examples());
      report_truncation(c, vb.truncation_stats(), "validation ", out, out);
    }
    out << plan.resolve_length(batcher.batches_per_epoch(), 1);
    out << fmt::format(
        "data: {} examples in {} row{}{} and {} micro-batch{} per epoch; {} step{} of {} "
        "micro-batch{} = {:.2f} epochs\n",
        batcher.num_examples(), batcher.rows_per_epoch(), batcher.rows_per_epoch() == 1 ? "" : "s",
        resolved_packing(c) ? " (packed)" : "", batcher.batches_per_epoch(),
        batcher.batches_per_epoch() == 1 ? "" : "es", plan.steps(), plan.steps() == 1 ? "" : "s",
        c.train.grad_accum, c.train.grad_accum == 1 ? "" : "es",
        static_cast<double>(plan.steps() * c.train.grad_accum) /
            static_cast<double>(batcher.batches_per_epoch()));
  }
  // The shipped NVFP4 files store lm_head separately even when config.json says tied; a random
  // init follows config.json. Checking the weights file would mean indexing it; assume the
  // shipped layout for files.
  const bool separate_lm_head = c.model.init == InitKind::kFile ? true : !mc.tie_word_embeddings;
  // The device memory the run plans with: guard.max_gpu_gb, or this machine's GPU's free memory;
  // without either, gradient_checkpointing auto decides at start and nothing says what fits.
  std::optional<int64_t> free_bytes;
  if (device_is_cuda(c)) {
    if (c.guard.max_gpu_gb > 0) {
      free_bytes = 0;
    } else {
      try {
        check_device_available(c);
        const auto snap = memory_snapshot(at::Device(c.model.device));
        free_bytes = snap.device_total_bytes.value_or(0) - snap.device_used_bytes.value_or(0);
      } catch (const ConfigError&) {
      }
    }
  }
  // gradient_checkpointing auto: the choice the run would make here (with what fits instead
  // when even its least is over the budget). Other settings: whether the estimate fits, and
  // what would when it does not (advise_placements).
  std::string recompute_note, fit_note;
  if (c.train.gradient_checkpointing == Recompute::kAuto && device_is_cuda(c)) {
    recompute_note =
        free_bytes ? plan.resolve_recompute(mc, separate_lm_head, *free_bytes)
                   : "gradient checkpointing auto: decided at start from the GPU's free memory "
                     "(no usable GPU here); estimated below with every layer recomputed";
  } else if (free_bytes) {
    const PlacementAdvice a = advise_placements(mc, c, separate_lm_head, *free_bytes);
    fit_note = fmt::format("memory: estimate {:.1f} GiB {} {:.1f} GiB usable of {:.1f} GiB {}{}",
                           to_gib(a.config_bytes), a.config_fits ? "within" : "OVER",
                           to_gib(a.budget.usable_bytes), to_gib(a.budget.budget_bytes),
                           a.budget.source, a.config_fits ? "" : "; " + a.summary());
  }
  if (device_is_cuda(c) && !free_bytes) {
    fit_note =
        "memory: set guard.max_gpu_gb to the card's memory (GB) to see whether this fits and, "
        "if not, which placements would";
  }
  const auto b = estimate_budget(mc, c, separate_lm_head);
  out << fmt::format(
      "dry run: {} layers, hidden {}, intermediate {}, vocab {}; device {}, "
      "masters {}, compute {}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size, c.model.device,
      to_string(c.model.master_dtype), to_string(resolved_compute_dtype(c)));
  out << fmt::format("micro-batch {} x {} tokens, grad_accum {}, {} steps; optimizer state {}\n",
                     c.train.batch_size, c.train.seq_len, c.train.grad_accum, plan.steps(),
                     to_string(c.optim.state));
  if (!recompute_note.empty()) out << recompute_note << "\n";
  if (const auto lora = lora_summary(mc, c, separate_lm_head); !lora.empty()) out << lora << "\n";
  if (c.train.objective == ObjectiveKind::kPreference) out << preference_summary(c) << "\n";
  out << "memory estimate (device, one micro-batch):\n" << b.to_table();
  if (!fit_note.empty()) out << fit_note << "\n";
  if (c.model.init == InitKind::kFile && model::is_hf_folder(c.model.weights)) {
    out << fmt::format("weights: Hugging Face folder {} (imported at load)\n", c.model.weights);
  } else if (c.model.init == InitKind::kFile) {
    out << fmt::format("weights file: {} ({:.3f} GiB)\n", c.model.weights,
                       to_gib(static_cast<int64_t>(fs::file_size(c.model.weights))));
  }
  if (const auto left = run_dir_leftovers(c); !left.empty()) {
    out << "note: output.dir " << c.output.dir << " is not empty (" << join_names(left, 4)
        << "): a fresh run there needs --overwrite (or --resume to continue)\n";
  }
  out << "resolved config:\n" << config_to_yaml(c);
  // Last, so that a GPU run can still be estimated here: but "ok" means it starts here.
  check_device_available(c);
  out << "dry run ok: config valid, inputs present, data read and batched, device available; "
         "no weights loaded\n";
  return kExitOk;
}

}  // namespace q4::trainer
