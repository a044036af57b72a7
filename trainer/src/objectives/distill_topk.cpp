// Offline distillation: writing the teacher's top-K file once and training from it; see
// distill.h for the file's layout.
#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <ostream>

#include "q4/io/dat_file.h"
#include "q4/model/fused_divergence.h"
#include "q4/trainer/objectives/distill.h"
#include "q4/trainer/objectives/registry.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/runtime/signals.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

constexpr const char* kIds = "topk.ids";
constexpr const char* kLogprobs = "topk.logprobs";
constexpr const char* kOffsets = "topk.example_offsets";
constexpr const char* kHashes = "topk.example_hashes";
constexpr const char* kVocab = "topk.vocab_size";
constexpr const char* kTemperature = "topk.temperature";

// Positions j of an example whose next token is supervised (labels[j + 1]), in order: the rows
// the file keeps for it. Position 0's own label is never a target (data::Batch).
int64_t supervised_rows(const data::Example& e) {
  int64_t n = 0;
  for (size_t j = 1; j < e.labels.size(); ++j) n += e.labels[j] != data::kIgnoreIndex;
  return n;
}

std::vector<int64_t> example_offsets(const std::vector<data::Example>& examples) {
  std::vector<int64_t> off{0};
  for (const auto& e : examples) off.push_back(off.back() + supervised_rows(e));
  return off;
}

}  // namespace

int64_t example_hash(const data::Example& e) {
  uint64_t h = 0xcbf29ce484222325ULL;
  auto mix = [&](int64_t v) {
    for (int b = 0; b < 8; ++b) {
      h ^= static_cast<uint64_t>(v >> (8 * b)) & 0xFFu;
      h *= 0x100000001b3ULL;
    }
  };
  for (auto t : e.input_ids) mix(t);
  mix(-1);  // separates ids from labels
  for (auto t : e.labels) mix(t);
  return static_cast<int64_t>(h);
}

std::vector<int64_t> topk_rows_of_batch(const data::Batch& batch,
                                        const std::vector<data::Example>& examples,
                                        const std::vector<int64_t>& offsets) {
  const int64_t B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  const at::Tensor seg = batch.segment_ids.contiguous();
  const int64_t* s = seg.data_ptr<int64_t>();
  std::vector<int64_t> rows(static_cast<size_t>(B * T), -1);
  size_t next = 0;  // the batch's examples, in the order the batcher laid them out
  for (int64_t r = 0; r < B; ++r) {
    int64_t prev = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t id = s[r * T + t];
      if (id == 0 || id == prev) continue;
      prev = id;  // a new example starts here
      TORCH_CHECK(next < batch.example_indices.size(),
                  "distill.topk_file: the batch has more segments than examples");
      const int64_t e = batch.example_indices[next++];
      const auto& ex = examples.at(static_cast<size_t>(e));
      int64_t row = offsets.at(static_cast<size_t>(e));
      const auto len = static_cast<int64_t>(ex.input_ids.size());
      TORCH_CHECK(t + len <= T, "distill.topk_file: example ", e, " does not fit its row");
      for (int64_t j = 0; j + 1 < len; ++j) {
        if (ex.labels[static_cast<size_t>(j + 1)] != data::kIgnoreIndex) {
          rows[static_cast<size_t>(r * T + t + j)] = row++;
        }
      }
    }
  }
  return rows;
}

