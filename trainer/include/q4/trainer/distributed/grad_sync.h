// Gradient synchronization for data parallelism with a sharded optimizer (ZeRO-2,
// docs/multi-gpu.md): each trainable parameter has one owner rank that holds its moments,
// receives its reduced gradient and broadcasts its updated master. Gradients go to their owner
// with one reduce per parameter, launched from inside the backward as soon as a gradient is
// complete (grad_accum 1; the model's grad-ready hook) or after the last micro-batch, always in
// one fixed order (the reverse of the model's) so that every rank issues the same collectives in
// the same order. Updated masters go back from their owners with one broadcast per parameter,
// launched in model order after the optimizer step and not waited for there: each master is
// waited for right before the next forward's first use of it (the model's master fence, which
// this class installs), so the broadcasts of later layers overlap the forward of earlier ones.
// Every other reader of masters waits for all of them first (wait_masters; the model's parameter
// accessors and its export call it through the same fence). With one process (no communicator)
// this process owns every parameter and nothing is communicated.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <deque>
#include <unordered_map>
#include <vector>

#include "q4/model/qwen3.h"
#include "q4/optim/adamw.h"
#include "q4/trainer/distributed/distributed.h"

namespace q4::trainer {

class GradSync {
 public:
  // `comm`: null for one process. `params`: the model's trainable parameters in model order.
  // With a communicator, installs the model's master fence (removed by the destructor).
  GradSync(DistComm* comm, model::Qwen3Model& model, std::vector<model::Parameter*> params);
  ~GradSync();
  GradSync(const GradSync&) = delete;  // the model's hooks point at this object
  GradSync& operator=(const GradSync&) = delete;

  // Registers the parameters this rank owns with `optimizer` (the rounding stream of each is
  // its index in the model, the same on every layout). Returns, per owned parameter, its
  // index in the optimizer (for in-backward updates).
  std::unordered_map<const model::Parameter*, int64_t> add_owned_params(
      optim::PackedAdamW& optimizer);

  bool distributed() const { return comm_ != nullptr; }
  const std::vector<model::Parameter*>& params() const { return params_; }
  // The ownership line of a sharded optimizer ("" with one process).
  std::string ownership_summary(int64_t owned_tensors) const;

  // Before a step's first micro-batch: reductions launch from inside the backward when the
  // step has one micro-batch (grad_accum 1), after the last one otherwise.
  void begin_step(int64_t grad_accum);
  // After the last backward: every remaining reduce launched and waited for, the model's
  // gradients freed. Returns the reduced gradients of the owned parameters, in optimizer order.
  std::vector<at::Tensor> finish_step(int64_t num_owned);
  // Each owner's masters to every rank (after an applied step, and after a resume): launched in
  // model order, not waited for. Rules for the masters until they are waited for: nothing reads
  // a master before wait_master() of it (the forward, through the fence) or wait_masters()
  // (everything else), and nothing writes one, not even its owner (a broadcast reads the
  // owner's master): the optimizer step is preceded by wait_masters().
  void broadcast_masters();
  // Waits for the broadcast of `p` if one is in flight (else returns at once). NCCL: the current
  // stream waits for it, the host does not; Gloo: the host waits. NVTX range "master_wait".
  void wait_master(const model::Parameter& p);
  // Waits for every broadcast in flight (NVTX range "master_wait_all" when there are any).
  void wait_masters();
  // Broadcasts launched and not yet waited for.
  int64_t masters_in_flight() const { return masters_in_flight_; }

 private:
  void launch_ready_reductions();
  void wait_master_at(size_t i);

  DistComm* comm_;
  model::Qwen3Model& model_;
  std::vector<model::Parameter*> params_;  // trainable parameters in model order
  std::unordered_map<const model::Parameter*, size_t> global_index_;
  std::vector<int> owner_;               // per parameter: the rank holding its optimizer state
  std::vector<int64_t> local_index_;     // per parameter: index in the optimizer, -1 if not owned
  std::vector<char> grad_ready_;         // this step: gradient complete on this rank
  std::vector<at::Tensor> ready_grads_;  // complete gradients whose reduce is not launched yet
  std::vector<at::Tensor> owned_grads_;  // owned parameters' reduced gradients
  std::deque<DistWork> reduce_works_;    // launched, not yet retired, oldest first
  size_t next_launch_ = 0;               // reduces launched so far (fixed order)
  std::vector<DistWork> master_works_;   // per parameter: its broadcast, pending until waited
  int64_t masters_in_flight_ = 0;        // pending entries of master_works_
};

}  // namespace q4::trainer
