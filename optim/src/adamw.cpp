// PackedAdamW: registration, the step (global norm -> non-finite guard -> clip -> per-parameter
// update), and the CPU chunk loop. The CPU update walks a parameter in chunks of chunk_rows rows
// (rounded to whole moment blocks) using only the scratch arena; CUDA parameters go to one fused
// kernel per mode (adamw_launch.cu). The fp32 arithmetic order is the one in docs/optim.md and
// is shared with the kernels, so the two paths agree bit-for-bit when no clipping is involved.
#include "q4/optim/adamw.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <unordered_set>

#include "cpu_kernels.h"
#include "cuda_launch.h"
#include "grad_norm.h"
#include "host_stager.h"
#include "optim_math.h"
#include "optim_state.h"
#include "q4/io/pinned.h"
#include "q4/optim/state_codec.h"

#if Q4_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#endif

namespace q4::optim {

StateMode parse_state_mode(const std::string& text) {
  return io::parse_enum<StateMode>(text, "state mode");
}

std::string to_string(StateMode mode) { return io::enum_name(mode); }

MasterRounding parse_master_rounding(const std::string& text) {
  return io::parse_enum<MasterRounding>(text, "master rounding");
}

std::string to_string(MasterRounding rounding) { return io::enum_name(rounding); }

void AdamWOptions::validate() const {
  TORCH_CHECK(std::isfinite(lr) && lr >= 0.0, "AdamWOptions.lr: expected a finite value >= 0, got ",
              lr);
  TORCH_CHECK(beta1 >= 0.0 && beta1 < 1.0, "AdamWOptions.beta1: expected 0 <= beta1 < 1, got ",
              beta1);
  TORCH_CHECK(beta2 >= 0.0 && beta2 < 1.0, "AdamWOptions.beta2: expected 0 <= beta2 < 1, got ",
              beta2);
  TORCH_CHECK(std::isfinite(eps) && eps > 0.0,
              "AdamWOptions.eps: expected a finite value > 0, got ", eps);
  TORCH_CHECK(std::isfinite(weight_decay) && weight_decay >= 0.0,
              "AdamWOptions.weight_decay: expected a finite value >= 0, got ", weight_decay);
  TORCH_CHECK(chunk_rows >= 1, "AdamWOptions.chunk_rows: expected >= 1, got ", chunk_rows);
  TORCH_CHECK(small_tensor_threshold >= 0,
              "AdamWOptions.small_tensor_threshold: expected >= 0, got ", small_tensor_threshold);
  TORCH_CHECK(max_consecutive_nonfinite >= 0,
              "AdamWOptions.max_consecutive_nonfinite: expected >= 0, got ",
              max_consecutive_nonfinite);
  TORCH_CHECK(lr * weight_decay < 1.0,
              "AdamWOptions.weight_decay: lr * weight_decay must be < 1 (got ", lr, " * ",
              weight_decay, ")");
}

PackedAdamW::PackedAdamW(AdamWOptions options) : impl_(std::make_unique<Impl>()) {
  options.validate();
  impl_->opt = options;
}
PackedAdamW::~PackedAdamW() = default;
PackedAdamW::PackedAdamW(PackedAdamW&&) noexcept = default;
PackedAdamW& PackedAdamW::operator=(PackedAdamW&&) noexcept = default;

namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

bool is_master_dtype(at::ScalarType t) {
  return t == at::kHalf || t == at::kBFloat16 || t == at::kFloat;
}

}  // namespace

void PackedAdamW::add_param(const std::string& name, const at::Tensor& master, bool weight_decay,
                            int64_t stream_index) {
  TORCH_CHECK(!master.defined() || master.is_cpu() || master.is_cuda(), "PackedAdamW::add_param('",
              name, "'): master must be on CPU or CUDA, got ", master.device());
  register_param(name, master, master.defined() ? master.device() : at::Device(at::kCPU),
                 weight_decay, stream_index);
}

void PackedAdamW::add_host_param(const std::string& name, const at::Tensor& master,
                                 const at::Device& device, bool weight_decay,
                                 int64_t stream_index) {
  TORCH_CHECK(master.defined() && master.is_cpu() && master.is_pinned(),
              "PackedAdamW::add_host_param('", name,
              "'): master must be a tensor in pinned host memory");
  TORCH_CHECK(device.is_cuda(), "PackedAdamW::add_host_param('", name,
              "'): expected a CUDA device, got ", device);
#if Q4_WITH_CUDA
  const at::Device dev = device.has_index() ? device : at::Device(at::kCUDA, c10::cuda::current_device());
  register_param(name, master, dev, weight_decay, stream_index);
#else
  TORCH_CHECK(false, "PackedAdamW::add_host_param('", name,
              "'): q4_optim was built without CUDA kernels (configure with -DQ4_ENABLE_CUDA=ON)");
#endif
}

