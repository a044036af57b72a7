// Byte-level BPE from an HF tokenizer.json. Pipeline per encode(): validate UTF-8, split out
// added tokens (leftmost-longest, raw text), NFC each remaining segment, split it with the
// pre-tokenizer regexes (PCRE2, UTF+UCP, JIT; "Isolated" keeps matches and gaps), then BPE each
// piece on raw bytes with a (left,right)->(rank,merged) table, lowest rank first, leftmost on
// ties (the same heap order as HF's word.rs). Results per piece are cached (bounded map).
// Vocabulary strings are converted from the GPT-2 byte alphabet to raw bytes once at load.
#include "q4/data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <c10/util/Exception.h>
#include <pcre2.h>

#include <algorithm>
#include <array>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <queue>
#include <unordered_map>

#include "normalize.h"
#include "q4/io/utf8.h"
#include "token_tables.h"
#include "tokenizer_json.h"

namespace q4::data {
namespace {

using json = nlohmann::json;

// GPT-2 bytes_to_unicode(): printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order.
std::array<int32_t, 256> byte_to_codepoint_table() {
  std::array<int32_t, 256> t{};
  int32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable =
        (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    t[b] = printable ? b : next++;
  }
  return t;
}

// Inverse of byte_to_codepoint_table(): codepoint (< 324) -> byte, -1 when not in the alphabet.
using ByteLevelInverse = std::array<int16_t, 324>;
ByteLevelInverse codepoint_to_byte_table() {
  ByteLevelInverse inv;
  inv.fill(-1);
  const auto b2c = byte_to_codepoint_table();
  for (int b = 0; b < 256; ++b) inv[b2c[b]] = static_cast<int16_t>(b);
  return inv;
}

// Decodes a byte-level vocabulary string to raw bytes; false when a character is outside the
// 256-character alphabet.
bool byte_level_to_bytes(std::string_view token, const ByteLevelInverse& inv, std::string* out) {
  out->clear();
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  size_t i = 0;
  while (i < token.size()) {
    int32_t cp = -1;
    if (p[i] < 0x80) {
      cp = p[i];
      i += 1;
    } else if ((p[i] & 0xE0) == 0xC0 && i + 1 < token.size() && (p[i + 1] & 0xC0) == 0x80) {
      cp = ((p[i] & 0x1F) << 6) | (p[i + 1] & 0x3F);
      i += 2;
    } else {
      return false;  // the alphabet is U+0021..U+0143: one or two bytes
    }
    if (cp >= static_cast<int32_t>(inv.size()) || inv[cp] < 0) return false;
    out->push_back(static_cast<char>(inv[cp]));
  }
  return true;
}

std::string json_type_of(const json& j) { return j.is_null() ? "null" : j.type_name(); }

// HF tokenizers compiles Split regexes with Oniguruma, whose Unicode \s is the White_Space
// property. PCRE2's UCP \s also matches U+180E (MONGOLIAN VOWEL SEPARATOR, a format character
// since Unicode 6.3), so \s and \S are rewritten to the explicit White_Space set.
constexpr const char* kWhiteSpaceSet =
    "\\t-\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

std::string rewrite_whitespace_classes(const std::string& pattern, const std::string& where) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if (e == 's') {
        out += in_class ? std::string(kWhiteSpaceSet) : "[" + std::string(kWhiteSpaceSet) + "]";
      } else if (e == 'S') {
        TORCH_CHECK(!in_class, where, ": \\S inside a character class is not supported");
        out += "[^" + std::string(kWhiteSpaceSet) + "]";
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// A compiled PCRE2 pattern (immutable after construction, shareable across threads).
class Regex {
 public:
  Regex(const std::string& pattern, bool literal, const std::string& where) {
    int err = 0;
    PCRE2_SIZE err_off = 0;
    uint32_t flags = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
    const std::string pat = literal ? pattern : rewrite_whitespace_classes(pattern, where);
    if (literal) flags |= PCRE2_LITERAL;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pat.data()), pat.size(), flags, &err,
                          &err_off, nullptr);
    if (code_ == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      TORCH_CHECK(false, where, ": cannot compile pre-tokenizer regex at offset ", err_off, ": ",
                  reinterpret_cast<const char*>(msg));
    }
    // JIT is an optimization; pcre2_match falls back to the interpreter when it is unavailable.
    pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
  }
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;
  ~Regex() { pcre2_code_free(code_); }
  pcre2_code* code() const { return code_; }

