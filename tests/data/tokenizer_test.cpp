// Tokenizer tests: HF tokenizers goldens (tests/fixtures/tokenizer_golden.json plus cases below
// produced by HF tokenizers 0.23.2 for the whitespace/normalization corners where PCRE2 or utf8proc
// differ from HF's Oniguruma/Unicode-9 tables), decode round trips across invalid UTF-8
// boundaries, invalid input errors, and rejection of unsupported tokenizer.json features on a
// small synthetic byte-level BPE.
#include "q4/data/tokenizer.h"

#include <gtest/gtest.h>

#include <functional>
#include <nlohmann/json.hpp>

#include "q4/test/error_of.h"
#include "test_util.h"

namespace q4::data {
namespace {

using json = nlohmann::json;

using q4::test::error_of;

TEST(Tokenizer, MatchesHfGolden) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json gold = test::read_json(Q4_FIXTURES_DIR "/tokenizer_golden.json");
  ASSERT_GE(gold.size(), 20u);
  for (const auto& c : gold) {
    const std::string text = c["text"];
    EXPECT_EQ(tok.encode(text), c["ids"].get<std::vector<TokenId>>()) << "text: " << text;
  }
}

// Ids from HF tokenizers 0.23.2 (npm `tokenizers`, addSpecialTokens=false) with the same file.
TEST(Tokenizer, MatchesHfOnUnicodeCorners) {
  const std::vector<std::pair<std::string, std::vector<TokenId>>> cases = {
      {"a \xe1\xa0\x8e b\xe1\xa0\x8e"
       "c",
       {64, 86089, 254, 236, 293, 123970, 236, 66}},
      {"x \xc2\x85y \xc2\xa0z\xe2\x80\xa8w\xe3\x80\x80v",
       {87, 220, 126, 227, 88, 220, 4102, 89, 378, 101, 86, 22441, 85}},
      {"IT'\xc5\xbf fine 'S 'LL \xe2\x84\xaa"
       "elvin",
       {952, 6, 144815, 6915, 364, 50, 364, 4086, 90973}},
      {"\xd3\xb3\xd2\x86\xf0\x90\xbe\x83l e\xcc\x81\xcc\xa3 \xf0\x90\xbd\x8b\xd9\x92",
       {148962, 142, 228, 123934, 122, 225, 75, 220, 124635, 53839, 220, 123934, 121, 233, 59397}},
      {"A\xcc\x8a\xe2\x84\xab\xe1\x84\x80\xe1\x85\xa1\xe1\x86\xa8 \xef\xbc\xa1\xc2\xbd\xe2\x91\xa0",
       {144044, 144044, 126317, 62823, 94, 26062, 48312, 254}},
      {"\x09\x09\x0a \x0a\x0d\x0a  \x0a", {2394, 715, 319, 2303}},
      {"<|im_start|><|im_end|><|im_start|<|im_end|>>\xe2\x80\x8b<think>x</think>",
       {151644, 151645, 27, 91, 318, 4906, 91, 151645, 29, 15692, 151667, 87, 151668}},
      {"caf\xc3\xa9 na\xc3\xafve \xe0\xa4\x95\xe0\xa5\x8d\xe0\xa4\xb7 \xe0\xb8\x81\xe0\xb8\xb3 "
       "\xf0\x9f\x91\xa8\xe2\x80\x8d\xf0\x9f\x91\xa9\xe2\x80\x8d\xf0\x9f\x91\xa7",
       {924, 58858, 94880, 586, 47809, 30484, 115, 220, 124660, 61804, 101, 378, 235, 145233, 378,
        235, 145665}},
  };
  const Tokenizer& tok = test::qwen3_tokenizer();
  for (const auto& [text, ids] : cases) EXPECT_EQ(tok.encode(text), ids) << "text: " << text;
}

TEST(Tokenizer, SpecialTokensAndVocab) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  EXPECT_EQ(tok.vocab_size(), 151669);
  EXPECT_EQ(tok.endoftext_id(), 151643);
  EXPECT_EQ(tok.im_start_id(), 151644);
  EXPECT_EQ(tok.im_end_id(), 151645);
  EXPECT_TRUE(tok.is_special(151645));
  EXPECT_FALSE(tok.is_special(151667));  // <think> is added but not special
  EXPECT_TRUE(tok.is_added(151667));
  EXPECT_FALSE(tok.is_added(9707));
  EXPECT_EQ(tok.id_to_token(151667), "<think>");
  EXPECT_EQ(tok.token_to_id("<think>"), std::optional<TokenId>(151667));
  EXPECT_EQ(tok.id_to_token(220), "\xC4\xA0");  // "Ġ": byte-level spelling of a space
  EXPECT_EQ(tok.token_to_id("\xC4\xA0"), std::optional<TokenId>(220));
  EXPECT_EQ(tok.token_to_id("Hello"), std::optional<TokenId>(9707));
  EXPECT_FALSE(tok.token_to_id("no-such-token-xyz").has_value());
  EXPECT_NE(error_of([&] { tok.id_to_token(151669); }).find("151669"), std::string::npos);
  EXPECT_NE(error_of([&] { tok.decode({1, -5}); }).find("-5"), std::string::npos);
}

