// PackedAdamW: AdamW (decoupled weight decay, bias correction) over fp16/bf16/fp32 master
// weights, with the two moments stored fp32, block-wise int8, block-wise 4-bit or NVFP4. The
// master is the only weight of record; the step never rebuilds it from a quantized copy. The CPU
// step walks each parameter in chunks of `chunk_rows` rows using a scratch arena whose high-water
// mark is exposed; on CUDA one fused kernel per mode reads grad, master and packed moments once.
// Arithmetic order is fixed (docs/optim.md) so that CPU and CUDA agree bit-for-bit where stated.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "q4/io/enum_names.h"

namespace q4::optim {

// How the two Adam moments of a parameter are stored between steps.
enum class StateMode {
  kFp32,   // reference: m, v as fp32 tensors (8 bytes/element)
  kInt8,   // block-wise dynamic-tree int8 (m signed map, v zero-free map), block 256
  k4Bit,   // block-wise 4-bit: m signed dynamic-exponent map, v linear zero-free map, block 128
  kNvfp4,  // E2M1 codes + E4M3 scale per 16 (docs/design.md#nvfp4-arithmetic), the NVFP4 weight
           // format
};

// How the fp32 result of an update is written into an fp16/bf16 master (fp32 masters: exact).
enum class MasterRounding {
  kNearest,     // round-to-nearest-even; updates below half an ulp are lost
  kStochastic,  // unbiased stochastic rounding from a counter-based hash (reproducible)
};

// The spellings are the tables below (errors name the accepted ones).
StateMode parse_state_mode(const std::string& text);
std::string to_string(StateMode mode);
MasterRounding parse_master_rounding(const std::string& text);
std::string to_string(MasterRounding rounding);

struct AdamWOptions {
  double lr = 1e-4;           // learning rate used when StepArgs::lr is not given
  double beta1 = 0.9;         // first-moment decay, in [0, 1)
  double beta2 = 0.999;       // second-moment decay, in [0, 1)
  double eps = 1e-8;          // added to sqrt(v_hat), > 0
  double weight_decay = 0.0;  // decoupled: p *= 1 - lr * weight_decay (params with the flag set)
  StateMode state_mode = StateMode::kFp32;  // moment storage of tensors >= threshold
  int64_t chunk_rows = 1024;  // CPU step granularity: rows of a parameter processed at once
  MasterRounding rounding = MasterRounding::kStochastic;  // fp16/bf16 master write-back
  uint64_t seed = 0;  // stochastic-rounding stream (with step, param index, element)
  int64_t small_tensor_threshold = 4096;  // tensors with fewer elements keep fp32 moments
  int64_t max_consecutive_nonfinite = 8;  // more non-finite steps than this in a row: error
  // CUDA int8/4-bit kernels: false (default) = fused multiply-adds and the hardware's square
  // root and division (a few fp32 ulp from the CPU path; results still deterministic, and a
  // stored code or master differs from the CPU's only where a value falls within those ulps of
  // a rounding boundary); true = the CPU path's arithmetic op for op, bit-identical to it
  // (tests; ~15% slower). fp32 and NVFP4 moments always use the exact arithmetic.
  bool cuda_exact_arithmetic = false;
  // CUDA masters: the moments live in pinned host memory and the update kernels read and write
  // them there over PCIe (zero-copy: pinned memory is mapped into the device's address space), so
  // they take no device memory; results are bit-identical to device-resident moments, the update
  // runs at PCIe rather than HBM speed. No effect on CPU masters.
  bool offload_moments = false;
  // Checks every field (and cross-field rules); the message names the field.
  void validate() const;
};

// Per-call step arguments.
struct StepArgs {
  double lr = std::numeric_limits<double>::quiet_NaN();  // NaN: use AdamWOptions::lr
  double max_grad_norm = 0.0;  // > 0: scale grads so the global norm is at most this
  double grad_scale = 1.0;     // applied to every gradient first (e.g. 1 / accumulation steps)
  // Data parallel with a sharded optimizer: maps this optimizer's sum of squared gradients to the
  // global one (an all-reduce over the ranks), so clipping and the non-finite guard see the whole
  // model. Unset: this optimizer's own sum.
  std::function<double(double)> reduce_sumsq;
  // Gradients' sums of squares already taken (gradient_sumsq_parts of exactly the gradient later
  // passed to step()): one entry per registered parameter, undefined where step() takes it from
  // the gradient; empty: all. A caller that had the gradient in device memory before it went to
  // pinned host memory spares the norm pass a read over PCIe. The norm is bit-identical.
  std::vector<at::Tensor> sumsq_parts;
};

struct StepResult {
  bool applied = false;    // false: a gradient was non-finite, nothing changed
  double grad_norm = 0.0;  // global L2 norm of grad_scale * grads, before clipping (fp32 parts,
                           // combined in double); NaN/Inf when the step was skipped
  double clip_coef = 1.0;  // factor applied to the gradients (1 when not clipped)
  double lr = 0.0;         // learning rate used
  int64_t step = 0;        // applied steps so far (the Adam t of the last applied step)
  int64_t consecutive_nonfinite = 0;  // skipped steps in a row, including this one
  int64_t skipped_total = 0;          // skipped steps since construction/load
};

// What was registered, and how it is stored.
struct ParamInfo {
  std::string name;
  std::vector<int64_t> shape;
  at::ScalarType master_dtype = at::kHalf;
  at::Device device = at::kCPU;
  int64_t rows = 0;  // shape[0] (1 for 0-/1-D tensors); chunks are taken over rows
  int64_t cols = 0;  // numel / rows
  bool weight_decay = true;
  StateMode mode = StateMode::kFp32;  // effective mode (small tensors: kFp32)
  int64_t state_bytes = 0;            // bytes of m and v as stored (codes + scales)
  bool moments_on_host = false;  // pinned host memory (offload_moments, or master_on_host)
  bool master_on_host = false;   // add_host_param: the master is in pinned host memory
  int64_t stream_index = 0;  // stochastic-rounding stream of the parameter (default: its index)
};

// Bytes one step touches in device memory, from each parameter's actual storage; used for the
// HBM floor of the benchmark.
struct StepTraffic {
  int64_t norm_read_bytes = 0;   // gradient read by the global-norm pass
  int64_t step_read_bytes = 0;   // gradient + master + moments (codes and scales) read
  int64_t step_write_bytes = 0;  // master + moments written
  int64_t total() const { return norm_read_bytes + step_read_bytes + step_write_bytes; }
};

class PackedAdamW {
 public:
  explicit PackedAdamW(AdamWOptions options);
  ~PackedAdamW();
  PackedAdamW(PackedAdamW&&) noexcept;
  PackedAdamW& operator=(PackedAdamW&&) noexcept;
  PackedAdamW(const PackedAdamW&) = delete;
  PackedAdamW& operator=(const PackedAdamW&) = delete;