 private:
  pcre2_code* code_ = nullptr;
};

// Per-call match data (pcre2_match_data is not shareable between threads).
class MatchData {
 public:
  explicit MatchData(const Regex& re)
      : md_(pcre2_match_data_create_from_pattern(re.code(), nullptr)) {
    TORCH_CHECK(md_ != nullptr, "tokenizer: out of memory creating PCRE2 match data");
  }
  ~MatchData() { pcre2_match_data_free(md_); }
  pcre2_match_data* get() { return md_; }

 private:
  pcre2_match_data* md_;
};

constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

struct AddedToken {
  std::string content;
  TokenId id = 0;
  bool special = false;
};

// Leftmost-longest matcher over a small set of added tokens: candidates bucketed by first byte,
// each bucket sorted longest first.
class AddedMatcher {
 public:
  void add(const AddedToken& t) {
    if (t.content.empty()) return;
    auto& b = buckets_[static_cast<uint8_t>(t.content[0])];
    b.push_back(t);
    std::stable_sort(b.begin(), b.end(), [](const AddedToken& a, const AddedToken& c) {
      return a.content.size() > c.content.size();
    });
    any_ = true;
  }
  bool empty() const { return !any_; }
  // Finds the leftmost match at or after `from`; returns false when none.
  bool find(std::string_view s, size_t from, size_t* pos, const AddedToken** tok) const {
    for (size_t i = from; i < s.size(); ++i) {
      const auto& b = buckets_[static_cast<uint8_t>(s[i])];
      for (const auto& t : b) {
        if (t.content.size() <= s.size() - i && s.compare(i, t.content.size(), t.content) == 0) {
          *pos = i;
          *tok = &t;
          return true;
        }
      }
    }
    return false;
  }

 private:
  std::array<std::vector<AddedToken>, 256> buckets_;
  bool any_ = false;
};

}  // namespace

using token_tables::Merge;
using token_tables::MergeTable;
using token_tables::VocabIndex;

struct Tokenizer::Impl {
  std::string source;
  VocabIndex vocab;  // BPE vocabulary: raw bytes -> id
  std::array<TokenId, 256> byte_ids{};
  MergeTable merges;  // key = (left << 32) | right
  bool ignore_merges = false;
  // Per id (size vocab_size): raw bytes it decodes to, the token string, kind.
  std::vector<std::string> id_bytes;
  std::vector<std::string> id_string;
  enum Kind : uint8_t { kAbsent = 0, kVocab = 1, kAdded = 2, kSpecial = 3 };
  std::vector<uint8_t> id_kind;
  std::unordered_map<std::string, TokenId> added_by_content;
  AddedMatcher added_raw;   // "normalized": false, matched in the raw text
  AddedMatcher added_norm;  // "normalized": true, matched after normalization
  bool nfc = false;
  std::vector<std::unique_ptr<Regex>> splits;  // applied in order, behavior Isolated
  std::optional<TokenId> im_start, im_end, endoftext;

  static constexpr size_t kCacheMaxEntries = 1 << 18;
  static constexpr size_t kCacheMaxPieceBytes = 256;
  mutable std::mutex cache_mu;
  mutable std::unordered_map<std::string, std::vector<TokenId>> cache;

  // Every section of tokenizer.json, checked: the DOM and the streamed vocab and merges.
  void load(const json& root, const tokenizer_json::StreamedModel& streamed);
  void load_vocab(const json& model, const tokenizer_json::StreamedModel& streamed,
                  const ByteLevelInverse& c2b);
  bool add_vocab_member(std::string_view token, const tokenizer_json::VocabMember& m,
                        const ByteLevelInverse& c2b, bool checked, std::string* bytes);
  std::vector<std::pair<AddedToken, bool>> read_added_tokens(const json& root) const;
  void index_ids(const std::vector<std::pair<AddedToken, bool>>& added);
  void load_merges(const tokenizer_json::StreamedModel& streamed, const ByteLevelInverse& c2b);
  void load_normalizer(const json& root);
  void load_pre_tokenizer(const json& root);
  void bpe(std::string_view piece, std::vector<TokenId>* out) const;
  void encode_piece(std::string_view piece, std::vector<TokenId>* out) const;
  void encode_segment(std::string_view seg, int64_t base, Encoding* out, bool offsets) const;
  void encode_normalized(std::string_view seg, int64_t base, Encoding* out, bool offsets) const;
  Encoding encode(std::string_view text, bool offsets) const;
  void check_id(TokenId id) const {
    TORCH_CHECK(id >= 0 && id < static_cast<TokenId>(id_kind.size()) && id_kind[id] != kAbsent,
                source, ": token id ", id, " is not in the vocabulary (size ", id_kind.size(), ")");
  }
};

