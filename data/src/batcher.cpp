// Batcher: applies the truncation policy once, then streams batches epoch after epoch. Each
// epoch's order is a splitmix64 Fisher-Yates permutation of (seed, epoch), so the whole stream
// is a pure function of (examples, options) and a BatcherState {epoch, cursor} is enough to
// resume exactly. Packing fills each row greedily with consecutive examples of that order.
#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/data/dataset.h"

namespace q4::data {
namespace {

uint64_t splitmix64(uint64_t* x) {
  uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

int64_t supervised_from(const std::vector<TokenId>& labels, size_t begin) {
  int64_t n = 0;
  for (size_t i = begin; i < labels.size(); ++i) n += labels[i] != kIgnoreIndex;
  return n;
}

// The windows of an example longer than `max_len` (Truncation::kSplit): `max_len` tokens each
// (the last one shorter), each starting on the last token of the one before, so that every
// label at positions >= 1 is a target (never at a row's position 0) of exactly one window.
void split_into_windows(Example&& ex, size_t max_len, std::vector<Example>* out,
                        TruncationStats* stats) {
  const size_t len = ex.input_ids.size();
  ++stats->split;
  int64_t k = 0;
  for (size_t start = 0;; start += max_len - 1) {
    const size_t end = std::min(len, start + max_len);
    Example w;
    w.source_line = ex.source_line;
    w.plain_text = ex.plain_text;
    w.window = k++;
    w.input_ids.assign(ex.input_ids.begin() + static_cast<std::ptrdiff_t>(start),
                       ex.input_ids.begin() + static_cast<std::ptrdiff_t>(end));
    w.labels.assign(ex.labels.begin() + static_cast<std::ptrdiff_t>(start),
                    ex.labels.begin() + static_cast<std::ptrdiff_t>(end));
    out->push_back(std::move(w));
    ++stats->windows;
    if (end == len) break;
  }
}

}  // namespace

Truncation parse_truncation(const std::string& name) {
  const auto t = io::enum_from_name<Truncation>(name);
  TORCH_CHECK(t.has_value(), "truncation: expected ", io::enum_choices<Truncation>(), ", found \"",
              name, "\"");
  return *t;
}

std::string to_string(Truncation t) { return io::enum_name(t); }

std::string describe(Truncation t) {
  if (t == Truncation::kAuto) return "auto: plain text split into windows, other records cut_left";
  return to_string(t);
}

int64_t TruncationStats::supervised_tokens_lost() const {
  return supervised_tokens_cut + supervised_tokens_dropped;
}

double TruncationStats::lost_share() const {
  return supervised_tokens_in > 0 ? static_cast<double>(supervised_tokens_lost()) /
                                        static_cast<double>(supervised_tokens_in)
                                  : 0.0;
}

std::string TruncationStats::to_string() const {
  std::ostringstream s;
  s << examples_in << " examples, " << kept << " kept (" << truncated << " truncated), " << dropped
    << " dropped (" << dropped_unsupervised << " with nothing to supervise)";
  if (split > 0) s << ", " << split << " split into " << windows << " windows";
  s << "; " << supervised_tokens_lost() << " of " << supervised_tokens_in
    << " supervised tokens lost (" << fmt::format("{:.1f}", 100.0 * lost_share()) << "%";
  if (supervised_tokens_lost() > 0) {
    s << ": " << supervised_tokens_cut << " cut from truncated examples, "
      << supervised_tokens_dropped << " in dropped ones";
  }
  s << "), longest " << longest_tokens << " tokens";
  return s.str();
}

std::string truncation_warning(const TruncationStats& stats, int64_t max_seq_len,
                               Truncation truncation, const std::string& seq_len_key,
                               const std::string& truncation_key) {
  if (stats.lost_share() <= kTruncationWarnShare) return "";
  // auto and split lose no plain text; under the other policies long documents are cut too.
  std::string advice = "raise " + seq_len_key;
  if (truncation != Truncation::kAuto && truncation != Truncation::kSplit) {
    advice += ", or for plain text set " + truncation_key +
              " auto or split (every token trained, in windows)";
  }
  return fmt::format(
      "truncation to {} tokens ({}) loses {} of {} supervised tokens ({:.1f}%, over {:.0f}%): {} "
      "examples truncated, {} dropped; {}",
      max_seq_len, to_string(truncation), stats.supervised_tokens_lost(),
      stats.supervised_tokens_in, 100.0 * stats.lost_share(), 100.0 * kTruncationWarnShare,
      stats.truncated, stats.dropped - stats.dropped_unsupervised, advice);
}

std::string BatcherState::to_json() const {
  nlohmann::json j = {{"seed", seed},
                      {"epoch", epoch},
                      {"cursor", cursor},
                      {"batches", batches},
                      {"num_examples", num_examples},
                      {"pending", pending}};
  return j.dump();
}

BatcherState BatcherState::from_json(const std::string& text) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    TORCH_CHECK(false, "batcher state: not valid JSON: ", e.what());
  }
  TORCH_CHECK(j.is_object(), "batcher state: expected a JSON object");
  BatcherState s;
  auto get_int = [&](const char* key) -> int64_t {
    TORCH_CHECK(j.contains(key) && j[key].is_number_integer(), "batcher state: key \"", key,
                "\": expected an integer");
    return j[key].get<int64_t>();
  };
  TORCH_CHECK(j.contains("seed") && j["seed"].is_number_unsigned(),
              "batcher state: key \"seed\": expected an unsigned integer");
  s.seed = j["seed"].get<uint64_t>();
  s.epoch = get_int("epoch");
  s.cursor = get_int("cursor");
  s.batches = get_int("batches");
  s.num_examples = get_int("num_examples");
  TORCH_CHECK(s.epoch >= 0 && s.cursor >= 0 && s.batches >= 0 && s.num_examples >= 0,
              "batcher state: negative value in ", text);
  if (j.contains("pending")) {  // absent in states written before best-fit packing
    TORCH_CHECK(j["pending"].is_array(), "batcher state: key \"pending\": expected an array");
    for (const auto& v : j["pending"]) {
      TORCH_CHECK(v.is_number_integer() && v.get<int64_t>() >= 0,
                  "batcher state: key \"pending\": expected example indices >= 0");
      s.pending.push_back(v.get<int64_t>());
    }
  }
  return s;
}

