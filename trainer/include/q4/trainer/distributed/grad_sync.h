// Gradient synchronization for data parallelism with a sharded optimizer (ZeRO-2,
// docs/multi-gpu.md): each trainable parameter has one owner rank that holds its moments,
// receives its reduced gradient and broadcasts its updated master. Gradients go to their owner
// in buckets: in one fixed order (the reverse of the model's), each complete gradient joins its
// owner's bucket, and a bucket of about kGradBucketBytes is reduced to the owner as one flat
// tensor (the same element-wise sums as one reduce per gradient; a gradient of that size or more
// is reduced alone, where it is), from inside the backward (grad_accum 1; on_gradient, called by
// the step's gradient path) or after the last micro-batch; once every gradient is in, the
// partial buckets follow in owner order. Every rank so issues the same collectives in the same
// order. Updated masters go back from their owners with one broadcast per parameter,
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

// The size at which a bucket of gradients is reduced.
inline constexpr int64_t kGradBucketBytes = int64_t{25} << 20;

class GradSync {
 public:
  // `comm`: null for one process. `params`: the model's trainable parameters in model order.
  // `bucket_bytes`: the bucket size (0: one reduce per gradient). With a communicator, installs
  // the model's master fence (removed by the destructor).
  GradSync(DistComm* comm, model::Qwen3Model& model, std::vector<model::Parameter*> params,
           int64_t bucket_bytes = kGradBucketBytes);
  ~GradSync();
  GradSync(const GradSync&) = delete;  // the model's hooks point at this object
  GradSync& operator=(const GradSync&) = delete;

  // Registers the parameters this rank owns with `optimizer` (the rounding stream of each is
  // its index in the model, the same on every layout). Returns, per owned parameter, its
  // index in the optimizer (for in-backward updates).
  std::unordered_map<const model::Parameter*, int64_t> add_owned_params(
      optim::PackedAdamW& optimizer);

  bool distributed() const { return comm_ != nullptr; }
  model::Qwen3Model& model() { return model_; }
  const std::vector<model::Parameter*>& params() const { return params_; }
  // The ownership line of a sharded optimizer ("" with one process).
  std::string ownership_summary(int64_t owned_tensors) const;

  // Before a step's first micro-batch.
  void begin_step();
  // The complete gradient of `p` on this rank (from the backward with one micro-batch a step:
  // the step's gradient path calls it from the model's grad-ready hook). Its reduce launches
  // once those before it in the fixed order have; finished reduces are retired.
  void on_gradient(model::Parameter& p);
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
  // Gradient reduces launched since construction (one per bucket).
  int64_t reduces_launched() const { return reduces_launched_; }

 private:
  // Gradients waiting for their owner's reduce, in launch order.
  struct Bucket {
    std::vector<size_t> params;
    std::vector<at::Tensor> grads;
    int64_t bytes = 0;
  };
  void launch_ready_reductions();
  void add_to_bucket(size_t i, at::Tensor g);
  void launch_bucket(int owner);
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
  int64_t bucket_bytes_;
  std::vector<Bucket> buckets_;  // per owner rank: the bucket being filled
  int64_t reduces_launched_ = 0;
  std::deque<DistWork> reduce_works_;   // launched, not yet retired, oldest first
  size_t next_launch_ = 0;              // gradients given to buckets so far (fixed order)
  std::vector<DistWork> master_works_;  // per parameter: its broadcast, pending until waited
  int64_t masters_in_flight_ = 0;       // pending entries of master_works_
};

}  // namespace q4::trainer
