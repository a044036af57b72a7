// Private: one pass over an HF tokenizer.json that streams the two large members, model.vocab
// (an object {token: id}) and model.merges (an array), into flat tables, and builds a DOM only
// for the rest (normalizer, pre_tokenizer, added_tokens, ...). A 151k-entry vocabulary as a DOM
// costs a std::map node and a JSON value per token; the flat tables cost one string buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

namespace q4::data::tokenizer_json {

// One member of model.vocab in file order: the token (a span of StreamedModel::text) and its id,
// or the JSON type found where the id belongs.
struct VocabMember {
  size_t offset = 0, size = 0;
  int64_t id = 0;  // the integer (an unsigned one cast as nlohmann's get<int64_t> casts it)
  nlohmann::json::value_t type = nlohmann::json::value_t::null;
  bool is_integer() const {
    return type == nlohmann::json::value_t::number_integer ||
           type == nlohmann::json::value_t::number_unsigned;
  }
};

// One element of model.merges: a string ("left right", size_b unused), a pair of strings
// (left then right back to back in StreamedModel::text), or anything else.
struct MergeElement {
  enum Form : uint8_t { kString, kPair, kInvalid };
  Form form = kInvalid;
  size_t offset = 0, size_a = 0, size_b = 0;
};

struct StreamedModel {
  std::string text;  // the vocabulary tokens and merge strings, back to back
  std::vector<VocabMember> vocab;
  std::vector<MergeElement> merges;
  std::string_view view(size_t offset, size_t size) const {
    return std::string_view(text).substr(offset, size);
  }
};

// Parses tokenizer.json text as nlohmann::json::parse does (same syntax errors, thrown as the
// same json::exception). The returned DOM is the document except that an object at model.vocab
// and an array at model.merges are empty there and their members are in *streamed (the last
// occurrence when a key repeats, as in the DOM). Anything else at those keys stays in the DOM.
nlohmann::json parse(const std::string& text, StreamedModel* streamed);

// The type name nlohmann's type_name() gives, "null" for null.
std::string type_name(nlohmann::json::value_t type);

}  // namespace q4::data::tokenizer_json