void PackedAdamW::register_param(const std::string& name, const at::Tensor& master,
                                 const at::Device& device, bool weight_decay,
                                 int64_t stream_index) {
  Impl& d = *impl_;
  TORCH_CHECK(!d.frozen, "PackedAdamW::add_param('", name,
              "'): parameters must be registered before the first step() or load()");
  TORCH_CHECK(!name.empty(), "PackedAdamW::add_param: empty parameter name");
  for (const auto& p : d.ps) {
    TORCH_CHECK(p.info.name != name, "PackedAdamW::add_param: parameter '", name,
                "' is already registered");
  }
  TORCH_CHECK(master.defined(), "PackedAdamW::add_param('", name, "'): undefined tensor");
  TORCH_CHECK(is_master_dtype(master.scalar_type()), "PackedAdamW::add_param('", name,
              "'): master dtype must be fp16, bf16 or fp32, got ", master.scalar_type());
  TORCH_CHECK(master.is_contiguous(), "PackedAdamW::add_param('", name,
              "'): master must be contiguous");
  TORCH_CHECK(master.numel() > 0, "PackedAdamW::add_param('", name, "'): empty tensor");
#if !Q4_WITH_CUDA
  TORCH_CHECK(!device.is_cuda(), "PackedAdamW::add_param('", name,
              "'): CUDA master given but q4_optim was built without CUDA kernels "
              "(configure with -DQ4_ENABLE_CUDA=ON)");
#endif
  detail::ParamState p;
  p.master = master;
  ParamInfo& info = p.info;
  info.master_on_host = master.is_cpu() && device.is_cuda();
  // A master in pinned host memory is updated by the device's kernels through an alias.
  p.flat = info.master_on_host ? io::device_alias(master.detach().view({-1}), device)
                               : master.detach().view({-1});
  info.name = name;
  info.shape = master.sizes().vec();
  info.master_dtype = master.scalar_type();
  info.device = device;
  info.rows = master.dim() >= 1 ? master.size(0) : 1;
  info.cols = master.numel() / std::max<int64_t>(info.rows, 1);
  info.weight_decay = weight_decay;
  info.stream_index = stream_index >= 0 ? stream_index : static_cast<int64_t>(d.ps.size());
  info.mode = master.numel() < d.opt.small_tensor_threshold ? StateMode::kFp32 : d.opt.state_mode;
  const int64_t n = master.numel();
  info.moments_on_host = (d.opt.offload_moments && device.is_cuda()) || info.master_on_host;
  // Offloaded moments: pinned host memory, which the CUDA kernels address directly.
  const auto zeros = [&](int64_t count, at::ScalarType dtype) {
    if (!info.moments_on_host) {
      return at::zeros({count}, at::TensorOptions().device(device).dtype(dtype));
    }
    return io::pinned_empty({count}, dtype).zero_();
  };
  if (info.mode == StateMode::kFp32) {
    p.m32 = zeros(n, at::kFloat);
    p.v32 = zeros(n, at::kFloat);
  } else {
    const int64_t nb = ceil_div(n, moment_block_size(info.mode));
    const int64_t ncodes = info.mode == StateMode::kInt8 ? n : ceil_div(n, 2);
    const auto sdt = info.mode == StateMode::kNvfp4 ? at::kByte : at::kFloat;
    for (PackedMoment* pm : {&p.m, &p.v}) {
      pm->numel = n;
      pm->codes = zeros(ncodes, at::kByte);
      pm->scales = zeros(nb, sdt);
    }
  }
  info.state_bytes = 2 * packed_moment_bytes(info.mode, n);
  d.infos.push_back(info);
  d.ps.push_back(std::move(p));
}

const AdamWOptions& PackedAdamW::options() const { return impl_->opt; }

void PackedAdamW::set_options(const AdamWOptions& options) {
  options.validate();
  const AdamWOptions& o = impl_->opt;
  TORCH_CHECK(options.state_mode == o.state_mode,
              "AdamWOptions.state_mode cannot change on a live optimizer (",
              to_string(o.state_mode), " -> ", to_string(options.state_mode), ")");
  TORCH_CHECK(options.small_tensor_threshold == o.small_tensor_threshold,
              "AdamWOptions.small_tensor_threshold cannot change on a live optimizer");
  TORCH_CHECK(options.seed == o.seed, "AdamWOptions.seed cannot change on a live optimizer");
  TORCH_CHECK(options.offload_moments == o.offload_moments,
              "AdamWOptions.offload_moments cannot change on a live optimizer");
  impl_->opt = options;
}

int64_t PackedAdamW::num_params() const { return static_cast<int64_t>(impl_->ps.size()); }
const std::vector<ParamInfo>& PackedAdamW::params() const { return impl_->infos; }
const at::Tensor& PackedAdamW::master(int64_t index) const {
  TORCH_CHECK(index >= 0 && index < num_params(), "PackedAdamW::master: index ", index,
              " out of range [0, ", num_params(), ")");
  return impl_->ps[index].master;
}
int64_t PackedAdamW::step_count() const { return impl_->step; }
int64_t PackedAdamW::skipped_total() const { return impl_->skipped; }
int64_t PackedAdamW::consecutive_nonfinite() const { return impl_->consecutive; }
int64_t PackedAdamW::state_bytes() const {
  int64_t b = 0;
  for (const auto& i : impl_->infos) b += i.state_bytes;
  return b;
}

