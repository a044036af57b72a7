// Gradient sync with one process: every parameter is this rank's, registered with the optimizer
// in model order with its model index as the rounding stream, and nothing is communicated. With
// two ranks (two threads over Gloo): steps whose master broadcasts overlap the next forward give
// one process's losses and masters, and every reader of masters waits for the broadcasts.
#include "q4/trainer/distributed/grad_sync.h"

#include <ATen/core/grad_mode.h>
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <fstream>
#include <functional>
#include <iterator>
#include <thread>

#include "component_fixtures.h"

using namespace q4;
using namespace q4::trainer;
using namespace q4::trainer::testing;

TEST(GradSync, OneProcessOwnsEverything) {
  auto model = tiny_model();
  const auto params = model.trainable_parameters();
  GradSync sync(nullptr, model, params);
  EXPECT_FALSE(sync.distributed());
  EXPECT_EQ(sync.params().size(), params.size());
  optim::PackedAdamW optimizer{optim::AdamWOptions{}};
  const auto index = sync.add_owned_params(optimizer);
  ASSERT_EQ(optimizer.num_params(), static_cast<int64_t>(params.size()));
  ASSERT_EQ(index.size(), params.size());
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_EQ(index.at(params[i]), static_cast<int64_t>(i));
    EXPECT_EQ(optimizer.params()[i].name, params[i]->name);
  }
  EXPECT_EQ(sync.ownership_summary(optimizer.num_params()), "");
  sync.broadcast_masters();  // nothing to broadcast
}

TEST(GradSync, OwnersSplitTheElements) {
  // The sharded layout the ranks agree on: every parameter has exactly one owner and the
  // elements are spread over the ranks.
  const std::vector<int64_t> numels = {1000, 10, 500, 500, 990, 20};
  const auto owners = assign_owners(numels, 2);
  ASSERT_EQ(owners.size(), numels.size());
  int64_t per_rank[2] = {0, 0};
  for (size_t i = 0; i < numels.size(); ++i) {
    ASSERT_TRUE(owners[i] == 0 || owners[i] == 1);
    per_rank[owners[i]] += numels[i];
  }
  EXPECT_GT(per_rank[0], 0);
  EXPECT_GT(per_rank[1], 0);
  EXPECT_EQ(assign_owners(numels, 2), owners);  // the same on every rank
}

// ---------------------------------------------------------------------------------------------
// Two ranks as two threads of this process, each with its own Gloo process group over localhost
// and its own copy of the model. The masters are bf16: Gloo carries them widened to fp32 and
// copies them back only when a broadcast is waited for, so a master read without its wait is
// deterministically the old value, and each test checks that it would see one.

namespace {

#if defined(Q4_HAVE_GLOO) && Q4_HAVE_GLOO
constexpr bool kGloo = true;
#else
constexpr bool kGloo = false;
#endif

// A free TCP port on 127.0.0.1 for the rendezvous (bound to port 0, read back, closed).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  if (fd >= 0) ::close(fd);
  return ok ? ntohs(a.sin_port) : 29517;
}

// `body(comm)` on ranks 0 and 1 at once; an exception on a rank is a failure naming it.
void on_two_ranks(const std::function<void(DistComm&)>& body) {
  const int port = free_port();
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&body, port, r] {
      try {
        WorldInfo w;
        w.rank = r;
        w.world_size = 2;
        w.local_rank = r;
        w.master_port = port;
        auto comm = DistComm::connect(w, at::Device(at::kCPU), std::chrono::seconds(60));
        body(*comm);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "rank " << r << ": " << e.what();
      }
    });
  }
  for (auto& t : ranks) t.join();
}

// The tiny model with bf16 masters (bf16 gradients), every tensor trainable, checkpointing on
// (a layer's recompute in the backward reads its masters again). Every call gives the same
// masters.
model::Qwen3Model bf16_model() {
  model::ModelOptions o = tiny_fp32_options();
  o.master_dtype = at::kBFloat16;
  o.grad_dtype.reset();  // the default for bf16 masters
  o.gradient_checkpointing = true;
  return tiny_model_with(o, /*seed=*/7, 0.02);
}

std::vector<at::Tensor> trainable_masters(model::Qwen3Model& m) {
  std::vector<at::Tensor> out;
  for (auto* p : m.trainable_parameters()) out.push_back(p->master.clone());
  return out;
}