  // Registers a master weight (fp16/bf16/fp32, contiguous, CPU or CUDA) that this optimizer
  // updates in place. Names must be unique. Moment storage is allocated (zeroed) on the master's
  // device now. Not allowed after the first step or after load(). `stream_index` names the
  // parameter's stochastic-rounding stream (default: its registration index); a sharded
  // optimizer passes the parameter's index in the whole model so that every rank layout rounds
  // a parameter the same way.
  void add_param(const std::string& name, const at::Tensor& master, bool weight_decay = true,
                 int64_t stream_index = -1);
  // Registers a master in pinned host memory (q4/io/pinned.h) that the CUDA kernels of `device`
  // update in place over PCIe, with its moments in pinned host memory too: nothing of the
  // parameter's optimizer state takes device memory. Gradients come on `device`. Results are
  // bit-identical to a master on the device; the host reads the master only after the device has
  // finished (the state file does that itself).
  void add_host_param(const std::string& name, const at::Tensor& master, const at::Device& device,
                      bool weight_decay = true, int64_t stream_index = -1);

  // One AdamW step. The first overload reads each master's .grad(); the second takes one
  // gradient per registered parameter, in registration order (same numel and device; fp32, bf16
  // or fp16; any layout with the master's numel, contiguous). A CUDA parameter's gradient may
  // also be in pinned host memory (copied in by DMA; best with its StepArgs::sumsq_parts). A parameter whose grad is undefined
  // (first overload) gets a zero gradient (its moments decay, weight decay still applies).
  // Order: global norm of grad_scale*g -> non-finite guard -> clip coef -> fused update.
  // Throws when the non-finite guard trips more than max_consecutive_nonfinite times in a row.
  StepResult step(const StepArgs& args = {});
  StepResult step(const std::vector<at::Tensor>& grads, const StepArgs& args = {});

