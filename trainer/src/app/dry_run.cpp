// --dry-run: what a run checks before its first step, without loading weights, and the memory
// estimate (see trainer.h).
#include <fmt/format.h>

#include <filesystem>
#include <iostream>
#include <optional>

#include "q4/model/hf_interop.h"
#include "q4/trainer/app/trainer.h"
#include "q4/trainer/objectives/grpo.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/dry_run_stages.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/memory.h"

namespace fs = std::filesystem;

namespace q4::trainer {

int run_dry_run(const Config& config, std::ostream& out, bool overwrite) {
  std::string note;
  RunPlan plan = resolve_plan(config, RunOptions{}, /*probe=*/false, /*dry_run=*/true)
                     .with_warmup_clipped(&note);
  const Config& c = plan.config();
  const ObjectiveNeeds& needs = plan.objective_needs();
  if (!note.empty()) out << note << "\n";
  if (const std::string w = ignored_settings_warning(c, needs); !w.empty()) out << w << "\n";
  check_input_files(c, needs, /*need_data=*/plan.steps() > 0);
  check_output_paths(c, needs, overwrite);
  const auto mc = load_model_config(c);
  as_input_error("train.trainable", [&] {
    trainable_spec(c).validate(mc.num_hidden_layers);
    return 0;
  });
  // The frozen models the run loads (a teacher only without distill.topk_file), their files and
  // vocabularies checked as the run checks them before loading them.
  if (plan.steps() > 0) check_objective_models(c, mc.vocab_size);
  if (plan.steps() > 0 && needs.prompt_records) {
    check_grpo_prompts(c, out);  // prompts are sampled from, not batched
  } else if (plan.steps() > 0) {
    plan = dry_run_data(plan, mc, out);
  }
  // The shipped NVFP4 files store lm_head separately even when config.json says tied; a random
  // init follows config.json. Checking the weights file would mean indexing it; assume the
  // shipped layout for files.
  const bool separate_lm_head = c.model.init == InitKind::kFile ? true : !mc.tie_word_embeddings;
  std::string recompute_note, fit_note;
  plan = plan_memory(plan, mc, separate_lm_head, &recompute_note, &fit_note);
  const auto b = estimate_budget(mc, c, separate_lm_head, needs);
  out << fmt::format(
      "dry run: {} layers, hidden {}, intermediate {}, vocab {}; device {}, "
      "masters {}, compute {}\n",
      mc.num_hidden_layers, mc.hidden_size, mc.intermediate_size, mc.vocab_size, c.model.device,
      to_string(c.model.master_dtype), to_string(resolved_compute_dtype(c)));
  out << fmt::format("micro-batch {} x {} tokens, grad_accum {}, {} steps; optimizer state {}\n",
                     c.train.batch_size, c.train.seq_len, plan.grad_accum(), plan.steps(),
                     to_string(c.optim.state));
  if (!recompute_note.empty()) out << recompute_note << "\n";
  if (const auto moe = moe_summary(mc, c, separate_lm_head); !moe.empty()) out << moe << "\n";
  if (const auto lora = lora_summary(mc, c, separate_lm_head); !lora.empty()) out << lora << "\n";
  if (const auto note = moe_lora_note(mc, c); !note.empty()) out << "note: " << note << "\n";
  if (const auto summary = objective_summary(c); !summary.empty()) out << summary << "\n";
  out << "memory estimate (device, one micro-batch):\n" << b.to_table();
  if (!fit_note.empty()) out << fit_note << "\n";
  out << plan.describe();
  if (c.model.init == InitKind::kFile && model::is_hf_folder(c.model.weights)) {
    out << fmt::format("weights: Hugging Face folder {} (imported at load)\n", c.model.weights);
  } else if (c.model.init == InitKind::kFile) {
    out << fmt::format("weights file: {} ({:.3f} GiB)\n", c.model.weights,
                       to_gib(static_cast<int64_t>(fs::file_size(c.model.weights))));
  }
  if (const auto left = run_dir_leftovers(c, needs); !left.empty()) {
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