at::Tensor block_causal_mask(const at::Tensor& segment_ids) {
  TORCH_CHECK(segment_ids.dim() == 2 && segment_ids.scalar_type() == at::kLong,
              "block_causal_mask: expected int64 [B, T] segment_ids, found ",
              segment_ids.scalar_type(), " ", segment_ids.sizes());
  const int64_t t = segment_ids.size(1);
  const auto opts = segment_ids.options().dtype(at::kBool);
  const at::Tensor q = segment_ids.unsqueeze(2);                 // [B, T, 1]
  const at::Tensor k = segment_ids.unsqueeze(1);                 // [B, 1, T]
  at::Tensor allowed = q.eq(k).logical_and(q.ne(0));             // [B, T, T]
  allowed = allowed.logical_and(at::ones({t, t}, opts).tril());  // causal
  allowed = allowed.logical_or(at::eye(t, opts));                // padding rows see themselves
  return allowed.unsqueeze(1);                                   // [B, 1, T, T]
}

namespace {

// The options' own rules, and those a group size above 1 adds.
void check_batcher_options(const BatcherOptions& o, size_t num_examples) {
  TORCH_CHECK(o.batch_size >= 1, "batch_size: expected >= 1, found ", o.batch_size);
  TORCH_CHECK(o.max_seq_len >= 2, "max_seq_len: expected >= 2, found ", o.max_seq_len);
  TORCH_CHECK(o.pad_id >= 0, "pad_id: expected a valid token id >= 0, found ", o.pad_id);
  TORCH_CHECK(o.pack_window >= 1, "pack_window: expected >= 1, found ", o.pack_window);
  TORCH_CHECK(o.pad_multiple >= 1, "pad_multiple: expected >= 1, found ", o.pad_multiple);
  const int64_t g = o.group;
  TORCH_CHECK(g >= 1, "group: expected >= 1, found ", g);
  if (g > 1) {
    TORCH_CHECK(o.batch_size % g == 0, "batch_size ", o.batch_size,
                " must be a multiple of the group size ", g, " (whole pairs in every batch)");
    TORCH_CHECK(!o.pack, "packing would separate the examples of a group of ", g);
    TORCH_CHECK(o.truncation != Truncation::kSplit,
                "split truncation would separate the examples of a group of ", g);
    TORCH_CHECK(static_cast<int64_t>(num_examples) % g == 0, "found ", num_examples,
                " examples, not whole groups of ", g);
  }
}

// Split truncation, first: kSplit splits every long example, kAuto the plain-text documents
// (never a group's: check_batcher_options keeps kSplit away from groups). Also counts the
// longest example and the supervised tokens that come in.
std::vector<Example> split_long_examples(std::vector<Example> in, const BatcherOptions& o,
                                         TruncationStats* stats) {
  const auto max_len = static_cast<size_t>(o.max_seq_len);
  std::vector<Example> examples;
  examples.reserve(in.size());
  for (Example& ex : in) {
    const size_t len = ex.input_ids.size();
    stats->longest_tokens = std::max(stats->longest_tokens, static_cast<int64_t>(len));
    stats->supervised_tokens_in += supervised_from(ex.labels, 1);
    const bool split = o.truncation == Truncation::kSplit ||
                       (o.truncation == Truncation::kAuto && ex.plain_text && o.group == 1);
    if (split && len > max_len && ex.labels.size() == len) {  // a size mismatch: reported later
      split_into_windows(std::move(ex), max_len, &examples, stats);
    } else {
      examples.push_back(std::move(ex));
    }
  }
  return examples;
}

// Cuts an example longer than max_len to the window of max_len tokens that is kept. cut_left:
// the end (the answer and some of the prompt); cut_right: the start. When that window would
// lose every supervised token but the first (cut_left: the supervised part plus one context
// token is longer than the window; cut_right: the prompt fills it), the window starts half a
// window before the first supervised token instead: the end of the prompt, then as much of the
// answer as fits.
void cut_to_window(Example& ex, size_t max_len, Truncation truncation) {
  const size_t len = ex.input_ids.size();
  const auto first = static_cast<size_t>(std::find_if(ex.labels.begin(), ex.labels.end(),
                                                      [](TokenId l) { return l != kIgnoreIndex; }) -
                                         ex.labels.begin());
  auto supervised_in = [&](size_t start) {
    int64_t n = 0;
    for (size_t k = start + 1; k < start + max_len; ++k) n += ex.labels[k] != kIgnoreIndex;
    return n;
  };
  size_t start = truncation == Truncation::kCutRight ? 0 : len - max_len;
  const bool answer_fits = first < len && len - first + 1 <= max_len;
  if ((truncation != Truncation::kCutRight && !answer_fits) || supervised_in(start) == 0) {
    start = first < len ? std::min(len - max_len, first - std::min(first, max_len / 2)) : 0;
  }
  ex.input_ids.erase(ex.input_ids.begin() + static_cast<std::ptrdiff_t>(start + max_len),
                     ex.input_ids.end());
  ex.labels.erase(ex.labels.begin() + static_cast<std::ptrdiff_t>(start + max_len),
                  ex.labels.end());
  ex.input_ids.erase(ex.input_ids.begin(),
                     ex.input_ids.begin() + static_cast<std::ptrdiff_t>(start));
  ex.labels.erase(ex.labels.begin(), ex.labels.begin() + static_cast<std::ptrdiff_t>(start));
}

// Applies the truncation policy to example i; returns its supervised tokens as kept, 0 when it
// is dropped (then its input_ids are cleared, which marks it dropped for its group).
int64_t truncate_example(Example& ex, size_t i, const BatcherOptions& o, TruncationStats* stats) {
  const auto max_len = static_cast<size_t>(o.max_seq_len);
  TORCH_CHECK(ex.input_ids.size() == ex.labels.size(), "example ", i, " (line ", ex.source_line,
              "): input_ids has ", ex.input_ids.size(), " tokens but labels has ",
              ex.labels.size());
  const size_t len = ex.input_ids.size();
  bool keep = true;
  if (len > max_len && o.truncation == Truncation::kDrop) {
    keep = false;
    stats->supervised_tokens_dropped += supervised_from(ex.labels, 1);
  } else if (len > max_len) {
    // Position 0 of a row is never a target, so only labels at positions >= 1 count.
    const int64_t before = supervised_from(ex.labels, 1);
    cut_to_window(ex, max_len, o.truncation);
    stats->supervised_tokens_cut += before - supervised_from(ex.labels, 1);
    ++stats->truncated;
    if (supervised_from(ex.labels, 1) == 0) --stats->truncated;
  }
  const int64_t supervised = keep ? supervised_from(ex.labels, 1) : 0;
  if (keep && supervised == 0) {
    keep = false;
    ++stats->dropped_unsupervised;
  }
  if (!keep) {
    ++stats->dropped;
    ex.input_ids.clear();
    return supervised;
  }
  for (TokenId id : ex.input_ids) {
    TORCH_CHECK(id >= 0, "example ", i, " (line ", ex.source_line, "): negative token id ", id);
  }
  return supervised;
}

// Moves the kept examples to `out`, a group only when all of its examples are kept; a group's
// kept examples are counted dropped otherwise.
void keep_whole_groups(std::vector<Example>& examples, const std::vector<int64_t>& supervised,
                       int64_t g, std::vector<Example>* out, TruncationStats* stats) {
  for (size_t i = 0; i < examples.size(); i += static_cast<size_t>(g)) {
    const auto first = examples.begin() + static_cast<std::ptrdiff_t>(i);
    const auto last = first + g;
    const auto kept = std::count_if(first, last, [](const Example& e) { return !e.input_ids.empty(); });
    if (kept < g) {
      stats->dropped += kept;
      for (size_t k = i; k < i + static_cast<size_t>(g); ++k) {
        stats->supervised_tokens_dropped += supervised[k];
      }
      continue;
    }
    for (auto it = first; it != last; ++it) out->push_back(std::move(*it));
  }
}

// drop_last needs at least one full batch.
void check_drop_last(const std::vector<Example>& examples, const BatcherOptions& o,
                     const TruncationStats& stats) {
  if (!o.drop_last) return;
  if (o.pack) {
    int64_t total = 0;
    for (const auto& ex : examples) total += static_cast<int64_t>(ex.input_ids.size());
    // Greedy rows hold <= max_seq_len tokens, so this many tokens always need batch_size rows.
    TORCH_CHECK(total > (o.batch_size - 1) * o.max_seq_len,
                "batcher: drop_last with packing needs more than (batch_size-1)*max_seq_len = ",
                (o.batch_size - 1) * o.max_seq_len, " tokens, found ", total);
  } else {
    TORCH_CHECK(stats.kept >= o.batch_size,
                "batcher: drop_last needs at least batch_size=", o.batch_size, " examples, found ",
                stats.kept);
  }
}

}  // namespace

