// q4eval's scoring, text counts and exact match (see eval.h).
#include "eval.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>

#include "q4/io/utf8.h"

namespace q4::eval {

namespace {

// Python's str.isspace() code points (what \s matches in a str pattern).
bool is_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

double ratio(double num, int64_t den) {
  return den > 0 ? num / static_cast<double>(den) : std::numeric_limits<double>::quiet_NaN();
}

}  // namespace

int64_t count_words(const std::string& text) {
  int64_t runs = 0;
  bool in_space = false;
  for (size_t i = 0; i < text.size();) {
    const auto [cp, n] = io::utf8::decode(text, i);
    const bool space = is_space(cp);
    if (space && !in_space) ++runs;
    in_space = space;
    i += n;
  }
  return runs + 1;
}

Metrics metrics(const Totals& t) {
  Metrics m;
  m.loss = ratio(t.nll, t.tokens);
  m.perplexity = std::exp(m.loss);
  m.word_perplexity = std::exp(ratio(t.nll, t.words));
  m.byte_perplexity = std::exp(ratio(t.nll, t.bytes));
  m.bits_per_byte = ratio(t.nll, t.bytes) / std::log(2.0);
  return m;
}

TextCount count_scored_text(const std::vector<data::Example>& examples,
                            const data::Tokenizer& tokenizer) {
  TextCount out;
  std::vector<data::TokenId> run;
  const auto flush = [&] {
    if (run.empty()) return;
    const std::string text = tokenizer.decode(run, /*skip_special=*/true);
    out.bytes += static_cast<int64_t>(text.size());
    if (!text.empty()) out.words += count_words(text);
    run.clear();
  };
  const data::Example* prev = nullptr;
  for (const data::Example& e : examples) {
    // A window that does not continue the previous example starts a document of its own.
    if (prev == nullptr || e.window != prev->window + 1) flush();
    for (size_t t = 1; t < e.labels.size(); ++t) {
      if (e.labels[t] == data::kIgnoreIndex) {
        flush();
      } else {
        run.push_back(e.labels[t]);
      }
    }
    prev = &e;
  }
  flush();
  return out;
}

model::ModelInputs batch_inputs(const data::Batch& batch, const model::Qwen3Model& model,
                                const at::Device& device) {
  model::ModelInputs in;
  in.labels = batch.labels;
  in.cu_seqlens = batch.cu_seqlens;
  in.max_seqlen = batch.max_seqlen;
  const bool varlen = model.uses_varlen_attention(in);
  in.input_ids = batch.input_ids.to(device);
  in.position_ids = batch.position_ids.to(device);
  if (varlen) {
    in.cu_seqlens = batch.cu_seqlens.to(device);
  } else {
    in.cu_seqlens = at::Tensor();
    in.attention_mask = batch.attention_mask.to(device);
    in.segment_ids = batch.segment_ids.to(device);
  }
  return in;
}

Totals score(model::Qwen3Model& model, data::Batcher& batcher, const data::Tokenizer& tokenizer) {
  TORCH_CHECK(!batcher.options().shuffle, "score: the batcher must keep file order");
  at::NoGradGuard no_grad;
  const at::Device device = model.options().device;
  Totals t;
  at::Tensor sum;
  const int64_t batches = batcher.batches_per_epoch();
  for (int64_t i = 0; i < batches; ++i) {
    const data::Batch b = batcher.next();
    TORCH_INTERNAL_ASSERT(b.epoch == 0, "score: batches ran past one pass");
    const at::Tensor s = model.loss(batch_inputs(b, model, device)).loss_sum.to(at::kDouble);
    sum = sum.defined() ? sum + s : s;
    t.tokens += b.supervised_tokens;
  }
  const TextCount c = count_scored_text(batcher.examples(), tokenizer);
  t.words = c.words;
  t.bytes = c.bytes;
  t.nll = sum.defined() ? sum.item<double>() : 0.0;
  return t;
}

std::optional<AnswerCase> answer_case(const data::Example& example,
                                      const data::Tokenizer& tokenizer) {
  const auto& labels = example.labels;
  if (labels.empty() || labels[0] != data::kIgnoreIndex) return std::nullopt;
  size_t end = labels.size();
  while (end > 0 && labels[end - 1] == data::kIgnoreIndex) --end;
  if (end == 0) return std::nullopt;
  size_t start = end;
  while (start > 0 && labels[start - 1] != data::kIgnoreIndex) --start;
  std::vector<data::TokenId> answer(example.input_ids.begin() + static_cast<int64_t>(start),
                                    example.input_ids.begin() + static_cast<int64_t>(end));
  const data::TokenId last = answer.back();
  if (last == tokenizer.im_end_id() || last == tokenizer.endoftext_id()) answer.pop_back();
  AnswerCase c;
  c.prompt_ids.assign(example.input_ids.begin(),
                      example.input_ids.begin() + static_cast<int64_t>(start));
  c.reference = tokenizer.decode(answer, /*skip_special=*/true);
  c.reference_tokens = static_cast<int64_t>(answer.size());
  return c;
}

std::string strip(const std::string& text) {
  const char* kSpace = " \t\n\v\f\r";
  const size_t b = text.find_first_not_of(kSpace);
  if (b == std::string::npos) return "";
  const size_t e = text.find_last_not_of(kSpace);
  return text.substr(b, e - b + 1);
}

ExactMatch exact_match(model::Qwen3Model& model, const std::vector<data::Example>& examples,
                       const data::Tokenizer& tokenizer) {
  ExactMatch em;
  const int64_t im_end = tokenizer.im_end_id();
  const int64_t eot = tokenizer.endoftext_id();
  for (const auto& e : examples) {
    const auto c = answer_case(e, tokenizer);
    if (!c) continue;
    model::GenerateOptions gen;
    gen.max_new_tokens = c->reference_tokens + kExtraAnswerTokens;
    gen.stop_ids = {im_end, eot};
    const std::vector<int64_t> out = model.generate(c->prompt_ids, gen);
    std::vector<data::TokenId> ids;
    bool decodable = true;
    for (const int64_t id : out) {
      if (id == im_end || id == eot) break;
      // Embedding rows without a token (Qwen3: 151669..151935) spell no answer.
      if (id >= tokenizer.vocab_size()) decodable = false;
      ids.push_back(static_cast<data::TokenId>(id));
    }
    ++em.examples;
    if (decodable && strip(tokenizer.decode(ids, /*skip_special=*/true)) == strip(c->reference)) {
      ++em.matches;
    }
  }
  return em;
}

}  // namespace q4::eval
