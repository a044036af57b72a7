// GRPO's rollouts as a batch source; see rollout_source.h.
#include "q4/trainer/step/rollout_source.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>

#include "q4/model/sampling.h"
#include "q4/trainer/objectives/grpo.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/memory.h"
#include "q4/trainer/runtime/nvtx.h"

namespace q4::trainer {
namespace rollout_detail {

// splitmix64: the sampler's seed of generation batch `index` (any seed, any index: distinct).
uint64_t generation_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9E3779B97F4A7C15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// The longest reward error message shared between ranks, in bytes.
constexpr int64_t kErrorBytes = 1024;

std::string prompt_as_given(const data::PromptRecord& r) {
  return r.prompt.is_string() ? r.prompt.get<std::string>() : r.prompt.dump();
}

// What a rollout may keep of the linears' forward weights (Qwen3Model::InferenceWeights): half
// the device memory free now (the KV cache and the logits need the rest); 2 GiB on the CPU.
int64_t inference_weight_budget_for(const c10::Device& device) {
  if (!device.is_cuda()) return int64_t{2} << 30;
  const MemorySnapshot m = memory_snapshot(device);
  if (!m.device_total_bytes || !m.device_used_bytes) return 0;
  const int64_t cached_free = m.reserved_bytes && m.allocated_bytes
                                  ? *m.reserved_bytes - *m.allocated_bytes
                                  : 0;
  return std::max<int64_t>(0, (*m.device_total_bytes - *m.device_used_bytes + cached_free) / 2);
}

// The sampler's generators of rows [first, first + n) of generation batch `index`: row i's seed
// mixes the batch's seed with i, so a row draws the same in any batch and on any rank.
std::vector<at::Generator> row_generators(uint64_t seed, uint64_t index, int64_t first,
                                          int64_t n) {
  const uint64_t batch = generation_seed(seed, index);
  std::vector<at::Generator> gens;
  gens.reserve(static_cast<size_t>(n));
  for (int64_t i = first; i < first + n; ++i) {
    gens.push_back(at::make_generator<at::CPUGeneratorImpl>(
        generation_seed(batch, static_cast<uint64_t>(i))));
  }
  return gens;
}

// Every rank's rows of `mine` (R, C) double, rank r's at rows [r R, (r + 1) R): each rank's in
// its place, zeros elsewhere, summed over the ranks (x + 0 is exact). On the host.
at::Tensor gather_rows(DistComm* comm, const at::Tensor& mine, const at::Device& device) {
  if (comm == nullptr) return mine;
  const int64_t R = mine.size(0);
  at::Tensor all = at::zeros({R * comm->world_size(), mine.size(1)},
                             at::TensorOptions().dtype(at::kDouble).device(device));
  all.narrow(0, R * comm->rank(), R).copy_(mine);
  comm->allreduce_sum(all);
  return all.cpu();
}

// The first failing rank's error on every rank ("" when no rank's `mine` is set): which ranks
// failed (one allreduce), then, only when one did, that rank's message (one broadcast).
std::string first_error(DistComm& comm, const std::string& mine, const at::Device& device) {
  const auto opt = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor failed = at::zeros({comm.world_size()}, opt);
  if (!mine.empty()) failed[comm.rank()].fill_(1.0);
  comm.allreduce_sum(failed);
  const at::Tensor h = failed.cpu();
  int root = -1;
  for (int r = 0; r < comm.world_size() && root < 0; ++r) {
    if (h.data_ptr<double>()[r] > 0) root = r;
  }
  if (root < 0) return "";
  if (root == comm.rank()) {
    at::Tensor text = at::zeros({kErrorBytes}, at::kInt);
    for (size_t i = 0; i < std::min<size_t>(mine.size(), kErrorBytes); ++i) {
      text.data_ptr<int32_t>()[i] = static_cast<unsigned char>(mine[i]);
    }
    comm.broadcast(text.to(device), root).wait();
    return mine;
  }
  const at::Tensor text = at::zeros({kErrorBytes}, at::TensorOptions().dtype(at::kInt).device(device));
  comm.broadcast(text, root).wait();
  const at::Tensor th = text.cpu();
  std::string msg;
  for (int64_t i = 0; i < kErrorBytes && th.data_ptr<int32_t>()[i] != 0; ++i) {
    msg.push_back(static_cast<char>(th.data_ptr<int32_t>()[i]));
  }
  return msg + " (on rank " + std::to_string(root) + ")";
}

}  // namespace rollout_detail

using rollout_detail::first_error;
using rollout_detail::gather_rows;
using rollout_detail::generation_seed;
using rollout_detail::row_generators;
using rollout_detail::inference_weight_budget_for;
using rollout_detail::prompt_as_given;

RolloutSource::RolloutSource(RolloutPlan plan, model::Qwen3Model& model, const at::Device& device,
                             const data::Tokenizer& tokenizer,
                             const std::vector<data::PromptRecord>& prompts,
                             const std::vector<std::string>& origins, data::Batcher& order,
                             Rewards& rewards, DistComm* comm)
    : p_(std::move(plan)),
      model_(model),
      device_(device),
      tok_(tokenizer),
      prompts_(prompts),
      origins_(origins),
      order_(order),
      rewards_(rewards),
      comm_(comm) {
  TORCH_CHECK(origins.size() == prompts.size() &&
                  order.num_examples() == static_cast<int64_t>(prompts.size()),
              "RolloutSource: the prompt order must hold every prompt once");
  fields_.reserve(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    check_grpo_prompt_length(static_cast<int64_t>(prompts[i].prompt_ids.size()),
                             p_.grpo.max_completion_length, p_.seq_len, origins[i]);
    fields_.push_back(nlohmann::json::parse(prompts[i].fields.dump()));
    rewards.check_example(fields_.back(), origins[i]);
  }
}

int64_t RolloutSource::generations() const { return order_.state().batches; }

bool RolloutSource::at_generation_boundary() const {
  return micro_.empty() ||
         (next_micro_ == micro_.size() && passes_ + 1 >= p_.grpo.num_iterations);
}

data::Batch RolloutSource::next() {
  if (next_micro_ == micro_.size()) {
    ++passes_;
    next_micro_ = 0;
    if (micro_.empty() || passes_ >= p_.grpo.num_iterations) generate();
  }
  return micro_[next_micro_++];
}

namespace {

// The sampler's settings for GRPO's rollouts: grpo.temperature, top_k, top_p and
// max_completion_length; the log-probabilities at the temperature; stop at the ChatML and
// document ends.
model::SamplingParams sampling_params(const GrpoConfig& g, const data::Tokenizer& tok) {
  model::SamplingParams sp;
  sp.temperature = g.temperature;
  sp.top_k = g.top_k;
  sp.top_p = g.top_p;
  sp.max_new_tokens = g.max_completion_length;
  sp.want_logprobs = true;
  sp.logprobs_at_temperature = true;
  sp.stop_ids = {tok.im_end_id(), tok.endoftext_id()};
  return sp;
}

}  // namespace

void RolloutSource::generate() {
  NvtxRange range("rollout");
  const auto& g = p_.grpo;
  const int64_t G = g.num_generations;
  const int world = comm_ ? comm_->world_size() : 1;
  const int rank = comm_ ? comm_->rank() : 0;
  const data::BatcherState before = order_.state();
  const data::Batch pb = order_.next();
  // This rank's share of the generation batch's prompts: the rank-th of `world` equal parts.
  const auto all = static_cast<int64_t>(pb.example_indices.size());
  TORCH_CHECK(all % world == 0, "rollouts: ", all, " prompts for ", world, " ranks");
  const int64_t share = all / world;
  const std::vector<int64_t> picked(pb.example_indices.begin() + rank * share,
                                    pb.example_indices.begin() + (rank + 1) * share);
  std::vector<std::vector<int64_t>> prompt_ids;
  for (const int64_t p : picked) {
    const auto& ids = prompts_[static_cast<size_t>(p)].prompt_ids;
    prompt_ids.emplace_back(ids.begin(), ids.end());
  }
  const model::SamplingParams sp = sampling_params(g, tok_);
  model::TokenSampler sampler(
      sp, row_generators(static_cast<uint64_t>(p_.seed),
                         static_cast<uint64_t>(before.batches), rank * share * G, share * G));
  std::vector<model::GenerationResult> results;
  const auto t0 = std::chrono::steady_clock::now();
  {
    at::NoGradGuard no_grad;
    model::Qwen3Model::InferenceWeights keep(model_, inference_weight_budget_for(device_));
    results = model::sample_completions(model_, prompt_ids, G, sp, &sampler);
  }
  const auto N = static_cast<int64_t>(results.size());
  std::vector<int64_t> prompt_of_row(N);
  std::vector<std::vector<int64_t>> completions(N);
  std::vector<std::vector<float>> entropies(N);
  std::vector<bool> truncated(N);
  std::vector<std::string> texts(N);
  std::vector<RewardInput> inputs(N);
  for (int64_t i = 0; i < N; ++i) {
    const auto p = static_cast<size_t>(picked[static_cast<size_t>(i / G)]);
    prompt_of_row[i] = static_cast<int64_t>(p);
    completions[i] = results[i].tokens;
    entropies[i] = results[i].entropy;
    truncated[i] = results[i].finish != model::FinishReason::kStop;
    const std::vector<data::TokenId> ids(results[i].tokens.begin(), results[i].tokens.end());
    // Invalid UTF-8 (a completion may end inside a character) as U+FFFD, as HF tokenizers
    // decode: the rewards, the command's JSON and the logs get valid text.
    texts[i] = tok_.decode_lossy(ids, /*skip_special=*/true);
    inputs[i].prompt = prompt_as_given(prompts_[p]);
    inputs[i].completion = texts[i];
    inputs[i].fields = &fields_[p];
    inputs[i].completion_tokens = static_cast<int64_t>(results[i].tokens.size());
    inputs[i].where = origins_[p];
  }
  const auto t1 = std::chrono::steady_clock::now();  // the completions are host vectors: synced
  const RewardScores scores = score(inputs, before);
  const auto t2 = std::chrono::steady_clock::now();
  // Per row: total, length, truncated, each function's reward; every rank's rows (data parallel),
  // so the advantages and the logs are the whole generation batch's, as in one process.
  const auto F = static_cast<int64_t>(scores.names.size());
  at::Tensor mine = at::zeros({N, 3 + F}, at::kDouble);
  auto m = mine.accessor<double, 2>();
  for (int64_t i = 0; i < N; ++i) {
    m[i][0] = scores.total[i];
    m[i][1] = static_cast<double>(completions[i].size());
    m[i][2] = truncated[i] ? 1.0 : 0.0;
    for (int64_t f = 0; f < F; ++f) m[i][3 + f] = scores.per_function[f][i];
  }
  const at::Tensor rows = gather_rows(comm_, mine, device_);
  const int64_t NA = rows.size(0);
  std::vector<int64_t> lengths(NA);
  std::vector<bool> trunc_all(NA);
  const auto a = rows.accessor<double, 2>();
  for (int64_t i = 0; i < NA; ++i) {
    lengths[i] = static_cast<int64_t>(a[i][1]);
    trunc_all[i] = a[i][2] > 0;
  }
  const at::Tensor total = rows.select(1, 0).to(at::kFloat).contiguous();
  const GroupAdvantages adv = group_advantages(total, G, g.scale_rewards);
  stats_ = grpo_rollout_stats(lengths, trunc_all, total, adv, G,
                              F > 0 ? rows.narrow(1, 3, F).contiguous() : at::Tensor(),
                              scores.names);
  // This rank's seconds in the sampler and in the rewards (the rest of a step is training).
  stats_.emplace_back("time/generate_s", std::chrono::duration<double>(t1 - t0).count());
  stats_.emplace_back("time/score_s", std::chrono::duration<double>(t2 - t1).count());
  samples_.clear();
  for (int64_t k = 0; k < std::min<int64_t>(kSamples, N / G); ++k) {
    const int64_t i = k * G;
    samples_.push_back({inputs[i].prompt, texts[i], scores.total[i], truncated[i]});
  }
  build_micro_batches(prompt_of_row, completions, entropies, truncated,
                      adv.advantages.narrow(0, rank * N, N));
  next_micro_ = 0;
  passes_ = 0;
}

RewardScores RolloutSource::score(const std::vector<RewardInput>& inputs,
                                  const data::BatcherState& before) {
  RewardScores scores;
  std::string error;
  try {
    scores = rewards_.score(inputs);
  } catch (const RewardError& e) {
    error = e.what();
  } catch (...) {
    order_.restore(before);
    throw;
  }
  // Data parallel: every rank stops on any rank's reward error (and takes its checkpoint).
  if (comm_) error = first_error(*comm_, error, device_);
  if (!error.empty()) {
    order_.restore(before);  // a checkpoint then resumes with this generation batch
    throw RewardError(error);
  }
  return scores;
}

void RolloutSource::build_micro_batches(const std::vector<int64_t>& prompt_of_row,
                                        const std::vector<std::vector<int64_t>>& completions,
                                        const std::vector<std::vector<float>>& entropies,
                                        const std::vector<bool>& truncated,
                                        const at::Tensor& advantages) {
  const auto& g = p_.grpo;
  const int64_t rows = p_.batch_size;
  const auto N = static_cast<int64_t>(completions.size());
  TORCH_CHECK(N % rows == 0, "rollouts: ", N, " completions for micro-batches of ", rows);
  micro_.clear();
  // The batcher lays the rows out as training batches them (padding, the CUDA varlen layout);
  // without shuffling or packing its rows are the examples in order.
  data::BatcherOptions bo = p_.batcher;
  bo.batch_size = rows;
  bo.shuffle = false;
  bo.truncation = data::Truncation::kDrop;
  for (int64_t start = 0; start < N; start += rows) {
    std::vector<data::Example> examples;
    auto rr = std::make_shared<data::RolloutRows>();
    std::vector<bool> trunc;
    std::vector<float> entropy;  // the rows' completion tokens in order
    int64_t L = 1, tokens = 0;
    for (int64_t i = start; i < start + rows; ++i) {
      const auto& prompt = prompts_[static_cast<size_t>(prompt_of_row[i])].prompt_ids;
      data::Example e;
      e.input_ids.assign(prompt.begin(), prompt.end());
      e.labels.assign(prompt.size(), data::kIgnoreIndex);
      for (const int64_t t : completions[i]) {
        e.input_ids.push_back(static_cast<data::TokenId>(t));
        e.labels.push_back(static_cast<data::TokenId>(t));
      }
      examples.push_back(std::move(e));
      const auto len = static_cast<int64_t>(completions[i].size());
      TORCH_INTERNAL_ASSERT(static_cast<int64_t>(entropies[i].size()) == len);
      entropy.insert(entropy.end(), entropies[i].begin(), entropies[i].end());
      rr->completion_lengths.push_back(len);
      trunc.push_back(truncated[i]);
      L = std::max(L, len);
      tokens += len;
    }
    data::Batcher batcher(std::move(examples), bo);
    TORCH_CHECK(batcher.num_examples() == rows, "rollouts: a prompt + completion row is longer "
                "than train.seq_len");
    data::Batch b = batcher.next();
    TORCH_CHECK(b.supervised_tokens == tokens, "rollouts: ", b.supervised_tokens,
                " labelled tokens for ", tokens, " completion tokens");
    rr->advantages = advantages.narrow(0, start, rows).contiguous();
    rr->mask = completion_mask(rr->completion_lengths, trunc, L, g.mask_truncated_completions);
    rr->entropy = completion_rows(at::tensor(entropy, at::kFloat), rr->completion_lengths, L);
    if (g.num_iterations > 1) {
      // The old policy of the later passes: the training forward before the first update, so
      // the first pass's ratio is exactly 1 and the later ones are pi / pi_old.
      at::NoGradGuard no_grad;
      const at::Tensor lp = model_.token_logprobs(to_inputs(b, model_, device_), g.temperature).logprobs;
      rr->old_logprobs = completion_rows(lp, rr->completion_lengths, L).cpu();
    }
    b.rollout = std::move(rr);
    micro_.push_back(std::move(b));
  }
}

}  // namespace q4::trainer