TopkTeacher::TopkTeacher(const std::string& path, const std::vector<data::Example>& examples,
                         int64_t vocab_size, double temperature) {
  require_file(path, "distill.topk_file");
  const auto reader =
      as_input_error("distill.topk_file", [&] { return std::make_unique<io::DatReader>(path); });
  const io::DatReader& r = *reader;
  auto entry = [&](const char* key) {
    const io::DatEntry* e = r.find(key);
    if (e == nullptr) {
      throw ConfigError(fmt::format(
          "config key distill.topk_file: {} has no entry {} (not a file written by q4train "
          "--write-teacher-topk)",
          path, key));
    }
    return r.load(*e);
  };
  const at::Tensor offsets = entry(kOffsets), hashes = entry(kHashes);
  const int64_t file_vocab = entry(kVocab).item<int64_t>();
  const double file_t = entry(kTemperature).item<double>();
  if (file_t != temperature) {
    throw ConfigError(fmt::format(
        "config key distill.temperature: {} holds the teacher's probabilities at temperature {}, "
        "not {} (write it again with this temperature, or set it to {})",
        path, file_t, temperature, file_t));
  }
  ids_ = entry(kIds);
  logprobs_ = entry(kLogprobs);
  const auto mismatch = [&](const std::string& what) {
    return ConfigError(fmt::format(
        "config key distill.topk_file: {} was written for other training data ({}); write it "
        "again with q4train --write-teacher-topk and this config",
        path, what));
  };
  if (file_vocab != vocab_size) {
    throw mismatch(fmt::format("vocabulary {} vs {}", file_vocab, vocab_size));
  }
  const auto E = static_cast<int64_t>(examples.size());
  if (offsets.numel() != E + 1 || hashes.numel() != E) {
    throw mismatch(fmt::format("{} examples vs {}", hashes.numel(), E));
  }
  offsets_.assign(offsets.data_ptr<int64_t>(), offsets.data_ptr<int64_t>() + E + 1);
  const int64_t* h = hashes.data_ptr<int64_t>();
  for (int64_t e = 0; e < E; ++e) {
    const auto& ex = examples[static_cast<size_t>(e)];
    if (h[e] != example_hash(ex) ||
        offsets_[static_cast<size_t>(e) + 1] - offsets_[static_cast<size_t>(e)] !=
            supervised_rows(ex)) {
      throw mismatch(fmt::format("example {} (line {}) differs", e, ex.source_line));
    }
  }
  if (ids_.dim() != 2 || logprobs_.sizes() != ids_.sizes() || ids_.size(0) != offsets_.back() ||
      ids_.scalar_type() != at::kInt || logprobs_.scalar_type() != at::kFloat) {
    throw ConfigError(fmt::format(
        "config key distill.topk_file: {}: expected int32 ids and fp32 log-probabilities of "
        "shape ({}, K), found {} {} and {} {}",
        path, offsets_.back(), c10::toString(ids_.scalar_type()), c10::str(ids_.sizes()),
        c10::toString(logprobs_.scalar_type()), c10::str(logprobs_.sizes())));
  }
  if (ids_.numel() > 0 &&
      (ids_.min().item<int64_t>() < 0 || ids_.max().item<int64_t>() >= vocab_size)) {
    throw ConfigError("config key distill.topk_file: " + path + ": token ids out of range");
  }
  check_logprobs(path, examples);
}

// Every row a distribution's top K: finite log-probabilities <= 0 whose probabilities sum to at
// most 1. The tolerances cover fp32 rounding: log_softmax's largest value can come out a few ulps
// above 0, and K <= 4096 rounded probabilities sum to within K x 2^-24 < 3e-4 of their true sum.
void TopkTeacher::check_logprobs(const std::string& path,
                                 const std::vector<data::Example>& examples) const {
  constexpr double kLogprobTolerance = 1e-5, kMassTolerance = 1e-3;
  constexpr int64_t kRowsAtOnce = 1 << 16;  // bounds the fp64 temporaries
  const int64_t S = logprobs_.size(0);
  int64_t row = -1;  // the first row that is not a distribution's top K
  for (int64_t r0 = 0; r0 < S && row < 0; r0 += kRowsAtOnce) {
    const at::Tensor lp = logprobs_.narrow(0, r0, std::min(kRowsAtOnce, S - r0));  // (n, K)
    const at::Tensor ok =
        at::isfinite(lp)
            .all(1)
            .logical_and(lp.le(kLogprobTolerance).all(1))
            .logical_and(lp.to(at::kDouble).exp().sum(1).le(1.0 + kMassTolerance));
    if (!ok.all().item<bool>()) row = r0 + ok.logical_not().to(at::kByte).argmax().item<int64_t>();
  }
  if (row < 0) return;
  const at::Tensor lp = logprobs_[row];  // (K)
  const auto first = [](const at::Tensor& mask) {
    return mask.to(at::kByte).argmax().item<int64_t>();
  };
  std::string what;
  if (!at::isfinite(lp).all().item<bool>()) {
    const int64_t k = first(at::isfinite(lp).logical_not());
    what = fmt::format("log-probability {} is {}", k, lp[k].item<float>());
  } else if (lp.gt(kLogprobTolerance).any().item<bool>()) {
    const int64_t k = first(lp.gt(kLogprobTolerance));
    what = fmt::format("log-probability {} is {}, above 0", k, lp[k].item<float>());
  } else {
    what = fmt::format("its probabilities sum to {:.6g}, above 1",
                       lp.to(at::kDouble).exp().sum().item<double>());
  }
  // The example (and its line) whose positions hold the row.
  const auto e = static_cast<size_t>(std::upper_bound(offsets_.begin(), offsets_.end(), row) -
                                     offsets_.begin() - 1);
  throw ConfigError(fmt::format(
      "config key distill.topk_file: {}: row {} (example {}, line {}): {} (not a teacher's "
      "top-K log-probabilities; write it again with q4train --write-teacher-topk)",
      path, row, e, e < examples.size() ? examples[e].source_line : 0, what));
}

