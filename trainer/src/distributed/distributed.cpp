// c10d behind DistComm: a TCPStore rendezvous (rank 0 serves it) and ProcessGroupNCCL (CUDA,
// LibTorch 2.x wheels ship it with NCCL) or ProcessGroupGloo (CPU; Debian's LibTorch 1.13 with
// libgloo-dev). The backends' base class differs between LibTorch versions (ProcessGroup in 1.x,
// Backend in 2.x); both have the same collective signatures, which is all this file uses. Also
// the local launcher behind `q4train --nproc N`.
#include "q4/trainer/distributed/distributed.h"

#include <ATen/ATen.h>
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <torch/version.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <numeric>
#include <stdexcept>
#include <thread>

#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#if defined(Q4_HAVE_NCCL) && Q4_HAVE_NCCL
#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#endif
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include "q4/model/dat_file.h"
#include "q4/model/hf_interop.h"
#include "q4/trainer/config/config.h"

#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace q4::trainer {
namespace {

#if TORCH_VERSION_MAJOR >= 2
using PgBase = c10d::Backend;
#else
using PgBase = c10d::ProcessGroup;
#endif

// An environment variable as an int in [lo, hi]; `fallback` when unset.
int env_int(const char* name, int fallback, int lo, int hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  errno = 0;
  const long x = std::strtol(v, &end, 10);
  if (errno != 0 || end == v || *end != '\0' || x < lo || x > hi) {
    throw ConfigError(
        fmt::format("environment variable {}={} is not an integer in [{}, {}]", name, v, lo, hi));
  }
  return static_cast<int>(x);
}

std::string rank_prefix(int rank) { return fmt::format("distributed (rank {}): ", rank); }

}  // namespace

WorldInfo world_from_env() {
  WorldInfo w;
  const bool has_world = std::getenv("WORLD_SIZE") != nullptr;
  const bool has_rank = std::getenv("RANK") != nullptr;
  if (!has_world && !has_rank) return w;
  if (has_world != has_rank) {
    throw ConfigError(std::string("environment: ") + (has_world ? "WORLD_SIZE" : "RANK") +
                      " is set but " + (has_world ? "RANK" : "WORLD_SIZE") +
                      " is not (launch with torchrun, or q4train --nproc N)");
  }
  w.world_size = env_int("WORLD_SIZE", 1, 1, 1 << 20);
  w.rank = env_int("RANK", 0, 0, w.world_size - 1);
  w.local_rank = env_int("LOCAL_RANK", w.rank, 0, w.world_size - 1);
  if (const char* a = std::getenv("MASTER_ADDR"); a != nullptr && *a != '\0') w.master_addr = a;
  w.master_port = env_int("MASTER_PORT", 29500, 1, 65535);
  if (w.world_size > 1 && std::getenv("MASTER_ADDR") == nullptr) {
    throw ConfigError(
        "environment: WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT (torchrun "
        "sets them; q4train --nproc N does too)");
  }
  return w;
}

std::string dist_backend_for(const at::Device& device) {
  if (device.is_cuda()) {
#if defined(Q4_HAVE_NCCL) && Q4_HAVE_NCCL
    return "nccl";
#else
    return "";
#endif
  }
#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
  return "gloo";
#else
  return "";
#endif
}

// ------------------------------------------------------------------------------ DistWork

struct DistWork::Impl {
  c10::intrusive_ptr<c10d::Work> work;
  int rank = 0;
  std::string what;
  std::function<void()>
      after;  // runs once the collective is done (e.g. copy a widened result back)
};

DistWork::DistWork() = default;
DistWork::~DistWork() = default;
DistWork::DistWork(DistWork&&) noexcept = default;
DistWork& DistWork::operator=(DistWork&&) noexcept = default;

bool DistWork::pending() const { return impl_ && impl_->work; }

bool DistWork::done() const {
  if (!pending()) return true;
  try {
    return impl_->work->isCompleted();
  } catch (const std::exception&) {
    return true;  // wait() reports the error
  }
}

void DistWork::wait() {
  if (!pending()) return;
  try {
    impl_->work->wait();
  } catch (const c10::Error& e) {
    throw std::runtime_error(rank_prefix(impl_->rank) + impl_->what +
                             " failed: " + e.what_without_backtrace() +
                             " (another rank died or hung; see its output)");
  } catch (const std::exception& e) {
    throw std::runtime_error(rank_prefix(impl_->rank) + impl_->what + " failed: " + e.what() +
                             " (another rank died or hung; see its output)");
  }
  impl_->work.reset();
  if (impl_->after) {
    impl_->after();
    impl_->after = nullptr;
  }
}

