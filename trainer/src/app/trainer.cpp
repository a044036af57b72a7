// The run loop (docs/design.md#trainer-components): a Trainer owns the run's components (set-up,
// the step, gradient sync, checkpointing, evaluation, export, the run log) and sequences them:
// set-up, then for each step the step function followed by its logging and the eval, export and
// checkpoint cadences and the stop-signal check, then the end of the run (final checkpoint,
// eval, export, report). Set-up failures caused by inputs are ConfigError (exit 2); failures
// after set-up are runtime errors (exit 1).
#include "q4/trainer/app/trainer.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <thread>

#include "q4/io/atomic_file.h"
#include "q4/io/host_heap.h"
#include "q4/io/remove_tree.h"
#include "q4/model/dat_file.h"
#include "q4/quant/nvfp4.h"
#include "q4/trainer/distributed/distributed.h"
#include "q4/trainer/distributed/grad_sync.h"
#include "q4/trainer/objectives/objective.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/output/checkpointer.h"
#include "q4/trainer/output/evaluator.h"
#include "q4/trainer/output/exporter.h"
#include "q4/trainer/plan/estimate.h"
#include "q4/trainer/plan/run_plan.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/report/run_log.h"
#include "q4/trainer/rewards/rewards.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/fault.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/metrics.h"
#include "q4/trainer/runtime/nvtx.h"
#include "q4/trainer/runtime/profile.h"
#include "q4/trainer/runtime/signals.h"
#include "q4/trainer/step/rollout_source.h"
#include "q4/trainer/step/step.h"

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace q4::trainer {
namespace {

// ---------------------------------------------------------------------------------------------

class Trainer {
 public:
  Trainer(const Config& c, const RunOptions& o, std::ostream& out, std::ostream& err)
      : plan_(resolve_plan(c, o)),
        loop_(plan_.loop_plan()),
        out_(out),
        err_(err),
        setup_(out, err),
        evaluator_(plan_.eval_plan(), o.world.rank == 0) {}

  int run() {
    run_start_ = Clock::now();
    plan_.check_device();  // before anything is written
    if (plan_.options().export_only) return export_only();
    // A run length from the data (train.epochs, warmup_ratio) is clipped once it is resolved.
    std::string note;
    plan_ = plan_.with_warmup_clipped(&note);
    if (!note.empty()) out_ << note << "\n";
    if (const std::string w = plan_.ignored_settings_warning(); !w.empty()) {
      err_ << w << "\n";
    }
    install_stop_handlers();  // before set-up: a signal there ends the run cleanly, too
    setup();
    if (stop_requested()) {
      // A fresh run stopped in set-up trained nothing: what it created goes, so that the same
      // command runs again (check_fresh_output_dir would refuse the leftovers).
      if (!plan_.resuming()) remove_setup_outputs();
      out_ << "signal " << stop_signal() << " during set-up: stopped before the first step\n";
      return kExitOk;
    }
    if (leader()) {
      log_->print_summary(setup_, evaluator_,
                          plan_.memory_estimate(setup_.model_config(), setup_.separate_lm_head()),
                          ranks(), start_step_);
      print_moe_summary();
    }
    return loop();
  }

 private:
  bool leader() const { return !comm_ || comm_->rank() == 0; }
  int64_t ranks() const { return comm_ ? comm_->world_size() : plan_.options().world.world_size; }

  // --resume DIR --export-only: the checkpoint's masters over the run's weights, exported to
  // output.export_path (atomic, with output.hf_export and the export check); no training, and
  // nothing else in the run directory changes.
  int export_only() {
    if (!plan_.options().resume) {
      throw ConfigError("--export-only needs --resume DIR (a checkpoint or a run directory)");
    }
    const CheckpointDir ck = resolve_resume_dir(*plan_.options().resume);
    if (plan_.export_path().empty()) {
      throw ConfigError(
          "--export-only: output.export_path is none; set one (e.g. --set "
          "output.export_path=model.dat)");
    }
    plan_.check_inputs(/*need_data=*/false);
    plan_.check_outputs();
    // An older checkpoint never replaces a newer export, nor a file of unknown step.
    check_export_not_newer(plan_.export_path(), ck.step, plan_.options().overwrite,
                           /*unknown_is_error=*/true, loop_.output_dir);
    fs::create_directories(loop_.output_dir);
    lock_ = std::make_unique<RunDirLock>(loop_.output_dir);
    plan_ = setup_.load_model(plan_, /*need_tokenizer=*/false);
    build_components();
    start_step_ = checkpointer_->restore(ck, Checkpointer::RestoreFor::kExportOnly).step;
    setup_.model().refresh_forward_weights();
    exporter_->write(start_step_, setup_.model(), setup_.source_path());
    out_ << fmt::format("exported the model of {} (step {}) in {}\n", ck.path, start_step_,
                        format_duration(ms_since(run_start_) / 1000.0));
    return kExitOk;
  }

  // A fresh run refuses an output.dir holding anything but its own inputs (a previous run's
  // checkpoints, metrics or export, the user's files) unless --overwrite. A config file that is
  // <output.dir>/config.yaml is refused even with --overwrite: the run writes its resolved
  // config there and would replace the user's.
  void check_fresh_output_dir() {
    std::error_code ec;
    const std::string& dir = loop_.output_dir;
    const std::string& source = loop_.config_source;
    const fs::path saved = fs::path(dir) / kConfigFile;
    if (fs::is_regular_file(source, ec) && fs::equivalent(source, saved, ec)) {
      throw ConfigError("the config file " + source + " is " + saved.string() +
                        ", where a run writes its resolved config; move the config out of "
                        "output.dir (or choose another output.dir), or continue that run with "
                        "--resume " +
                        dir);
    }
    const auto left = plan_.run_dir_leftovers();
    if (left.empty() || plan_.options().overwrite) return;
    const bool ck = latest_checkpoint(dir).has_value();
    throw ConfigError(
        "output.dir " + dir + " is not empty (" + join_names(left, 4) +
        "); pass --overwrite to replace the previous run's files" +
        (ck ? ", --resume " + dir + " to continue its newest checkpoint" : std::string()) +
        ", or choose another output.dir");
  }

  // --overwrite: the previous run's files in output.dir go (checkpoints, config, metrics, eval
  // log, report, event files, init/import files, the export and its HF folder); the user's other
  // files, symbolic links (q4train never makes one: the user's) and this run's inputs stay.
  void remove_previous_run() {
    const fs::path dir(loop_.output_dir);
    const std::string exp = plan_.export_path();
    std::set<std::string> owned;
    if (!loop_.metrics.empty()) owned.insert(loop_.metrics);
    if (!exp.empty() && fs::absolute(exp).parent_path() == fs::absolute(dir)) {
      owned.insert(fs::path(exp).filename().string());
      owned.insert(fs::path(export_record_path(exp)).filename().string());
      owned.insert(fs::path(hf_export_dir(exp)).filename().string());
      owned.insert(fs::path(adapter_dir(exp)).filename().string());
    }
    std::vector<std::string> removed, kept;
    for (const auto& name : plan_.run_dir_leftovers()) {
      if (!fs::is_symlink(dir / name) && (is_reserved_run_name(name) || owned.count(name))) {
        q4::io::remove_tree(dir / name);
        removed.push_back(name);
      } else {
        kept.push_back(name);
      }
    }
    if (!removed.empty()) {
      out_ << "--overwrite: removed the previous run's " << join_names(removed, 8) << "\n";
    }
    if (!kept.empty()) out_ << "--overwrite: kept " << join_names(kept, 8) << " (not q4train's)\n";
  }

  void setup() {
    std::optional<CheckpointDir> resume;
    if (plan_.options().resume) resume = resolve_resume_dir(*plan_.options().resume);
    const fs::path state_path = resume ? fs::path(resume->path) / kTrainStateFile : fs::path();
    std::error_code ec;
    if (resume && fs::is_regular_file(state_path, ec)) {
      // Before anything is written (config.yaml included); an unreadable state.json is reported
      // by restore() with the checksums.
      // With train.epochs or a warmup_ratio the schedule is known only once the data is loaded:
      // setup_locked checks it then, before restoring anything.
      if (!plan_.length_from_data()) {
        Checkpointer(plan_.checkpoint_plan(), out_).check_schedule_unchanged(*resume);
      }
    }
    plan_.check_inputs(/*need_data=*/plan_.steps() > 0);
    // Every output, before anything is written.
    plan_.check_outputs();
    // Every rank sees the directory before the rendezvous, so before rank 0 writes to it.
    if (!resume) check_fresh_output_dir();
    // The final export (step train.steps) never replaces a newer one, another run's, or (a fresh
    // run; a resume whose export lies outside its run directory) a file of unknown origin
    // (docs/trainer.md#export).
    {
      const std::string exp = plan_.export_path();
      check_export_not_newer(exp, plan_.steps(), plan_.options().overwrite,
                             /*unknown_is_error=*/!resume || !path_inside(exp, loop_.output_dir),
                             loop_.output_dir);
    }
    // Every rank checked its inputs first.
    if (plan_.options().world.distributed()) connect_ranks();
    const fs::path dir(loop_.output_dir);
    setup_dir_existed_ = fs::is_directory(dir, ec);
    if (setup_dir_existed_ && leader()) {
      for (const auto& e : fs::directory_iterator(dir)) {
        setup_dir_before_.insert(e.path().filename().string());
      }
    }
    // Rank 0 owns the run directory; the other ranks write only their optimizer shards.
    if (leader()) {
      fs::create_directories(dir);
      lock_ = std::make_unique<RunDirLock>(loop_.output_dir);  // held until the run ends
    }
    try {
      setup_locked(resume);
    } catch (...) {
      // A fresh run that fails in set-up (bad data, weights, tokenizer) leaves nothing behind:
      // what it created goes, so that the corrected command runs without --overwrite.
      if (!resume) remove_setup_outputs();
      throw;
    }
  }

  // A fresh run ended in set-up (an error or a stop signal): rank 0 removes what the run created
  // in output.dir (and the directory when the run made it and it is empty).
  void remove_setup_outputs() {
    if (!leader()) return;
    lock_.reset();
    std::error_code ec;
    const fs::path dir(loop_.output_dir);
    std::vector<fs::path> created;
    for (const auto& e : fs::directory_iterator(dir, ec)) {
      if (!setup_dir_before_.count(e.path().filename().string())) created.push_back(e.path());
    }
    for (const auto& p : created) q4::io::remove_tree(p, ec);
    if (!setup_dir_existed_) fs::remove(dir, ec);  // only when empty
  }
  void setup_locked(const std::optional<CheckpointDir>& resume) {
    if (leader()) {
      for (const auto& p : plan_.clean_stale_files()) out_ << "removed stale " << p << "\n";
      if (!resume && plan_.options().overwrite) remove_previous_run();
      // A fresh random-init run draws a fresh init; with model.init: file, init.dat may be the
      // user's weights and is never touched.
      if (!resume && loop_.random_init) fs::remove(fs::path(loop_.output_dir) / kInitFile);
      // A resume writes its config once the checkpoint is restored: a refused resume (another
      // trainable set, schedule or world) leaves the run's config.yaml as it was.
      if (!resume) write_saved_config();
    }
    // A random init is written by rank 0 and then loaded by the others.
    if (!leader()) comm_->barrier();
    plan_ = setup_.load_model(plan_, /*need_tokenizer=*/true);
    if (comm_ && leader()) comm_->barrier();
    if (plan_.steps() > 0) plan_ = setup_.load_data(plan_, ranks());
    build_components();
    if (resume && plan_.length_from_data()) checkpointer_->check_schedule_unchanged(*resume);
    int64_t tokens_seen = 0;
    if (resume) {
      tokens_seen = restore(*resume);
      if (leader()) write_saved_config();
    }
    // The plan is final here (the run length, the recompute, a resume's grad_accum).
    log_.emplace(plan_.report_plan(), out_, err_, plan_.options().world.rank == 0, run_start_);
    log_->set_flops(plan_.flops_per_token(setup_.model_config(), setup_.separate_lm_head()),
                    device_peak_flops(device_name(plan_.device())));
    log_->set_tokens_seen(tokens_seen);
    if (leader()) log_->open(resume.has_value(), start_step_, evaluator_);
  }

  // The resolved config into <output.dir>/config.yaml (the run's record; a resume reads it).
  void write_saved_config() const {
    write_file_atomic((fs::path(loop_.output_dir) / kConfigFile).string(),
                      config_to_yaml(plan_.config_to_save()));
  }

  // The optimizer over this rank's parameters (ZeRO-2 owners), the step, and what the
  // checkpointer, evaluator and run log borrow.
  void build_components() {
    model::Qwen3Model& model = setup_.model();
    // Without data (--export-only, zero steps) nothing trains: no teacher to load.
    // Before restore(): the preference reference is the starting model.
    const ObjectivePlan objective = plan_.objective_plan();
    objective_ = setup_.batcher() ? make_objective(objective, model, setup_.batcher(),
                                                   setup_.validation_batcher(), leader(), out_)
                                  : std::make_unique<SupervisedCrossEntropy>();
    sync_ = std::make_unique<GradSync>(comm_.get(), model, model.trainable_parameters());
    setup_.make_optimizer(plan_, *sync_);
    checkpointer_.emplace(plan_.checkpoint_plan(), out_);
    exporter_.emplace(plan_.export_plan(), out_, err_);
    step_ = std::make_unique<TrainStep>(
        plan_, model, setup_.optimizer(), setup_.schedule(), *objective_, *sync_, comm_.get(),
        /*in_backward=*/plan_.step().in_backward, setup_.optimizer_index(),
        [this] { return checkpointer_->time_due(); });
    checkpointer_->attach(setup_.optimizer(), sync_->params(), setup_.batcher(), setup_.schedule(),
                          comm_.get(), sync_.get());
    if (plan_.data().prompt_records && setup_.batcher()) {
      // GRPO: the rollouts are the step's batches; the batcher orders the prompts (its state,
      // checkpointed, is the position in that order and seeds the sampler).
      rewards_.emplace(make_rewards(objective.reward));
      rollouts_ = std::make_unique<RolloutSource>(
          plan_.rollout_plan(setup_.tokenizer()->endoftext_id()), model, plan_.device(), *setup_.tokenizer(), setup_.prompts(),
          setup_.prompt_origins(), *setup_.batcher(), *rewards_, comm_.get());
    }
    evaluator_.attach(model, setup_.tokenizer(), *objective_, setup_.take_validation_batcher());
  }

  // Returns the tokens seen before the checkpoint.
  int64_t restore(const CheckpointDir& ck) {
    const auto r =
        checkpointer_->restore(ck, Checkpointer::RestoreFor::kResume, [this, &ck](int64_t accum) {
          if (rollouts_) {
            // Its prompt order batches one generation batch of every rank's prompts, sized by
            // the ranks and grad_accum this run was started with.
            throw ConfigError(fmt::format(
                "--resume {}: train.objective grpo resumes on the number of ranks its checkpoint "
                "was written with (here grad_accum would become {})",
                ck.path, accum));
          }
          plan_ = plan_.with_grad_accum(accum);
          if (step_->in_backward() && !plan_.step().in_backward) {
            // auto's choice for the checkpoint's grad_accum is buffered updates.
            step_->disable_in_backward();
            out_ << "resume: grad_accum " << accum
                 << ", so optimizer updates run after the backward (optim.in_backward auto)\n";
          }
        });
    setup_.model().refresh_forward_weights();  // from the restored masters
    start_step_ = r.step;
    const int64_t iterations = plan_.objective_plan().grpo.num_iterations;
    if (rollouts_ && start_step_ % iterations != 0) {
      throw ConfigError(fmt::format(
          "--resume {}: step {} is inside a generation batch of grpo.num_iterations {} (its "
          "rollouts are not in the checkpoint); resume from a checkpoint at a multiple of {}",
          ck.path, start_step_, iterations, iterations));
    }
    return r.tokens_seen;
  }

  // Mixture-of-experts models, after the start summary: the experts and, with LoRA, that they
  // are not adapted (docs/trainer.md#--dry-run says the same).
  void print_moe_summary() {
    const auto& mc = setup_.model_config();
    if (const auto moe = plan_.moe_summary(mc, setup_.separate_lm_head()); !moe.empty()) {
      out_ << "  experts    " << moe << "\n";
    }
    if (const auto note = plan_.moe_lora_note(mc); !note.empty()) {
      out_ << "  note       " << note << "\n";
    }
  }

  // The training loop (docs/design.md#trainer-components).
  int loop() {
    const int64_t total = plan_.steps();
    if (start_step_ == 0 && loop_.eval_at_start && total > 0) validate_at_start();
    if (loop_.eval_at_start && start_step_ == 0) evaluate(0, "start");
    log_->start_steps(start_step_);
    checkpointer_->start_clock();  // checkpoint_minutes count training time
    for (int64_t step = start_step_; step < total; ++step) {
      inject_fault(step + 1);
      const auto t0 = Clock::now();
      log_->note_run_peak();  // the window before this step (load, eval, the previous step)
      reset_peak_memory(plan_.device());
      StepRecord rec;
      rec.lr = setup_.schedule().lr_at(step);
      StepOutcome so = rollout_step(step);
      const int64_t done = step + 1;
      const bool last = done == total;
      rec.done = done;
      // The validation loss: every eval.every steps and after the last one.
      const bool val_due = evaluator_.has_validation() &&
                           ((loop_.eval_every > 0 && done % loop_.eval_every == 0) || last);
      rec.log_step = done % loop_.log_every == 0 || last || step == start_step_ || val_due;
      // Logging steps wait for the optimizer too (exact timing and memory there); other steps
      // return as soon as the loss is on the host, the optimizer kernels still running. Only the
      // compute stream is waited for: the master broadcasts on the communication stream overlap
      // the next step, whose time includes any wait for them.
      if (rec.log_step) synchronize_stream(plan_.device());
      rec.step_ms = ms_since(t0);
      // Mixture of experts: the routing of the step's last forward, before a validation runs
      // another (one device sync, log steps only).
      if (rec.log_step && leader() && setup_.model_config().is_moe()) {
        rec.router = setup_.model().router_stats();
      }
      log_->add_tokens(so.real_tokens);
      check_nonfinite(so.res, done);
      rec.mem = memory_snapshot(plan_.device());
      if (val_due) {
        if (fault_at(FaultPlan::Kind::kValSignal, done)) request_stop(SIGINT);
        rec.val = evaluator_.validation_loss(done);
        // A stop signal during the validation (which then ends early) stops the run here, not
        // after another step; the ranks agree on it (val_due is the same on every rank).
        const double stop = stop_requested() ? 1.0 : 0.0;
        so.stop = so.stop || (comm_ ? comm_->allreduce_sum(stop) : stop) > 0;
        if (!rec.val && leader() && stop > 0) {
          log_->end_bar_line();
          out_ << "validation after step " << done << " cut short by the stop signal\n";
        }
      }
      rec.batcher = setup_.batcher();
      rec.world = ranks();
      log_->record_step(so, rec);
      if (rollouts_ && rec.log_step && leader()) log_->log_rollouts(rollouts_->samples(), done);
      plan_.check_guard(fmt::format("at step {}", done));
      if (after_step(so, done, last)) return kExitOk;  // a stop signal
    }
    return end_of_run(total);
  }

  // The step; GRPO's rollout logs join its logged values. A reward that cannot be computed
  // (RewardError) ends the run with a checkpoint of the steps done, if any were trained.
  StepOutcome rollout_step(int64_t step) {
    if (!rollouts_) return traced_step(step);
    StepOutcome so;
    try {
      so = traced_step(step);
    } catch (const RewardError&) {
      if (step > 0 && checkpointer_->last_step() != step) {
        log_->end_bar_line();
        err_ << "a reward could not be computed; writing a checkpoint of step " << step << "\n";
        save_checkpoint(step);
      }
      throw;
    }
    const auto opt = at::TensorOptions().dtype(at::kDouble);
    for (const auto& [name, value] : rollouts_->stats()) {
      so.logged.emplace_back(name, at::scalar_tensor(value, opt));
    }
    return so;
  }

  // The step, traced with Kineto for steps 3-4 of this session (--profile-trace).
  StepOutcome traced_step(int64_t step) {
    const std::string& trace = plan_.options().profile_trace;
    const bool trace_first = !trace.empty() && step == start_step_ + 2;
    const bool trace_last =
        !trace.empty() && (step == start_step_ + 3 || (trace_first && step + 1 == plan_.steps()));
    if (trace_first) profiler_start(plan_.device().is_cuda());
    StepOutcome so = rollouts_ ? step_->run(step, *rollouts_) : step_->run(step, *setup_.batcher());
    if (trace_last) {
      synchronize_device(plan_.device());
      profiler_stop_and_save(trace);
      err_ << "profile trace of steps " << start_step_ + 3 << "-" << step + 1 << " written to "
           << trace << "\n";
    }
    return so;
  }

  // A skipped update (non-finite gradients) is a warning; more than train.max_nonfinite_steps
  // in a row end the run, and so does a run whose every step was skipped (end_of_run).
  void check_nonfinite(const optim::StepResult& res, int64_t done) {
    if (res.applied) {
      consecutive_nonfinite_ = 0;
      return;
    }
    ++consecutive_nonfinite_;
    err_ << fmt::format(
        "warning: step {} has non-finite gradients (norm {}); update skipped ({} in a row)\n", done,
        res.grad_norm, consecutive_nonfinite_);
    if (consecutive_nonfinite_ > loop_.max_nonfinite_steps) {
      TORCH_CHECK(false, "training diverged: ", consecutive_nonfinite_,
                  " consecutive steps with non-finite gradients (train.max_nonfinite_steps = ",
                  loop_.max_nonfinite_steps, ")");
    }
  }

  // The eval, export and checkpoint cadences after step `done`, then the stop-signal check.
  // Returns true when a stop signal ends the run here (checkpointed).
  bool after_step(const StepOutcome& so, int64_t done, bool last) {
    const LoopPlan& o = loop_;
    // Stopping: straight to the checkpoint, without the answers to eval.prompts.
    if (o.eval_every > 0 && done % o.eval_every == 0 && !last && !so.stop) {
      evaluate(done, "step");
    }
    if (o.export_every > 0 && done % o.export_every == 0 && !last) {
      exporter_->write_periodic(done, setup_.model(), setup_.source_path());
    }
    const bool step_due = o.checkpoint_every > 0 && done % o.checkpoint_every == 0;
    if (step_due || (so.checkpoint_due && !last)) save_checkpoint(done);
    if (!so.stop || last) return false;
    log_->end_bar_line();
    out_ << "signal " << (stop_requested() ? stop_signal() : SIGTERM) << ": stopping after step "
         << done << "\n";
    if (checkpointer_->last_step() != done) save_checkpoint(done);
    sync_->wait_masters();  // no broadcast outlives the run
    log_->update_report(RunLog::ReportPage::kFinal);
    log_->print_stopped(done);
    if (comm_) comm_->barrier();
    return true;
  }

  void validate_at_start() {
    if (const auto v = evaluator_.validation_loss(0)) {
      out_ << fmt::format("validation loss at step 0: {:.4f} ({} {}, {:.1f} s){}\n", v->loss,
                          v->tokens, objective_->units_name(), v->ms / 1000.0,
                          v->values.empty() ? "" : "; " + v->values_line());
      log_->log_validation_at_start(*v);
    }
  }

  void evaluate(int64_t step, const char* tag) {
    if (!loop_.has_prompts || !leader()) return;
    NvtxRange r("eval");
    const auto t0 = Clock::now();
    const auto answers = evaluator_.answer_prompts();
    log_->log_answers(answers, step, tag, ms_since(t0));
  }

  void save_checkpoint(int64_t step) { checkpointer_->save(step, log_->tokens_seen()); }

  // After the last step: the final checkpoint before anything at the end that can fail (eval,
  // export, report), the end-of-run eval, the export, the report and the summary.
  int end_of_run(int64_t total) {
    // The last step's broadcasts, before anything reads a master (the checkpoint and export wait
    // for them too; this also covers a run with neither).
    sync_->wait_masters();
    if (total > start_step_) log_->end_bar_line();
    // A run shorter than train.max_nonfinite_steps whose every step was skipped trained nothing:
    // an error, not a finished run (its export would be the starting model).
    if (total > start_step_ && consecutive_nonfinite_ == total - start_step_) {
      TORCH_CHECK(false, "training diverged: every step of this run (", consecutive_nonfinite_,
                  ") had non-finite gradients and was skipped; nothing was trained (check the "
                  "data, optim.lr and the objective's settings)");
    }
    if (total == start_step_ && evaluator_.has_validation()) {  // nothing left to train
      if (const auto v = evaluator_.validation_loss(total)) {
        out_ << fmt::format("validation loss at step {}: {:.4f}{}\n", total, v->loss,
                            v->values.empty() ? "" : "; " + v->values_line());
      }
    }
    if (plan_.checkpoints_on() && checkpointer_->last_step() != total && total > start_step_) {
      save_checkpoint(total);
    }
    if (fault_at(FaultPlan::Kind::kEndEval, total)) {
      throw std::runtime_error("Q4_FAULT: the end-of-run eval fails (test fault)");
    }
    if (loop_.eval_at_end) evaluate(total, "end");
    finish(total);
    log_->note_run_peak();
    log_->print_run_peak();
    log_->update_report(RunLog::ReportPage::kFinal);  // after the last eval
    if (leader()) log_->print_end_summary(total, evaluator_);
    if (comm_) comm_->barrier();  // no rank leaves while rank 0 still exports
    return kExitOk;
  }

  // The end of a run: an export that fails is checkpointed before the error ends the run (with
  // checkpoints off too), so that no trained step is lost to a full disk, a bad export path or
  // a failing eval.
  void finish(int64_t total) {
    const bool trained = total > start_step_;
    if (plan_.checkpoints_on() && checkpointer_->last_step() != total && trained) {
      save_checkpoint(total);
    }
    // Rank 0 exports; every rank learns whether it failed (the checkpoint is a collective).
    std::exception_ptr failure;
    if (leader()) {
      try {
        exporter_->write_periodic(total, setup_.model(), setup_.source_path());
      } catch (...) {
        failure = std::current_exception();
      }
    }
    bool failed = failure != nullptr;
    if (comm_) failed = comm_->allreduce_sum(failed ? 1.0 : 0.0) > 0.0;
    if (failed && checkpointer_->last_step() != total && trained) {
      err_ << "export failed; writing a checkpoint of step " << total << " first\n";
      save_checkpoint(total);
    }
    if (failure) std::rethrow_exception(failure);
    if (failed) throw std::runtime_error("the export on rank 0 failed (its output says why)");
    log_->close();
  }

  // The test fault of kind `k` on this rank at `step` (runtime/fault.h).
  bool fault_at(FaultPlan::Kind k, int64_t step) const {
    return fault_.at(k, plan_.options().world.rank, step);
  }

  void inject_fault(int64_t step) const {
    if (fault_at(FaultPlan::Kind::kExit, step)) {
      std::fprintf(stderr, "q4train: Q4_FAULT: rank %d exits at step %lld\n",
                   plan_.options().world.rank, static_cast<long long>(step));
      std::_Exit(9);
    }
    if (fault_at(FaultPlan::Kind::kHang, step)) {
      std::fprintf(stderr, "q4train: Q4_FAULT: rank %d hangs at step %lld\n",
                   plan_.options().world.rank, static_cast<long long>(step));
      for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
  }

  // Data parallel: the process group, after every input check (a bad config or file fails on
  // every rank before any collective).
  void connect_ranks() {
    const WorldInfo& w = plan_.options().world;
    if (loop_.in_backward_forced) {
      throw ConfigError(
          "optim.in_backward: true does not apply with several ranks (each "
          "parameter is updated by its owner after the gradient reduction); use "
          "auto or false");
    }
    const auto t0 = Clock::now();
    comm_ = DistComm::connect(w, plan_.device(), plan_.options().dist_timeout);
    out_ << fmt::format(
        "data parallel: {} ranks ({}), rank {} on {}, rendezvous {}:{} in {:.1f} s\n", w.world_size,
        comm_->backend(), w.rank, plan_.device().str(), w.master_addr, w.master_port,
        ms_since(t0) / 1000.0);
  }

  // The run's plan: resolved in stages during set-up (the warmup against the run, the recompute,
  // the run length, a resume's grad_accum), each a new value kept here; final once set-up ends.
  RunPlan plan_;
  const LoopPlan loop_;  // the cadences and the run directory (no stage changes them)
  std::ostream& out_;
  std::ostream& err_;
  std::unique_ptr<DistComm> comm_;  // data parallel (null with one process)
  RunSetup setup_;                  // model, data, optimizer
  std::unique_ptr<Objective> objective_;
  std::unique_ptr<GradSync> sync_;
  std::unique_ptr<TrainStep> step_;
  std::optional<Rewards> rewards_;            // GRPO: the reward: section's functions
  std::unique_ptr<RolloutSource> rollouts_;  // GRPO: the step's batch source
  // Made once the plan stages they depend on are done: the checkpointer and exporter with the
  // run length (build_components), the run log once the plan is final (setup_locked).
  std::optional<Checkpointer> checkpointer_;
  Evaluator evaluator_;
  std::optional<Exporter> exporter_;
  std::optional<RunLog> log_;
  const FaultPlan fault_ = installed_fault_plan();  // read once, at construction
  std::unique_ptr<RunDirLock> lock_;                // output.dir, for the whole run
  Clock::time_point run_start_ = Clock::now();
  int64_t start_step_ = 0;
  int64_t consecutive_nonfinite_ = 0;
  bool setup_dir_existed_ = false;          // output.dir existed before set-up
  std::set<std::string> setup_dir_before_;  // its entries then (rank 0)
};

}  // namespace

// ---------------------------------------------------------------------------------------------

std::string saved_config_path_for_resume(const std::string& resume_dir) {
  fs::path p = fs::absolute(resume_dir).lexically_normal();
  if (p.filename().empty()) p = p.parent_path();
  if (fs::exists(p / kConfigFile)) return (p / kConfigFile).string();
  if (fs::exists(p.parent_path() / kConfigFile)) return (p.parent_path() / kConfigFile).string();
  throw ConfigError("--resume " + resume_dir + ": no " + kConfigFile +
                    " in it or its parent; pass --config");
}

int run_training(const Config& config, const RunOptions& options, std::ostream& out,
                 std::ostream& err) {
  if (!device_is_cuda(config)) io::keep_freed_host_blocks();  // CPU steps reuse their blocks
  if (!options.world.distributed()) {
    Trainer t(config, options, out, err);
    return t.run();
  }
  // Data parallel: rank r trains on cuda:LOCAL_RANK (model.device: cuda) or the CPU; only rank 0
  // prints (errors reach main as exceptions on every rank).
  Config c = config;
  if (device_is_cuda(c)) {
    if (c.model.device != "cuda") {
      throw ConfigError("model.device: " + c.model.device +
                        " names one GPU, but this is a data-parallel run of " +
                        std::to_string(options.world.world_size) +
                        " ranks; use model.device: cuda (rank r takes cuda:LOCAL_RANK)");
    }
    c.model.device = "cuda:" + std::to_string(options.world.local_rank);
  }
  if (options.world.rank == 0) {
    Trainer t(c, options, out, err);
    return t.run();
  }
  std::ostream null_out(nullptr);
  Trainer t(c, options, null_out, null_out);
  return t.run();
}

}  // namespace q4::trainer
