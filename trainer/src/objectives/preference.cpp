// Preference tuning: the losses, the per-sequence log-probabilities, the reference computed once
// and the objective (see preference.h).
#include "q4/trainer/objectives/preference.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <ostream>

#include "q4/io/crc32c.h"
#include "q4/io/dat_file.h"
#include "q4/trainer/objectives/distill.h"
#include "q4/trainer/plan/options.h"
#include "q4/trainer/rundir/run_dir.h"
#include "q4/trainer/plan/setup.h"
#include "q4/trainer/runtime/signals.h"

namespace fs = std::filesystem;

namespace q4::trainer {

void PreferenceLossOptions::validate() const {
  // The config's bounds (config.h): inside them the fp32 loss math stays finite.
  TORCH_CHECK(beta >= kMinPreferenceBeta && beta <= kMaxPreferenceBeta,
              "preference.beta: expected a value in [", kMinPreferenceBeta, ", ",
              kMaxPreferenceBeta, "], got ", beta);
  TORCH_CHECK(label_smoothing >= 0 && label_smoothing < 0.5,
              "preference.label_smoothing: expected 0 <= value < 0.5, got ", label_smoothing);
  TORCH_CHECK(simpo_gamma >= -kMaxSimpoGamma && simpo_gamma <= kMaxSimpoGamma,
              "preference.simpo_gamma: expected a value in [", -kMaxSimpoGamma, ", ",
              kMaxSimpoGamma, "], got ", simpo_gamma);
}

namespace {

// -(1 - eps) log sigmoid(beta z) - eps log sigmoid(-beta z), stable for any z.
at::Tensor sigmoid_loss(const at::Tensor& z, double beta, double eps) {
  at::Tensor loss = -at::log_sigmoid(z * beta) * (1.0 - eps);
  if (eps > 0) loss = loss - at::log_sigmoid(z * -beta) * eps;
  return loss;
}

void check_pairs(const PreferencePairs& p, bool needs_reference) {
  const int64_t n = p.chosen_logps.defined() ? p.chosen_logps.numel() : -1;
  TORCH_CHECK(n >= 0 && p.chosen_logps.dim() == 1, "preference_loss: chosen_logps must be (P)");
  auto same = [&](const at::Tensor& t, const char* what) {
    TORCH_CHECK(t.defined() && t.dim() == 1 && t.numel() == n, "preference_loss: ", what,
                " must be (", n, ") like chosen_logps");
  };
  same(p.rejected_logps, "rejected_logps");
  same(p.chosen_tokens, "chosen_tokens");
  same(p.rejected_tokens, "rejected_tokens");
  if (needs_reference) {
    same(p.ref_chosen_logps, "ref_chosen_logps");
    same(p.ref_rejected_logps, "ref_rejected_logps");
  }
}

}  // namespace

PreferenceLossOutput preference_loss(const PreferencePairs& p, const PreferenceLossOptions& o) {
  o.validate();
  const bool reference = o.kind != PreferenceLossKind::kSimpo;
  check_pairs(p, reference);
  const auto dt = p.chosen_logps.scalar_type();
  const at::Tensor nc = p.chosen_tokens.to(dt), nr = p.rejected_tokens.to(dt);
  PreferenceLossOutput out;
  switch (o.kind) {
    case PreferenceLossKind::kSigmoid: {
      const at::Tensor dc = p.chosen_logps - p.ref_chosen_logps.to(dt);
      const at::Tensor dr = p.rejected_logps - p.ref_rejected_logps.to(dt);
      out.losses = sigmoid_loss(dc - dr, o.beta, o.label_smoothing);
      out.chosen_rewards = (dc * o.beta).detach();
      out.rejected_rewards = (dr * o.beta).detach();
      break;
    }
    case PreferenceLossKind::kIpo: {
      const at::Tensor dc = (p.chosen_logps - p.ref_chosen_logps.to(dt)) / nc;
      const at::Tensor dr = (p.rejected_logps - p.ref_rejected_logps.to(dt)) / nr;
      out.losses = (dc - dr - 1.0 / (2.0 * o.beta)).pow(2);
      out.chosen_rewards = (dc * o.beta).detach();
      out.rejected_rewards = (dr * o.beta).detach();
      break;
    }
    case PreferenceLossKind::kSimpo: {
      const at::Tensor ac = p.chosen_logps / nc, ar = p.rejected_logps / nr;
      out.losses = sigmoid_loss(ac - ar - o.simpo_gamma / o.beta, o.beta, o.label_smoothing);
      out.chosen_rewards = (ac * o.beta).detach();
      out.rejected_rewards = (ar * o.beta).detach();
      break;
    }
  }
  return out;
}

PreferenceLossOptions preference_loss_options(const PreferenceConfig& c) {
  PreferenceLossOptions o;
  o.kind = c.loss;
  o.beta = c.beta;
  o.label_smoothing = c.label_smoothing;
  o.simpo_gamma = c.simpo_gamma;
  return o;
}

namespace {

// For each flat (B * T) position of `batch`, the ordinal of the sequence it belongs to (its index
// in batch.example_indices: the batcher lays the examples out in that order), -1 on padding.
std::vector<int64_t> sequence_of_positions(const data::Batch& batch) {
  const int64_t B = batch.input_ids.size(0), T = batch.input_ids.size(1);
  const at::Tensor seg = batch.segment_ids.contiguous();
  const int64_t* s = seg.data_ptr<int64_t>();
  std::vector<int64_t> out(static_cast<size_t>(B * T), -1);
  int64_t next = 0;
  for (int64_t r = 0; r < B; ++r) {
    int64_t prev = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t id = s[r * T + t];
      if (id == 0) continue;
      if (id != prev) {
        prev = id;
        ++next;
      }
      out[static_cast<size_t>(r * T + t)] = next - 1;
    }
  }
  TORCH_CHECK(next == static_cast<int64_t>(batch.example_indices.size()),
              "preference: the batch has ", next, " sequences but ", batch.example_indices.size(),
              " examples");
  return out;
}

constexpr const char* kTrain = "reference.train";
constexpr const char* kTrainHashes = "reference.train_hashes";
constexpr const char* kValidation = "reference.validation";
constexpr const char* kValidationHashes = "reference.validation_hashes";
constexpr const char* kModel = "reference.model";
constexpr const char* kChecksum = "reference.crc32c";

at::Tensor hashes_of(const std::vector<data::Example>& examples) {
  std::vector<int64_t> h;
  h.reserve(examples.size());
  for (const auto& e : examples) h.push_back(example_hash(e));
  return at::tensor(h, at::kLong);
}

// preference.reference as the file records it: the path, or "" for the starting model.
at::Tensor model_entry(const std::string& reference) {
  return at::tensor(std::vector<uint8_t>(reference.begin(), reference.end()), at::kByte);
}

std::string model_name(const std::string& reference) {
  return reference.empty() ? "the starting model" : reference;
}

// CRC32C over the payloads of every other entry, in the order they are written.
int64_t checksum_of(const std::vector<at::Tensor>& payloads) {
  uint32_t crc = 0;
  for (const at::Tensor& t : payloads) {
    const at::Tensor c = t.contiguous();
    crc = io::crc32c(c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size(), crc);
  }
  return static_cast<int64_t>(crc);
}

// The file's entries as written by reference_logprobs: nullopt for a file without a checksum (an
// older q4train's, computed again); an input error for a damaged one (checksum, types, values),
// or one computed by another reference model than the config names.
struct ReferenceFile {
  at::Tensor train, train_hashes, validation, validation_hashes;
};
// `reference`: preference.reference.
std::optional<ReferenceFile> read_reference_file(const std::string& path,
                                                 const std::string& reference, std::ostream& out) {
  const std::string key = "output.dir (" + std::string(kReferenceFile) + ")";
  const auto reader = as_input_error(key, [&] { return std::make_unique<io::DatReader>(path); });
  const io::DatReader& r = *reader;
  if (r.find(kChecksum) == nullptr) {
    out << "reference log-probabilities: " << path
        << " has no checksum (an older q4train wrote it); computing them again\n";
    return std::nullopt;
  }
  auto damaged = [&](const std::string& what) {
    return ConfigError(fmt::format(
        "{}: {} is damaged ({}); remove it to compute the reference log-probabilities again", key,
        path, what));
  };
  ReferenceFile f;
  at::Tensor model, crc;
  const std::vector<std::pair<const char*, at::Tensor*>> entries = {
      {kTrain, &f.train},
      {kTrainHashes, &f.train_hashes},
      {kValidation, &f.validation},
      {kValidationHashes, &f.validation_hashes},
      {kModel, &model},
      {kChecksum, &crc}};
  for (const auto& [name, t] : entries) {
    const io::DatEntry* e = r.find(name);
    if (e == nullptr) throw damaged(std::string("no entry ") + name);
    *t = as_input_error(key, [&] { return r.load(*e); });
  }
  const bool types_ok =
      f.train.scalar_type() == at::kDouble && f.validation.scalar_type() == at::kDouble &&
      f.train_hashes.scalar_type() == at::kLong && f.validation_hashes.scalar_type() == at::kLong &&
      model.scalar_type() == at::kByte && crc.scalar_type() == at::kLong && crc.numel() == 1 &&
      f.train.dim() == 1 && f.validation.dim() == 1 && f.train_hashes.sizes() == f.train.sizes() &&
      f.validation_hashes.sizes() == f.validation.sizes();
  if (!types_ok) throw damaged("unexpected entry types or shapes");
  if (checksum_of({f.train, f.train_hashes, f.validation, f.validation_hashes, model}) !=
      crc.item<int64_t>()) {
    throw damaged("checksum mismatch");
  }
  for (const at::Tensor* v : {&f.train, &f.validation}) {
    const double* p = v->data_ptr<double>();
    for (int64_t i = 0; i < v->numel(); ++i) {
      if (!std::isfinite(p[i])) {
        throw damaged(fmt::format("{}[{}] is {}, not a finite log-probability",
                                  v == &f.train ? kTrain : kValidation, i, p[i]));
      }
    }
  }
  // The run's objective is defined by its reference: a resume that names another one would train
  // against scores of the old one (or change the objective mid-run).
  const std::string was(static_cast<const char*>(model.data_ptr()),
                        static_cast<size_t>(model.numel()));
  if (was != reference) {
    throw ConfigError(fmt::format(
        "config key preference.reference: {}, but {} holds the reference log-probabilities of {} "
        "(this run's reference); set it back, or remove the file to score with the new one",
        model_name(reference), path, model_name(was)));
  }
  return f;
}

// The file's log-probabilities of `examples`, or nothing when it holds other examples.
std::optional<std::vector<double>> matching(const at::Tensor& values, const at::Tensor& hashes,
                                            const std::vector<data::Example>& examples) {
  if (values.numel() != static_cast<int64_t>(examples.size()) ||
      !at::equal(hashes, hashes_of(examples))) {
    return std::nullopt;
  }
  return std::vector<double>(values.data_ptr<double>(), values.data_ptr<double>() + values.numel());
}

}  // namespace