void Tokenizer::Impl::load(const json& root, const tokenizer_json::StreamedModel& streamed) {
  const std::string& src = source;
  TORCH_CHECK(root.is_object(), src, ": expected a JSON object at the top level, found ",
              json_type_of(root));
  TORCH_CHECK(root.contains("model") && root["model"].is_object(), src,
              ": missing object \"model\"");
  const json& model = root["model"];
  const ByteLevelInverse c2b = codepoint_to_byte_table();
  load_vocab(model, streamed, c2b);
  index_ids(read_added_tokens(root));
  load_merges(streamed, c2b);
  load_normalizer(root);
  load_pre_tokenizer(root);
  // Decoder and post-processor: byte-level only (encode never inserts special tokens).
  const json dec = root.value("decoder", json(nullptr));
  TORCH_CHECK(dec.is_object() && dec.value("type", "") == "ByteLevel", src,
              ": decoder: only ByteLevel is supported, found ", dec.dump());
  const json post = root.value("post_processor", json(nullptr));
  TORCH_CHECK(post.is_null() || (post.is_object() && post.value("type", "") == "ByteLevel"), src,
              ": post_processor: only null or ByteLevel is supported, found ", post.dump());
}

// model: a byte-level BPE with the options this encoder implements; its vocabulary (every one of
// the 256 bytes has a token) fills `vocab` and the per-id tables.
void Tokenizer::Impl::load_vocab(const json& model, const tokenizer_json::StreamedModel& streamed,
                                 const ByteLevelInverse& c2b) {
  const std::string& src = source;
  const std::string mtype = model.value("type", std::string("BPE"));
  TORCH_CHECK(mtype == "BPE", src, ": model.type: only \"BPE\" is supported, found \"", mtype,
              "\"");
  auto require_null_or = [&](const char* key, const json& allowed) {
    if (!model.contains(key) || model[key].is_null() || model[key] == allowed) return;
    TORCH_CHECK(false, src, ": model.", key, ": unsupported value ", model[key].dump(),
                " (supported: null or ", allowed.dump(), ")");
  };
  require_null_or("dropout", json(nullptr));
  require_null_or("continuing_subword_prefix", json(""));
  require_null_or("end_of_word_suffix", json(""));
  require_null_or("byte_fallback", json(false));
  require_null_or("fuse_unk", json(false));
  ignore_merges = model.value("ignore_merges", false);
  TORCH_CHECK(model.contains("vocab") && model["vocab"].is_object(), src,
              ": model.vocab: expected an object {token: id}");
  TORCH_CHECK(model.contains("merges") && model["merges"].is_array(), src,
              ": model.merges: expected an array");

  // Members are added in file order. When one is an error or repeats a token or an id, the
  // vocabulary is rebuilt in the order a DOM object (std::map) iterates, the last of a repeated
  // key winning: which error is reported and which token a shared id decodes to stay as they
  // are for the DOM (a later token in that order takes the id).
  const auto& members = streamed.vocab;
  TokenId max_id = -1;
  for (const auto& m : members) {
    if (m.is_integer() && m.id >= 0 && m.id < (int64_t{1} << 30)) {
      max_id = std::max(max_id, static_cast<TokenId>(m.id));
    }
  }
  auto reset = [&] {
    vocab.reset(members.size());
    id_bytes.assign(max_id + 1, std::string());
    id_string.assign(max_id + 1, std::string());
    id_kind.assign(max_id + 1, kAbsent);
  };
  auto token = [&](size_t k) { return streamed.view(members[k].offset, members[k].size); };
  reset();
  std::string bytes;
  size_t k = 0;
  while (k < members.size() && add_vocab_member(token(k), members[k], c2b, false, &bytes)) ++k;
  if (k < members.size()) {
    std::vector<size_t> order(members.size());
    for (size_t i = 0; i < order.size(); ++i) order[i] = i;
    std::stable_sort(order.begin(), order.end(),
                     [&](size_t x, size_t y) { return token(x) < token(y); });
    reset();
    for (size_t i = 0; i < order.size(); ++i) {
      if (i + 1 < order.size() && token(order[i]) == token(order[i + 1])) continue;
      add_vocab_member(token(order[i]), members[order[i]], c2b, true, &bytes);
    }
  }
  for (int b = 0; b < 256; ++b) {
    const char byte = static_cast<char>(b);
    const std::optional<TokenId> id = vocab.find(std::string_view(&byte, 1));
    TORCH_CHECK(id.has_value(), src, ": model.vocab: byte 0x", std::hex, b,
                " has no token (byte-level BPE needs all 256 bytes)");
    byte_ids[b] = *id;
  }
}

