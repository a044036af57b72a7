// Batcher tests on synthetic examples (no tokenizer): padding and masks, truncation policies and
// their counts, seeded determinism and epoch coverage, exact resume from a saved state, packing
// without cross-example attention (segment ids, restarted positions, block-causal mask).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "q4/data/dataset.h"

namespace q4::data {
namespace {

constexpr TokenId kI = kIgnoreIndex;

// Example i: `prompt` unsupervised tokens then `answer` supervised ones; ids encode (i, k) so
// any mix-up is visible.
Example make(int i, int prompt, int answer) {
  Example e;
  for (int k = 0; k < prompt + answer; ++k) {
    e.input_ids.push_back(1000 * (i + 1) + k);
    e.labels.push_back(k < prompt ? kI : 1000 * (i + 1) + k);
  }
  e.source_line = i + 1;
  return e;
}

std::vector<Example> make_many(int n, int seed_len = 3) {
  std::vector<Example> v;
  for (int i = 0; i < n; ++i) v.push_back(make(i, 2 + (i * 7) % 5, 1 + (i * seed_len) % 4));
  return v;
}

// Shuffled batches of `batch` rows of at most `seq_len` tokens, packed or not.
BatcherOptions shuffled(int64_t batch, int64_t seq_len, bool pack, uint64_t seed) {
  BatcherOptions o;
  o.batch_size = batch;
  o.max_seq_len = seq_len;
  o.pack = pack;
  o.seed = seed;
  return o;
}

std::vector<int64_t> row(const at::Tensor& t, int64_t r) {
  const at::Tensor c = t[r].contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void expect_batches_equal(const Batch& a, const Batch& b) {
  EXPECT_TRUE(at::equal(a.input_ids, b.input_ids));
  EXPECT_TRUE(at::equal(a.labels, b.labels));
  EXPECT_TRUE(at::equal(a.attention_mask, b.attention_mask));
  EXPECT_TRUE(at::equal(a.position_ids, b.position_ids));
  EXPECT_TRUE(at::equal(a.segment_ids, b.segment_ids));
  EXPECT_EQ(a.example_indices, b.example_indices);
  EXPECT_EQ(a.epoch, b.epoch);
}

// Groups (preference pairs): shuffling moves whole pairs, every batch holds whole pairs in
// order (chosen, rejected), a pair whose one example is dropped goes whole, the stream resumes
// exactly, and what cannot keep a group together is refused.
TEST(Batcher, GroupsStayTogether) {
  BatcherOptions o = shuffled(4, 12, false, 9);
  o.group = 2;
  o.truncation = Truncation::kDrop;
  std::vector<Example> ex = make_many(20);
  ex[7] = make(7, 10, 5);  // 15 tokens > 12: dropped, and its pair (6, 7) with it
  Batcher b(ex, o);
  EXPECT_EQ(b.truncation_stats().kept, 18);
  EXPECT_EQ(b.truncation_stats().dropped, 2);
  std::set<int64_t> seen;
  std::vector<int64_t> first_epoch;
  for (int i = 0; i < 5; ++i) {  // 18 examples in batches of 4: 4 + 4 + 4 + 4 + 2
    const Batch batch = b.next();
    const auto& idx = batch.example_indices;
    ASSERT_EQ(idx.size() % 2, 0u);
    for (size_t k = 0; k < idx.size(); k += 2) {
      EXPECT_EQ(idx[k] % 2, 0) << "a pair starts with its first example";
      EXPECT_EQ(idx[k + 1], idx[k] + 1) << "the pair's second example follows";
      // Rows carry the examples themselves: the first token names the source example.
      const int64_t src0 = row(batch.input_ids, static_cast<int64_t>(k))[0] / 1000 - 1;
      const int64_t src1 = row(batch.input_ids, static_cast<int64_t>(k) + 1)[0] / 1000 - 1;
      EXPECT_EQ(src1, src0 + 1);
      EXPECT_EQ(src0 % 2, 0);
      EXPECT_NE(src0, 6);  // the dropped pair
    }
    for (int64_t i2 : idx) seen.insert(i2), first_epoch.push_back(i2);
  }
  EXPECT_EQ(seen.size(), 18u);
  // Not the file order: pairs were shuffled.
  std::vector<int64_t> sorted = first_epoch;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_NE(first_epoch, sorted);
  // Exact resume mid-epoch.
  Batcher c(ex, o);
  c.next();
  const auto st = c.state();
  const Batch want = c.next();
  Batcher d(ex, o);
  d.restore(st);
  expect_batches_equal(d.next(), want);
  // Group 1 keeps the stream it always had.
  BatcherOptions one = shuffled(4, 12, false, 9);
  Batcher e1(make_many(20), one), e2(make_many(20), [&] {
    BatcherOptions x = one;
    x.group = 1;
    return x;
  }());
  for (int i = 0; i < 6; ++i) expect_batches_equal(e1.next(), e2.next());
  // Refused: an odd batch, packing, split truncation, a partial group.
  BatcherOptions bad = o;
  bad.batch_size = 3;
  EXPECT_THROW(Batcher(make_many(20), bad), c10::Error);
  bad = o;
  bad.pack = true;
  EXPECT_THROW(Batcher(make_many(20), bad), c10::Error);
  bad = o;
  bad.truncation = Truncation::kSplit;
  EXPECT_THROW(Batcher(make_many(20), bad), c10::Error);
  EXPECT_THROW(Batcher(make_many(19), o), c10::Error);
}

TEST(Batcher, PadsToLongestWithMasks) {
  BatcherOptions o;
  o.batch_size = 3;
  o.shuffle = false;
  o.pad_id = 7;
  Batcher b({make(0, 2, 2), make(1, 4, 3), make(2, 1, 1)}, o);
  const Batch x = b.next();
  ASSERT_EQ(x.input_ids.sizes(), (std::vector<int64_t>{3, 7}));
  for (const auto* t :
       {&x.input_ids, &x.labels, &x.attention_mask, &x.position_ids, &x.segment_ids}) {
    EXPECT_EQ(t->scalar_type(), at::kLong);
    EXPECT_EQ(t->sizes(), x.input_ids.sizes());
  }
  EXPECT_EQ(row(x.input_ids, 0), (std::vector<int64_t>{1000, 1001, 1002, 1003, 7, 7, 7}));
  // Position 0 is never a target (nothing predicts it); pads are ignored.
  EXPECT_EQ(row(x.labels, 0), (std::vector<int64_t>{kI, kI, 1002, 1003, kI, kI, kI}));
  EXPECT_EQ(row(x.attention_mask, 0), (std::vector<int64_t>{1, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(row(x.position_ids, 0), (std::vector<int64_t>{0, 1, 2, 3, 0, 0, 0}));
  EXPECT_EQ(row(x.segment_ids, 0), (std::vector<int64_t>{1, 1, 1, 1, 0, 0, 0}));
  EXPECT_EQ(row(x.attention_mask, 1), (std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1}));
  EXPECT_EQ(row(x.labels, 2), (std::vector<int64_t>{kI, 3001, kI, kI, kI, kI, kI}));
  EXPECT_EQ(x.real_tokens, 4 + 7 + 2);
  EXPECT_EQ(x.supervised_tokens, 2 + 3 + 1);
  EXPECT_EQ(x.supervised_tokens, x.labels.slice(1, 1).ne(kI).sum().item<int64_t>());
  EXPECT_EQ(x.example_indices, (std::vector<int64_t>{0, 1, 2}));
}

TEST(Batcher, CutLeftKeepsAnswerAndTruncatesWhatCannotFit) {
  BatcherOptions o;
  o.max_seq_len = 8;
  o.shuffle = false;
  o.batch_size = 4;
  // 0: fits. 1: long prompt (10) + answer 3 -> cut to the last 8. 2: answer 8 > 7 -> the window
  // starts at the prompt (2 < 8 / 2 tokens before the answer): prompt + first 6 answer tokens.
  // 3: exactly 7 answer tokens + >= 1 context -> kept. 4: no supervision -> dropped.
  Batcher b({make(0, 3, 2), make(1, 10, 3), make(2, 2, 8), make(3, 5, 7), make(4, 3, 0)}, o);
  const auto& s = b.truncation_stats();
  EXPECT_EQ(s.examples_in, 5);
  EXPECT_EQ(s.kept, 4);
  EXPECT_EQ(s.truncated, 3);
  EXPECT_EQ(s.dropped, 1);
  EXPECT_EQ(s.dropped_unsupervised, 1);
  EXPECT_EQ(s.supervised_tokens_cut, 2);
  EXPECT_EQ(s.longest_tokens, 13);
  const auto& ex = b.examples();
  ASSERT_EQ(ex.size(), 4u);
  EXPECT_EQ(ex[1].input_ids,
            (std::vector<TokenId>{2005, 2006, 2007, 2008, 2009, 2010, 2011, 2012}));
  EXPECT_EQ(ex[1].labels, (std::vector<TokenId>{kI, kI, kI, kI, kI, 2010, 2011, 2012}));
  EXPECT_EQ(ex[2].labels, (std::vector<TokenId>{kI, kI, 3002, 3003, 3004, 3005, 3006, 3007}));
  EXPECT_EQ(ex[3].labels[0], kI);  // one context token kept before the answer
  EXPECT_EQ(
      std::count_if(ex[3].labels.begin(), ex[3].labels.end(), [](TokenId l) { return l != kI; }),
      7);
  const Batch x = b.next();
  EXPECT_LE(x.input_ids.size(1), 8);
  EXPECT_NE(s.to_string().find("3 truncated"), std::string::npos) << s.to_string();
  EXPECT_NE(
      s.to_string().find("2 of 20 supervised tokens lost (10.0%: 2 cut from truncated examples"),
      std::string::npos)
      << s.to_string();
}

// A chat example whose prompt alone is longer than the window, or whose answer is: truncated (the
// end of the prompt, then the start of the answer), never dropped, under both cut policies.
TEST(Batcher, LongChatExamplesAreTruncatedNotDropped) {
  BatcherOptions o;
  o.max_seq_len = 8;
  o.shuffle = false;
  for (Truncation t : {Truncation::kCutLeft, Truncation::kCutRight}) {
    o.truncation = t;
    // 0: prompt 20, answer 30 (both longer than the window). 1: prompt 12, answer 2.
    Batcher b({make(0, 20, 30), make(1, 12, 2)}, o);
    const auto& s = b.truncation_stats();
    EXPECT_EQ(s.kept, 2) << s.to_string();
    EXPECT_EQ(s.dropped, 0) << s.to_string();
    EXPECT_EQ(s.truncated, 2) << s.to_string();
    const auto& ex = b.examples();
    // Half a window (4 tokens) of prompt, then the first 4 answer tokens.
    EXPECT_EQ(ex[0].input_ids,
              (std::vector<TokenId>{1016, 1017, 1018, 1019, 1020, 1021, 1022, 1023}));
    EXPECT_EQ(ex[0].labels, (std::vector<TokenId>{kI, kI, kI, kI, 1020, 1021, 1022, 1023}));
    EXPECT_EQ(ex[1].labels, (std::vector<TokenId>{kI, kI, kI, kI, kI, kI, 2012, 2013}));
    EXPECT_EQ(s.supervised_tokens_cut, 30 - 4) << s.to_string();
  }
}

TEST(Batcher, CutRightAndDropPolicies) {
  BatcherOptions o;
  o.max_seq_len = 4;
  o.shuffle = false;
  o.truncation = Truncation::kCutRight;
  // Text-like: everything supervised, 6 tokens -> first 4 kept, 2 supervised tokens cut.
  // Example 1's prompt fills the first 4 tokens: the window moves to its answer.
  Batcher r({make(0, 0, 6), make(1, 5, 2)}, o);
  EXPECT_EQ(r.truncation_stats().kept, 2);
  EXPECT_EQ(r.truncation_stats().truncated, 2);
  EXPECT_EQ(r.truncation_stats().dropped, 0);
  EXPECT_EQ(r.truncation_stats().supervised_tokens_cut, 2);
  EXPECT_EQ(r.examples()[1].input_ids, (std::vector<TokenId>{2003, 2004, 2005, 2006}));
  EXPECT_EQ(r.examples()[0].input_ids, (std::vector<TokenId>{1000, 1001, 1002, 1003}));
  o.truncation = Truncation::kDrop;
  Batcher d({make(0, 0, 6), make(1, 1, 2)}, o);
  EXPECT_EQ(d.truncation_stats().kept, 1);
  EXPECT_EQ(d.truncation_stats().dropped, 1);
  EXPECT_EQ(d.truncation_stats().truncated, 0);
  EXPECT_THROW(Batcher({make(0, 0, 6)}, o), c10::Error);  // nothing left: an error, not silence
  EXPECT_EQ(parse_truncation("cut_right"), Truncation::kCutRight);
  EXPECT_THROW(parse_truncation("middle"), c10::Error);
}

// split: a long example becomes its windows, in order, each starting on the last token of the one
// before (the context of its first target), so that every label at positions >= 1 is a target of
// exactly one window; a window with nothing supervised after its first token is dropped like any
// such example.
TEST(Batcher, SplitPolicyTrainsEveryTokenOnce) {
  BatcherOptions o;
  o.max_seq_len = 4;
  o.shuffle = false;
  o.truncation = Truncation::kSplit;
  Batcher b({make(0, 0, 10), make(1, 5, 2), make(2, 0, 3)}, o);
  const auto& s = b.truncation_stats();
  EXPECT_EQ(s.split, 2);
  EXPECT_EQ(s.windows, 5);
  EXPECT_EQ(s.examples_in, 6);
  EXPECT_EQ(s.kept, 5);
  EXPECT_EQ(s.dropped_unsupervised, 1);  // example 1's first window: prompt only
  EXPECT_EQ(s.truncated, 0);
  EXPECT_EQ(s.supervised_tokens_cut, 0);
  EXPECT_EQ(s.supervised_tokens_in, 9 + 2 + 2);
  EXPECT_EQ(s.supervised_tokens_lost(), 0);
  EXPECT_EQ(s.longest_tokens, 10);
  ASSERT_EQ(b.examples().size(), 5u);
  const auto& ex = b.examples();
  EXPECT_EQ(ex[0].input_ids, (std::vector<TokenId>{1000, 1001, 1002, 1003}));
  EXPECT_EQ(ex[1].input_ids, (std::vector<TokenId>{1003, 1004, 1005, 1006}));
  EXPECT_EQ(ex[2].input_ids, (std::vector<TokenId>{1006, 1007, 1008, 1009}));
  EXPECT_EQ((std::vector<int64_t>{ex[0].window, ex[1].window, ex[2].window}),
            (std::vector<int64_t>{0, 1, 2}));
  EXPECT_EQ(ex[3].input_ids, (std::vector<TokenId>{2003, 2004, 2005, 2006}));
  EXPECT_EQ(ex[3].labels, (std::vector<TokenId>{kI, kI, 2005, 2006}));
  EXPECT_EQ(ex[3].source_line, 2);
  EXPECT_EQ(ex[3].window, 1);  // its window 0 (prompt only) was dropped
  EXPECT_EQ(ex[4].input_ids, (std::vector<TokenId>{3000, 3001, 3002}));
  EXPECT_EQ(ex[4].window, 0);
  // The targets (labels at positions >= 1) of all windows: each supervised label once.
  std::multiset<TokenId> targets;
  for (const auto& e : ex) {
    for (size_t k = 1; k < e.labels.size(); ++k) {
      if (e.labels[k] != kI) targets.insert(e.labels[k]);
    }
  }
  std::multiset<TokenId> want;
  for (const Example& e : {make(0, 0, 10), make(1, 5, 2), make(2, 0, 3)}) {
    for (size_t k = 1; k < e.labels.size(); ++k) {
      if (e.labels[k] != kI) want.insert(e.labels[k]);
    }
  }
  EXPECT_EQ(targets, want);
  EXPECT_NE(s.to_string().find("2 split into 5 windows"), std::string::npos) << s.to_string();
  EXPECT_EQ(parse_truncation("split"), Truncation::kSplit);
  // Every window length from 2 up: the windows of a 37-token document train its 36 targets.
  for (int64_t len = 2; len <= 12; ++len) {
    o.max_seq_len = len;
    Batcher w({make(0, 0, 37)}, o);
    int64_t trained = 0;
    for (const auto& e : w.examples()) trained += static_cast<int64_t>(e.labels.size()) - 1;
    EXPECT_EQ(trained, 36) << "max_seq_len " << len;
    EXPECT_EQ(w.examples().back().input_ids.back(), 1036) << "max_seq_len " << len;
  }
}

// The default (auto): a plain-text document is split into windows, every other example (a
// conversation, a prompt and its answer) is cut on the left as before; grouped examples are
// never split.
TEST(Batcher, AutoSplitsPlainTextAndCutsTheRest) {
  BatcherOptions o;
  EXPECT_EQ(o.truncation, Truncation::kAuto);
  o.max_seq_len = 4;
  o.shuffle = false;
  Example text = make(0, 0, 10);
  text.plain_text = true;
  Batcher b({text, make(1, 5, 2)}, o);
  const auto& s = b.truncation_stats();
  EXPECT_EQ(s.split, 1);
  EXPECT_EQ(s.windows, 3);
  EXPECT_EQ(s.truncated, 1);  // the chat example
  ASSERT_EQ(b.examples().size(), 4u);
  EXPECT_EQ(b.examples()[2].input_ids, (std::vector<TokenId>{1006, 1007, 1008, 1009}));
  EXPECT_TRUE(b.examples()[2].plain_text);
  EXPECT_EQ(b.examples()[3].input_ids, (std::vector<TokenId>{2003, 2004, 2005, 2006}));
  EXPECT_EQ(s.supervised_tokens_lost(), 0) << s.to_string();
  EXPECT_EQ(parse_truncation("auto"), Truncation::kAuto);
  EXPECT_NE(describe(Truncation::kAuto).find("plain text split"), std::string::npos);
  o.group = 2;
  o.batch_size = 2;
  Example other = make(2, 0, 9);
  other.plain_text = true;
  Batcher g({text, other}, o);
  EXPECT_EQ(g.truncation_stats().split, 0);
  EXPECT_EQ(g.examples().size(), 2u);
}

// What truncation loses is counted (cut from kept examples, and whole dropped examples and their
// group partners) against the supervised tokens given, and past 1% of them a warning names the
// settings to change.
TEST(Batcher, LostTokensAreCountedAndWarnedAbout) {
  BatcherOptions o;
  o.max_seq_len = 4;
  o.shuffle = false;
  o.truncation = Truncation::kCutRight;
  Batcher r({make(0, 0, 6), make(1, 1, 2)}, o);  // 5 + 2 supervised; 2 cut
  const auto& s = r.truncation_stats();
  EXPECT_EQ(s.supervised_tokens_in, 7);
  EXPECT_EQ(s.supervised_tokens_cut, 2);
  EXPECT_EQ(s.supervised_tokens_lost(), 2);
  EXPECT_DOUBLE_EQ(s.lost_share(), 2.0 / 7.0);
  EXPECT_NE(s.to_string().find("2 of 7 supervised tokens lost (28.6%"), std::string::npos)
      << s.to_string();
  const std::string w = truncation_warning(s, 4, o.truncation, "train.seq_len", "data.truncation");
  EXPECT_NE(w.find("loses 2 of 7 supervised tokens (28.6%"), std::string::npos) << w;
  EXPECT_NE(w.find("1 examples truncated"), std::string::npos) << w;
  EXPECT_NE(w.find("raise train.seq_len, or for plain text set data.truncation auto or split"),
            std::string::npos)
      << w;
  // drop: the whole example's supervised tokens, and (groups) its partner's.
  o.truncation = Truncation::kDrop;
  Batcher d({make(0, 0, 6), make(1, 1, 2)}, o);
  EXPECT_EQ(d.truncation_stats().supervised_tokens_dropped, 5);
  EXPECT_EQ(d.truncation_stats().supervised_tokens_lost(), 5);
  o.group = 2;
  o.batch_size = 2;
  Batcher g({make(0, 0, 6), make(1, 1, 2), make(2, 1, 2), make(3, 1, 1)}, o);
  EXPECT_EQ(g.truncation_stats().supervised_tokens_dropped, 5 + 2);
  EXPECT_EQ(g.truncation_stats().supervised_tokens_in, 5 + 2 + 2 + 1);
  // Nothing lost, or at most 1%: no warning.
  o = BatcherOptions{};
  o.max_seq_len = 4;
  Batcher none({make(0, 1, 2)}, o);
  EXPECT_EQ(truncation_warning(none.truncation_stats(), 4, o.truncation, "a", "b"), "");
  TruncationStats one;
  one.supervised_tokens_in = 1000;
  one.supervised_tokens_cut = 10;
  EXPECT_EQ(truncation_warning(one, 4, Truncation::kCutLeft, "a", "b"), "");
  one.supervised_tokens_cut = 11;
  EXPECT_NE(truncation_warning(one, 4, Truncation::kCutLeft, "a", "b"), "");
  // split loses nothing it can help: the advice is the window size alone.
  one.supervised_tokens_cut = 0;
  one.supervised_tokens_dropped = 11;
  EXPECT_EQ(truncation_warning(one, 4, Truncation::kSplit, "a", "b").find("set b"),
            std::string::npos);
}

TEST(Batcher, SeededShuffleIsDeterministicAndCoversEachEpoch) {
  BatcherOptions o;
  o.batch_size = 4;
  o.seed = 1234;
  const auto data = make_many(23);
  Batcher a(data, o), b(data, o);
  o.seed = 99;
  Batcher c(data, o);
  EXPECT_EQ(a.batches_per_epoch(), 6);  // 5 full + 1 of 3
  std::vector<int64_t> order_a, order_c;
  for (int k = 0; k < 12; ++k) {
    const Batch x = a.next(), y = b.next(), z = c.next();
    expect_batches_equal(x, y);
    if (k < 6) {
      EXPECT_EQ(x.epoch, 0);
      order_a.insert(order_a.end(), x.example_indices.begin(), x.example_indices.end());
      order_c.insert(order_c.end(), z.example_indices.begin(), z.example_indices.end());
    } else {
      EXPECT_EQ(x.epoch, 1);
    }
  }
  EXPECT_EQ(order_a.size(), 23u);
  EXPECT_EQ(std::set<int64_t>(order_a.begin(), order_a.end()).size(), 23u);
  EXPECT_NE(order_a, order_c);
  std::vector<int64_t> identity(23);
  for (int i = 0; i < 23; ++i) identity[i] = i;
  EXPECT_NE(order_a, identity);
}

TEST(Batcher, DropLastSkipsShortTail) {
  BatcherOptions o;
  o.batch_size = 4;
  o.drop_last = true;
  Batcher b(make_many(10), o);
  EXPECT_EQ(b.batches_per_epoch(), 2);
  for (int k = 0; k < 5; ++k) {
    const Batch x = b.next();
    EXPECT_EQ(x.input_ids.size(0), 4);
    EXPECT_EQ(x.epoch, k / 2);
  }
  o.batch_size = 11;
  EXPECT_THROW(Batcher(make_many(10), o), c10::Error);
}

TEST(Batcher, ResumesExactlyFromSavedState) {
  for (bool pack : {false, true}) {
    const BatcherOptions o = shuffled(3, 16, pack, 7);
    const auto data = make_many(17);
    Batcher ref(data, o);
    std::vector<Batch> stream;
    for (int k = 0; k < 20; ++k) stream.push_back(ref.next());  // spans several epochs
    for (int cut : {0, 1, 5, 7, 13}) {
      Batcher first(data, o);
      for (int k = 0; k < cut; ++k) first.next();
      const std::string saved = first.state().to_json();
      Batcher resumed(data, o);
      resumed.restore(BatcherState::from_json(saved));
      EXPECT_EQ(resumed.state().batches, cut);
      for (int k = cut; k < 20; ++k) expect_batches_equal(resumed.next(), stream[k]);
    }
    // A state from other data or another seed is refused.
    Batcher other(make_many(5), o);
    EXPECT_THROW(other.restore(ref.state()), c10::Error);
    BatcherState wrong_seed = ref.state();
    wrong_seed.seed = 8;
    EXPECT_THROW(ref.restore(wrong_seed), c10::Error);
  }
  EXPECT_THROW(BatcherState::from_json("{\"seed\": 1}"), c10::Error);
  EXPECT_THROW(BatcherState::from_json("not json"), c10::Error);
}

TEST(Batcher, PackingKeepsExamplesApart) {
  const BatcherOptions o = shuffled(2, 12, /*pack=*/true, 3);
  const auto data = make_many(20);
  Batcher b(data, o);
  std::vector<int64_t> seen;
  for (int k = 0; k < b.batches_per_epoch(); ++k) {
    const Batch x = b.next();
    ASSERT_EQ(x.epoch, 0);
    EXPECT_LE(x.input_ids.size(1), 12);
    size_t e = 0;
    for (int64_t r = 0; r < x.input_ids.size(0); ++r) {
      const auto ids = row(x.input_ids, r), labels = row(x.labels, r), pos = row(x.position_ids, r),
                 seg = row(x.segment_ids, r), mask = row(x.attention_mask, r);
      size_t t = 0;
      int64_t segment = 0;
      while (t < ids.size() && seg[t] != 0) {
        const Example& ex = data[x.example_indices[e++]];
        ++segment;
        for (size_t k = 0; k < ex.input_ids.size(); ++k, ++t) {
          EXPECT_EQ(ids[t], ex.input_ids[k]);
          EXPECT_EQ(labels[t], k == 0 ? kI : ex.labels[k]);  // never predict across examples
          EXPECT_EQ(pos[t], static_cast<int64_t>(k));
          EXPECT_EQ(seg[t], segment);
          EXPECT_EQ(mask[t], 1);
        }
      }
      for (; t < ids.size(); ++t) {
        EXPECT_EQ(seg[t], 0);
        EXPECT_EQ(mask[t], 0);
        EXPECT_EQ(labels[t], kI);
      }
    }
    EXPECT_EQ(e, x.example_indices.size());
    seen.insert(seen.end(), x.example_indices.begin(), x.example_indices.end());
    // Block-diagonal causal mask: allowed iff same non-pad segment and causal.
    const at::Tensor m = block_causal_mask(x.segment_ids);
    const int64_t rows = x.input_ids.size(0), tt = x.input_ids.size(1);
    ASSERT_EQ(m.sizes(), (std::vector<int64_t>{rows, 1, tt, tt}));
    auto acc = m.accessor<bool, 4>();
    auto sacc = x.segment_ids.accessor<int64_t, 2>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t q = 0; q < tt; ++q) {
        for (int64_t kk = 0; kk < tt; ++kk) {
          const bool want = (q == kk) || (kk < q && sacc[r][q] == sacc[r][kk] && sacc[r][q] != 0);
          ASSERT_EQ(acc[r][0][q][kk], want) << r << " " << q << " " << kk;
        }
      }
    }
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(20);
  for (int i = 0; i < 20; ++i) all[i] = i;
  EXPECT_EQ(seen, all);  // one epoch of packed rows visits every example exactly once
  // Packing actually packs: fewer rows than examples.
  EXPECT_LT(b.batches_per_epoch() * 2, 20);
}

TEST(Batcher, RejectsBadOptionsAndExamples) {
  BatcherOptions o;
  o.batch_size = 0;
  EXPECT_THROW(Batcher(make_many(3), o), c10::Error);
  o.batch_size = 1;
  o.max_seq_len = 1;
  EXPECT_THROW(Batcher(make_many(3), o), c10::Error);
  o.max_seq_len = 8;
  Example bad = make(0, 1, 1);
  bad.labels.pop_back();
  EXPECT_THROW(Batcher({bad}, o), c10::Error);
  EXPECT_THROW(Batcher({}, o), c10::Error);
}

// Best-fit packing from a window fills rows better than taking examples in order, keeps every
// example whole and once per epoch, and cu_seqlens describes exactly the rows' segments plus
// each padding tail (the layout the varlen attention kernels read).
TEST(Batcher, BestFitPackingFillsRowsAndDescribesSegments) {
  std::vector<Example> data;
  for (int i = 0; i < 120; ++i) data.push_back(make(i, 3 + (i * 37) % 23, 2 + (i * 11) % 17));
  auto fill_of = [&](int64_t window, std::vector<Batch>* out) {
    BatcherOptions o;
    o.batch_size = 2;
    o.max_seq_len = 64;
    o.pack = true;
    o.pack_window = window;
    o.fixed_len = true;
    o.seed = 5;
    Batcher b(data, o);
    int64_t real = 0, slots = 0;
    std::vector<int64_t> seen;
    for (int64_t k = 0; k < b.batches_per_epoch(); ++k) {
      Batch x = b.next();
      EXPECT_EQ(x.epoch, 0);
      EXPECT_EQ(x.input_ids.size(1), 64);  // fixed_len
      real += x.real_tokens;
      slots += x.slots();
      seen.insert(seen.end(), x.example_indices.begin(), x.example_indices.end());
      if (out) out->push_back(std::move(x));
    }
    std::sort(seen.begin(), seen.end());
    EXPECT_EQ(seen.size(), data.size());
    EXPECT_TRUE(std::adjacent_find(seen.begin(), seen.end()) == seen.end());
    return static_cast<double>(real) / static_cast<double>(slots);
  };
  std::vector<Batch> batches;
  const double greedy = fill_of(1, nullptr), best = fill_of(32, &batches);
  EXPECT_GT(best, greedy + 0.05) << "best fit " << best << " vs in-order " << greedy;
  EXPECT_GT(best, 0.9);
  for (const Batch& x : batches) {
    const int64_t rows = x.input_ids.size(0), t = x.input_ids.size(1);
    std::vector<int32_t> want{0};
    int64_t longest = 0;
    auto seg = x.segment_ids.accessor<int64_t, 2>();
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t k = 1; k <= t; ++k) {
        if (k == t || seg[r][k] != seg[r][k - 1]) {
          longest = std::max<int64_t>(longest, r * t + k - want.back());
          want.push_back(static_cast<int32_t>(r * t + k));
        }
      }
    }
    const auto* cu = x.cu_seqlens.data_ptr<int32_t>();
    EXPECT_EQ(std::vector<int32_t>(cu, cu + x.cu_seqlens.numel()), want);
    EXPECT_EQ(x.max_seqlen, longest);
  }
}

TEST(Batcher, PadMultipleRoundsRowLength) {
  BatcherOptions o;
  o.batch_size = 3;
  o.shuffle = false;
  o.max_seq_len = 20;
  o.pad_multiple = 8;
  Batcher b({make(0, 2, 2), make(1, 4, 3), make(2, 1, 1)}, o);
  const Batch x = b.next();  // longest row 7 -> 8
  EXPECT_EQ(x.input_ids.size(1), 8);
  const auto* cu = x.cu_seqlens.data_ptr<int32_t>();
  EXPECT_EQ(std::vector<int32_t>(cu, cu + x.cu_seqlens.numel()),
            (std::vector<int32_t>{0, 4, 8, 15, 16, 18, 24}));
  EXPECT_EQ(x.max_seqlen, 7);
}

// flatten: the same examples and segments as the row layout, end to end in one row, padded
// once at the end (to pad_multiple, or batch_size * max_seq_len with fixed_len).
TEST(Batcher, FlattenKeepsExamplesAndDropsInterRowPadding) {
  const auto data = make_many(30);
  BatcherOptions o;
  o.batch_size = 3;
  o.max_seq_len = 16;
  o.seed = 2;
  o.pad_multiple = 8;
  Batcher rowwise(data, o);
  o.flatten = true;
  Batcher flat(data, o);
  for (int k = 0; k < 5; ++k) {
    const Batch a = rowwise.next(), b = flat.next();
    ASSERT_EQ(b.input_ids.size(0), 1);
    EXPECT_EQ(a.example_indices, b.example_indices);
    EXPECT_EQ(a.real_tokens, b.real_tokens);
    EXPECT_EQ(a.supervised_tokens, b.supervised_tokens);
    EXPECT_EQ(b.input_ids.size(1) % 8, 0);
    EXPECT_LT(b.input_ids.size(1) - b.real_tokens, 8);
    // Real tokens in order, then padding.
    const at::Tensor real_a = a.input_ids.masked_select(a.attention_mask.ne(0));
    const at::Tensor real_b = b.input_ids.masked_select(b.attention_mask.ne(0));
    EXPECT_TRUE(at::equal(real_a, real_b));
    EXPECT_TRUE(at::equal(a.labels.masked_select(a.attention_mask.ne(0)),
                          b.labels.masked_select(b.attention_mask.ne(0))));
  }
  o.fixed_len = true;
  Batcher fixed(data, o);
  EXPECT_EQ(fixed.next().input_ids.size(1), 3 * 16);
}

}  // namespace
}  // namespace q4::data