SequenceLogprobs sequence_logprobs(model::Qwen3Model& model, const model::ModelInputs& in,
                                   const data::Batch& batch) {
  const std::vector<int64_t> seq = sequence_of_positions(batch);
  const auto n = static_cast<int64_t>(batch.example_indices.size());
  const model::Qwen3Model::TokenLogprobs tl = model.token_logprobs(in);
  const at::Tensor pos = tl.positions.cpu().contiguous();
  at::Tensor index = at::empty({pos.numel()}, at::kLong);
  const int64_t* p = pos.data_ptr<int64_t>();
  int64_t* ix = index.data_ptr<int64_t>();
  SequenceLogprobs out;
  out.tokens = at::zeros({n}, at::kLong);
  int64_t* tokens = out.tokens.data_ptr<int64_t>();
  for (int64_t k = 0; k < pos.numel(); ++k) {
    ix[k] = seq.at(static_cast<size_t>(p[k]));
    TORCH_CHECK(ix[k] >= 0, "preference: a supervised label on padding");
    ++tokens[ix[k]];
  }
  const at::Tensor lp = tl.logprobs.to(at::kFloat);
  out.sums =
      at::zeros({n}, lp.options()).index_add(0, index.to(lp.device(), /*non_blocking=*/false), lp);
  return out;
}