// Adds one model.vocab member to `vocab` and the per-id tables. Checked: a bad member is an
// error and a repeated id goes to this token; unchecked: either returns false, changing nothing.
bool Tokenizer::Impl::add_vocab_member(std::string_view token, const tokenizer_json::VocabMember& m,
                                       const ByteLevelInverse& c2b, bool checked,
                                       std::string* bytes) {
  const std::string& src = source;
  const bool in_range = m.is_integer() && m.id >= 0 && m.id < (int64_t{1} << 30);
  const bool ok = in_range && byte_level_to_bytes(token, c2b, bytes);
  if (!checked && (!ok || id_kind[m.id] != kAbsent)) return false;
  TORCH_CHECK(m.is_integer(), src, ": model.vocab[\"", token, "\"]: expected an integer id, found ",
              tokenizer_json::type_name(m.type));
  TORCH_CHECK(in_range, src, ": model.vocab[\"", token, "\"]: id ", m.id, " out of range");
  TORCH_CHECK(ok, src, ": model.vocab: token \"", token,
              "\" has characters outside the byte-level alphabet (only byte-level BPE "
              "vocabularies are supported)");
  const auto id = static_cast<TokenId>(m.id);
  const bool inserted = vocab.insert(*bytes, id);
  if (!checked && !inserted) return false;
  TORCH_CHECK(inserted, src, ": model.vocab: token \"", token,
              "\" duplicates another token's bytes");
  id_bytes[id] = *bytes;
  id_string[id].assign(token.data(), token.size());
  id_kind[id] = kVocab;
  return true;
}

// added_tokens: (token, normalized) in file order.
std::vector<std::pair<AddedToken, bool>> Tokenizer::Impl::read_added_tokens(
    const json& root) const {
  const std::string& src = source;
  std::vector<std::pair<AddedToken, bool>> added;  // token, normalized
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    TORCH_CHECK(root["added_tokens"].is_array(), src, ": added_tokens: expected an array");
    for (size_t k = 0; k < root["added_tokens"].size(); ++k) {
      const json& a = root["added_tokens"][k];
      const std::string where = src + ": added_tokens[" + std::to_string(k) + "]";
      TORCH_CHECK(a.is_object() && a.contains("id") && a["id"].is_number_integer() &&
                      a.contains("content") && a["content"].is_string(),
                  where, ": expected {\"id\": int, \"content\": string, ...}");
      for (const char* flag : {"lstrip", "rstrip", "single_word"}) {
        TORCH_CHECK(!a.value(flag, false), where, ": \"", flag, "\": true is not supported (\"",
                    a["content"].get<std::string>(), "\")");
      }
      AddedToken t;
      t.content = a["content"].get<std::string>();
      TORCH_CHECK(!t.content.empty() && io::utf8::find_invalid(t.content) == std::string::npos,
                  where, ": content must be non-empty valid UTF-8");
      const int64_t id64 = a["id"].get<int64_t>();
      TORCH_CHECK(id64 >= 0 && id64 < (int64_t{1} << 30), where, ": id ", id64, " out of range");
      t.id = static_cast<TokenId>(id64);
      t.special = a.value("special", false);
      added.push_back({t, a.value("normalized", !t.special)});
    }
  }
  return added;
}

// The per-id tables (bytes, token string, kind), the added-token matchers and the ChatML ids.
void Tokenizer::Impl::index_ids(const std::vector<std::pair<AddedToken, bool>>& added) {
  TokenId max_id = static_cast<TokenId>(id_kind.size()) - 1;
  for (const auto& a : added) max_id = std::max(max_id, a.first.id);
  id_bytes.resize(max_id + 1);
  id_string.resize(max_id + 1);
  id_kind.resize(max_id + 1, kAbsent);
  for (const auto& [t, normalized] : added) {
    id_bytes[t.id] = t.content;
    id_string[t.id] = t.content;
    id_kind[t.id] = t.special ? kSpecial : kAdded;
    added_by_content[t.content] = t.id;
    (normalized ? added_norm : added_raw).add(t);
  }
  auto find_added = [&](const char* s) -> std::optional<TokenId> {
    auto it = added_by_content.find(s);
    if (it == added_by_content.end()) return std::nullopt;
    return it->second;
  };
  im_start = find_added("<|im_start|>");
  im_end = find_added("<|im_end|>");
  endoftext = find_added("<|endoftext|>");
}

