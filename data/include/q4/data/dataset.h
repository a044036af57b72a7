// Training data: file loading (TSV / JSONL / plain text) into tokenized Examples with a
// supervision mask, and a deterministic, resumable Batcher that truncates, shuffles, pads or
// packs them into Batch tensors. Loading errors name file and line; with OnError::kSkip bad
// lines are skipped and counted in a LoadSummary that the caller prints once.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "q4/data/chat.h"
#include "q4/data/tokenizer.h"
#include "q4/io/enum_names.h"

namespace q4::data {

// ---------------------------------------------------------------- loading

enum class DataFormat {
  kAuto,   // by extension: .tsv -> kTsv, .jsonl/.json -> kJsonl, .txt/.text -> kText; else error
  kTsv,    // "prompt<TAB>answer" per line (first tab splits); blank and '#' lines skipped;
           // an optional first row "prompt<TAB>answer" or "prompt<TAB>target" is a header
  kJsonl,  // per line, by its keys: {"messages":[{"role","content"},...]}, {"prompt":...,
           // "answer"|"response"|"target":...}, TRL {"prompt","completion"} (strings or message
           // lists; only the completion supervised), ShareGPT {"conversations":[{"from":
           // "system|human|gpt","value"}]}, alpaca {"instruction","input","output"}, or
           // {"text":...} (plain text, every token supervised, like kText). A file whose first
           // character is '[' is one JSON array of such records (e.g. alpaca_data.json).
  kText,   // plain-text documents (DatasetOptions::text_unit), no template, every token
           // supervised
};

// What one plain-text example of a kText file is.
enum class TextUnit {
  kFile,       // the whole file is one document (default)
  kParagraph,  // each run of non-blank lines (paragraphs are separated by blank lines)
  kLine,       // each non-blank line
};

enum class OnError {
  kFail,  // first malformed line throws, naming file and line (default)
  kSkip,  // malformed lines are skipped and counted in LoadSummary
};

// The spellings in the tables below, any case; also "json" (jsonl) and "txt" (text).
DataFormat parse_data_format(const std::string& name);
OnError parse_on_error(const std::string& name);
TextUnit parse_text_unit(const std::string& name);

struct DatasetOptions {
  DataFormat format = DataFormat::kAuto;
  // Prepended as a system turn to every prompt/answer pair and to every "messages"
  // conversation that has no system message of its own. Empty = no system turn.
  std::string system_prompt;
  OnError on_error = OnError::kFail;
  // How the caller sets on_error, for the error on a malformed line ("set data.on_error: skip");
  // empty: the caller has no such setting and the error gives no hint.
  std::string skip_hint = "set on_error: skip";
  // A preference record ({"chosen", "rejected"}) met by load_dataset is an error; this says how
  // the caller reads such a file instead ("set train.objective: preference"); empty: nothing.
  std::string preference_hint;
  // kText only: append <|endoftext|> (supervised) to each document so the model learns ends.
  bool text_append_endoftext = true;
  // kText only: a document is the whole file, a paragraph or a line. In every unit, line ends
  // ("\r\n", a lone "\r") read as "\n" and the document's leading and trailing line ends go.
  TextUnit text_unit = TextUnit::kFile;
  // The chat template conversations render with (resolved: never kAuto).
  ChatOptions chat;
};

struct SkippedLine {
  int64_t line = 0;    // 1-based line number in the file
  std::string reason;  // e.g. "no tab separating prompt and answer"
};

struct LoadSummary {
  std::string path;
  int64_t lines = 0;                       // physical lines read
  int64_t ignored = 0;                     // blank, '#' comment and header lines
  int64_t examples = 0;                    // examples produced
  int64_t skipped = 0;                     // malformed lines skipped (OnError::kSkip)
  std::vector<SkippedLine> first_skipped;  // the first kMaxReported skipped lines
  static constexpr int64_t kMaxReported = 20;
  int64_t tokens = 0;                            // sum of example lengths
  int64_t supervised_tokens = 0;                 // sum of supervised labels
  std::map<std::string, int64_t> jsonl_formats;  // JSONL: examples per detected shape
  int64_t reasoning_dropped = 0;  // assistant turns whose reasoning the template does not render
  bool json_array = false;  // the file is one JSON array of records (a .json file)
  // "jsonl (sharegpt)", "jsonl (mixed: alpaca 2, text 1)", "json array (alpaca)"; "" for
  // TSV/text files.
  std::string format_name() const;
  std::string to_string() const;  // one human-readable paragraph (for tools/trainer to print)
};

// One tokenized training sequence (before truncation/batching).
struct Example {
  std::vector<TokenId> input_ids;  // [L]
  std::vector<TokenId> labels;     // [L], token id where supervised, kIgnoreIndex elsewhere
  int64_t source_line = 0;         // 1-based line in the source file (for messages)
  // A plain-text document (a text file's unit or a {"text"} record): Truncation::kAuto splits it
  // into windows instead of cutting it.
  bool plain_text = false;
  // Set by split truncation: 0 for an example's first (or only) window, k for its (k+1)-th,
  // which continues the previous one.
  int64_t window = 0;
  int64_t reasoning_dropped = 0;   // ChatTokens::reasoning_dropped of its conversation
};

struct Dataset {
  std::vector<Example> examples;
  LoadSummary summary;
};

// Loads a file. Errors (OnError::kFail): "<path>:<line>: <what was expected>, found <...>".
// I/O errors and an unknown format always throw.
Dataset load_dataset(const std::string& path, const Tokenizer& tokenizer,
                     const DatasetOptions& options = {});
// Same from in-memory content (format must not be kAuto unless `name` has an extension).
Dataset load_dataset_from_string(const std::string& content, const std::string& name,
                                 const Tokenizer& tokenizer, const DatasetOptions& options = {});

// Preference data (TRL's format), one record per JSONL line or JSON-array element:
// {"prompt", "chosen", "rejected"} with strings (a user prompt and two answers) or message lists
// (a conversation and two assistant continuations), or {"chosen", "rejected"} message lists whose
// shared leading messages are the prompt. Each answer is an Example of prompt + answer with the
// answer alone supervised; the two differ. Errors and on_error as for load_dataset.
struct PreferencePair {
  Example chosen;
  Example rejected;
  int64_t source_line = 0;
};
struct PreferenceDataset {
  std::vector<PreferencePair> pairs;
  LoadSummary summary;  // examples counts pairs; tokens both answers
};
PreferenceDataset load_preference_dataset(const std::string& path, const Tokenizer& tokenizer,
                                          const DatasetOptions& options = {});
PreferenceDataset load_preference_dataset_from_string(const std::string& content,
                                                      const std::string& name,
                                                      const Tokenizer& tokenizer,
                                                      const DatasetOptions& options = {});

// Helper used by the loaders: a prompt/answer pair as a (system,) user, assistant conversation.
Example make_pair_example(const Tokenizer& tokenizer, const std::string& prompt,
                          const std::string& answer, const std::string& system_prompt = "",
                          const ChatOptions& chat = {});

// ---------------------------------------------------------------- batching

enum class Truncation {
  // Default: plain-text documents (Example::plain_text) as kSplit, every other example (a
  // conversation, a prompt and its answer) as kCutLeft. Grouped examples are never split.
  kAuto,
  // Keep the end of the sequence (the answer and its <|im_end|>) and cut tokens from
  // the left (the prompt side). If the supervised part (first supervised token .. end) plus one
  // token of context is longer than max_seq_len, keep instead the window that starts half a
  // window (max_seq_len / 2 tokens) before the first supervised token (from the start when the
  // prompt is shorter): the end of the prompt and as much of the answer as fits. The supervised
  // tokens cut are counted.
  kCutLeft,
  // Keep the first max_seq_len tokens (for plain-text documents). When that leaves nothing
  // supervised (a prompt longer than the window), the window moves as for kCutLeft.
  kCutRight,
  // Drop and count every example longer than max_seq_len.
  kDrop,
  // Cut every example longer than max_seq_len into windows of max_seq_len tokens (the last one
  // shorter), each its own example. Consecutive windows share one token: a window's first token
  // is the last of the previous window, the context of its first target (a row's position 0 is
  // never a target), so every label at positions >= 1 is a target of exactly one window and
  // nothing of a long text document is lost. Windows with nothing supervised at positions >= 1
  // are dropped (they held only prompt).
  kSplit,
};

// "auto", "cut_left", "cut_right", "drop", "split".
Truncation parse_truncation(const std::string& name);
std::string to_string(Truncation t);
// The policy in a few words, for the start lines: "auto (plain text split into windows, other
// records cut_left)", "cut_left", ...
std::string describe(Truncation t);

struct BatcherOptions {
  int64_t batch_size = 1;      // rows per batch (examples per batch when not packing)
  int64_t max_seq_len = 1024;  // tokens per row, upper bound (T <= max_seq_len)
  uint64_t seed = 0;           // shuffle seed; epoch e uses permutation(seed, e)
  bool shuffle = true;         // false: file order every epoch
  // Pack several examples into each row: a row starts with the oldest example not yet placed
  // and is filled best-fit (the longest pending example that still fits, repeatedly) from a
  // window of the next `pack_window` examples of the epoch's order. A chat example is never
  // split. false: one example per row.
  bool pack = false;
  int64_t pack_window = 256;  // packing: examples considered for each row (>= 1)
  // Row length T of a batch: max_seq_len when `fixed_len` (stable shapes, e.g. for packed rows
  // on a GPU); otherwise the longest row rounded up to a multiple of `pad_multiple`, capped at
  // max_seq_len (1: exactly the longest row).
  bool fixed_len = false;
  int64_t pad_multiple = 1;
  // Lay the batch's rows end to end as one row (B = 1) of their summed length (fixed_len:
  // batch_size * max_seq_len; else rounded up to pad_multiple). The examples and their segments
  // are the same, only the padding between rows goes: for variable-length attention, which
  // needs no row structure (cu_seqlens separates the examples).
  bool flatten = false;
  bool drop_last = false;  // drop the short final batch of each epoch
  // Consecutive examples form groups of this many that stay together (a preference pair: its
  // chosen and rejected answers): shuffling permutes whole groups, truncation keeps or drops a
  // group whole, and every batch holds whole groups in order. Needs batch_size a multiple of it,
  // an example count that is one too, no packing and no split truncation.
  int64_t group = 1;
  Truncation truncation = Truncation::kAuto;
  int64_t pad_id = 0;  // input id written at padding (masked out; any valid id works)
};

// Counts from applying the truncation policy (done once, at Batcher construction).
struct TruncationStats {
  int64_t examples_in = 0;
  int64_t kept = 0;                   // examples that made it into batches (truncated included)
  int64_t truncated = 0;              // kept but shortened
  int64_t dropped = 0;                // removed (all reasons): too long for kDrop, or nothing
                                      // left to supervise at positions >= 1
  int64_t dropped_unsupervised = 0;   // of `dropped`: no supervised label at positions >= 1
  int64_t supervised_tokens_cut = 0;  // supervised labels lost by truncation
  // Supervised labels (at positions >= 1) of the examples before truncation, and those of whole
  // examples dropped (kDrop, or a group whose other example was dropped).
  int64_t supervised_tokens_in = 0;
  int64_t supervised_tokens_dropped = 0;
  int64_t longest_tokens = 0;  // longest example before truncation
  int64_t split = 0;           // examples cut into windows
  int64_t windows = 0;         // the windows they became (counted in examples_in)
  // Supervised tokens that no batch trains on (cut or dropped), and their share of
  // supervised_tokens_in (0 when there are none).
  int64_t supervised_tokens_lost() const;
  double lost_share() const;
  std::string to_string() const;
};

// Past this share of the supervised tokens lost to truncation, the tools warn.
inline constexpr double kTruncationWarnShare = 0.01;

// "" when lost_share() <= kTruncationWarnShare; otherwise a warning (no "warning: " prefix, no
// newline) that says how much is lost and what to set: `seq_len_key` and `truncation_key` name
// the settings where the caller reads them ("train.seq_len", "--seq-len").
std::string truncation_warning(const TruncationStats& stats, int64_t max_seq_len,
                               Truncation truncation, const std::string& seq_len_key,
                               const std::string& truncation_key);

// Resume point: serialize it with a checkpoint and pass it back to Batcher::restore().
struct BatcherState {
  uint64_t seed = 0;
  int64_t epoch = 0;         // 0-based epoch of the next batch
  int64_t cursor = 0;        // index into that epoch's permutation of the next example
  int64_t batches = 0;       // batches produced so far (all epochs)
  int64_t num_examples = 0;  // kept examples when saved; restore() checks it still matches
  // Packing: examples already taken from this epoch's order (cursor moved past them) but not yet
  // placed in a row, oldest first. Always empty without packing.
  std::vector<int64_t> pending;
  std::string to_json() const;
  static BatcherState from_json(const std::string& json);  // throws on malformed input
};

// One batch. B = rows, T = longest row in this batch (<= max_seq_len). Padding is on the right.
// What model code must do with each field:
//  - input_ids:      embed. Padding holds pad_id; never let it influence real positions.
//  - labels:         loss = mean CE over logits[:, :-1] vs labels[:, 1:] where label != -100.
//                    Padding, prompts, and (packed) the first token of every segment are -100,
//                    so the shifted loss never predicts across examples.
//  - attention_mask: 1 real token, 0 padding (HF convention). Sufficient on its own when
//                    pack == false (each row is one example).
//  - position_ids:   RoPE positions; restart at 0 at the start of every example (packed or not);
//                    0 on padding. Always use these instead of arange(T).
//  - segment_ids:    1..k = which example of the row a token belongs to, 0 = padding. Attention
//                    must be block-diagonal causal: query q may attend key k iff
//                    segment_ids[q] == segment_ids[k] != 0 and k <= q. block_causal_mask()
//                    builds it. Without packing every row is segment 1 (+ padding 0).
//  - cu_seqlens:     the same segments for variable-length attention over the flattened B*T
//                    tokens: boundaries of every example, and of each row's padding tail as a
//                    segment of its own (padding attends only to padding), so the last entry is
//                    B*T. max_seqlen is the longest of these segments (host int: no sync).
// Rollout rows (GRPO, docs/trainer.md#grpo) that a batch of sampled completions carries: one
// entry per example of the batch (example_indices order), each example a prompt followed by one
// sampled completion whose tokens (and only they) are labelled. L = the longest completion.
struct RolloutRows {
  std::vector<int64_t> completion_lengths;  // [E] completion tokens (a stop id included)
  at::Tensor advantages;                    // fp32 [E]
  at::Tensor mask;                          // fp32 [E, L]: 1 where a completion token trains
  at::Tensor old_logprobs;  // fp32 [E, L] the old policy's; undefined: the ratio is 1
  // fp32 [E, L] each completion position's entropy (nats) of the sampling distribution (logits /
  // temperature, full vocabulary) as the rollout recorded it, 0 past the end; undefined: none.
  at::Tensor entropy;
};

struct Batch {
  at::Tensor input_ids;           // int64 [B, T]
  at::Tensor labels;              // int64 [B, T], kIgnoreIndex where not supervised
  at::Tensor attention_mask;      // int64 [B, T], 1 real / 0 pad
  at::Tensor position_ids;        // int64 [B, T]
  at::Tensor segment_ids;         // int64 [B, T], 0 pad, 1..k segments
  at::Tensor cu_seqlens;          // int32 [S + 1], 0 .. B*T (see above)
  int64_t max_seqlen = 0;         // longest segment of cu_seqlens
  int64_t epoch = 0;              // epoch this batch came from
  int64_t real_tokens = 0;        // attention_mask.sum()
  int64_t supervised_tokens = 0;  // count of labels[:, 1:] != -100 (what the loss averages)
  int64_t slots() const { return input_ids.defined() ? input_ids.numel() : 0; }  // B * T
  std::vector<int64_t> example_indices;  // indices into the (post-truncation) example list
  // Rollouts only (null from a Batcher): the rows' advantages, masks and old log-probabilities.
  std::shared_ptr<const RolloutRows> rollout;
};

// bool [B, 1, T, T]: true where attention is allowed (block-diagonal causal, padding rows and
// columns false except the diagonal so softmax never sees an all-masked row).
at::Tensor block_causal_mask(const at::Tensor& segment_ids);

// Turns examples into batches. Epochs repeat forever; each epoch visits every kept example
// once in permutation(seed, epoch) order (a portable splitmix64 Fisher-Yates, identical on
// every platform). The whole stream is a pure function of (examples, options), so
// restore(state()) reproduces the exact continuation.
class Batcher {
 public:
  Batcher(std::vector<Example> examples, const BatcherOptions& options);