StepTraffic PackedAdamW::step_traffic(at::ScalarType grad_dtype) const {
  StepTraffic t;
  const int64_t gb = static_cast<int64_t>(c10::elementSize(grad_dtype));
  for (const auto& i : impl_->infos) {
    int64_t n = 1;
    for (int64_t s : i.shape) n *= s;
    const int64_t mb = static_cast<int64_t>(c10::elementSize(i.master_dtype));
    t.norm_read_bytes += n * gb;
    t.step_read_bytes += n * (gb + mb) + i.state_bytes;
    t.step_write_bytes += n * mb + i.state_bytes;
  }
  return t;
}

int64_t PackedAdamW::scratch_peak_bytes() const { return impl_->scratch.peak_bytes(); }
void PackedAdamW::release_scratch() { impl_->scratch.release(); }

at::Tensor PackedAdamW::decoded_exp_avg(int64_t index) const {
  master(index);  // range check
  detail::wait_for_host_moments(impl_->ps);
  const detail::ParamState& p = impl_->ps[index];
  if (p.info.mode == StateMode::kFp32) return p.m32.clone();
  return unpack_moment(p.m, p.info.mode, Moment::kFirst);
}

at::Tensor PackedAdamW::decoded_exp_avg_sq(int64_t index) const {
  master(index);
  detail::wait_for_host_moments(impl_->ps);
  const detail::ParamState& p = impl_->ps[index];
  if (p.info.mode == StateMode::kFp32) return p.v32.clone();
  return unpack_moment(p.v, p.info.mode, Moment::kSecond);
}

void PackedAdamW::zero_grad(bool set_to_none) {
  for (auto& p : impl_->ps) {
    at::Tensor& g = p.master.mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g = at::Tensor();
    } else {
      g.detach_();
      g.zero_();
    }
  }
}

// ---------------------------------------------------------------- step

namespace detail {

// Constants of one step, rounded to fp32 once (shared by the CPU path and the kernels).
struct StepConsts {
  float grad_scale, beta1, omb1, beta2, omb2, inv_sqrt_bc2, eps, step_size, decay;
  bool cuda_exact = false;  // AdamWOptions::cuda_exact_arithmetic
};

void step_param_cpu(ParamState& p, const at::Tensor& grad, const StepConsts& c, bool decay,
                    bool stochastic, uint32_t key, int64_t chunk_rows, Scratch& s) {
  const StateMode mode = p.info.mode;
  const int64_t n = p.flat.numel();
  const int64_t block = mode == StateMode::kFp32 ? 1 : moment_block_size(mode);
  const int64_t row_elems = std::max<int64_t>(1, chunk_rows * p.info.cols);
  const int64_t chunk = std::max<int64_t>(block, (row_elems / block) * block);
  const at::Tensor gflat = grad.defined() ? grad.reshape({-1}) : at::Tensor();
  const bool fp32_master = p.info.master_dtype == at::kFloat;
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    const int64_t npad = ceil_div(len, block) * block;
    at::Tensor g = s.get(kSlotGrad, at::kFloat, npad);
    if (gflat.defined()) {
      g.narrow(0, 0, len).copy_(gflat.narrow(0, start, len));
      g.mul_(c.grad_scale);
    } else {
      g.narrow(0, 0, len).zero_();
    }
    if (npad > len) g.narrow(0, len, npad - len).zero_();
    at::Tensor m, v;
    if (mode == StateMode::kFp32) {
      m = p.m32.narrow(0, start, len);
      v = p.v32.narrow(0, start, len);
    } else {
      m = s.get(kSlotM, at::kFloat, npad);
      v = s.get(kSlotV, at::kFloat, npad);
      decode_chunk_cpu(p.m.codes, p.m.scales, mode, Moment::kFirst, start, len, m, s);
      decode_chunk_cpu(p.v.codes, p.v.scales, mode, Moment::kSecond, start, len, v, s);
    }
    at::Tensor tmp = s.get(kSlotTmp, at::kFloat, npad);
    // m = b1*m + (1-b1)*g ; v = b2*v + (1-b2)*(g*g), one rounding per operation.
    tmp.copy_(g).mul_(c.omb1);
    m.mul_(c.beta1).add_(tmp);
    tmp.copy_(g).mul_(g).mul_(c.omb2);
    v.mul_(c.beta2).add_(tmp);
    if (mode != StateMode::kFp32) {
      // Stochastic moment codes (4-bit): bits derived from the master-rounding stream.
      encode_chunk_cpu(m, mode, Moment::kFirst, start, len, p.m.codes, p.m.scales, key, s);
      encode_chunk_cpu(v, mode, Moment::kSecond, start, len, p.v.codes, p.v.scales, key, s);
    }
    // u = step_size * (m / (sqrt(v) * inv_sqrt_bc2 + eps)); p = p*decay - u. Fresh (unquantized)
    // moments are used for this step's update, as in bitsandbytes and torchao.
    at::Tensor u = tmp.narrow(0, 0, len);
    at::sqrt_out(u, v.narrow(0, 0, len));
    u.mul_(c.inv_sqrt_bc2).add_(c.eps);
    at::div_out(u, m.narrow(0, 0, len), u);
    u.mul_(c.step_size);
    at::Tensor master = p.flat.narrow(0, start, len);
    at::Tensor w = s.get(kSlotMaster, at::kFloat, len);
    w.copy_(master);
    if (decay) w.mul_(c.decay);
    w.sub_(u);
    if (fp32_master) {
      master.copy_(w);
    } else if (stochastic) {
      stochastic_round_cpu(w, master, key, start, s);
    } else {
      const double maxf = p.info.master_dtype == at::kHalf ? 65504.0 : 3.3895313892515355e38;
      w.clamp_(-maxf, maxf);
      master.copy_(w);
    }
  }
}