Batcher::Batcher(std::vector<Example> examples, const BatcherOptions& options) : options_(options) {
  check_batcher_options(options_, examples.size());
  examples = split_long_examples(std::move(examples), options_, &stats_);
  stats_.examples_in = static_cast<int64_t>(examples.size());
  std::vector<int64_t> supervised(examples.size(), 0);  // of each example as kept
  for (size_t i = 0; i < examples.size(); ++i) {
    supervised[i] = truncate_example(examples[i], i, options_, &stats_);
  }
  keep_whole_groups(examples, supervised, options_.group, &examples_, &stats_);
  stats_.kept = static_cast<int64_t>(examples_.size());
  TORCH_CHECK(!examples_.empty(), "no example left to train on after truncation to ",
              options_.max_seq_len, " tokens (", stats_.to_string(), ")",
              options_.truncation == Truncation::kDrop
                  ? "; the drop policy removes every example longer than that"
                  : "");
  check_drop_last(examples_, options_, stats_);
  state_.seed = options_.seed;
  state_.num_examples = stats_.kept;
  // Batches in epoch 0 (exact without packing).
  const std::vector<int64_t> order0 = permutation(0);
  BatcherState sim = state_;
  for (auto rows = plan_rows(order0, &sim); !rows.empty(); rows = plan_rows(order0, &sim)) {
    ++batches_per_epoch_;
    rows_per_epoch_ += static_cast<int64_t>(rows.size());
  }
}