// ------------------------------------------------------------------------------ DistComm

struct DistComm::Impl {
  WorldInfo world;
  std::string backend;
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<PgBase> pg;
#if defined(Q4_HAVE_NCCL) && Q4_HAVE_NCCL
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> nccl;
#endif
  at::Device device = at::kCPU;

  DistWork wrap(c10::intrusive_ptr<c10d::Work> w, const char* what,
                std::function<void()> after = nullptr) {
    DistWork d;
    d.impl_ = std::make_unique<DistWork::Impl>();
    d.impl_->work = std::move(w);
    d.impl_->rank = world.rank;
    d.impl_->what = what;
    d.impl_->after = std::move(after);
    return d;
  }

  // Gloo has no bf16: such a tensor travels as fp32 (exact for a copy; a sum of two bf16 values
  // rounded back to bf16 equals their bf16 addition) and is copied back after the collective.
  bool widen(const at::Tensor& t) const {
    return backend == "gloo" && t.scalar_type() == at::kBFloat16;
  }

  template <class F>
  auto guarded(const char* what, F&& fn) -> decltype(fn()) {
    try {
      return fn();
    } catch (const c10::Error& e) {
      throw std::runtime_error(rank_prefix(world.rank) + what +
                               " failed: " + e.what_without_backtrace());
    }
  }
  // The collective `start(v)` on the one-tensor list v of `t` as the backend carries it (widen);
  // a widened result is copied back into `t` once the collective is done.
  template <class Start>
  DistWork run_widened(const char* what, const at::Tensor& t, Start&& start) {
    return guarded(what, [&] {
      const bool wide = widen(t);
      const at::Tensor x = wide ? t.to(at::kFloat) : t;
      std::vector<at::Tensor> v{x};
      std::function<void()> after;
      if (wide) after = [t, x] { t.copy_(x); };
      return wrap(start(v), what, std::move(after));
    });
  }
};

DistComm::DistComm() : impl_(std::make_unique<Impl>()) {}

DistComm::~DistComm() {
#if defined(Q4_HAVE_NCCL) && Q4_HAVE_NCCL && TORCH_VERSION_MAJOR >= 2
  // NCCL communicators are torn down explicitly (LibTorch warns about a leak otherwise).
  if (impl_ && impl_->nccl) {
    try {
      impl_->nccl->shutdown();
    } catch (const std::exception&) {
    }
  }
#endif
}

