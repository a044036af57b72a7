// The one training step; see step.h.
#include "q4/trainer/step/step.h"

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <thread>
#include <vector>

#include "q4/trainer/runtime/nvtx.h"
#include "q4/trainer/plan/setup.h"
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
                           [&](const auto& e) { return e.first == name; });
    if (it == o->logged.end()) {
      o->logged.emplace_back(name, x);
    } else {
      it->second = it->second + x;
    }
  }
}

}  // namespace

TrainStep::TrainStep(const RunPlan& plan, model::Qwen3Model& model, optim::PackedAdamW& optimizer,
                     const optim::LrSchedule& schedule, Objective& objective, GradSync& sync,
                     DistComm* comm, bool in_backward,
                     const std::unordered_map<const model::Parameter*, int64_t>& optimizer_index,
                     std::function<bool()> checkpoint_due)
    : plan_(plan),
      model_(model),
      optimizer_(optimizer),
      schedule_(schedule),
      objective_(objective),
      sync_(sync),
      comm_(comm),
      in_backward_(in_backward),
      checkpoint_due_(std::move(checkpoint_due)) {
  by_index_.assign(static_cast<size_t>(optimizer_.num_params()), nullptr);
  for (const auto& [p, i] : optimizer_index) {
    by_index_[static_cast<size_t>(i)] = p;
    index_[p] = i;
  }
  // An offloaded master updated in device memory (optimizer staging) gives its codes from there.
  optimizer_.set_master_updated_hook([this](int64_t i, const at::Tensor& master) {
    const model::Parameter* p = by_index_[static_cast<size_t>(i)];
    if (p == nullptr || !p->qdata.defined()) return;
    model_.refresh_codes(*p, master);
    refreshed_.insert(p);
  });
}

TrainStep::~TrainStep() {
  optimizer_.set_master_updated_hook(nullptr);
  optimizer_.set_staging_arena({});
}

void TrainStep::disable_in_backward() {
  in_backward_ = false;
  optimizer_.set_staging_arena({});  // buffered updates take theirs in the update
  staging_ = at::Tensor();
}

StepOutcome TrainStep::run(int64_t step, data::Batcher& batcher, const PhaseHook& mark) {
  StepOutcome o;
  const int64_t accum = plan_.grad_accum();
  std::vector<data::Batch> micro;
  {
    // Data parallel: the global batch is world x grad_accum micro-batches in the order one
    // process would take them; rank r trains micro-batches [r * accum, (r + 1) * accum). Every
    // rank draws them all, so the unit counts (the loss denominator) are global.
    NvtxRange r("data");
    const int64_t ranks = comm_ ? comm_->world_size() : 1;
    const int64_t mine = comm_ ? comm_->rank() : 0;
    for (int64_t i = 0; i < accum * ranks; ++i) {
      data::Batch b = batcher.next();
      o.supervised += b.supervised_tokens;
      o.units += objective_.units(b);
      o.real_tokens += b.real_tokens;
      o.slots += b.slots();
      if (i / accum == mine) micro.push_back(std::move(b));
    }
  }
  if (mark) mark("batch_ready");
  const double denom = static_cast<double>(std::max<int64_t>(o.units, 1));
  optim::StepArgs args;
  args.lr = schedule_.lr_at(step);
  args.max_grad_norm = plan_.config().train.max_grad_norm;
  if (comm_) sync_.begin_step(accum);
  const bool host_accum = accumulates_on_host();
  if (host_accum && !host_sums_) {
    const int64_t staging = in_backward_ ? kSharedStagingBytes : 0;
    host_sums_ = std::make_unique<HostGradientAccumulator>(model_.options().resolved_grad_dtype(),
                                                           plan_.device(),
                                                           kHostAccumulationRingBytes - staging);
    if (staging > 0) {
      staging_ = at::empty({staging}, at::TensorOptions().dtype(at::kByte).device(plan_.device()));
      optimizer_.set_staging_arena(staging_);
    }
  }
  const bool hooked = in_backward_ || host_accum;
  if (hooked) {
    model_.begin_grad_step();
    model_.set_grad_ready_hook([this](model::Parameter& p) { on_gradient(p); });
  }
  at::Tensor loss_sum;
  for (size_t i = 0; i < micro.size(); ++i) {
    const data::Batch& b = micro[i];
    last_micro_ = i + 1 == micro.size();
    if (in_backward_ && last_micro_) {
      // Its backward updates: the masters may be in no broadcast, and the optimizer's staging
      // is taken only now.
      sync_.wait_masters();
      optimizer_.begin_step(args);
    }
    if (host_accum) host_sums_->begin_micro_batch(i == 0, last_micro_);
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
    for (auto& [p, g] : kept_) p->grad = std::move(g);  // the next backward adds into it
    kept_.clear();
    if (mark) mark("backward_done");
    const at::Tensor ls = lo.loss_sum.detach();
    loss_sum = loss_sum.defined() ? loss_sum + ls : ls;
    add_logged(&o, lo.logged, denom);
  }
  if (hooked) model_.set_grad_ready_hook(nullptr);
  if (host_accum) host_sums_->finish();  // later reads of the host buffers are ordered after
  if (in_backward_) apply_unreached();
  if (comm_) return finish_distributed(std::move(o), loss_sum, args, denom, mark);
  AsyncScalar loss_host;
  loss_host.start(loss_sum);
  {
    NvtxRange r("optimizer");
    if (in_backward_) {
      o.res = optimizer_.end_step();  // the updates ran inside the backward
    } else {
      std::vector<at::Tensor> grads;
      for (auto* p : model_.trainable_parameters()) {
        if (host_accum && host_sums_->holds(p)) {
          // In pinned host memory: the optimizer copies it in by DMA.
          grads.push_back(host_sums_->sum(p));
          if (at::Tensor part = host_sums_->take_sumsq_parts(p); part.defined()) {
            args.sumsq_parts.resize(model_.trainable_parameters().size());
            args.sumsq_parts[grads.size() - 1] = std::move(part);
          }
          continue;
        }
        grads.push_back(p->grad.defined() ? p->grad
                                          : at::zeros(p->master.sizes(),
                                                      p->master.options().device(plan_.device())));
      }
      refreshed_.clear();
      o.res = optimizer_.step(grads, args);
      if (o.res.applied) {
        for (auto* p : model_.trainable_parameters()) {
          if (refreshed_.count(p) == 0) model_.refresh_codes(p);
        }
      }
      refreshed_.clear();
    }
    model_.zero_grad();
  }
  if (mark) mark("optimizer_step_done");
  o.loss = loss_host.read() / denom;
  o.stop = stop_requested();
  o.checkpoint_due = checkpoint_due_ && checkpoint_due_();
  return o;
}