std::vector<int64_t> Batcher::permutation(int64_t epoch) const {
  const int64_t g = options_.group;
  const auto n = static_cast<int64_t>(examples_.size()) / g;  // groups (examples when g is 1)
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  if (!options_.shuffle) return expand_groups(order);
  uint64_t x = options_.seed;
  x = splitmix64(&x) ^ (static_cast<uint64_t>(epoch) * 0xD1B54A32D192ED03ULL);
  for (int64_t i = n - 1; i > 0; --i) {
    // Unbiased-enough bounded draw (multiply-shift); portable and identical everywhere.
    const uint64_t r = splitmix64(&x);
    const auto j = static_cast<int64_t>(
        (static_cast<unsigned __int128>(r) * static_cast<uint64_t>(i + 1)) >> 64);
    std::swap(order[i], order[j]);
  }
  return expand_groups(order);
}

std::vector<int64_t> Batcher::expand_groups(const std::vector<int64_t>& groups) const {
  const int64_t g = options_.group;
  if (g == 1) return groups;
  std::vector<int64_t> order;
  order.reserve(groups.size() * static_cast<size_t>(g));
  for (int64_t k : groups) {
    for (int64_t m = 0; m < g; ++m) order.push_back(k * g + m);
  }
  return order;
}

std::vector<int64_t> Batcher::plan_row(const std::vector<int64_t>& order, BatcherState* st) const {
  const auto n = static_cast<int64_t>(order.size());
  auto len_of = [&](int64_t e) { return static_cast<int64_t>(examples_[e].input_ids.size()); };
  std::vector<int64_t> row;
  if (!options_.pack) {
    if (st->cursor < n) row.push_back(order[st->cursor++]);
    return row;
  }
  auto& pending = st->pending;
  auto refill = [&] {
    while (static_cast<int64_t>(pending.size()) < options_.pack_window && st->cursor < n) {
      pending.push_back(order[st->cursor++]);
    }
  };
  refill();
  if (pending.empty()) return row;
  // The oldest pending example opens the row, so none waits longer than a window's worth of
  // rows; then best fit: the longest pending example that fits what is left (earliest on ties).
  int64_t len = len_of(pending.front());
  row.push_back(pending.front());
  pending.erase(pending.begin());
  while (len < options_.max_seq_len) {
    refill();
    const int64_t room = options_.max_seq_len - len;
    int64_t best = -1, best_len = 0;
    for (size_t i = 0; i < pending.size(); ++i) {
      const int64_t l = len_of(pending[i]);
      if (l <= room && l > best_len) {
        best = static_cast<int64_t>(i);
        best_len = l;
        if (l == room) break;
      }
    }
    if (best < 0) break;
    row.push_back(pending[best]);
    pending.erase(pending.begin() + best);
    len += best_len;
  }
  return row;
}