std::unique_ptr<DistComm> DistComm::connect(const WorldInfo& world, const at::Device& device,
                                            std::chrono::milliseconds timeout) {
  const std::string backend = dist_backend_for(device);
  if (backend.empty()) {
    throw ConfigError(fmt::format(
        "WORLD_SIZE={} needs a {} process group, which this build of q4train lacks ({}); rebuild "
        "with {}",
        world.world_size, device.is_cuda() ? "NCCL" : "Gloo",
        device.is_cuda() ? "no nccl.h was found at configure time"
                         : "no gloo headers were found at configure time",
        device.is_cuda() ? "a LibTorch that ships NCCL (the pip wheel) and its nvidia-nccl headers"
                         : "libgloo-dev installed (tools/bootstrap.sh does it)"));
  }
#if defined(Q4_WITH_CUDA) && Q4_WITH_CUDA
  // NCCL and every tensor created without an explicit index use this rank's GPU.
  if (device.is_cuda() && device.has_index()) c10::cuda::set_device(device.index());
#endif
  std::unique_ptr<DistComm> c(new DistComm());
  Impl& d = *c->impl_;
  d.world = world;
  d.backend = backend;
  d.device = device;
  const char* phase = "rendezvous";
  try {
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(world.master_port);
    so.isServer = world.rank == 0;
    so.numWorkers = static_cast<std::size_t>(world.world_size);
    so.waitWorkers = true;
    so.timeout = timeout;
    d.store = c10::make_intrusive<c10d::TCPStore>(world.master_addr, so);
    phase = "process group creation";
#if defined(Q4_HAVE_NCCL) && Q4_HAVE_NCCL
    if (device.is_cuda()) {
      auto opts = c10d::ProcessGroupNCCL::Options::create();
      opts->timeout = timeout;
      d.nccl =
          c10::make_intrusive<c10d::ProcessGroupNCCL>(d.store, world.rank, world.world_size, opts);
      d.pg = d.nccl;
    }
#endif
#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
    if (!device.is_cuda()) {
      auto opts = c10d::ProcessGroupGloo::Options::create(timeout);
      const char* ifname = std::getenv("GLOO_SOCKET_IFNAME");
      if (ifname != nullptr && *ifname != '\0') {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(ifname));
      } else if (world.master_addr == "127.0.0.1" || world.master_addr == "localhost") {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1"));
      } else {
        opts->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
      }
      opts->threads = 2;
      d.pg =
          c10::make_intrusive<c10d::ProcessGroupGloo>(d.store, world.rank, world.world_size, opts);
    }
#endif
  } catch (const c10::Error& e) {
    throw std::runtime_error(fmt::format(
        "{}{} with {}:{} failed after at most {} s: {} (did every rank start? check the other "
        "ranks' output, MASTER_ADDR/MASTER_PORT and that the port is free)",
        rank_prefix(world.rank), phase, world.master_addr, world.master_port,
        std::chrono::duration_cast<std::chrono::seconds>(timeout).count(),
        e.what_without_backtrace()));
  } catch (const std::exception& e) {
    throw std::runtime_error(fmt::format("{}{} with {}:{} failed: {}", rank_prefix(world.rank),
                                         phase, world.master_addr, world.master_port, e.what()));
  }
  TORCH_CHECK(d.pg, "no process group was created for backend ", backend);
  return c;
}

int DistComm::rank() const { return impl_->world.rank; }
int DistComm::world_size() const { return impl_->world.world_size; }
const std::string& DistComm::backend() const { return impl_->backend; }

DistWork DistComm::reduce_sum(const at::Tensor& t, int root) {
  return impl_->run_widened("reduce", t, [&](std::vector<at::Tensor>& v) {
    c10d::ReduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    o.rootRank = root;
    return impl_->pg->reduce(v, o);
  });
}

DistWork DistComm::broadcast(const at::Tensor& t, int root) {
  return impl_->run_widened("broadcast", t, [&](std::vector<at::Tensor>& v) {
    c10d::BroadcastOptions o;
    o.rootRank = root;
    return impl_->pg->broadcast(v, o);
  });
}

void DistComm::allreduce_sum(const at::Tensor& t) {
  DistWork w = impl_->guarded("allreduce", [&] {
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = c10d::ReduceOp::SUM;
    return impl_->wrap(impl_->pg->allreduce(v, o), "allreduce");
  });
  w.wait();
}

double DistComm::allreduce_sum(double value) {
  at::Tensor t = at::full({1}, value, at::TensorOptions().dtype(at::kDouble).device(impl_->device));
  allreduce_sum(t);
  return t.cpu().item<double>();
}

void DistComm::barrier() {
  DistWork w = impl_->guarded("barrier", [&] {
    c10d::BarrierOptions o;
    return impl_->wrap(impl_->pg->barrier(o), "barrier");
  });
  w.wait();
  // NCCL's barrier only orders the device streams; a host-side barrier must also wait for it.
  if (impl_->device.is_cuda()) {
    at::Tensor t = at::zeros({1}, at::TensorOptions().device(impl_->device));
    allreduce_sum(t);
    (void)t.cpu();
  }
}

// ------------------------------------------------------------------------------ owners

std::vector<int> assign_owners(const std::vector<int64_t>& numels, int world_size) {
  std::vector<int> owner(numels.size(), 0);
  if (world_size <= 1) return owner;
  std::vector<size_t> order(numels.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return numels[a] > numels[b]; });
  std::vector<int64_t> load(static_cast<size_t>(world_size), 0);
  for (size_t i : order) {
    const auto r = static_cast<size_t>(std::min_element(load.begin(), load.end()) - load.begin());
    owner[i] = static_cast<int>(r);
    load[r] += numels[i];
  }
  return owner;
}

// ------------------------------------------------------------------------------ launcher