  // In-backward updates, for a backward that frees each gradient as soon as it is applied (no
  // full-model gradient buffer): begin_step() before the backward; step_param(index, grad) for
  // each registered parameter as soon as its gradient is complete (any order, at most once; the
  // gradient may be freed on return); end_step() after the backward, which gives parameters
  // without a gradient a zero one and returns the result. Differences from step():
  //  - clipping uses the previous step's global norm (this step's is known only at the end); the
  //    first step (no previous norm, zero moments) is applied unclipped (Adam's first update is
  //    sign(g) up to eps, scale-free) and end_step() then scales the moments it wrote to those
  //    of the clipped gradient (m by c, v by c^2), reporting c as clip_coef;
  //  - a parameter whose gradient holds NaN/Inf keeps its master and moments (decided on the
  //    device, no host sync); the others are updated and the step counts as non-finite.
  // On CUDA end_step() is the step's only host wait (the norm and the non-finite count).
  void begin_step(const StepArgs& args = {});
  void step_param(int64_t index, const at::Tensor& grad);
  StepResult end_step();
  bool in_step() const;
  // The global norm the next in-backward step clips with (NaN: none): the last applied step's,
  // buffered or in-backward, so a run may switch between the two (a resume with another
  // grad_accum); saved with checkpoints.
  double previous_grad_norm() const;
  void set_previous_grad_norm(double norm);

  // CUDA parameters whose master or moments are in pinned host memory are updated by DMA: the
  // state (and a gradient in pinned host memory) is copied to device buffers on a copy stream,
  // updated there by the same kernel (the same bits as through the device alias) and copied back
  // on another, so both PCIe directions run at copy-engine speed while other parameters update;
  // the copies take kMaxStagedBytes of device memory while updates run (a parameter whose copies
  // would take over half of that, e.g. an embedding, is updated over PCIe through its aliases
  // instead). `hook(index, master)`, when set, runs on the update's stream right after a
  // master is updated, with its new values: a staged master's device copy, else the master
  // itself (valid for work ordered on that stream; e.g. refreshing the forward
  // weight kept from it, without reading a host copy again). Small tensors that a CUDA step
  // updates together in one launch get no call.
  void set_master_updated_hook(std::function<void(int64_t, const at::Tensor&)> hook);
  // The device memory that staging uses, held by the caller (any size; a parameter whose copies
  // take over half of it goes through its aliases): the staging writes it only on its copy
  // streams after the caller's stream reaches begin_step(), and the caller's stream waits for
  // every copy by the end of the step. Undefined (the default): kMaxStagedBytes taken from the
  // caller's stream's pool for each step. A step in progress keeps the arena it began with.
  void set_staging_arena(const at::Tensor& arena);

  // Drops (set_to_none) or zeroes every registered master's .grad().
  void zero_grad(bool set_to_none = true);

  const AdamWOptions& options() const;
  // Learning rate, beta1/2, eps and weight decay may change between steps (e.g. a schedule);
  // state_mode, small_tensor_threshold and seed may not (error naming the field).
  void set_options(const AdamWOptions& options);