std::vector<std::vector<int64_t>> Batcher::plan_rows(const std::vector<int64_t>& order,
                                                     BatcherState* st) const {
  std::vector<std::vector<int64_t>> rows;
  while (static_cast<int64_t>(rows.size()) < options_.batch_size) {
    auto row = plan_row(order, st);
    if (row.empty()) break;
    rows.push_back(std::move(row));
  }
  if (options_.drop_last && static_cast<int64_t>(rows.size()) < options_.batch_size) {
    rows.clear();
    st->cursor = static_cast<int64_t>(order.size());
    st->pending.clear();
  }
  return rows;
}

Batch Batcher::next() {
  const int64_t n = static_cast<int64_t>(examples_.size());
  std::vector<std::vector<int64_t>> rows;
  for (int attempts = 0; rows.empty(); ++attempts) {
    TORCH_INTERNAL_ASSERT(attempts < 4, "batcher: no batch could be formed");
    if (state_.cursor >= n && state_.pending.empty()) {
      ++state_.epoch;
      state_.cursor = 0;
    }
    if (order_epoch_ != state_.epoch) {
      order_ = permutation(state_.epoch);
      order_epoch_ = state_.epoch;
    }
    rows = plan_rows(order_, &state_);
    if (rows.empty()) {  // dropped short tail of the epoch
      state_.cursor = n;
      state_.pending.clear();
    }
  }

  Batch b;
  b.epoch = state_.epoch;
  const int64_t max_len =
      options_.flatten ? options_.max_seq_len * options_.batch_size : options_.max_seq_len;
  if (options_.flatten) {
    std::vector<int64_t> all;
    for (const auto& row : rows) all.insert(all.end(), row.begin(), row.end());
    rows.assign(1, all);
  }
  const auto num_rows = static_cast<int64_t>(rows.size());
  int64_t t = 0;
  for (const auto& row : rows) {
    int64_t len = 0;
    for (int64_t e : row) len += static_cast<int64_t>(examples_[e].input_ids.size());
    t = std::max(t, len);
  }
  if (options_.fixed_len) {
    t = max_len;
  } else {
    t = std::min(max_len,
                 (t + options_.pad_multiple - 1) / options_.pad_multiple * options_.pad_multiple);
  }
  const auto opts = at::TensorOptions().dtype(at::kLong);
  b.input_ids = at::full({num_rows, t}, options_.pad_id, opts);
  b.labels = at::full({num_rows, t}, static_cast<int64_t>(kIgnoreIndex), opts);
  b.attention_mask = at::zeros({num_rows, t}, opts);
  b.position_ids = at::zeros({num_rows, t}, opts);
  b.segment_ids = at::zeros({num_rows, t}, opts);
  int64_t* ids = b.input_ids.data_ptr<int64_t>();
  int64_t* labels = b.labels.data_ptr<int64_t>();
  int64_t* mask = b.attention_mask.data_ptr<int64_t>();
  int64_t* pos = b.position_ids.data_ptr<int64_t>();
  int64_t* seg = b.segment_ids.data_ptr<int64_t>();
  std::vector<int32_t> cu{0};
  auto boundary = [&](int64_t at) {
    b.max_seqlen = std::max<int64_t>(b.max_seqlen, at - cu.back());
    cu.push_back(static_cast<int32_t>(at));
  };
  for (int64_t r = 0; r < num_rows; ++r) {
    int64_t at = r * t;
    int64_t segment = 0;
    for (int64_t e : rows[r]) {
      const Example& ex = examples_[e];
      ++segment;
      if (at != cu.back()) boundary(at);  // a previous row's padding tail
      for (size_t k = 0; k < ex.input_ids.size(); ++k, ++at) {
        ids[at] = ex.input_ids[k];
        // The first token of a segment is never a target: its logit row belongs to the
        // previous example (or does not exist).
        labels[at] = k == 0 ? kIgnoreIndex : ex.labels[k];
        mask[at] = 1;
        pos[at] = static_cast<int64_t>(k);
        seg[at] = segment;
        b.real_tokens += 1;
        b.supervised_tokens += labels[at] != kIgnoreIndex;
      }
      boundary(at);
      b.example_indices.push_back(e);
    }
  }
  if (cu.back() != num_rows * t) boundary(num_rows * t);
  b.cu_seqlens = at::from_blob(cu.data(), {static_cast<int64_t>(cu.size())},
                               at::TensorOptions().dtype(at::kInt))
                     .clone();
  ++state_.batches;
  return b;
}

