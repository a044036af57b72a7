// Byte-level BPE tokenizer loaded from a Hugging Face `tokenizer.json` (model type BPE).
// Supported: NFC normalizer (or none), pre-tokenizer Sequence[Split(regex, Isolated),
// ByteLevel(use_regex=false)] or a lone ByteLevel, added tokens matched in the raw text before
// splitting (longest first), ByteLevel decoder. Anything else is rejected at load with an error
// naming the file and the JSON key. encode() matches HF `tokenizers` id-for-id (no special-token
// insertion; added tokens written in the text are matched). Thread-safe (const methods).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace q4::data {

// Token ids are int32 on the host (vocabularies are < 2^31); Batch tensors are int64.
using TokenId = int32_t;

// Label value that the loss ignores (same as PyTorch/HF `ignore_index`).
constexpr TokenId kIgnoreIndex = -100;

// encode_with_offsets(): ids plus, per token, the byte span [begin, end) it covers in the
// NFC-normalized text (identical to the input text when the input is already NFC).
struct Encoding {
  std::vector<TokenId> ids;
  std::vector<std::pair<int64_t, int64_t>> offsets;  // one (begin, end) per id, bytes
};

class Tokenizer {
 public:
  // Loads and validates a tokenizer.json. Throws (c10::Error) naming `path` and the offending
  // key for unsupported features (other model types, normalizers, pre-tokenizers, decoders,
  // byte_fallback, dropout, lstrip/rstrip/single_word added tokens, ...).
  static Tokenizer from_file(const std::string& path);
  // Same from an in-memory JSON document; `source_name` is used in error messages.
  static Tokenizer from_json_string(const std::string& json, const std::string& source_name);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // UTF-8 text -> ids. Invalid UTF-8 is an error naming the byte offset.
  std::vector<TokenId> encode(std::string_view text) const;
  Encoding encode_with_offsets(std::string_view text) const;

  // ids -> raw bytes (exact inverse of encode for NFC input). The result is NOT guaranteed to
  // be valid UTF-8 when `ids` cuts a multi-byte character; concatenating the decodes of
  // consecutive id ranges always reproduces the decode of the whole range.
  // skip_special drops added tokens whose `special` flag is true. Unknown ids are an error.
  std::string decode(const std::vector<TokenId>& ids, bool skip_special = false) const;
  // Like decode() but every invalid UTF-8 sequence is replaced by U+FFFD and ids with no token
  // (past the vocabulary, or holes in it) are skipped, as HF decodes (for printing, rewards).
  std::string decode_lossy(const std::vector<TokenId>& ids, bool skip_special = false) const;

  // Vocabulary token string (byte-level form for BPE tokens, literal text for added tokens)
  // <-> id. token_to_id returns nullopt when absent; id_to_token throws when out of range.
  std::optional<TokenId> token_to_id(std::string_view token) const;
  std::string id_to_token(TokenId id) const;
  bool is_special(TokenId id) const;  // added token with "special": true
  bool is_added(TokenId id) const;    // any added token

  // max(id) + 1 over the BPE vocabulary and added tokens (151669 for Qwen3). The model's
  // embedding may be larger (Qwen3-4B: 151936); ids are always < vocab_size().
  int64_t vocab_size() const;

  // ChatML special tokens. Throw if the tokenizer has no such added token.
  TokenId im_start_id() const;   // "<|im_start|>"
  TokenId im_end_id() const;     // "<|im_end|>"   (Qwen3-2507 eos for chat)
  TokenId endoftext_id() const;  // "<|endoftext|>" (Qwen3 pad token)

  const std::string& source_name() const;  // path or name given at load

 private:
  struct Impl;
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace q4::data