#if Q4_WITH_CUDA
// The kernel arguments of one parameter's update; `g` is its contiguous gradient (undefined:
// zero), which must outlive the launch.
cuda::StepParams step_params_cuda(ParamState& p, const at::Tensor& g, const StepConsts& c,
                                  bool decay, bool stochastic, uint32_t key, const int32_t* skip) {
  cuda::StepParams k;
  k.grad = g.defined() ? g.data_ptr() : nullptr;
  k.grad_dtype = g.defined() ? cuda_dtype(g.scalar_type()) : cuda::kDtF32;
  k.master = p.flat.data_ptr();
  k.master_dtype = cuda_dtype(p.info.master_dtype);
  k.n = p.flat.numel();
  k.mode = static_cast<int>(p.info.mode);
  if (p.info.mode == StateMode::kFp32) {
    k.m32 = p.m32.data_ptr<float>();
    k.v32 = p.v32.data_ptr<float>();
  } else {
    k.m_codes = p.m.codes.data_ptr<uint8_t>();
    k.v_codes = p.v.codes.data_ptr<uint8_t>();
    k.m_scales = p.m.scales.data_ptr();
    k.v_scales = p.v.scales.data_ptr();
  }
  k.grad_scale = c.grad_scale;
  k.beta1 = c.beta1;
  k.one_minus_beta1 = c.omb1;
  k.beta2 = c.beta2;
  k.one_minus_beta2 = c.omb2;
  k.inv_sqrt_bc2 = c.inv_sqrt_bc2;
  k.eps = c.eps;
  k.step_size = c.step_size;
  k.decay = decay ? c.decay : 1.0f;
  k.stochastic = stochastic ? 1 : 0;
  k.sr_key = key;
  k.skip = skip;
  k.exact = c.cuda_exact ? 1 : 0;
  const double gs = c.grad_scale;
  k.fast_c1 = static_cast<float>(gs * static_cast<double>(c.omb1));
  k.fast_c2 = static_cast<float>(gs * gs * static_cast<double>(c.omb2));
  const bool no_step = c.step_size == 0.0f;
  k.fast_den_a = no_step ? std::numeric_limits<float>::max()
                         : static_cast<float>(static_cast<double>(c.inv_sqrt_bc2) / c.step_size);
  k.fast_den_b = no_step ? std::numeric_limits<float>::max()
                         : static_cast<float>(static_cast<double>(c.eps) / c.step_size);
  return k;
}

void step_param_cuda(ParamState& p, const at::Tensor& grad, const StepConsts& c, bool decay,
                     bool stochastic, uint32_t key, const int32_t* skip = nullptr) {
  c10::cuda::CUDAGuard guard(p.info.device);
  const at::Tensor g = grad.defined() ? grad.contiguous() : at::Tensor();
  cuda::launch_adamw_step(step_params_cuda(p, g, c, decay, stochastic, key, skip),
                          at::cuda::getCurrentCUDAStream());
}

// Small resident parameters with packed moments (the buffered step's adapters: a few hundred
// tensors of under a million elements), collected and updated kStepBatch to a launch on the
// caller's stream of their device (cuda::launch_adamw_steps; the same bits as one launch each).
class SmallStepBatch {
 public:
  static constexpr int64_t kMaxElements = int64_t{1} << 20;
  static bool takes(const ParamState& p, const at::Tensor& grad) {
    return p.info.mode != StateMode::kFp32 && p.flat.numel() > 0 &&
           p.flat.numel() <= kMaxElements && p.flat.is_cuda() &&
           (!grad.defined() || grad.is_cuda());
  }
  void add(ParamState& p, const at::Tensor& grad, const StepConsts& c, bool decay, bool stochastic,
           uint32_t key) {
    if (!params_.empty() && device_ != p.info.device) flush();
    device_ = p.info.device;
    const at::Tensor g = grad.defined() ? grad.contiguous() : at::Tensor();
    if (g.defined()) grads_.push_back(g);
    params_.push_back(step_params_cuda(p, g, c, decay, stochastic, key, nullptr));
  }
  void flush() {
    if (params_.empty()) return;
    c10::cuda::CUDAGuard guard(device_);
    cuda::launch_adamw_steps(params_.data(), static_cast<int>(params_.size()),
                             at::cuda::getCurrentCUDAStream());
    params_.clear();
    grads_.clear();
  }

 private:
  at::Device device_ = at::kCPU;
  std::vector<cuda::StepParams> params_;
  std::vector<at::Tensor> grads_;  // alive until the launch
};
#endif

void wait_for_host_moments(const std::vector<ParamState>& ps) {
#if Q4_WITH_CUDA
  for (const ParamState& p : ps) {
    if (p.info.moments_on_host || p.info.master_on_host) {
      // Kernels on any stream may still be writing offloaded state: wait for all of them.
      c10::cuda::device_synchronize();
      return;
    }
  }
#else
  (void)ps;
#endif
}