// model.merges: "left right" strings or [left, right] pairs, ranked by position.
void Tokenizer::Impl::load_merges(const tokenizer_json::StreamedModel& streamed,
                                  const ByteLevelInverse& c2b) {
  using tokenizer_json::MergeElement;
  const std::string& src = source;
  const std::vector<MergeElement>& elements = streamed.merges;
  merges.reserve(elements.size());
  std::string lb, rb, cat;
  for (size_t r = 0; r < elements.size(); ++r) {
    const MergeElement& m = elements[r];
    std::string_view left_s, right_s;
    if (m.form == MergeElement::kString) {
      const std::string_view s = streamed.view(m.offset, m.size_a);
      const size_t sp = s.find(' ');
      TORCH_CHECK(sp != std::string::npos && s.find(' ', sp + 1) == std::string::npos, src,
                  ": model.merges[", r, "]: expected \"left right\", found \"", s, "\"");
      left_s = s.substr(0, sp);
      right_s = s.substr(sp + 1);
    } else {
      TORCH_CHECK(m.form == MergeElement::kPair, src, ": model.merges[", r,
                  "]: expected \"left right\" or [\"left\", \"right\"]");
      left_s = streamed.view(m.offset, m.size_a);
      right_s = streamed.view(m.offset + m.size_a, m.size_b);
    }
    const bool ok = byte_level_to_bytes(left_s, c2b, &lb) && byte_level_to_bytes(right_s, c2b, &rb);
    cat.assign(lb).append(rb);
    const auto li = ok ? vocab.find(lb) : std::nullopt;
    const auto ri = ok ? vocab.find(rb) : std::nullopt;
    const auto mi = ok ? vocab.find(cat) : std::nullopt;
    TORCH_CHECK(li && ri && mi, src, ": model.merges[", r, "]: \"", left_s, "\", \"", right_s,
                "\" or their concatenation is not in the vocabulary");
    const uint64_t key = (static_cast<uint64_t>(*li) << 32) | static_cast<uint32_t>(*ri);
    merges.put(key, Merge{static_cast<int32_t>(r), *mi});
  }
}

// normalizer: null, NFC, or a sequence of NFC.
void Tokenizer::Impl::load_normalizer(const json& root) {
  const std::string& src = source;
  const json normalizer = root.value("normalizer", json(nullptr));
  auto is_nfc = [](const json& n) { return n.is_object() && n.value("type", "") == "NFC"; };
  if (normalizer.is_null()) {
    nfc = false;
  } else if (is_nfc(normalizer)) {
    nfc = true;
  } else if (normalizer.is_object() && normalizer.value("type", "") == "Sequence" &&
             normalizer.contains("normalizers") && normalizer["normalizers"].is_array() &&
             std::all_of(normalizer["normalizers"].begin(), normalizer["normalizers"].end(),
                         is_nfc)) {
    nfc = !normalizer["normalizers"].empty();
  } else {
    TORCH_CHECK(false, src, ": normalizer: only null or NFC is supported, found ",
                normalizer.dump());
  }
}