// The two-rank step tests' run: kSteps steps over 8 random rows of 12 tokens, 2 a micro-batch
// (each rank takes one micro-batch of a step; one process with grad_accum 2 takes both).
constexpr int kSteps = 3;

std::unique_ptr<data::Batcher> step_batcher(const model::Qwen3Model& m) {
  return random_batcher(8, 12, m.config().vocab_size, /*batch_size=*/2);
}

// The reference: one process with grad_accum 2 steps `m`; after_step(s) runs after step s.
std::vector<StepOutcome> one_process_steps(model::Qwen3Model& m,
                                           const std::function<void(int)>& after_step = {}) {
  SupervisedCrossEntropy ce;
  StepRig rig(cpu_config("unused", /*grad_accum=*/2), m, ce);
  auto batcher = step_batcher(m);
  std::vector<StepOutcome> out;
  for (int s = 0; s < kSteps; ++s) {
    out.push_back(rig.step->run(s, *batcher));
    if (after_step) after_step(s);
  }
  return out;
}

void expect_masters_equal(const std::vector<at::Tensor>& got, const std::vector<at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_TRUE(at::equal(got[i], want[i])) << "tensor " << i;
  }
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

// Two ranks with grad_accum 1 against one process with grad_accum 2 (the same global batch, the
// same micro-batches), three steps through the one step function. Each step returns with its
// master broadcasts in flight and the next step's forward waits for each master right before
// using it: the losses are the one process's (the loss read-out adds two fp32 sums in double:
// ~1e-8 relative apart) and the trained masters are identical bit for bit (bf16 gradients: the
// reduction adds the same two addends the one process adds). Stale masters in a forward would
// move the next loss by far more and change the masters.
TEST(GradSync, TwoRankStepsWithOverlappedBroadcastsEqualOneProcess) {
  if (!kGloo) GTEST_SKIP() << "q4_trainer was built without Gloo: no CPU ranks";
  auto one = bf16_model();
  std::vector<at::Tensor> want_after_first;
  const std::vector<StepOutcome> want = one_process_steps(one, [&](int s) {
    if (s == 0) want_after_first = trainable_masters(one);
  });
  const auto want_masters = trainable_masters(one);

  struct RankResult {
    std::vector<StepOutcome> got;
    std::vector<int64_t> in_flight;  // after each step
    int64_t in_flight_after_read = -1;
    int64_t stale_after_first = 0;  // masters that still held their old value after step 1
    std::vector<at::Tensor> masters;
  };
  RankResult res[2];
  on_two_ranks([&](DistComm& comm) {
    RankResult& out = res[comm.rank()];
    auto m = bf16_model();
    SupervisedCrossEntropy ce;
    StepRig rig(cpu_config("unused", /*grad_accum=*/1), m, ce, /*in_backward=*/false, &comm);
    const auto params = rig.sync.params();
    auto batcher = step_batcher(m);
    for (int s = 0; s < kSteps; ++s) {
      out.got.push_back(rig.step->run(s, *batcher));
      out.in_flight.push_back(rig.sync.masters_in_flight());
      if (s == 0) {
        // Read past the fence (raw pointers): what a reader without a wait would see.
        for (size_t i = 0; i < params.size(); ++i) {
          out.stale_after_first += !at::equal(params[i]->master, want_after_first[i]);
        }
      }
    }
    out.masters = trainable_masters(m);  // the accessor waits for the last step's broadcasts
    out.in_flight_after_read = rig.sync.masters_in_flight();
  });
  for (int r = 0; r < 2; ++r) {
    SCOPED_TRACE("rank " + std::to_string(r));
    const RankResult& got = res[r];
    ASSERT_EQ(got.got.size(), want.size());
    EXPECT_GT(got.stale_after_first, 0) << "the test cannot see a master read without its wait";
    for (size_t s = 0; s < want.size(); ++s) {
      EXPECT_EQ(got.in_flight[s], static_cast<int64_t>(want_masters.size()))
          << "step " << s + 1 << " returns with every broadcast in flight";
      EXPECT_EQ(got.got[s].supervised, want[s].supervised);
      EXPECT_TRUE(got.got[s].res.applied);
      EXPECT_NEAR(got.got[s].loss, want[s].loss, 1e-6 * want[s].loss) << "step " << s + 1;
    }
    EXPECT_EQ(got.in_flight_after_read, 0);
    expect_masters_equal(got.masters, want_masters);
  }
}