StepConsts make_step_consts(const AdamWOptions& o, double grad_scale, double lr, int64_t t) {
  StepConsts c;
  c.grad_scale = static_cast<float>(grad_scale);
  c.beta1 = static_cast<float>(o.beta1);
  c.omb1 = static_cast<float>(1.0 - o.beta1);
  c.beta2 = static_cast<float>(o.beta2);
  c.omb2 = static_cast<float>(1.0 - o.beta2);
  const double bc1 = 1.0 - std::pow(o.beta1, static_cast<double>(t));
  const double bc2 = 1.0 - std::pow(o.beta2, static_cast<double>(t));
  c.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(bc2));
  c.eps = static_cast<float>(o.eps);
  c.step_size = static_cast<float>(lr / bc1);
  c.decay = static_cast<float>(1.0 - lr * o.weight_decay);
  c.cuda_exact = o.cuda_exact_arithmetic;
  return c;
}

}  // namespace detail

StepResult PackedAdamW::step(const StepArgs& args) {
  std::vector<at::Tensor> grads;
  grads.reserve(impl_->ps.size());
  for (const auto& p : impl_->ps) grads.push_back(p.master.grad());
  return step(grads, args);
}

double PackedAdamW::Impl::check_step(const std::vector<at::Tensor>& grads,
                                     const StepArgs& args) const {
  const AdamWOptions& o = opt;
  TORCH_CHECK(grads.size() == ps.size(), "PackedAdamW::step: expected ", ps.size(),
              " gradients (one per registered parameter), got ", grads.size());
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined()) continue;
    const ParamInfo& info = infos[i];
    TORCH_CHECK(g.numel() == ps[i].flat.numel(), "PackedAdamW::step: gradient of '", info.name,
                "' has ", g.numel(), " elements, expected ", ps[i].flat.numel());
    TORCH_CHECK(g.device() == info.device || (info.device.is_cuda() && g.is_pinned()),
                "PackedAdamW::step: gradient of '", info.name, "' is on ", g.device(),
                ", master on ", info.device, " (a CUDA master also takes pinned host memory)");
    TORCH_CHECK(g.scalar_type() == at::kFloat || g.scalar_type() == at::kHalf ||
                    g.scalar_type() == at::kBFloat16,
                "PackedAdamW::step: gradient of '", info.name, "' must be fp32, fp16 or bf16, got ",
                g.scalar_type());
  }
  const double lr = std::isnan(args.lr) ? o.lr : args.lr;
  TORCH_CHECK(std::isfinite(lr) && lr >= 0.0, "PackedAdamW::step: lr must be finite and >= 0, got ",
              lr);
  TORCH_CHECK(lr * o.weight_decay < 1.0, "PackedAdamW::step: lr * weight_decay must be < 1");
  TORCH_CHECK(std::isfinite(args.grad_scale), "PackedAdamW::step: grad_scale must be finite, got ",
              args.grad_scale);
  TORCH_CHECK(std::isfinite(args.max_grad_norm) && args.max_grad_norm >= 0.0,
              "PackedAdamW::step: max_grad_norm must be finite and >= 0, got ", args.max_grad_norm);
  return lr;
}

double PackedAdamW::Impl::step_grad_norm(const std::vector<at::Tensor>& grads,
                                         const StepArgs& args) {
  // Chunk for the norm pass: the widest parameter's chunk, so the scratch bound is the same.
  int64_t norm_chunk = 1;
  for (const auto& i : infos) norm_chunk = std::max(norm_chunk, opt.chunk_rows * i.cols);
  // A CUDA parameter's gradient in pinned host memory without its norm parts: taken on the
  // device (a copy in), as for any CUDA gradient.
  std::vector<at::Tensor> parts = args.sumsq_parts;
  for (size_t i = 0; i < grads.size(); ++i) {
    const at::Tensor& g = grads[i];
    if (!g.defined() || g.is_cuda() || !infos[i].device.is_cuda()) continue;
    if (parts.empty()) parts.resize(grads.size());
    if (!parts[i].defined()) {
      parts[i] = gradient_sumsq_parts(g.contiguous().to(infos[i].device, /*non_blocking=*/true));
    }
  }
  double sumsq = detail::global_sumsq(grads, norm_chunk, scratch, parts);
  if (args.reduce_sumsq) sumsq = args.reduce_sumsq(sumsq);
  return std::sqrt(sumsq) * std::fabs(args.grad_scale);
}

