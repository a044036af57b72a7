// q4eval's scoring, text counts and exact match (see eval.h).
#include "eval.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "q4/io/utf8.h"
#include "q4/model/sampling.h"

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

ExactMatch exact_match(const std::vector<AnswerCase>& cases, const data::Tokenizer& tokenizer,
                       int64_t batch_size, const AnswerGenerator& generate) {
  TORCH_CHECK(batch_size >= 1, "exact_match: batch_size must be >= 1, got ", batch_size);
  const int64_t im_end = tokenizer.im_end_id();
  const int64_t eot = tokenizer.endoftext_id();
  ExactMatch em;
  const auto n = static_cast<int64_t>(cases.size());
  for (int64_t b0 = 0; b0 < n; b0 += batch_size) {
    const int64_t b1 = std::min(n, b0 + batch_size);
    std::vector<std::vector<int64_t>> prompts;
    int64_t longest = 0;
    for (int64_t i = b0; i < b1; ++i) {
      prompts.push_back(cases[i].prompt_ids);
      longest = std::max(longest, cases[i].reference_tokens + kExtraAnswerTokens);
    }
    const auto outputs = generate(prompts, longest);
    TORCH_CHECK(static_cast<int64_t>(outputs.size()) == b1 - b0, "exact_match: ", b1 - b0,
                " prompts gave ", outputs.size(), " answers");
    for (int64_t i = b0; i < b1; ++i) {
      const AnswerCase& c = cases[i];
      const std::vector<int64_t>& out = outputs[i - b0];
      const auto limit = static_cast<size_t>(c.reference_tokens + kExtraAnswerTokens);
      std::vector<data::TokenId> ids;
      bool decodable = true;
      for (size_t t = 0; t < out.size() && t < limit; ++t) {
        const int64_t id = out[t];
        if (id == im_end || id == eot) break;
        // Embedding rows without a token (Qwen3: 151669..151935) spell no answer.
        if (id >= tokenizer.vocab_size()) decodable = false;
        ids.push_back(static_cast<data::TokenId>(id));
      }
      ++em.examples;
      if (decodable && strip(tokenizer.decode(ids, /*skip_special=*/true)) == strip(c.reference)) {
        ++em.matches;
      }
    }
  }
  return em;
}

ExactMatch exact_match(model::Qwen3Model& model, const std::vector<data::Example>& examples,
                       const data::Tokenizer& tokenizer, int64_t batch_size) {
  std::vector<AnswerCase> cases;
  for (const auto& e : examples) {
    if (auto c = answer_case(e, tokenizer)) cases.push_back(std::move(*c));
  }
  return exact_match(cases, tokenizer, batch_size,
                     [&](const std::vector<std::vector<int64_t>>& prompts, int64_t max_new) {
                       model::SamplingParams p;  // temperature 0: greedy
                       p.max_new_tokens = max_new;
                       p.stop_ids = {tokenizer.im_end_id(), tokenizer.endoftext_id()};
                       std::vector<std::vector<int64_t>> out;
                       for (auto& r : model::generate(model, prompts, p)) {
                         out.push_back(std::move(r.tokens));
                       }
                       return out;
                     });
}

}  // namespace q4::eval