TEST(Tokenizer, DecodeInvertsEncode) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const json gold = test::read_json(Q4_FIXTURES_DIR "/tokenizer_golden.json");
  for (const auto& c : gold) {
    const std::string text = c["text"];
    const auto ids = tok.encode(text);
    const std::string back = tok.decode(ids);
    // Non-NFC input comes back NFC-normalized; re-encoding it must give the same ids.
    if (text.find("Cafe\xCC\x81") == std::string::npos) {
      EXPECT_EQ(back, text);
    }
    EXPECT_EQ(tok.encode(back), ids) << text;
  }
  const auto ids = tok.encode("<|im_start|>user\nhi<|im_end|>");
  EXPECT_EQ(tok.decode(ids, /*skip_special=*/true), "user\nhi");
}

TEST(Tokenizer, DecodeAcrossSplitCharacters) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::string
      text =  // "emoji 😀🚀👍🏽 Ünïcödé 鑿": several tokens split characters
      "emoji \xF0\x9F\x98\x80\xF0\x9F\x9A\x80\xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD "
      "\xC3\x9Cn\xC3\xAF"
      "c\xC3\xB6"
      "d\xC3\xA9 \xE9\x91\xBF";
  const auto ids = tok.encode(text);
  std::string joined;
  int partial = 0;
  for (TokenId id : ids) {
    const std::string piece = tok.decode({id});
    joined += piece;
    const std::string lossy = tok.decode_lossy({id});
    if (lossy != piece) {
      ++partial;  // a token holding part of a character: lossy decode shows U+FFFD
      EXPECT_NE(lossy.find("\xEF\xBF\xBD"), std::string::npos);
    }
  }
  EXPECT_EQ(joined, text);
  EXPECT_GT(partial, 0) << "expected some tokens to split a multi-byte character";
  // Any split point: decode(prefix) + decode(suffix) == text.
  for (size_t k = 0; k <= ids.size(); ++k) {
    const std::vector<TokenId> a(ids.begin(), ids.begin() + k), b(ids.begin() + k, ids.end());
    EXPECT_EQ(tok.decode(a) + tok.decode(b), text);
  }
  EXPECT_EQ(tok.decode_lossy(ids), text);
  // Ids past the vocabulary (a model's padded embedding rows: Qwen3's 151936 > 151669) are an
  // error for decode and are skipped by decode_lossy, as HF decodes them.
  std::vector<TokenId> padded(ids.begin(), ids.end());
  padded.insert(padded.begin() + 1, static_cast<TokenId>(tok.vocab_size()));
  padded.push_back(static_cast<TokenId>(tok.vocab_size() + 50));
  EXPECT_THROW(tok.decode(padded), c10::Error);
  EXPECT_EQ(tok.decode_lossy(padded), text);
}

TEST(Tokenizer, InvalidUtf8IsAnErrorNamingTheOffset) {
  const Tokenizer& tok = test::qwen3_tokenizer();
  const std::vector<std::pair<std::string, int>> bad = {
      {"ab\xFF"
       "cd",
       2},                      // invalid byte
      {"abc\xC0\xAF", 3},       // overlong
      {"x\xED\xA0\x80", 1},     // surrogate
      {"hello \xE4\xBD", 6},    // truncated at the end
      {"\xF4\x90\x80\x80", 0},  // above U+10FFFF
  };
  for (const auto& [text, offset] : bad) {
    const std::string msg = error_of([&, &text = text] { tok.encode(text); });
    EXPECT_NE(msg.find("byte offset " + std::to_string(offset)), std::string::npos) << msg;
  }
}

TEST(Tokenizer, MissingFileNamesThePath) {
  const std::string msg = error_of([] { Tokenizer::from_file("/nonexistent/tok.json"); });
  EXPECT_NE(msg.find("/nonexistent/tok.json"), std::string::npos) << msg;
}

// ---- synthetic tokenizer.json: bytes + a few merges, to test the loader's feature checks.

std::string byte_level(const std::string& bytes) {
  std::string out;
  for (unsigned char b : bytes) {
    int cp = b;
    if (!((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE))) {
      int n = 0;
      for (int c = 0; c < b; ++c) {
        if (!((c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE))) ++n;
      }
      cp = 256 + n;
    }
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else {
      out += static_cast<char>(0xC0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3F));
    }
  }
  return out;
}