void PackedAdamW::Impl::apply_updates(const std::vector<at::Tensor>& grads,
                                      const detail::StepConsts& c, int64_t t) {
  const AdamWOptions& o = opt;
  const bool stochastic = o.rounding == MasterRounding::kStochastic;
#if Q4_WITH_CUDA
  // The parameters' kernels alternate between the caller's stream and a side stream of the same
  // device, so that one launch's tail (its last CTAs) overlaps the next launch's start instead of
  // leaving SMs idle; a few hundred launches per step made that ~10% of the step (H100,
  // bench_optim). Each kernel touches only its own parameter, so the results do not depend on
  // the order; the side stream starts after the caller's stream (event) and the caller's stream
  // waits for it before step() returns.
  std::optional<c10::cuda::CUDAStream> side;
  std::optional<at::cuda::CUDAEvent> side_done;
  int cuda_launches = 0;
  stager->begin(ps, staging_arena);
  detail::SmallStepBatch small;
#endif
  for (size_t i = 0; i < ps.size(); ++i) {
    detail::ParamState& p = ps[i];
    const bool decay = p.info.weight_decay && o.weight_decay > 0.0;
    const uint32_t key = detail::sr_stream_key(o.seed, t, p.info.stream_index);
    if (p.info.device.is_cuda()) {
#if Q4_WITH_CUDA
      const c10::cuda::CUDAStream main = at::cuda::getCurrentCUDAStream(p.info.device.index());
      if (!side || side->device() != main.device()) {
        if (side) {  // parameters on another device: join the previous side stream first
          side_done->record(*side);
          side_done->block(at::cuda::getCurrentCUDAStream(side->device_index()));
        }
        side = at::cuda::getStreamFromPool(false, main.device_index());
        side_done.emplace();
        at::cuda::CUDAEvent ready;
        ready.record(main);
        ready.block(*side);
      }
      const auto launch = [&](detail::ParamState& state, const at::Tensor& g) {
        detail::step_param_cuda(state, g, c, decay, stochastic, key);
      };
      const auto update = [&] {
        if (stager->applies(p, grads[i])) {
          stager->update(p, grads[i], static_cast<int64_t>(i), launch, master_updated);
        } else {
          launch(p, grads[i]);
          if (master_updated) master_updated(static_cast<int64_t>(i), p.master);
        }
      };
      // Staged parameters run on the caller's stream, whose pool their copies come from.
      const bool staged = stager->applies(p, grads[i]);
      if (!staged && detail::SmallStepBatch::takes(p, grads[i])) {
        small.add(p, grads[i], c, decay, stochastic, key);
      } else if (!staged && cuda_launches++ % 2 == 1) {
        c10::cuda::CUDAStreamGuard on_side(*side);
        update();
      } else {
        update();
      }
#endif
    } else {
      detail::step_param_cpu(p, grads[i], c, decay, stochastic, key, o.chunk_rows, scratch);
      if (master_updated) master_updated(static_cast<int64_t>(i), p.master);
    }
  }
#if Q4_WITH_CUDA
  small.flush();
  stager->finish();
  if (side) {
    side_done->record(*side);
    side_done->block(at::cuda::getCurrentCUDAStream(side->device_index()));
  }
#endif
}

StepResult PackedAdamW::step(const std::vector<at::Tensor>& grads, const StepArgs& args) {
  Impl& d = *impl_;
  const AdamWOptions& o = d.opt;
  const double lr = d.check_step(grads, args);
  d.frozen = true;
  if (!d.stager) d.stager = std::make_shared<detail::HostStager>();
  c10::NoGradGuard no_grad;
  const double norm = d.step_grad_norm(grads, args);

  StepResult r;
  r.lr = lr;
  r.grad_norm = norm;
  if (!std::isfinite(norm)) {
    ++d.skipped;
    ++d.consecutive;
    r.applied = false;
    r.step = d.step;
    r.consecutive_nonfinite = d.consecutive;
    r.skipped_total = d.skipped;
    TORCH_CHECK(d.consecutive <= o.max_consecutive_nonfinite, "PackedAdamW::step: ", d.consecutive,
                " consecutive steps with non-finite gradients (grad norm ", norm,
                "), more than AdamWOptions.max_consecutive_nonfinite = ",
                o.max_consecutive_nonfinite, "; the run is diverging or the loss is broken");
    return r;
  }
  double coef = 1.0;
  if (args.max_grad_norm > 0.0 && norm > args.max_grad_norm) {
    coef = args.max_grad_norm / (norm + 1e-6);
  }
  const int64_t t = d.step + 1;
  d.apply_updates(grads, detail::make_step_consts(o, args.grad_scale * coef, lr, t), t);
  d.step = t;
  d.prev_norm = norm;  // what an in-backward step after this one clips with
  d.consecutive = 0;
  r.applied = true;
  r.clip_coef = coef;
  r.step = d.step;
  r.consecutive_nonfinite = 0;
  r.skipped_total = d.skipped;
  return r;
}

// ---------------------------------------------------------------- in-backward steps

namespace detail {

// Moments written by an Adam step from zero state are m = (1 - beta1) g and v = (1 - beta2) g^2:
// the moments of the gradient c g are m c and v c^2. fp32 moments are scaled; int8/4-bit scale
// their fp32 block absmax (decoded = map entry x absmax, so every element scales); NVFP4 (E4M3
// scales) is decoded, scaled and re-encoded. One fp32 multiply per value on either device.
void scale_first_step_moments(std::vector<ParamState>& ps, double c) {
  c10::NoGradGuard no_grad;
  wait_for_host_moments(ps);
  const float cm = static_cast<float>(c), cv = static_cast<float>(c * c);
  for (ParamState& p : ps) {
    switch (p.info.mode) {
      case StateMode::kFp32:
        p.m32.mul_(cm);
        p.v32.mul_(cv);
        break;
      case StateMode::kInt8:
      case StateMode::k4Bit:
        p.m.scales.mul_(cm);
        p.v.scales.mul_(cv);
        break;
      case StateMode::kNvfp4:
        for (const Moment mom : {Moment::kFirst, Moment::kSecond}) {
          PackedMoment& q = mom == Moment::kFirst ? p.m : p.v;
          const float f = mom == Moment::kFirst ? cm : cv;
          const at::Tensor x = unpack_moment(q, p.info.mode, mom).mul_(f);
          const PackedMoment s = pack_moment(x, p.info.mode, mom);
          q.codes.copy_(s.codes);
          q.scales.copy_(s.scales);
        }
        break;
    }
  }
}

}  // namespace detail