// pre_tokenizer: [Split(regex|string, Isolated)...] then ByteLevel.
void Tokenizer::Impl::load_pre_tokenizer(const json& root) {
  const std::string& src = source;
  const json pre = root.value("pre_tokenizer", json(nullptr));
  std::vector<json> steps;
  if (pre.is_object() && pre.value("type", "") == "Sequence") {
    TORCH_CHECK(pre.contains("pretokenizers") && pre["pretokenizers"].is_array(), src,
                ": pre_tokenizer.pretokenizers: expected an array");
    for (const auto& s : pre["pretokenizers"]) steps.push_back(s);
  } else {
    steps.push_back(pre);
  }
  TORCH_CHECK(
      !steps.empty() && steps.back().is_object() && steps.back().value("type", "") == "ByteLevel",
      src, ": pre_tokenizer: expected ByteLevel last (byte-level BPE), found ", pre.dump());
  for (size_t k = 0; k < steps.size(); ++k) {
    const json& s = steps[k];
    const std::string where = src + ": pre_tokenizer step " + std::to_string(k);
    const std::string type = s.value("type", "");
    if (type == "ByteLevel") {
      TORCH_CHECK(k + 1 == steps.size(), where, ": ByteLevel must be the last step");
      TORCH_CHECK(!s.value("add_prefix_space", false), where,
                  ": ByteLevel add_prefix_space=true is not supported");
      if (s.value("use_regex", true)) {
        splits.push_back(std::make_unique<Regex>(kGpt2Pattern, false, where));
      }
    } else if (type == "Split") {
      TORCH_CHECK(s.value("behavior", "") == "Isolated", where,
                  ": Split behavior must be \"Isolated\", found ",
                  s.value("behavior", json()).dump());
      TORCH_CHECK(!s.value("invert", false), where, ": Split invert=true is not supported");
      const json pat = s.value("pattern", json(nullptr));
      if (pat.is_object() && pat.contains("Regex") && pat["Regex"].is_string()) {
        splits.push_back(std::make_unique<Regex>(pat["Regex"].get<std::string>(), false, where));
      } else if (pat.is_object() && pat.contains("String") && pat["String"].is_string()) {
        splits.push_back(std::make_unique<Regex>(pat["String"].get<std::string>(), true, where));
      } else {
        TORCH_CHECK(false, where, ": Split pattern must be {\"Regex\": ...} or {\"String\": ...}");
      }
    } else {
      TORCH_CHECK(false, where, ": pre-tokenizer \"", type,
                  "\" is not supported (Split and ByteLevel only)");
    }
  }
}