BatcherState Batcher::state() const { return state_; }

void Batcher::restore(const BatcherState& s) {
  TORCH_CHECK(s.seed == options_.seed, "batcher resume: state seed ", s.seed,
              " does not match options seed ", options_.seed);
  TORCH_CHECK(s.num_examples == stats_.kept, "batcher resume: state was saved with ",
              s.num_examples, " examples, this data has ", stats_.kept,
              " (different data or truncation settings)");
  TORCH_CHECK(s.epoch >= 0 && s.cursor >= 0 && s.cursor <= stats_.kept && s.batches >= 0,
              "batcher resume: invalid state ", s.to_json());
  TORCH_CHECK(options_.pack || s.pending.empty(),
              "batcher resume: the state has packing's pending examples but packing is off");
  for (int64_t e : s.pending) {
    TORCH_CHECK(e < stats_.kept, "batcher resume: pending example ", e, " is out of range");
  }
  state_ = s;
}

int64_t Batcher::num_examples() const { return static_cast<int64_t>(examples_.size()); }
int64_t Batcher::batches_per_epoch() const { return batches_per_epoch_; }
int64_t Batcher::rows_per_epoch() const { return rows_per_epoch_; }
const TruncationStats& Batcher::truncation_stats() const { return stats_; }
const BatcherOptions& Batcher::options() const { return options_; }
const std::vector<Example>& Batcher::examples() const { return examples_; }

}  // namespace q4::data