void PackedAdamW::begin_step(const StepArgs& args) {
  Impl& d = *impl_;
  const AdamWOptions& o = d.opt;
  TORCH_CHECK(!d.in_step, "PackedAdamW::begin_step: the previous step was not ended");
  const double lr = std::isnan(args.lr) ? o.lr : args.lr;
  TORCH_CHECK(std::isfinite(lr) && lr >= 0.0,
              "PackedAdamW::begin_step: lr must be finite and >= 0, got ", lr);
  TORCH_CHECK(lr * o.weight_decay < 1.0, "PackedAdamW::begin_step: lr * weight_decay must be < 1");
  TORCH_CHECK(std::isfinite(args.grad_scale),
              "PackedAdamW::begin_step: grad_scale must be finite, got ", args.grad_scale);
  TORCH_CHECK(std::isfinite(args.max_grad_norm) && args.max_grad_norm >= 0.0,
              "PackedAdamW::begin_step: max_grad_norm must be finite and >= 0, got ",
              args.max_grad_norm);
  d.frozen = true;
  d.in_step = true;
  if (!d.stager) d.stager = std::make_shared<detail::HostStager>();
#if Q4_WITH_CUDA
  d.stager->begin(d.ps, d.staging_arena);
#endif
  d.cur_lr = lr;
  d.cur_grad_scale = args.grad_scale;
  d.cur_t = d.step + 1;
  // The clip coefficient of the previous step's norm: this step's is known only after every
  // gradient has been applied. Step 1 (no previous norm) is applied unclipped: Adam's first
  // update is m/sqrt(v) = sign(g) up to eps, whatever the gradient's scale; end_step() then
  // scales the moments it wrote (m by c, v by c^2: from zero state they are linear in g and g^2)
  // to those of the clipped gradient. Unclipped, the first v would hold (norm / max_norm)^2
  // times the clipped scale and shrink the next ~1/(1 - beta2) updates: on the tiny model the
  // loss at step 50 was 37% above the buffered run's (tests/convergence).
  d.cur_coef = 1.0;
  if (args.max_grad_norm > 0.0 && std::isfinite(d.prev_norm) && d.prev_norm > args.max_grad_norm) {
    d.cur_coef = args.max_grad_norm / (d.prev_norm + 1e-6);
  }
  d.cur_max_norm = args.max_grad_norm;
  d.cur_first_unclipped = d.cur_t == 1 && args.max_grad_norm > 0.0 && !std::isfinite(d.prev_norm);
  d.stepped.assign(d.ps.size(), 0);
  d.host_sumsq = 0.0;
  d.host_nonfinite = 0;
#if Q4_WITH_CUDA
  for (const auto& p : d.ps) {
    if (!p.info.device.is_cuda()) continue;
    const int64_t n = static_cast<int64_t>(d.ps.size());
    if (!d.partials.defined() || d.partials.size(0) != n || d.partials.device() != p.info.device) {
      const auto opt = at::TensorOptions().device(p.info.device);
      d.partials = at::empty({n, cuda::kSumsqPartials}, opt.dtype(at::kFloat));
      d.skip = at::empty({n}, opt.dtype(at::kInt));
    }
    d.partials.zero_();
    d.skip.zero_();
    break;
  }
#endif
}

