// The one training step; see step.h.
#include "q4/trainer/step/step.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/nvtx.h"
#include "q4/trainer/runtime/signals.h"

namespace q4::trainer {
namespace {

// A device scalar copied into pinned host memory without waiting for the device: read() waits
// only until the copy has happened (a CUDA event), so fetching the loss adds no sync of its own.
class AsyncScalar {
 public:
  void start(const at::Tensor& t) {  // t: () on any device
    event_.reset();
    if (!t.is_cuda()) {
      host_ = t.detach().to(at::kCPU, at::kFloat);
      return;
    }
    host_ = at::empty({}, at::TensorOptions().dtype(at::kFloat).pinned_memory(true));
    host_.copy_(t.detach().to(at::kFloat), /*non_blocking=*/true);
    event_ = std::make_unique<c10::Event>(c10::DeviceType::CUDA);
    c10::impl::VirtualGuardImpl impl(t.device().type());
    event_->record(impl.getStream(t.device()));
  }
  double read() const {
    // c10::Event has no blocking wait in LibTorch 1.13: poll (the copy is done by the time the
    // optimizer's norm has been read, so this returns at once in practice).
    if (event_) {
      while (!event_->query()) std::this_thread::yield();
    }
    return host_.item<double>();
  }

 private:
  at::Tensor host_;
  std::unique_ptr<c10::Event> event_;
};

// Sums the objective's named values of one micro-batch into the step's (each over `denom`).
void add_logged(StepOutcome* o, const std::vector<std::pair<std::string, at::Tensor>>& values,
                double denom) {
  for (const auto& [name, v] : values) {
    const at::Tensor x = v.detach().to(at::kDouble) / denom;
    auto it = std::find_if(o->logged.begin(), o->logged.end(),
                           [&name = name](const auto& e) { return e.first == name; });
    if (it == o->logged.end()) {
      o->logged.emplace_back(name, x);
    } else {
      it->second = it->second + x;
    }
  }
}

}  // namespace

TrainStep::TrainStep(const RunPlan& plan, model::Qwen3Model& model,
                     const optim::LrSchedule& schedule, Objective& objective, DistComm* comm,
                     bool in_backward, GradientPathFactory make_path,
                     std::function<bool()> checkpoint_due)
    : plan_(plan),
      model_(model),
      schedule_(schedule),
      objective_(objective),
      comm_(comm),
      in_backward_(in_backward),
      make_path_(std::move(make_path)),
      checkpoint_due_(std::move(checkpoint_due)) {}

TrainStep::TrainStep(const RunPlan& plan, model::Qwen3Model& model, optim::PackedAdamW& optimizer,
                     const optim::LrSchedule& schedule, Objective& objective, GradSync& sync,
                     DistComm* comm, bool in_backward,
                     const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
                     std::function<bool()> checkpoint_due)
    : TrainStep(
          plan, model, schedule, objective, comm, in_backward,
          [&plan, &model, &optimizer, &sync, comm, optimizer_index](bool updates_in_backward) {
            if (comm != nullptr) return make_data_parallel_path(sync, *comm, optimizer);
            return make_local_path(model, optimizer, optimizer_index, plan.device(),
                                   updates_in_backward, plan.grad_accum());
          },
          std::move(checkpoint_due)) {}

TrainStep::~TrainStep() = default;

void TrainStep::disable_in_backward() {
  in_backward_ = false;
  path_.reset();  // the next step makes the buffered path (it takes its staging in the update)
}

StepOutcome TrainStep::run(int64_t step, data::Batcher& batcher, const PhaseHook& mark) {
  BatcherSource source(batcher);
  return run(step, source, mark);
}

StepOutcome TrainStep::run(int64_t step, BatchSource& source, const PhaseHook& mark) {
  StepOutcome o;
  const std::vector<data::Batch> micro = draw(source, &o);
  if (mark) mark("batch_ready");
  const double denom = static_cast<double>(std::max<int64_t>(o.units, 1));
  optim::StepArgs args;
  args.lr = schedule_.lr_at(step);
  args.max_grad_norm = plan_.step().max_grad_norm;
  if (!path_) path_ = make_path_(in_backward_);
  GradientPath& path = *path_;
  path.begin_step(args, static_cast<int64_t>(micro.size()));
  const at::Tensor loss_sum = forward_backward(path, micro, denom, &o, mark);
  path.finish_backward();
  if (comm_) return finish_distributed(std::move(o), path, loss_sum, args, denom, mark);
  AsyncScalar loss_host;
  loss_host.start(loss_sum);
  o.res = path.finish_step(args);
  if (mark) mark("optimizer_step_done");
  o.loss = loss_host.read() / denom;
  o.stop = stop_requested();
  o.checkpoint_due = checkpoint_due_ && checkpoint_due_();
  return o;
}

std::vector<data::Batch> TrainStep::draw(BatchSource& source, StepOutcome* o) {
  // Data parallel: the global batch is world x grad_accum micro-batches in the order one
  // process would take them; rank r trains micro-batches [r * accum, (r + 1) * accum). Every
  // rank draws them all, so the unit counts (the loss denominator) are global. A per-rank
  // source yields this rank's only: its counts are summed over the ranks (one allreduce).
  NvtxRange r("data");
  const int64_t accum = plan_.grad_accum();
  const bool per_rank = source.per_rank();
  const int64_t ranks = comm_ && !per_rank ? comm_->world_size() : 1;
  const int64_t mine = comm_ && !per_rank ? comm_->rank() : 0;
  std::vector<data::Batch> micro;
  for (int64_t i = 0; i < accum * ranks; ++i) {
    data::Batch b = source.next();
    o->supervised += b.supervised_tokens;
    o->units += objective_.units(b);
    o->real_tokens += b.real_tokens;
    o->slots += b.slots();
    if (i / accum == mine) micro.push_back(std::move(b));
  }
  if (comm_ && per_rank) {
    // Counts below 2^53 add exactly in double.
    at::Tensor n = at::tensor({static_cast<double>(o->supervised), static_cast<double>(o->units),
                               static_cast<double>(o->real_tokens), static_cast<double>(o->slots)},
                              at::kDouble)
                       .to(plan_.device());
    comm_->allreduce_sum(n);
    const at::Tensor h = n.cpu();
    const double* v = h.data_ptr<double>();
    o->supervised = static_cast<int64_t>(v[0]);
    o->units = static_cast<int64_t>(v[1]);
    o->real_tokens = static_cast<int64_t>(v[2]);
    o->slots = static_cast<int64_t>(v[3]);
  }
  return micro;
}

at::Tensor TrainStep::forward_backward(GradientPath& path, const std::vector<data::Batch>& micro,
                                       double denom, StepOutcome* o, const PhaseHook& mark) {
  at::Tensor loss_sum;
  for (size_t i = 0; i < micro.size(); ++i) {
    const data::Batch& b = micro[i];
    path.begin_micro_batch(static_cast<int64_t>(i), i + 1 == micro.size());
    MicroBatch mb;
    mb.inputs = to_inputs(b, model_, plan_.device());
    mb.batch = &b;
    ObjectiveOutput lo;
    {
      NvtxRange r("forward");
      lo = objective_.compute(model_, mb);
    }
    if (mark) mark("forward_done");
    {
      NvtxRange r("backward");
      (lo.loss_sum / denom).backward();
    }
    path.end_micro_batch();
    if (mark) mark("backward_done");
    const at::Tensor ls = lo.loss_sum.detach();
    loss_sum = loss_sum.defined() ? loss_sum + ls : ls;
    add_logged(o, lo.logged, denom);
  }
  return loss_sum;
}

StepOutcome TrainStep::finish_distributed(StepOutcome o, GradientPath& path,
                                          const at::Tensor& loss_sum, const optim::StepArgs& args,
                                          double denom, const PhaseHook& mark) {
  o.res = path.finish_step(args);
  if (mark) mark("optimizer_step_done");
  // The step's loss (summed over the ranks), whether any rank got a stop signal and whether
  // rank 0's clock says a timed checkpoint is due: one collective for all three. It goes before
  // the master broadcasts: collectives run in launch order, and the host waits for this one
  // below, so after them it would wait for every broadcast and nothing would overlap.
  // The objective's logged values ride along: each rank's are its micro-batches' share of the
  // global step (already over the global units), so they add too. Every rank logs the same names.
  const auto opt = at::TensorOptions().dtype(at::kDouble).device(plan_.device());
  const auto n_logged = static_cast<int64_t>(o.logged.size());
  at::Tensor v = at::zeros({3 + n_logged}, opt);
  v[0].copy_(loss_sum.detach().to(at::kDouble).reshape({}));
  v[1].fill_(stop_requested() ? 1.0 : 0.0);
  v[2].fill_(checkpoint_due_ && checkpoint_due_() ? 1.0 : 0.0);
  for (int64_t i = 0; i < n_logged; ++i) {
    v[3 + i].copy_(o.logged[static_cast<size_t>(i)].second.detach().to(at::kDouble).reshape({}));
  }
  comm_->allreduce_sum(v);
  for (int64_t i = 0; i < n_logged; ++i) o.logged[static_cast<size_t>(i)].second = v[3 + i];
  path.step_closed(o.res);  // data parallel: the master broadcasts, launched
  const at::Tensor h = v.cpu();
  o.loss = h[0].item<double>() / denom;
  o.stop = h[1].item<double>() > 0.0;
  o.checkpoint_due = h[2].item<double>() > 0.0;
  return o;
}

}  // namespace q4::trainer