// model.forward_weights kept and codes on two ranks: each rank refreshes a master's forward
// weight once its broadcast is waited for (before the forward's first use), so the losses and
// masters are those of one process fake-quantizing its masters in every forward.
TEST(GradSync, KeptForwardWeightsFollowTheBroadcasts) {
  if (!kGloo) GTEST_SKIP() << "q4_trainer was built without Gloo: no CPU ranks";
  auto one = bf16_model();
  const std::vector<StepOutcome> want = one_process_steps(one);
  const auto want_masters = trainable_masters(one);
  for (const auto mode : {model::ForwardWeights::kKept, model::ForwardWeights::kCodes}) {
    std::vector<StepOutcome> got[2];
    std::vector<at::Tensor> got_masters[2];
    on_two_ranks([&](DistComm& comm) {
      auto m = bf16_model();
      m.set_forward_weights(mode);
      SupervisedCrossEntropy ce;
      StepRig rig(cpu_config("unused", /*grad_accum=*/1), m, ce, /*in_backward=*/false, &comm);
      auto batcher = step_batcher(m);
      for (int s = 0; s < kSteps; ++s) got[comm.rank()].push_back(rig.step->run(s, *batcher));
      got_masters[comm.rank()] = trainable_masters(m);
    });
    for (int r = 0; r < 2; ++r) {
      SCOPED_TRACE(std::string(io::enum_name(mode)) + " rank " + std::to_string(r));
      ASSERT_EQ(got[r].size(), want.size());
      for (size_t s = 0; s < want.size(); ++s) {
        EXPECT_NEAR(got[r][s].loss, want[s].loss, 1e-6 * want[s].loss) << "step " << s + 1;
      }
      expect_masters_equal(got_masters[r], want_masters);
    }
  }
}

// Every reader of masters other than the forward waits for all broadcasts in flight first: the
// export, the export check, the parameter accessors and wait_masters() itself. Each round, every
// owner changes its masters (the optimizer's part), every rank applies the same change to a
// reference model, and the owners' broadcasts are left in flight before the reader runs.
TEST(GradSync, EveryOtherReaderOfMastersWaitsForTheBroadcasts) {
  if (!kGloo) GTEST_SKIP() << "q4_trainer was built without Gloo: no CPU ranks";
  ComponentTempDir tmp;
  on_two_ranks([&](DistComm& comm) {
    const std::string rank = std::to_string(comm.rank());
    auto m = bf16_model();
    auto ref = bf16_model();
    const auto params = m.trainable_parameters();
    const auto ref_params = ref.trainable_parameters();
    const std::string source = (tmp.path / ("source" + rank + ".dat")).string();
    model::write_dat(m, source, /*quantize_lm_head=*/true);
    GradSync sync(&comm, m, params);
    optim::PackedAdamW optimizer{optim::AdamWOptions{}};
    const auto owned = sync.add_owned_params(optimizer);
    ASSERT_FALSE(owned.empty());
    ASSERT_LT(owned.size(), params.size());
    int round = 0;
    const auto update = [&] {
      ++round;
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < params.size(); ++i) {
        const double d = 0.125 * round * (i % 2 == 0 ? 1 : -1);
        ref_params[i]->master.add_(d);
        if (owned.count(params[i])) params[i]->master.add_(d);
      }
      sync.broadcast_masters();
      ASSERT_EQ(sync.masters_in_flight(), static_cast<int64_t>(params.size()));
      int64_t stale = 0;
      for (size_t i = 0; i < params.size(); ++i) {
        stale += !at::equal(params[i]->master, ref_params[i]->master);
      }
      ASSERT_GT(stale, 0) << "the test cannot see a master read without its wait";
    };
    const auto all_current = [&](const char* reader) {
      EXPECT_EQ(sync.masters_in_flight(), 0) << reader;
      for (size_t i = 0; i < params.size(); ++i) {
        EXPECT_TRUE(at::equal(params[i]->master, ref_params[i]->master))
            << reader << ": " << params[i]->name;
      }
    };

    update();
    const std::string out = (tmp.path / ("export" + rank + ".dat")).string();
    const std::string out_ref = (tmp.path / ("export_ref" + rank + ".dat")).string();
    m.export_to(model::DatReader(source), out);
    all_current("export_to");
    ref.export_to(model::DatReader(source), out_ref);
    EXPECT_EQ(file_bytes(out), file_bytes(out_ref));

    update();
    ref.export_to(model::DatReader(source), out_ref);
    EXPECT_EQ(m.compare_forward_weights(model::DatReader(out_ref)),
              ref.compare_forward_weights(model::DatReader(out_ref)));
    all_current("compare_forward_weights");

    update();
    (void)m.parameters();
    all_current("parameters()");

    update();
    (void)m.parameter("lm_head.weight");
    all_current("parameter()");

    update();
    sync.wait_masters();
    all_current("wait_masters()");
  });
}