void PackedAdamW::step_param(int64_t index, const at::Tensor& grad) {
  Impl& d = *impl_;
  const AdamWOptions& o = d.opt;
  TORCH_CHECK(d.in_step, "PackedAdamW::step_param: call begin_step() first");
  TORCH_CHECK(index >= 0 && index < static_cast<int64_t>(d.ps.size()),
              "PackedAdamW::step_param: no parameter ", index);
  TORCH_CHECK(!d.stepped[index], "PackedAdamW::step_param: parameter '", d.infos[index].name,
              "' was already updated in this step");
  detail::ParamState& p = d.ps[index];
  if (grad.defined()) {
    TORCH_CHECK(grad.numel() == p.flat.numel() && grad.device() == p.info.device &&
                    (grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kHalf ||
                     grad.scalar_type() == at::kBFloat16),
                "PackedAdamW::step_param: gradient of '", p.info.name,
                "' must match its master's numel and device and be fp32/fp16/bf16");
  }
  c10::NoGradGuard no_grad;
  d.stepped[index] = 1;
  const detail::StepConsts c =
      detail::make_step_consts(o, d.cur_grad_scale * d.cur_coef, d.cur_lr, d.cur_t);
  const bool decay = p.info.weight_decay && o.weight_decay > 0.0;
  const bool stochastic = o.rounding == MasterRounding::kStochastic;
  const uint32_t key = detail::sr_stream_key(o.seed, d.cur_t, p.info.stream_index);
  if (p.info.device.is_cuda()) {
#if Q4_WITH_CUDA
    c10::cuda::CUDAGuard guard(p.info.device);
    const auto stream = at::cuda::getCurrentCUDAStream();
    int32_t* flag = d.skip.data_ptr<int32_t>() + index;
    at::Tensor g = grad.defined() ? grad.contiguous() : grad;
    if (g.defined()) {
      float* parts = d.partials[index].data_ptr<float>();
      cuda::launch_sumsq(g.data_ptr(), detail::cuda_dtype(g.scalar_type()), g.numel(), parts,
                         stream);
      cuda::launch_nonfinite_flag(parts, cuda::kSumsqPartials, flag, stream);
    }
    const auto launch = [&](detail::ParamState& ps, const at::Tensor& gs) {
      detail::step_param_cuda(ps, gs, c, decay, stochastic, key, flag);
    };
    if (d.stager->applies(p, g)) {
      d.stager->update(p, g, index, launch, d.master_updated);
    } else {
      launch(p, g);
      if (d.master_updated) d.master_updated(index, p.master);
    }
#endif
    return;
  }
  if (grad.defined()) {
    int64_t chunk = std::max<int64_t>(1, o.chunk_rows * p.info.cols);
    const double ss = detail::global_sumsq({grad}, chunk, d.scratch, {});
    if (!std::isfinite(ss)) {
      ++d.host_nonfinite;
      d.host_sumsq = std::numeric_limits<double>::infinity();
      return;  // master and moments untouched
    }
    d.host_sumsq += ss;
  }
  detail::step_param_cpu(p, grad, c, decay, stochastic, key, o.chunk_rows, d.scratch);
  if (d.master_updated) d.master_updated(index, p.master);
}

StepResult PackedAdamW::end_step() {
  Impl& d = *impl_;
  const AdamWOptions& o = d.opt;
  TORCH_CHECK(d.in_step, "PackedAdamW::end_step: call begin_step() first");
  // Parameters no gradient reached: a zero gradient, as step() gives them.
  for (size_t i = 0; i < d.ps.size(); ++i) {
    if (!d.stepped[i]) step_param(static_cast<int64_t>(i), at::Tensor());
  }
  d.in_step = false;
#if Q4_WITH_CUDA
  d.stager->finish();
#endif
  double sumsq = d.host_sumsq;
  int64_t nonfinite = d.host_nonfinite;
  if (d.partials.defined()) {  // the step's one host wait
    c10::NoGradGuard no_grad;
    sumsq += d.partials.to(at::kDouble).sum().item<double>();
    nonfinite += d.skip.sum().item<int64_t>();
  }
  StepResult r;
  r.lr = d.cur_lr;
  r.grad_norm = std::sqrt(sumsq) * std::fabs(d.cur_grad_scale);
  r.clip_coef = d.cur_coef;
  if (nonfinite > 0) {
    // Every finite parameter was updated; the non-finite ones were not. The Adam step count
    // advances (those parameters' moments simply skipped one step).
    r.grad_norm = std::numeric_limits<double>::infinity();
    ++d.skipped;
    ++d.consecutive;
    d.step = d.cur_t;
    r.applied = false;
    r.step = d.step;
    r.consecutive_nonfinite = d.consecutive;
    r.skipped_total = d.skipped;
    TORCH_CHECK(d.consecutive <= o.max_consecutive_nonfinite,
                "PackedAdamW::end_step: ", d.consecutive,
                " consecutive steps with non-finite gradients (", nonfinite,
                " parameters this step), more than AdamWOptions.max_consecutive_nonfinite = ",
                o.max_consecutive_nonfinite, "; the run is diverging or the loss is broken");
    return r;
  }
  if (d.cur_first_unclipped && r.grad_norm > d.cur_max_norm) {
    r.clip_coef = d.cur_max_norm / (r.grad_norm + 1e-6);  // the buffered step's coefficient
    detail::scale_first_step_moments(d.ps, r.clip_coef);
  }
  d.prev_norm = r.grad_norm;
  d.step = d.cur_t;
  d.consecutive = 0;
  r.applied = true;
  r.step = d.step;
  r.consecutive_nonfinite = 0;
  r.skipped_total = d.skipped;
  return r;
}

void PackedAdamW::set_master_updated_hook(std::function<void(int64_t, const at::Tensor&)> hook) {
  impl_->master_updated = std::move(hook);
}

void PackedAdamW::set_staging_arena(const at::Tensor& arena) {
  TORCH_CHECK(!arena.defined() || (arena.is_cuda() && arena.dim() == 1 &&
                                   arena.scalar_type() == at::kByte && arena.is_contiguous()),
              "PackedAdamW::set_staging_arena: expected a contiguous 1-d uint8 CUDA tensor");
  impl_->staging_arena = arena;
}

bool PackedAdamW::in_step() const { return impl_->in_step; }
double PackedAdamW::previous_grad_norm() const { return impl_->prev_norm; }
void PackedAdamW::set_previous_grad_norm(double norm) { impl_->prev_norm = norm; }

}  // namespace q4::optim