// BPE of one pre-token (raw bytes). Symbols form a linked list; a min-heap of candidate merges
// ordered by (rank, position) pops the lowest rank, leftmost first; stale entries are skipped.
void Tokenizer::Impl::bpe(std::string_view piece, std::vector<TokenId>* out) const {
  const size_t n = piece.size();
  if (n == 1) {
    out->push_back(byte_ids[static_cast<uint8_t>(piece[0])]);
    return;
  }
  if (ignore_merges) {
    if (const auto id = vocab.find(piece)) {
      out->push_back(*id);
      return;
    }
  }
  struct Sym {
    TokenId id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Sym> syms(n);
  for (size_t i = 0; i < n; ++i) {
    syms[i] = {byte_ids[static_cast<uint8_t>(piece[i])], static_cast<int32_t>(i) - 1,
               i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  }
  struct Cand {
    int32_t rank, pos;
    TokenId merged;
    bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Cand, std::vector<Cand>, std::greater<Cand>> heap;
  auto lookup = [&](TokenId l, TokenId r) -> const Merge* {
    return merges.find((static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(r));
  };
  for (size_t i = 0; i + 1 < n; ++i) {
    if (const Merge* m = lookup(syms[i].id, syms[i + 1].id)) {
      heap.push({m->rank, static_cast<int32_t>(i), m->merged});
    }
  }
  while (!heap.empty()) {
    const Cand c = heap.top();
    heap.pop();
    Sym& s = syms[c.pos];
    if (!s.alive || s.next < 0) continue;
    const Merge* m = lookup(s.id, syms[s.next].id);
    if (m == nullptr || m->rank != c.rank || m->merged != c.merged) continue;
    Sym& nx = syms[s.next];
    nx.alive = false;
    s.id = c.merged;
    s.next = nx.next;
    if (s.next >= 0) syms[s.next].prev = c.pos;
    if (s.prev >= 0) {
      if (const Merge* pm = lookup(syms[s.prev].id, s.id))
        heap.push({pm->rank, s.prev, pm->merged});
    }
    if (s.next >= 0) {
      if (const Merge* nm = lookup(s.id, syms[s.next].id)) heap.push({nm->rank, c.pos, nm->merged});
    }
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out->push_back(syms[i].id);
}

void Tokenizer::Impl::encode_piece(std::string_view piece, std::vector<TokenId>* out) const {
  if (piece.size() == 1) {
    out->push_back(byte_ids[static_cast<uint8_t>(piece[0])]);
    return;
  }
  const bool cacheable = piece.size() <= kCacheMaxPieceBytes;
  std::string key;
  if (cacheable) {
    key.assign(piece.data(), piece.size());
    std::lock_guard<std::mutex> lock(cache_mu);
    auto it = cache.find(key);
    if (it != cache.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t start = out->size();
  bpe(piece, out);
  if (cacheable) {
    std::lock_guard<std::mutex> lock(cache_mu);
    if (cache.size() >= kCacheMaxEntries) cache.clear();
    cache.emplace(std::move(key), std::vector<TokenId>(out->begin() + start, out->end()));
  }
}

// Pre-tokenizes an already-normalized segment (no added tokens inside) and BPEs every piece.
void Tokenizer::Impl::encode_normalized(std::string_view seg, int64_t base, Encoding* out,
                                        bool offsets) const {
  if (seg.empty()) return;
  std::vector<std::pair<size_t, size_t>> pieces{{0, seg.size()}}, next;
  for (const auto& re : splits) {
    MatchData md(*re);
    next.clear();
    for (const auto& [pb, plen] : pieces) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(seg.data() + pb);
      size_t pos = 0, last = 0;
      while (pos < plen) {
        const int rc =
            pcre2_match(re->code(), subject, plen, pos, PCRE2_NO_UTF_CHECK, md.get(), nullptr);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        TORCH_CHECK(rc > 0, source, ": pre-tokenizer regex failed with PCRE2 error ", rc);
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md.get());
        const size_t mb = ov[0], me = ov[1];
        if (me == mb) {  // empty match: step over one character
          size_t bad = 0;
          const size_t len = io::utf8::sequence_length(seg.substr(pb, plen), mb, &bad);
          pos = mb + std::max<size_t>(len, 1);
          continue;
        }
        if (mb > last) next.push_back({pb + last, mb - last});
        next.push_back({pb + mb, me - mb});
        last = pos = me;
      }
      if (last < plen) next.push_back({pb + last, plen - last});
    }
    pieces.swap(next);
  }
  for (const auto& [pb, plen] : pieces) {
    const size_t first = out->ids.size();
    encode_piece(seg.substr(pb, plen), &out->ids);
    if (offsets) {
      int64_t at = base + static_cast<int64_t>(pb);
      for (size_t k = first; k < out->ids.size(); ++k) {
        const auto len = static_cast<int64_t>(id_bytes[out->ids[k]].size());
        out->offsets.push_back({at, at + len});
        at += len;
      }
    }
  }
}

// Normalizes a raw segment (no raw added tokens inside), then splits out normalized added tokens.
void Tokenizer::Impl::encode_segment(std::string_view seg, int64_t base, Encoding* out,
                                     bool offsets) const {
  std::string normalized;
  std::string_view norm = seg;
  if (nfc) {
    normalized = nfc_like_hf(seg);
    norm = normalized;
  }
  size_t from = 0;
  size_t at = 0;
  const AddedToken* tok = nullptr;
  while (!added_norm.empty() && added_norm.find(norm, from, &at, &tok)) {
    encode_normalized(norm.substr(from, at - from), base + static_cast<int64_t>(from), out,
                      offsets);
    out->ids.push_back(tok->id);
    if (offsets) {
      out->offsets.push_back(
          {base + static_cast<int64_t>(at), base + static_cast<int64_t>(at + tok->content.size())});
    }
    from = at + tok->content.size();
  }
  encode_normalized(norm.substr(from), base + static_cast<int64_t>(from), out, offsets);
}

Encoding Tokenizer::Impl::encode(std::string_view text, bool offsets) const {
  const size_t bad = io::utf8::find_invalid(text);
  TORCH_CHECK(bad == std::string_view::npos, "tokenizer: input is not valid UTF-8: invalid byte 0x",
              std::hex, static_cast<int>(static_cast<uint8_t>(text[bad])), std::dec,
              " at byte offset ", bad);
  Encoding out;
  out.ids.reserve(text.size() / 3 + 4);
  size_t from = 0, at = 0;
  int64_t norm_pos = 0;  // offsets are in the normalized text
  const AddedToken* tok = nullptr;
  auto segment = [&](std::string_view seg) {
    const size_t before = out.ids.size();
    encode_segment(seg, norm_pos, &out, offsets);
    if (offsets) {
      norm_pos =
          out.offsets.empty() || out.ids.size() == before ? norm_pos : out.offsets.back().second;
    }
  };
  while (!added_raw.empty() && added_raw.find(text, from, &at, &tok)) {
    segment(text.substr(from, at - from));
    out.ids.push_back(tok->id);
    if (offsets) {
      out.offsets.push_back({norm_pos, norm_pos + static_cast<int64_t>(tok->content.size())});
      norm_pos += static_cast<int64_t>(tok->content.size());
    }
    from = at + tok->content.size();
  }
  segment(text.substr(from));
  return out;
}

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_json_string(const std::string& text, const std::string& source_name) {
  tokenizer_json::StreamedModel streamed;
  json root;
  try {
    root = tokenizer_json::parse(text, &streamed);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, source_name, ": not valid JSON: ", e.what());
  }
  auto impl = std::make_unique<Impl>();
  impl->source = source_name;
  try {
    impl->load(root, streamed);
  } catch (const json::exception& e) {
    // A field of the wrong JSON type (a list where a string belongs, ...): the checks in load()
    // name the fields they know; anything they do not reach is still an input error.
    TORCH_CHECK(false, source_name, ": unexpected tokenizer.json structure: ", e.what());
  }
  return Tokenizer(std::move(impl));
}

Tokenizer Tokenizer::from_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in.good(), path, ": cannot open tokenizer file");
  // One read of the size the file reports (a pipe reports none: then doubling chunks), into the
  // string that is parsed: the bytes are copied once.
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  in.clear();
  in.seekg(0, std::ios::beg);
  in.clear();
  std::string text(size > 0 ? static_cast<size_t>(size) + 1 : size_t{1} << 16, '\0');
  size_t n = 0;
  while (true) {
    in.read(&text[n], static_cast<std::streamsize>(text.size() - n));
    n += static_cast<size_t>(in.gcount());
    if (n < text.size()) break;  // end of file (or an error, checked below)
    text.resize(2 * text.size());
  }
  TORCH_CHECK(!in.bad(), path, ": read error");
  text.resize(n);
  return from_json_string(text, path);
}

std::vector<TokenId> Tokenizer::encode(std::string_view text) const {
  return impl_->encode(text, false).ids;
}

Encoding Tokenizer::encode_with_offsets(std::string_view text) const {
  return impl_->encode(text, true);
}

std::string Tokenizer::decode(const std::vector<TokenId>& ids, bool skip_special) const {
  std::string out;
  for (TokenId id : ids) {
    impl_->check_id(id);
    if (skip_special && impl_->id_kind[id] == Impl::kSpecial) continue;
    out += impl_->id_bytes[id];
  }
  return out;
}

std::string Tokenizer::decode_lossy(const std::vector<TokenId>& ids, bool skip_special) const {
  // An id with no token (a model's padded embedding rows past the vocabulary, which a sampler
  // can draw) decodes to nothing, as Hugging Face tokenizers' decode skips it.
  std::vector<TokenId> known;
  known.reserve(ids.size());
  for (const TokenId id : ids) {
    if (id >= 0 && id < vocab_size() && impl_->id_kind[id] != Impl::kAbsent) known.push_back(id);
  }
  return io::utf8::repair(decode(known, skip_special));
}

std::optional<TokenId> Tokenizer::token_to_id(std::string_view token) const {
  auto a = impl_->added_by_content.find(std::string(token));
  if (a != impl_->added_by_content.end()) return a->second;
  // Vocabulary tokens are looked up by their byte-level spelling (e.g. "Ġthe").
  static const ByteLevelInverse c2b = codepoint_to_byte_table();
  std::string bytes;
  if (!byte_level_to_bytes(token, c2b, &bytes)) return std::nullopt;
  return impl_->vocab.find(bytes);
}

std::string Tokenizer::id_to_token(TokenId id) const {
  impl_->check_id(id);
  return impl_->id_string[id];
}

bool Tokenizer::is_special(TokenId id) const {
  impl_->check_id(id);
  return impl_->id_kind[id] == Impl::kSpecial;
}

bool Tokenizer::is_added(TokenId id) const {
  impl_->check_id(id);
  return impl_->id_kind[id] == Impl::kSpecial || impl_->id_kind[id] == Impl::kAdded;
}

int64_t Tokenizer::vocab_size() const { return static_cast<int64_t>(impl_->id_kind.size()); }

namespace {
TokenId require_special(const std::optional<TokenId>& id, const std::string& src,
                        const char* what) {
  TORCH_CHECK(id.has_value(), src, ": the tokenizer has no added token \"", what,
              "\" (needed for the Qwen ChatML format)");
  return *id;
}
}  // namespace

TokenId Tokenizer::im_start_id() const {
  return require_special(impl_->im_start, impl_->source, "<|im_start|>");
}
TokenId Tokenizer::im_end_id() const {
  return require_special(impl_->im_end, impl_->source, "<|im_end|>");
}
TokenId Tokenizer::endoftext_id() const {
  return require_special(impl_->endoftext, impl_->source, "<|endoftext|>");
}

const std::string& Tokenizer::source_name() const { return impl_->source; }

}  // namespace q4::data