OfflineDistillation::OfflineDistillation(const DistillConfig& c,
                                         std::unique_ptr<TopkTeacher> teacher,
                                         const data::Batcher& train)
    : alpha_(c.alpha), temperature_(c.temperature), teacher_(std::move(teacher)), train_(train) {}

ObjectiveOutput OfflineDistillation::compute(model::Qwen3Model& model, const MicroBatch& micro) {
  TORCH_CHECK(micro.batch != nullptr, "offline distillation needs the micro-batch's host batch");
  const std::vector<int64_t> src =
      topk_rows_of_batch(*micro.batch, train_.examples(), teacher_->offsets());
  const at::Tensor src_t = at::from_blob(const_cast<int64_t*>(src.data()),
                                         {static_cast<int64_t>(src.size())}, at::kLong);
  const at::Device dev = model.options().device;
  at::Tensor ids, logprobs;  // (N, K) for the loss's supervised rows, on the device
  model::LossTerm term;
  term.weight = alpha_;
  term.prepare = [&](const at::Tensor& rows) {
    const at::Tensor file_rows = src_t.index_select(0, rows.cpu());
    TORCH_CHECK(file_rows.numel() == 0 || file_rows.min().item<int64_t>() >= 0,
                "distill.topk_file: a supervised position has no row in the file");
    ids = teacher_->ids().index_select(0, file_rows).to(at::kLong);
    logprobs = teacher_->logprobs().index_select(0, file_rows);
    if (dev.is_cuda()) {
      ids = ids.pin_memory().to(dev, /*non_blocking=*/true);
      logprobs = logprobs.pin_memory().to(dev, /*non_blocking=*/true);
    }
  };
  term.chunk = [&](at::Tensor& z, const at::Tensor& valid, int64_t row_begin, bool want_grad) {
    const int64_t n = z.size(0);
    return topk_divergence_chunk(z, ids.narrow(0, row_begin, n), logprobs.narrow(0, row_begin, n),
                                 valid, temperature_, want_grad);
  };
  term.fused = [&](at::Tensor& z, const at::Tensor& labels, int64_t row_begin, bool want_grad) {
    const int64_t n = z.size(0);
    const at::Tensor chunk_ids = ids.narrow(0, row_begin, n);
    if (!model::fused_topk_distill_applies(z, labels, chunk_ids)) return model::LossRows{};
    return model::fused_topk_distill_xent_(z, labels, chunk_ids, logprobs.narrow(0, row_begin, n),
                                           temperature_, alpha_, want_grad);
  };
  return distillation_output(model, micro, term);
}

ObjectiveOutput OfflineDistillation::evaluate(model::Qwen3Model& model, const MicroBatch& micro) {
  return SupervisedCrossEntropy().compute(model, micro);
}

namespace {

// distill.topk_file's entries (distill.h), written whole or not at all.
void write_topk_file(const std::string& path, const at::Tensor& ids, const at::Tensor& logprobs,
                     const std::vector<int64_t>& offsets,
                     const std::vector<data::Example>& examples, int64_t vocab_size,
                     double temperature) {
  std::vector<int64_t> hashes;
  for (const auto& e : examples) hashes.push_back(example_hash(e));
  io::DatWriter w(path, 6);
  w.add(kIds, ids);
  w.add(kLogprobs, logprobs);
  w.add(kOffsets, at::tensor(offsets, at::kLong));
  w.add(kHashes, at::tensor(hashes, at::kLong));
  w.add(kVocab, at::tensor({vocab_size}, at::kLong));
  w.add(kTemperature, at::tensor({temperature}, at::kDouble));
  w.commit();
}

}  // namespace