  Batch next();

  BatcherState state() const;
  void restore(const BatcherState& state);  // seed must match options.seed

  int64_t num_examples() const;  // kept examples (after truncation policy)
  // Exact without packing; with packing the row count depends on the order, so this is the
  // count for epoch 0 (other epochs may differ slightly).
  int64_t batches_per_epoch() const;
  // Rows of those batches (before flatten): the examples without packing, the packed rows with
  // it (epoch 0). Fewer than batch_size: every batch is one whole epoch, short of rows.
  int64_t rows_per_epoch() const;
  const TruncationStats& truncation_stats() const;
  const BatcherOptions& options() const;
  const std::vector<Example>& examples() const;  // kept, post-truncation

 private:
  std::vector<int64_t> permutation(int64_t epoch) const;
  // Example order from an order of groups (BatcherOptions::group; itself when groups are 1).
  std::vector<int64_t> expand_groups(const std::vector<int64_t>& groups) const;
  // Example indices (into examples_) of each row of the next batch, advancing `state`
  // (cursor and pending) within the epoch whose order is `order`. Empty: the epoch is done.
  std::vector<std::vector<int64_t>> plan_rows(const std::vector<int64_t>& order,
                                              BatcherState* state) const;
  std::vector<int64_t> plan_row(const std::vector<int64_t>& order, BatcherState* state) const;

