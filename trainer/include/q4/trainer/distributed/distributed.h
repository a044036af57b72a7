// Data-parallel runs over LibTorch's c10d: who this process is (torchrun's environment or
// `q4train --nproc N`), a process group (NCCL for CUDA tensors, Gloo for CPU ones) behind a small
// interface, the launcher that spawns local ranks, and the parameter-to-rank assignment of the
// sharded optimizer. docs/multi-gpu.md describes the scheme; this header only the mechanics.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace q4::trainer {

// This process's place in the job. One process (world_size 1) is the default.
struct WorldInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool distributed() const { return world_size > 1; }
};

// From torchrun's variables: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT. None set:
// one process. Inconsistent or malformed values: ConfigError naming the variable.
WorldInfo world_from_env();

// Whether this build can create a process group for `device` (NCCL for CUDA, Gloo for CPU), and
// the backend's name ("nccl", "gloo") or "" when it cannot.
std::string dist_backend_for(const at::Device& device);

// A collective in flight. wait(): on CUDA the current stream waits for it (the host does not);
// on CPU the host waits. Errors and timeouts are thrown as std::runtime_error naming the rank.
class DistWork {
 public:
  DistWork();
  ~DistWork();
  DistWork(DistWork&&) noexcept;
  DistWork& operator=(DistWork&&) noexcept;
  void wait();
  bool pending() const;
  // Whether the collective has finished (a host query, no waiting). Finished work is retired
  // with wait() (which then returns at once) so that its tensors are released.
  bool done() const;

 private:
  friend class DistComm;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The process group of a run. Every call is a collective: all ranks make the same calls in the
// same order.
class DistComm {
 public:
  // Connects to the rendezvous (TCPStore at MASTER_ADDR:MASTER_PORT; rank 0 serves it) and
  // creates the process group. `timeout` bounds the rendezvous and every collective: a rank that
  // died or hangs makes the others fail with an error instead of waiting forever.
  static std::unique_ptr<DistComm> connect(const WorldInfo& world, const at::Device& device,
                                           std::chrono::milliseconds timeout);
  ~DistComm();

  int rank() const;
  int world_size() const;
  const std::string& backend() const;

  // In-place sum of `t` over the ranks, the result on `root` only (other ranks' `t` is scratch).
  DistWork reduce_sum(const at::Tensor& t, int root);
  // `t` of `root` copied into every rank's `t`.
  DistWork broadcast(const at::Tensor& t, int root);
  // In-place sum over the ranks, waited for.
  void allreduce_sum(const at::Tensor& t);
  // Sum of a host scalar over the ranks (a small device tensor on CUDA), waited for on the host.
  double allreduce_sum(double value);
  void barrier();

 private:
  DistComm();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// The sharded optimizer's owners: each parameter (by element count) goes to the rank with the
// fewest elements so far, largest first, ties by index, so every rank computes the same map.
std::vector<int> assign_owners(const std::vector<int64_t>& numels, int world_size);

struct ModelConfig;
// `q4train --nproc N`, before any rank starts: the weights file every rank would read is indexed
// once here (`model`: the config's model.*; model.init: file, a .dat), so that a missing, truncated or corrupt file is one
// ConfigError naming it (exit 2) rather than N rank failures behind a broken collective.
void check_inputs_before_launch(const ModelConfig& model);

// `q4train --nproc N`: runs `argv` (the q4train command line without --nproc) as N local ranks
// with RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (a free localhost port), forwards
// SIGINT/SIGTERM to them, and when one rank fails kills the others (SIGKILL) unless they exit
// within `grace`. Returns the first failing rank's exit code, or 0.
int launch_local_ranks(int nproc, const std::vector<std::string>& argv,
                       std::chrono::seconds grace);

}  // namespace q4::trainer