namespace {

volatile sig_atomic_t g_launcher_signal = 0;
extern "C" void q4_launcher_on_signal(int sig) { g_launcher_signal = sig; }

// A free TCP port on 127.0.0.1 (bound to port 0, read back, closed).
int free_local_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) throw std::runtime_error(std::string("--nproc: socket: ") + std::strerror(errno));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const std::string msg = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error("--nproc: cannot find a free local port: " + msg);
  }
  const int port = ntohs(a.sin_port);
  ::close(fd);
  return port;
}

std::string self_exe() {
  char buf[4096];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) throw std::runtime_error("--nproc: cannot read /proc/self/exe");
  buf[n] = '\0';
  return buf;
}

}  // namespace

void check_inputs_before_launch(const ModelConfig& m) {
  if (m.init != InitKind::kFile || model::is_hf_folder(m.weights)) return;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(m.weights, ec)) {
    throw ConfigError("config key model.weights: file not found: " + m.weights);
  }
  try {
    const model::DatReader r(m.weights);  // indexes the header: sizes against the file
  } catch (const c10::Error& e) {
    throw ConfigError("config key model.weights: " + std::string(e.what_without_backtrace()));
  }
}

int launch_local_ranks(int nproc, const std::vector<std::string>& argv,
                       std::chrono::seconds grace) {
  const std::string exe = self_exe();
  const int port = free_local_port();
  struct sigaction sa {};
  sa.sa_handler = q4_launcher_on_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);

  std::vector<pid_t> pids(static_cast<size_t>(nproc), -1);
  for (int r = 0; r < nproc; ++r) {
    const pid_t pid = ::fork();
    if (pid < 0) throw std::runtime_error(std::string("--nproc: fork: ") + std::strerror(errno));
    if (pid == 0) {
      // The ranks get their own process group: a terminal's Ctrl-C reaches the launcher only,
      // which forwards one signal to each rank (a rank stops at its second signal).
      ::setpgid(0, 0);
      ::setenv("RANK", std::to_string(r).c_str(), 1);
      ::setenv("LOCAL_RANK", std::to_string(r).c_str(), 1);
      ::setenv("WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("LOCAL_WORLD_SIZE", std::to_string(nproc).c_str(), 1);
      ::setenv("MASTER_ADDR", "127.0.0.1", 1);
      ::setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      std::vector<char*> args;
      args.push_back(const_cast<char*>(exe.c_str()));
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(exe.c_str(), args.data());
      std::fprintf(stderr, "q4train: error: --nproc: cannot start rank %d: %s\n", r,
                   std::strerror(errno));
      ::_exit(127);
    }
    pids[static_cast<size_t>(r)] = pid;
  }

  int first_failure = 0;
  int failed_rank = -1;
  int alive = nproc;
  bool forwarded = false;
  auto kill_all = [&](int sig) {
    for (pid_t p : pids) {
      if (p > 0) ::kill(p, sig);
    }
  };
  std::chrono::steady_clock::time_point kill_deadline{};
  bool terminating = false;
  while (alive > 0) {
    if (g_launcher_signal != 0 && !forwarded) {
      kill_all(g_launcher_signal);
      forwarded = true;
    }
    int status = 0;
    const pid_t pid = ::waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      const auto it = std::find(pids.begin(), pids.end(), pid);
      if (it == pids.end()) continue;
      const int r = static_cast<int>(it - pids.begin());
      *it = -1;
      --alive;
      const int code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      if (code != 0 && first_failure == 0 && !terminating) {
        first_failure = code;
        failed_rank = r;
        if (alive > 0) {
          std::fprintf(stderr,
                       "q4train: error: rank %d exited with code %d; the other %d rank(s) get %lld "
                       "s to fail on their own, then are killed\n",
                       r, code, alive, static_cast<long long>(grace.count()));
        }
        // The others are stuck in (or about to fail) a collective that needs the dead rank: no
        // graceful stop is possible, so they are killed after a short grace to print their own
        // errors (every file they write is atomic).
        terminating = true;
        kill_deadline = std::chrono::steady_clock::now() + grace;
      }
      continue;
    }
    if (terminating && std::chrono::steady_clock::now() > kill_deadline) {
      kill_all(SIGKILL);
      kill_deadline = std::chrono::steady_clock::now() + std::chrono::hours(24);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (first_failure != 0) {
    std::fprintf(stderr, "q4train: error: rank %d of %d failed with exit code %d\n", failed_rank,
                 nproc, first_failure);
  }
  return first_failure;
}

}  // namespace q4::trainer
