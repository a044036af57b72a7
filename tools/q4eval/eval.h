// Held-out evaluation for q4eval (docs/eval.md): the summed cross-entropy of a model over the
// tokens training takes loss on (batched as the trainer batches its validation set), the words
// and bytes of the text those tokens spell (lm-evaluation-harness's wikitext conventions), and
// greedy exact-match accuracy on prompt/answer examples. A small library (q4eval_core) so that
// the metric arithmetic is tested without the executable.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "q4/data/dataset.h"
#include "q4/data/tokenizer.h"
#include "q4/model/qwen3.h"

namespace q4::eval {

// Python's len(re.split(r"\s+", text)) on the UTF-8 `text`: one more than the number of maximal
// runs of whitespace (str.isspace() code points), so leading or trailing whitespace adds an empty
// piece, as the harness counts it. Invalid UTF-8 bytes count as non-space.
int64_t count_words(const std::string& text);

// Sums over the scored tokens of a data set.
struct Totals {
  double nll = 0;      // summed negative log-likelihood, nats
  int64_t tokens = 0;  // scored tokens (supervised labels at positions >= 1)
  int64_t words = 0;   // count_words of the scored text
  int64_t bytes = 0;   // UTF-8 bytes of the scored text
};

struct Metrics {
  double loss = 0;             // nll / tokens
  double perplexity = 0;       // exp(loss)
  double word_perplexity = 0;  // exp(nll / words)
  double byte_perplexity = 0;  // exp(nll / bytes)
  double bits_per_byte = 0;    // nll / (bytes * ln 2)
};

// The metrics of `t`; a ratio whose denominator is 0 is NaN.
Metrics metrics(const Totals& t);

// Words and bytes of the text the loss scores in `examples` (as batched: after truncation):
// each example's labels at positions >= 1 (a row's position 0 is never a target), with the
// windows of one document (Example::window 1, 2, ... after 0) read as one sequence (a window's
// position 0 is its previous window's last position), so the count is the document's whatever
// the window size. Every run of consecutive supervised labels is decoded with special tokens
// skipped (<|im_end|>, <|endoftext|> add no text) and counted as one document; a run with no text
// counts no word.
struct TextCount {
  int64_t words = 0;
  int64_t bytes = 0;
};
TextCount count_scored_text(const std::vector<data::Example>& examples,
                            const data::Tokenizer& tokenizer);

// A batch as the model's inputs on `device` (the attention layout the model uses for it: the
// variable-length segments on CUDA with 16-bit compute, the mask elsewhere); labels stay on the
// host (the loss reads them there).
model::ModelInputs batch_inputs(const data::Batch& batch, const model::Qwen3Model& model,
                                const at::Device& device);

// One pass over the batcher's epoch 0 in file order, without gradients: the summed CE (the
// per-batch sums added in fp64 on the device, one host read, as the trainer's validation loss)
// and the scored text. The batcher must not shuffle.
Totals score(model::Qwen3Model& model, data::Batcher& batcher, const data::Tokenizer& tokenizer);

// A prompt/answer example: its first token is not supervised (a prompt precedes the answer)
// and it has supervised tokens. The answer is its last run of supervised tokens without the
// closing <|im_end|>/<|endoftext|>; the prompt is every token before that run (the template's
// "<|im_start|>assistant\n" included).
struct AnswerCase {
  std::vector<int64_t> prompt_ids;
  std::string reference;  // decoded answer, special tokens skipped
  int64_t reference_tokens = 0;
};
std::optional<AnswerCase> answer_case(const data::Example& example,
                                      const data::Tokenizer& tokenizer);

// `text` without leading and trailing ASCII whitespace (space, \t, \n, \v, \f, \r).
std::string strip(const std::string& text);

struct ExactMatch {
  int64_t examples = 0;  // prompt/answer examples generated for
  int64_t matches = 0;
};

// Greedy generation of each prompt/answer example's answer (stops at <|im_end|> or
// <|endoftext|>, at most reference_tokens + kExtraAnswerTokens tokens): a match when the
// decoded generation (special tokens skipped) equals the reference after strip().
inline constexpr int64_t kExtraAnswerTokens = 16;

// Generates for a batch of prompts, up to `max_new_tokens` each: every row's new tokens, its
// stop id included when one came (q4::model::generate's GenerationResult::tokens).
using AnswerGenerator = std::function<std::vector<std::vector<int64_t>>(
    const std::vector<std::vector<int64_t>>& prompts, int64_t max_new_tokens)>;

// Exact match of `cases`, `batch_size` prompts per call of `generate` in file order. A batch
// generates up to its longest limit; each row is then cut at its own limit, so a row scores as
// it would alone.
ExactMatch exact_match(const std::vector<AnswerCase>& cases, const data::Tokenizer& tokenizer,
                       int64_t batch_size, const AnswerGenerator& generate);

// The same with the model's greedy batched generation (q4::model::generate with temperature 0:
// one KV cache per batch, left-padded prompts, finished rows leave the batch). A row's logits in
// a batch can differ from its logits alone in the last bits (GEMM row blocking), so an argmax
// between two nearly equal logits may go either way; batch_size 1 generates each prompt alone.
ExactMatch exact_match(model::Qwen3Model& model, const std::vector<data::Example>& examples,
                       const data::Tokenizer& tokenizer, int64_t batch_size);

}  // namespace q4::eval