bool TrainStep::accumulates_on_host() const {
  return comm_ == nullptr && plan_.grad_accum() > 1 &&
         model_.options().offload_masters && plan_.device().is_cuda();
}

void TrainStep::on_gradient(model::Parameter& p) {
  const bool on_host = host_sums_ && p.qdata.defined() && p.master.is_cpu();
  if (!(in_backward_ && last_micro_)) {
    // Summed on: in host memory, or on the device (put back after the micro-batch).
    if (on_host) {
      host_sums_->add(&p, p.grad);
    } else {
      kept_.emplace_back(&p, p.grad);
    }
    return;
  }
  // Updated now, from its complete sum; the model frees the gradient when this returns.
  const int64_t i = index_.at(&p);
  if (on_host) {
    host_sums_->add(&p, p.grad, [&](const at::Tensor& sum) { optimizer_.step_param(i, sum); });
  } else {
    optimizer_.step_param(i, p.grad);
  }
  // Offloaded master: the next forward's codes, unless the update gave them already.
  if (refreshed_.erase(&p) == 0) model_.refresh_codes(&p);
}

void TrainStep::apply_unreached() {
  // Sums of earlier micro-batches that the last one's backward did not reach: updated now
  // (end_step() gives the parameters no micro-batch reached a zero gradient).
  for (auto* p : model_.trainable_parameters()) {
    if (!p->grad.defined()) continue;
    optimizer_.step_param(index_.at(p), p->grad);
    if (refreshed_.erase(p) == 0) model_.refresh_codes(p);
    p->grad = at::Tensor();
  }
  if (!host_sums_) return;
  for (const void* key : host_sums_->unapplied()) {
    const auto* p = static_cast<const model::Parameter*>(key);
    optimizer_.step_param(index_.at(p), host_sums_->sum(key).to(plan_.device()));
    if (refreshed_.erase(p) == 0) model_.refresh_codes(p);
  }
}

StepOutcome TrainStep::finish_distributed(StepOutcome o, const at::Tensor& loss_sum,
                                          const optim::StepArgs& step_args, double denom,
                                          const PhaseHook& mark) {
  std::vector<at::Tensor> grads = sync_.finish_step(optimizer_.num_params());
  // The optimizer writes owned masters, which the previous step's broadcasts read: all of them
  // are waited for first (the forward waited for each master it used, so this orders the rest).
  sync_.wait_masters();
  {
    NvtxRange r("optimizer");
    optim::StepArgs args = step_args;
    // Clipping and the non-finite guard see the global norm: the owners' sums of squares add.
    args.reduce_sumsq = [this](double s) { return comm_->allreduce_sum(s); };
    o.res = optimizer_.step(grads, args);
  }
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
  // Launched, not waited for: the next forward waits for each master right before its first
  // use (GradSync, the model's master fence).
  if (o.res.applied) sync_.broadcast_masters();
  const at::Tensor h = v.cpu();
  o.loss = h[0].item<double>() / denom;
  o.stop = h[1].item<double>() > 0.0;
  o.checkpoint_due = h[2].item<double>() > 0.0;
  return o;
}

}  // namespace q4::trainer