  BatcherOptions options_;
  std::vector<Example> examples_;
  TruncationStats stats_;
  BatcherState state_;
  std::vector<int64_t> order_;  // permutation of the current epoch
  int64_t order_epoch_ = -1;
  int64_t batches_per_epoch_ = 0;
  int64_t rows_per_epoch_ = 0;
};

}  // namespace q4::data

Q4_ENUM_NAMES(q4::data::DataFormat, {"auto", q4::data::DataFormat::kAuto},
              {"tsv", q4::data::DataFormat::kTsv}, {"jsonl", q4::data::DataFormat::kJsonl},
              {"text", q4::data::DataFormat::kText});
Q4_ENUM_NAMES(q4::data::OnError, {"fail", q4::data::OnError::kFail},
              {"skip", q4::data::OnError::kSkip});
Q4_ENUM_NAMES(q4::data::TextUnit, {"file", q4::data::TextUnit::kFile},
              {"paragraph", q4::data::TextUnit::kParagraph}, {"line", q4::data::TextUnit::kLine});
Q4_ENUM_NAMES(q4::data::Truncation, {"auto", q4::data::Truncation::kAuto},
              {"cut_left", q4::data::Truncation::kCutLeft},
              {"cut_right", q4::data::Truncation::kCutRight}, {"drop", q4::data::Truncation::kDrop},
              {"split", q4::data::Truncation::kSplit});