json tiny_tokenizer(bool array_merges) {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[byte_level(std::string(1, static_cast<char>(b)))] = b;
  const std::vector<std::pair<std::string, std::string>> merges = {
      {"l", "l"}, {"h", "e"}, {"he", "ll"}, {"hell", "o"}, {" ", "w"}, {"o", "r"}};
  json jm = json::array();
  int id = 256;
  for (const auto& [a, b] : merges) {
    vocab[byte_level(a + b)] = id++;
    if (array_merges) {
      jm.push_back({byte_level(a), byte_level(b)});
    } else {
      jm.push_back(byte_level(a) + " " + byte_level(b));
    }
  }
  json t;
  t["model"] = {{"type", "BPE"}, {"vocab", vocab}, {"merges", jm}, {"dropout", nullptr}};
  t["added_tokens"] =
      json::array({{{"id", 300}, {"content", "<|x|>"}, {"special", true}, {"normalized", false}}});
  t["normalizer"] = {{"type", "NFC"}};
  t["pre_tokenizer"] = {
      {"type", "Sequence"},
      {"pretokenizers",
       json::array({{{"type", "Split"},
                     {"pattern", {{"Regex", " ?\\p{L}+|\\s+|[^\\s\\p{L}]+"}}},
                     {"behavior", "Isolated"},
                     {"invert", false}},
                    {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}})}};
  t["decoder"] = {{"type", "ByteLevel"}};
  t["post_processor"] = nullptr;
  return t;
}

TEST(Tokenizer, SyntheticBpeBothMergeForms) {
  for (bool array_merges : {false, true}) {
    const auto tok = Tokenizer::from_json_string(tiny_tokenizer(array_merges).dump(), "tiny");
    // "hello" -> l+l, h+e, he+ll, hell+o = 259; " world" -> " w"(260), "or"(261), "l", "d".
    EXPECT_EQ(tok.encode("hello world"), (std::vector<TokenId>{259, 260, 261, 'l', 'd'}));
    EXPECT_EQ(tok.encode("hello<|x|>!"), (std::vector<TokenId>{259, 300, '!'}));
    EXPECT_EQ(tok.decode(tok.encode("hello<|x|> world")), "hello<|x|> world");
    EXPECT_EQ(tok.vocab_size(), 301);
    EXPECT_THROW(tok.im_start_id(), c10::Error);
  }
}