std::vector<double> sequence_logprobs_of(model::Qwen3Model& model,
                                         const std::vector<data::Example>& examples,
                                         data::BatcherOptions options, std::ostream& out,
                                         const std::string& what) {
  std::vector<double> result(examples.size(), std::nan(""));
  if (examples.empty()) return result;
  options.shuffle = false;
  options.drop_last = false;
  data::Batcher batcher(examples, options);
  TORCH_CHECK(batcher.num_examples() == static_cast<int64_t>(examples.size()),
              "preference: the reference pass dropped examples");
  at::NoGradGuard no_grad;
  const at::Device dev = model.options().device;
  const auto t0 = std::chrono::steady_clock::now();
  auto last_report = t0;
  size_t done = 0;
  for (;;) {
    // A stop signal ends the pass at the next batch (docs/reliability.md, "Signals"): the run
    // stops in set-up and the caller writes nothing.
    if (stop_requested()) return result;
    const data::Batch b = batcher.next();
    if (b.epoch > 0) break;
    const SequenceLogprobs s = sequence_logprobs(model, to_inputs(b, model, dev), b);
    const at::Tensor sums = s.sums.to(at::kCPU, at::kDouble).contiguous();
    const double* v = sums.data_ptr<double>();
    for (size_t k = 0; k < b.example_indices.size(); ++k) {
      result.at(static_cast<size_t>(b.example_indices[k])) = v[k];
    }
    done += b.example_indices.size();
    if (std::chrono::steady_clock::now() - last_report > std::chrono::seconds(30)) {
      last_report = std::chrono::steady_clock::now();
      out << fmt::format("reference log-probabilities ({}): {} of {} sequences\n", what, done,
                         examples.size())
          << std::flush;
    }
  }
  for (double v : result) {
    TORCH_CHECK(std::isfinite(v),
                "preference: the reference pass left a sequence without a "
                "finite log-probability");
  }
  return result;
}