  int64_t num_params() const;
  const std::vector<ParamInfo>& params() const;
  const at::Tensor& master(int64_t index) const;
  int64_t step_count() const;     // applied steps
  int64_t skipped_total() const;  // skipped (non-finite) steps
  int64_t consecutive_nonfinite() const;
  int64_t state_bytes() const;  // sum of ParamInfo::state_bytes
  // Bytes a step touches on the device when gradients come in `grad_dtype`.
  StepTraffic step_traffic(at::ScalarType grad_dtype) const;

  // CPU scratch arena: every chunk-sized temporary of a CPU step comes from it. Its high-water
  // mark (bytes ever held at once) is bounded by ~16 x chunk_rows x cols x 4 of the widest
  // parameter (docs/optim.md has the exact list). CUDA steps use no scratch beyond a few floats.
  int64_t scratch_peak_bytes() const;
  void release_scratch();  // frees the arena (and resets the peak)

  // Moments of parameter `index` decoded to fp32 (numel, on the master's device). For tests and
  // diagnostics.
  at::Tensor decoded_exp_avg(int64_t index) const;
  at::Tensor decoded_exp_avg_sq(int64_t index) const;

  // State file: magic, version, mode, counters, per-parameter name/shape/dtype/mode, packed
  // moments and (include_masters) the master values. Written atomically (temp + fsync +
  // rename). load() checks magic, version, mode and every parameter against the registered
  // ones, with errors naming the file and the parameter; a resumed CPU run continues
  // bit-identically. Masters are restored only when the file has them and restore_masters.
  void save(const std::string& path, bool include_masters = true) const;
  void load(const std::string& path, bool restore_masters = true);
  // Loads from the shard files of a sharded optimizer (any number, any split): each registered
  // parameter is taken, by name, from the one file that holds it; parameters registered
  // nowhere are an error, parameters of the files that are not registered here are skipped
  // (another rank owns them). Counters must agree across the files. A one-file load() is the
  // same with the file's parameters all registered.
  void load_shards(const std::vector<std::string>& paths, bool restore_masters = true);

 private:
  struct Impl;
  void register_param(const std::string& name, const at::Tensor& master, const at::Device& device,
                      bool weight_decay, int64_t stream_index);
  static void load_files(Impl& d, const std::vector<std::string>& paths, bool restore_masters,
                         bool strict);
  std::unique_ptr<Impl> impl_;
};

// The device memory the staging of host-memory optimizer state takes while updates run; see
// PackedAdamW::set_master_updated_hook.
inline constexpr int64_t kMaxStagedBytes = int64_t{512} << 20;

// Global L2 norm of a list of gradients (fp32/bf16/fp16, any device), each processed in
// chunks of at most `chunk_elems` elements converted to fp32 (CPU) or by a fused fp32-accumulating
// reduction (CUDA); partial sums combined in double. Undefined tensors are skipped. Returns
// NaN/Inf when any element is non-finite.
double global_grad_norm(const std::vector<at::Tensor>& grads, int64_t chunk_elems = 1 << 20);

// The global-norm pass's partial sums of squares of one CUDA gradient (fp32/bf16/fp16,
// contiguous): (P) fp32 on its device, computed on the current stream, for StepArgs::sumsq_parts.
at::Tensor gradient_sumsq_parts(const at::Tensor& grad);

// Scales every gradient in place by min(1, max_norm / (norm + 1e-6)) and returns the norm before
// clipping. Non-finite norm: nothing is scaled. max_norm must be > 0.
double clip_grad_norm_(const std::vector<at::Tensor>& grads, double max_norm);

}  // namespace q4::optim

Q4_ENUM_NAMES(q4::optim::StateMode, {"fp32", q4::optim::StateMode::kFp32},
              {"int8", q4::optim::StateMode::kInt8}, {"4bit", q4::optim::StateMode::k4Bit},
              {"nvfp4", q4::optim::StateMode::kNvfp4});
Q4_ENUM_NAMES(q4::optim::MasterRounding, {"stochastic", q4::optim::MasterRounding::kStochastic},
              {"nearest", q4::optim::MasterRounding::kNearest});