TEST(Tokenizer, RejectsUnsupportedFeatures) {
  struct Case {
    const char* what;
    std::function<void(json&)> edit;
    const char* expect;  // substring of the error
  };
  // The edit that replaces the section `key` by {"type": type}.
  const auto typed = [](const char* key, const char* type) {
    return [key, type](json& t) { t[key] = {{"type", type}}; };
  };
  const std::vector<Case> cases = {
      {"model type", [](json& t) { t["model"]["type"] = "WordPiece"; }, "model.type"},
      {"dropout", [](json& t) { t["model"]["dropout"] = 0.1; }, "model.dropout"},
      {"byte_fallback", [](json& t) { t["model"]["byte_fallback"] = true; }, "byte_fallback"},
      {"normalizer", typed("normalizer", "NFKC"), "normalizer"},
      {"lowercase in sequence",
       [](json& t) {
         t["normalizer"] = {{"type", "Sequence"},
                            {"normalizers", json::array({{{"type", "Lowercase"}}})}};
       },
       "normalizer"},
      {"split behavior",
       [](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["behavior"] = "Removed"; }, "Isolated"},
      {"split invert", [](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["invert"] = true; },
       "invert"},
      {"bad regex",
       [](json& t) { t["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(("; }, "regex"},
      {"metaspace", typed("pre_tokenizer", "Metaspace"), "ByteLevel"},
      {"prefix space",
       [](json& t) { t["pre_tokenizer"]["pretokenizers"][1]["add_prefix_space"] = true; },
       "add_prefix_space"},
      {"decoder", typed("decoder", "WordPiece"), "decoder"},
      {"post processor", typed("post_processor", "TemplateProcessing"), "post_processor"},
      {"lstrip", [](json& t) { t["added_tokens"][0]["lstrip"] = true; }, "lstrip"},
      {"model type not a string", [](json& t) { t["model"]["type"] = json::array({"H e"}); },
       "tokenizer.json structure"},
      {"post processor type not a string",
       [](json& t) {
         t["post_processor"] = {{"type", 3}};
       },
       "tokenizer.json structure"},
      {"merge not in vocab", [](json& t) { t["model"]["merges"].push_back("q z"); },
       "model.merges[6]"},
      {"missing byte", [](json& t) { t["model"]["vocab"].erase("A"); }, "byte 0x41"},
  };
  for (const auto& c : cases) {
    json t = tiny_tokenizer(false);
    c.edit(t);
    const std::string msg = error_of([&] { Tokenizer::from_json_string(t.dump(), "tiny.json"); });
    EXPECT_NE(msg.find(c.expect), std::string::npos) << c.what << ": " << msg;
    EXPECT_NE(msg.find("tiny.json"), std::string::npos) << c.what << ": " << msg;
  }
}

// model.vocab and model.merges are streamed, not read from a DOM: a repeated key, a shared id and
// several bad members must still resolve as a DOM object (std::map, last key wins) resolves them.
std::string with_vocab_prefix(const std::string& members) {
  std::string text = tiny_tokenizer(false).dump();
  const size_t at = text.find("\"vocab\":{");
  text.insert(at + 9, members);
  return text;
}

TEST(Tokenizer, StreamedVocabResolvesAsTheDom) {
  // "ll" is 256 further on: the later member wins and 299 names nothing.
  auto tok = Tokenizer::from_json_string(with_vocab_prefix("\"ll\":299,"), "tiny");
  EXPECT_EQ(tok.token_to_id("ll"), std::optional<TokenId>(256));
  EXPECT_THROW(tok.id_to_token(299), c10::Error);
  EXPECT_EQ(tok.encode("hello"), (std::vector<TokenId>{259}));
  // Two tokens with id 256: the later in key order ("zz" > "ll") is what 256 decodes to.
  tok = Tokenizer::from_json_string(with_vocab_prefix("\"zz\":256,"), "tiny");
  EXPECT_EQ(tok.id_to_token(256), "zz");
  EXPECT_EQ(tok.decode({256}), "zz");
  EXPECT_EQ(tok.token_to_id("ll"), std::optional<TokenId>(256));
  EXPECT_EQ(tok.token_to_id("zz"), std::optional<TokenId>(256));
  // Two bad members: the first in key order is reported.
  std::string msg = error_of(
      [] { Tokenizer::from_json_string(with_vocab_prefix("\"zz\":\"x\",\"ab\":-1,"), "t.json"); });
  EXPECT_NE(msg.find("t.json: model.vocab[\"ab\"]: id -1 out of range"), std::string::npos) << msg;
  msg = error_of(
      [] { Tokenizer::from_json_string(with_vocab_prefix("\"ab\":{\"id\":[1]},"), "t.json"); });
  EXPECT_NE(msg.find("t.json: model.vocab[\"ab\"]: expected an integer id, found object"),
            std::string::npos)
      << msg;
  // A repeated "model" replaces the first, streamed members included.
  const std::string tiny = tiny_tokenizer(false).dump();
  tok = Tokenizer::from_json_string(
      "{\"model\":{\"vocab\":{\"q\":1},\"merges\":[\"q q\"]}," + tiny.substr(1), "tiny");
  EXPECT_EQ(tok.encode("hello world"), (std::vector<TokenId>{259, 260, 261, 'l', 'd'}));
}

TEST(Tokenizer, StreamedMergeFormsAreChecked) {
  const std::vector<json> bad = {json(5),
                                 json::array({"l", "l", "l"}),
                                 json::array({"l"}),
                                 json::array({json::array({"l"}), "l"}),
                                 json::array({"l", 1}),
                                 json::object({{"l", "l"}}),
                                 json(nullptr)};
  for (const json& b : bad) {
    json t = tiny_tokenizer(false);
    t["model"]["merges"].push_back(b);
    const std::string msg = error_of([&] { Tokenizer::from_json_string(t.dump(), "t.json"); });
    EXPECT_NE(msg.find("t.json: model.merges[6]: expected \"left right\" or [\"left\", \"right\"]"),
              std::string::npos)
        << b.dump() << ": " << msg;
  }
  json t = tiny_tokenizer(false);
  t["model"]["merges"] = json::object();
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json_string(t.dump(), "t.json");
            }).find("t.json: model.merges: expected an array"),
            std::string::npos);
  t["model"]["merges"] = json::array();
  t["model"]["vocab"] = json::array();
  EXPECT_NE(error_of([&] {
              Tokenizer::from_json_string(t.dump(), "t.json");
            }).find("t.json: model.vocab: expected an object {token: id}"),
            std::string::npos);
}

// A number out of double range made nlohmann throw out_of_range, which escaped as a
// runtime error (exit 1) instead of an input error naming the file.
TEST(Tokenizer, JsonNumberOverflowIsAnInputError) {
  try {
    Tokenizer::from_json_string("{\"version\": 1e400}", "t.json");
    ADD_FAILURE() << "accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find("t.json: not valid JSON"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace q4::data