// Gradients reduced in buckets (one flat tensor per bucket) sum to the same bits as one reduce
// per gradient, whether they come from the backward one by one (grad_accum 1) or all at the end
// of the step, with fewer collectives; each rank's gradients differ (seeded by rank), some
// parameters get none on one rank (zeros), and the bucket size splits the tiny model's tensors
// into several buckets per owner.
TEST(GradSync, BucketedReducesEqualOneReducePerGradient) {
  if (!kGloo) GTEST_SKIP() << "q4_trainer was built without Gloo: no CPU ranks";
  struct RankResult {
    std::vector<at::Tensor> per_tensor, bucketed;
    int64_t per_tensor_reduces = 0, bucketed_reduces = 0;
  };
  RankResult res[2];
  on_two_ranks([&](DistComm& comm) {
    RankResult& out = res[comm.rank()];
    auto m = bf16_model();
    const auto params = m.trainable_parameters();
    at::Generator gen = at::detail::createCPUGenerator(100 + static_cast<uint64_t>(comm.rank()));
    std::vector<at::Tensor> grads;
    for (size_t i = 0; i < params.size(); ++i) {
      const bool none = comm.rank() == 1 && i % 5 == 2;  // never reached the loss here
      grads.push_back(none ? at::Tensor()
                           : at::randn(params[i]->master.sizes(), gen).to(at::kBFloat16));
    }
    const auto reduce = [&](int64_t bucket_bytes, bool from_backward, int64_t* launched) {
      GradSync sync(&comm, m, params, bucket_bytes);
      optim::PackedAdamW optimizer{optim::AdamWOptions{}};
      sync.add_owned_params(optimizer);
      sync.begin_step();
      for (size_t k = 0; k < params.size(); ++k) {
        const size_t i = params.size() - 1 - k;  // the backward's order
        params[i]->grad = grads[i].defined() ? grads[i].clone() : at::Tensor();
        if (from_backward) {
          sync.on_gradient(*params[i]);
          params[i]->grad = at::Tensor();  // freed by the model after the hook
        }
      }
      std::vector<at::Tensor> got = sync.finish_step(optimizer.num_params());
      *launched = sync.reduces_launched();
      for (auto& g : got) g = g.clone();
      return got;
    };
    for (const bool from_backward : {true, false}) {
      out.per_tensor = reduce(/*bucket_bytes=*/0, from_backward, &out.per_tensor_reduces);
      out.bucketed = reduce(/*bucket_bytes=*/16384, from_backward, &out.bucketed_reduces);
      SCOPED_TRACE(from_backward ? "from the backward" : "after the step");
      EXPECT_EQ(out.per_tensor_reduces, static_cast<int64_t>(params.size()));
      EXPECT_LT(out.bucketed_reduces, out.per_tensor_reduces);
      EXPECT_GT(out.bucketed_reduces, 2) << "several buckets per owner";
      ASSERT_EQ(out.per_tensor.size(), out.bucketed.size());
      for (size_t i = 0; i < out.per_tensor.size(); ++i) {
        EXPECT_TRUE(at::equal(out.per_tensor[i], out.bucketed[i])) << "owned tensor " << i;
      }
    }
  });
  EXPECT_FALSE(res[0].bucketed.empty());
  EXPECT_FALSE(res[1].bucketed.empty());
}