ReferenceLogprobs reference_logprobs(const ObjectivePlan& c, model::Qwen3Model& policy,
                                     const data::Batcher& train, const data::Batcher* validation,
                                     bool write, std::ostream& out) {
  const std::string& path = c.reference_file;
  static const std::vector<data::Example> kNone;
  const auto& held = validation ? validation->examples() : kNone;
  ReferenceLogprobs ref;
  std::error_code ec;
  if (fs::is_regular_file(path, ec)) {
    if (const auto f = read_reference_file(path, c.preference.reference, out)) {
      auto t = matching(f->train, f->train_hashes, train.examples());
      auto v = matching(f->validation, f->validation_hashes, held);
      if (t && v) {
        out << fmt::format("reference log-probabilities: read from {} ({} + {} sequences)\n", path,
                           t->size(), v->size());
        ref.train = std::move(*t);
        ref.validation = std::move(*v);
        return ref;
      }
      out << "reference log-probabilities: " << path
          << " describes other examples; computing them again\n";
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::unique_ptr<model::Qwen3Model> loaded;
  model::Qwen3Model* reference = &policy;
  if (!c.preference.reference.empty()) {
    loaded = load_frozen_model(c.reference, c.model, policy.config().vocab_size, out);
    reference = loaded.get();
  }
  // Batched as training batches them (unshuffled): the same rows, padding and attention path.
  ref.train = sequence_logprobs_of(*reference, train.examples(), train.options(), out, "training");
  if (validation) {
    ref.validation =
        sequence_logprobs_of(*reference, held, validation->options(), out, "validation");
  }
  loaded.reset();  // the reference leaves memory before training
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (stop_requested()) {
    // A signal in the pass: the partial scores are no file (the run stops before its first step).
    out << "reference log-probabilities: stopped by signal " << stop_signal()
        << "; nothing written\n";
    return ref;
  }
  if (write) {
    const std::vector<at::Tensor> payloads = {at::tensor(ref.train, at::kDouble),
                                              hashes_of(train.examples()),
                                              at::tensor(ref.validation, at::kDouble),
                                              hashes_of(held), model_entry(c.preference.reference)};
    io::DatWriter w(path, 6);
    const char* keys[] = {kTrain, kTrainHashes, kValidation, kValidationHashes, kModel};
    for (size_t i = 0; i < payloads.size(); ++i) w.add(keys[i], payloads[i]);
    w.add(kChecksum, at::tensor({checksum_of(payloads)}, at::kLong));
    w.commit();
  }
  out << fmt::format("reference log-probabilities of {} + {} sequences by {} in {:.1f} s{}\n",
                     ref.train.size(), ref.validation.size(),
                     c.preference.reference.empty() ? "the starting model" : c.preference.reference,
                     secs, write ? " -> " + path : "");
  return ref;
}

std::string preference_summary(const PreferenceConfig& p, const std::string& reference_file) {
  std::string s = fmt::format("preference: {} loss, beta {}", to_string(p.loss), p.beta);
  if (p.loss != PreferenceLossKind::kIpo && p.label_smoothing > 0) {
    s += fmt::format(", label smoothing {}", p.label_smoothing);
  }
  if (p.loss == PreferenceLossKind::kSimpo) s += fmt::format(", gamma {}", p.simpo_gamma);
  if (p.sft_weight > 0) s += fmt::format(", + {} x chosen cross-entropy", p.sft_weight);
  if (p.loss == PreferenceLossKind::kSimpo) return s + "; no reference model";
  return s + fmt::format(
                 "; reference log-probabilities computed once, before step 1, by {} and "
                 "kept in {}",
                 p.reference.empty() ? "the starting model" : p.reference, reference_file);
}

PreferenceObjective::PreferenceObjective(const PreferenceConfig& c, ReferenceLogprobs reference)
    : loss_(preference_loss_options(c)),
      sft_weight_(c.sft_weight),
      reference_(std::move(reference)) {
  loss_.validate();
}

ObjectiveNeeds PreferenceObjective::needs() const {
  ObjectiveNeeds n;
  n.paired_sequences = true;
  return n;
}

ObjectiveOutput PreferenceObjective::compute(model::Qwen3Model& model, const MicroBatch& micro) {
  return pairs_output(model, micro, reference_.train);
}

ObjectiveOutput PreferenceObjective::evaluate(model::Qwen3Model& model, const MicroBatch& micro) {
  return pairs_output(model, micro, reference_.validation);
}

ObjectiveOutput PreferenceObjective::pairs_output(model::Qwen3Model& model, const MicroBatch& micro,
                                                  const std::vector<double>& reference) const {
  TORCH_CHECK(micro.batch != nullptr, "preference: the micro-batch's host batch is needed");
  const data::Batch& b = *micro.batch;
  const auto n = static_cast<int64_t>(b.example_indices.size());
  TORCH_CHECK(n % 2 == 0, "preference: a micro-batch of ", n, " sequences is not whole pairs");
  const SequenceLogprobs s = sequence_logprobs(model, micro.inputs, b);
  const at::Device dev = s.sums.device();
  auto even = [&](const at::Tensor& t) { return t.slice(0, 0, n, 2); };
  auto odd = [&](const at::Tensor& t) { return t.slice(0, 1, n, 2); };
  PreferencePairs pairs;
  pairs.chosen_logps = even(s.sums);
  pairs.rejected_logps = odd(s.sums);
  pairs.chosen_tokens = even(s.tokens).to(dev);
  pairs.rejected_tokens = odd(s.tokens).to(dev);
  TORCH_CHECK(at::all(s.tokens.gt(0)).item<bool>(),
              "preference: an answer has no supervised token left (train.seq_len cut it away)");
  if (loss_.kind != PreferenceLossKind::kSimpo) {
    std::vector<double> r;
    r.reserve(static_cast<size_t>(n));
    for (int64_t e : b.example_indices) r.push_back(reference.at(static_cast<size_t>(e)));
    const at::Tensor ref = at::tensor(r, at::kDouble).to(dev, at::kFloat);
    pairs.ref_chosen_logps = even(ref);
    pairs.ref_rejected_logps = odd(ref);
  }
  const PreferenceLossOutput lo = preference_loss(pairs, loss_);
  ObjectiveOutput out;
  out.loss_sum = lo.losses.sum();
  const at::Tensor cr = lo.chosen_rewards, rr = lo.rejected_rewards;
  const at::Tensor wins = cr.gt(rr).to(at::kFloat) + cr.eq(rr).to(at::kFloat) * 0.5;
  out.logged = {{"rewards/chosen", cr.sum()},
                {"rewards/rejected", rr.sum()},
                {"rewards/margins", (cr - rr).sum()},
                {"rewards/accuracies", wins.sum()},
                {"logps/chosen", pairs.chosen_logps.detach().sum()},
                {"logps/rejected", pairs.rejected_logps.detach().sum()}};
  if (sft_weight_ > 0) {
    // The chosen answer's mean cross-entropy per token, per pair (TRL's rpo_alpha term).
    const at::Tensor nll = -pairs.chosen_logps / pairs.chosen_tokens.to(at::kFloat);
    out.loss_sum = out.loss_sum + nll.sum() * sft_weight_;
    out.logged.emplace_back("nll_loss", nll.detach().sum());
  }
  return out;
}

}  // namespace q4::trainer
