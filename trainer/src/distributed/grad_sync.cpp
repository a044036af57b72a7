// ZeRO-2 gradient reductions and master broadcasts; see grad_sync.h.
#include "q4/trainer/distributed/grad_sync.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <stdexcept>

#include "q4/trainer/runtime/nvtx.h"

namespace q4::trainer {

GradSync::GradSync(DistComm* comm, model::Qwen3Model& model, std::vector<model::Parameter*> params,
                   int64_t bucket_bytes)
    : comm_(comm), model_(model), params_(std::move(params)), bucket_bytes_(bucket_bytes) {
  std::vector<int64_t> numels;
  for (auto* p : params_) numels.push_back(p->master.numel());
  owner_ = assign_owners(numels, comm_ ? comm_->world_size() : 1);
  local_index_.assign(params_.size(), -1);
  for (size_t i = 0; i < params_.size(); ++i) global_index_[params_[i]] = i;
  master_works_.resize(params_.size());
  if (comm_ && model_.options().offload_masters) {
    throw std::runtime_error(
        "optim.offload: all trains on one GPU (data parallel broadcasts the masters from the "
        "GPU); use optim.offload: moments with several processes");
  }
  if (comm_) {
    model_.set_master_fence([this](const model::Parameter* p) {
      if (p != nullptr) {
        wait_master(*p);
      } else {
        wait_masters();
      }
    });
  }
}

GradSync::~GradSync() {
  // Broadcasts still in flight are released, not waited for (a destructor must not throw): a run
  // that ends normally has drained them (end of run, checkpoint, export).
  if (comm_) model_.set_master_fence(nullptr);
}

std::unordered_map<const model::Parameter*, int64_t> GradSync::add_owned_params(
    optim::PackedAdamW& optimizer) {
  std::unordered_map<const model::Parameter*, int64_t> index;
  for (size_t i = 0; i < params_.size(); ++i) {
    model::Parameter* p = params_[i];
    if (owner_[i] != (comm_ ? comm_->rank() : 0)) continue;
    local_index_[i] = optimizer.num_params();
    index[p] = optimizer.num_params();
    if (p->master.is_cpu() && model_.options().device.is_cuda()) {  // optim.offload: all
      optimizer.add_host_param(p->name, p->master, model_.options().device,
                               /*weight_decay=*/p->master.dim() >= 2,
                               /*stream_index=*/static_cast<int64_t>(i));
    } else {
      optimizer.add_param(p->name, p->master, /*weight_decay=*/p->master.dim() >= 2,
                          /*stream_index=*/static_cast<int64_t>(i));
    }
  }
  return index;
}

std::string GradSync::ownership_summary(int64_t owned_tensors) const {
  if (!comm_) return "";
  int64_t mine = 0, total = 0;
  for (size_t i = 0; i < params_.size(); ++i) {
    total += params_[i]->master.numel();
    if (local_index_[i] >= 0) mine += params_[i]->master.numel();
  }
  return fmt::format(
      "sharded optimizer: rank {} owns {} of {} tensors, {} of {} elements "
      "({:.1f}%)\n",
      comm_->rank(), owned_tensors, params_.size(), mine, total,
      total > 0 ? 100.0 * static_cast<double>(mine) / total : 0.0);
}

void GradSync::begin_step() {
  const size_t n = params_.size();
  grad_ready_.assign(n, 0);
  ready_grads_.assign(n, at::Tensor());
  owned_grads_.assign(n, at::Tensor());
  reduce_works_.clear();
  next_launch_ = 0;
  buckets_.assign(static_cast<size_t>(comm_ ? comm_->world_size() : 1), Bucket{});
}

void GradSync::on_gradient(model::Parameter& p) {
  const size_t i = global_index_.at(&p);
  ready_grads_[i] = p.grad;
  grad_ready_[i] = 1;
  launch_ready_reductions();
}

void GradSync::launch_ready_reductions() {
  const size_t n = params_.size();
  while (next_launch_ < n) {
    const size_t i = n - 1 - next_launch_;  // reverse model order
    if (!grad_ready_[i]) return;
    at::Tensor g = ready_grads_[i];
    ready_grads_[i] = at::Tensor();
    if (!g.defined()) {  // no use of the parameter reached the loss on this rank
      g = at::zeros(params_[i]->master.sizes(),
                    params_[i]->master.options().dtype(model_.options().resolved_grad_dtype()));
    }
    add_to_bucket(i, std::move(g));
    ++next_launch_;
  }
  // Every gradient is in: the buckets not yet full go too, in owner order.
  for (size_t r = 0; r < buckets_.size(); ++r) launch_bucket(static_cast<int>(r));
  // Retire finished reduces so that a non-owner's gradients are freed during the backward
  // (a collective holds its tensors until retired): ZeRO-2's memory, not a full buffer.
  while (!reduce_works_.empty() && reduce_works_.front().done()) {
    reduce_works_.front().wait();
    reduce_works_.pop_front();
  }
}

void GradSync::add_to_bucket(size_t i, at::Tensor g) {
  // The bucket's size counts the gradient as every rank has it (the parameter's elements in the
  // gradient dtype), so every rank launches the same reduces in the same order.
  const int owner = owner_[i];
  Bucket& b = buckets_[static_cast<size_t>(owner)];
  const int64_t bytes =
      params_[i]->master.numel() *
      static_cast<int64_t>(c10::elementSize(model_.options().resolved_grad_dtype()));
  if (!b.params.empty() && b.bytes + bytes > bucket_bytes_) launch_bucket(owner);
  b.params.push_back(i);
  b.grads.push_back(std::move(g));
  b.bytes += bytes;
  if (b.bytes >= bucket_bytes_) launch_bucket(owner);
}

void GradSync::launch_bucket(int owner) {
  Bucket b = std::move(buckets_[static_cast<size_t>(owner)]);
  buckets_[static_cast<size_t>(owner)] = Bucket{};
  if (b.params.empty()) return;
  ++reduces_launched_;
  if (b.params.size() == 1) {  // reduced where it is
    reduce_works_.push_back(comm_->reduce_sum(b.grads[0], owner));
    if (local_index_[b.params[0]] >= 0) owned_grads_[b.params[0]] = b.grads[0];
    return;
  }
  // One flat tensor, reduced at once: the same element-wise sums as one reduce per gradient.
  // The owner's gradients are views of it; a non-owner's are freed here.
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> parts;
  for (const at::Tensor& g : b.grads) {
    TORCH_CHECK(g.scalar_type() == b.grads[0].scalar_type(), "GradSync: a bucket of ",
                b.grads[0].scalar_type(), " gradients gets a ", g.scalar_type(), " one");
    parts.push_back(g.reshape({-1}));
  }
  const at::Tensor flat = at::cat(parts);
  b.grads.clear();
  parts.clear();
  reduce_works_.push_back(comm_->reduce_sum(flat, owner));
  if (owner != comm_->rank()) return;
  int64_t offset = 0;
  for (const size_t i : b.params) {
    const at::Tensor& master = params_[i]->master;
    owned_grads_[i] = flat.narrow(0, offset, master.numel()).view(master.sizes());
    offset += master.numel();
  }
}

std::vector<at::Tensor> GradSync::finish_step(int64_t num_owned) {
  {
    NvtxRange r("grad_reduce");
    for (size_t i = 0; i < params_.size(); ++i) {
      if (grad_ready_[i]) continue;
      ready_grads_[i] = params_[i]->grad;  // accumulated (grad_accum > 1) or never reached
      grad_ready_[i] = 1;
    }
    launch_ready_reductions();
    for (auto& w : reduce_works_) w.wait();
    reduce_works_.clear();
    model_.zero_grad();
  }
  std::vector<at::Tensor> grads(static_cast<size_t>(num_owned));
  for (size_t i = 0; i < params_.size(); ++i) {
    if (local_index_[i] >= 0) grads[static_cast<size_t>(local_index_[i])] = owned_grads_[i];
  }
  owned_grads_.assign(params_.size(), at::Tensor());
  return grads;
}

void GradSync::broadcast_masters() {
  if (!comm_) return;
  wait_masters();  // a previous launch's broadcast of a master never used since
  NvtxRange r("master_broadcast");
  // Model order (embedding, layer 0, ..., final norm, lm_head): the order the forward uses them.
  for (size_t i = 0; i < params_.size(); ++i) {
    master_works_[i] = comm_->broadcast(params_[i]->master, owner_[i]);
    ++masters_in_flight_;
  }
}

void GradSync::wait_master(const model::Parameter& p) {
  if (masters_in_flight_ == 0) return;
  const auto it = global_index_.find(&p);
  if (it != global_index_.end()) wait_master_at(it->second);
}

void GradSync::wait_masters() {
  if (masters_in_flight_ == 0) return;
  NvtxRange r("master_wait_all");
  for (size_t i = 0; i < master_works_.size(); ++i) wait_master_at(i);
}

void GradSync::wait_master_at(size_t i) {
  DistWork& w = master_works_[i];
  if (!w.pending()) return;
  NvtxRange r("master_wait");
  w.wait();
  --masters_in_flight_;
  // The broadcast master is current from here: so is the forward weight kept from it
  // (model.forward_weights codes or kept), once a step, before its first reader.
  model_.refresh_forward_weights(params_[i]);
}

}  // namespace q4::trainer