int run_write_teacher_topk(const Config& c, bool overwrite, std::ostream& out, std::ostream& err) {
  const auto t0 = std::chrono::steady_clock::now();
  // The config's checks before anything loads; then the plan alone.
  ObjectiveNeeds writer;
  writer.inputs = teacher_inputs(c);
  check_topk_output(run_paths(c), c.distill, writer, overwrite);
  check_device_available(c);
  // A stop signal ends the pass at the next batch; the file is written whole or not at all.
  set_stop_message(
      "\nq4train: stop signal received: stopping at the next batch; nothing is written (a third "
      "signal kills)\n");
  install_stop_handlers();
  RunPlan plan = resolve_plan(c, RunOptions{});
  const ObjectivePlan objective = plan.objective_plan();
  const std::string& path = objective.distill.topk_file;
  RunSetup setup(out, err);
  plan = setup.load_model(plan, /*need_tokenizer=*/true, /*load_weights=*/false);
  plan = setup.load_data(plan, 1);
  const auto& examples = setup.batcher()->examples();
  const int64_t V = setup.model_config().vocab_size;
  const int64_t K = objective.distill.topk;
  if (K > V) {
    throw ConfigError(
        fmt::format("config key distill.topk: {} is more than the vocabulary ({})", K, V));
  }
  const model::ModelOptions& mo = objective.model;
  auto teacher = load_teacher(objective.teacher, mo, V, out);
  const at::Tensor& head =
      teacher->parameter(teacher->tied() ? "model.embed_tokens.weight" : "lm_head.weight").master;
  const std::vector<int64_t> offsets = example_offsets(examples);
  const int64_t S = offsets.back();
  at::Tensor ids = at::full({S, K}, -1, at::kInt);
  at::Tensor logprobs = at::empty({S, K}, at::kFloat);
  // Every training example once, in batches laid out like training's (no shuffling).
  data::BatcherOptions bo = plan.batcher_options(setup.tokenizer()->endoftext_id());
  bo.shuffle = false;
  bo.drop_last = false;
  data::Batcher batcher(examples, bo);
  const int64_t chunk = mo.loss_chunk_tokens;
  at::NoGradGuard no_grad;
  int64_t written = 0;
  auto last_report = std::chrono::steady_clock::now();
  for (;;) {
    if (stop_requested()) {
      out << fmt::format(
          "signal {}: stopped after {} of {} positions; nothing written ({} would be "
          "incomplete), run the command again to write it\n",
          stop_signal(), written, S, path);
      return kExitOk;
    }
    const data::Batch b = batcher.next();
    if (b.epoch > 0) break;
    const std::vector<int64_t> src = topk_rows_of_batch(b, examples, offsets);
    std::vector<int64_t> pos, dst;
    for (size_t p = 0; p < src.size(); ++p) {
      if (src[p] >= 0) {
        pos.push_back(static_cast<int64_t>(p));
        dst.push_back(src[p]);
      }
    }
    if (pos.empty()) continue;
    at::Tensor hidden = teacher->hidden_states(to_inputs(b, *teacher, mo.device));
    hidden = hidden.reshape({-1, hidden.size(-1)})
                 .index_select(0, at::tensor(pos, at::kLong).to(mo.device));
    const at::Tensor dst_t = at::tensor(dst, at::kLong);
    for (int64_t s = 0; s < hidden.size(0); s += chunk) {
      const int64_t n = std::min(chunk, hidden.size(0) - s);
      at::Tensor logits = at::matmul(hidden.narrow(0, s, n), head.t()).to(at::kFloat);
      if (objective.distill.temperature != 1.0) logits.div_(objective.distill.temperature);
      const at::Tensor lp = at::log_softmax(logits, 1);
      const auto [v, k] = lp.topk(K, 1);
      ids.index_copy_(0, dst_t.narrow(0, s, n), k.to(at::kInt).cpu());
      logprobs.index_copy_(0, dst_t.narrow(0, s, n), v.cpu());
    }
    written += static_cast<int64_t>(pos.size());
    if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(30)) {
      last_report = std::chrono::steady_clock::now();
      out << fmt::format("teacher top-{}: {} of {} positions ({:.0f}%)\n", K, written, S,
                         100.0 * static_cast<double>(written) / static_cast<double>(S))
          << std::flush;
    }
  }
  TORCH_CHECK(written == S, "--write-teacher-topk: wrote ", written, " of ", S,
              " positions (the batcher skipped examples)");
  write_topk_file(path, ids, logprobs, offsets, examples, V, objective.distill.temperature);
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out << fmt::format("teacher top-{} of {} positions ({} examples) -> {} ({:.1f} MB) in {:.1f} s\n",
                     K, S, examples.size(), path, static_cast<double>(fs::file_size(path)) / 1e6,
                     secs);
  return 0;
}

}  // namespace q4::trainer
