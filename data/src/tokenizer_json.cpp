// See tokenizer_json.h. The handler is nlohmann's SAX interface: outside the two streamed members
// it builds the DOM as nlohmann's own json_sax_dom_parser does (a stack of open containers and
// the member slot the next value goes to); inside them it appends to StreamedModel.
#include "tokenizer_json.h"

#include <utility>

namespace q4::data::tokenizer_json {
namespace {

using Json = nlohmann::json;

class StreamingHandler {
 public:
  explicit StreamingHandler(StreamedModel* streamed) : out_(streamed) {}
  Json take_root() { return std::move(root_); }

  bool null() { return scalar(Json(nullptr)); }
  bool boolean(bool v) { return scalar(Json(v)); }
  bool number_integer(Json::number_integer_t v) { return scalar(Json(v)); }
  bool number_unsigned(Json::number_unsigned_t v) { return scalar(Json(v)); }
  bool number_float(Json::number_float_t v, const Json::string_t& /*raw*/) {
    return scalar(Json(v));
  }
  bool binary(Json::binary_t& v) { return scalar(Json(Json::binary(std::move(v)))); }
  bool string(Json::string_t& v) {
    if (mode_ == kMerges && skip_ == 0) {
      out_->merges.push_back({MergeElement::kString, out_->text.size(), v.size(), 0});
      out_->text += v;
      return true;
    }
    if (mode_ == kMergePair && skip_ == 0) {
      if (pair_count_ < 2) {
        (pair_count_ == 0 ? pair_.size_a : pair_.size_b) = v.size();
        out_->text += v;
      }
      ++pair_count_;
      return true;
    }
    return scalar(Json(v));
  }

  bool key(Json::string_t& k) {
    if (skip_ > 0) return true;
    if (mode_ == kVocab) {
      out_->vocab.push_back({out_->text.size(), k.size(), 0, Json::value_t::null});
      out_->text += k;
      return true;
    }
    if (stack_.size() == 1) root_key_is_model_ = k == "model";
    if (stack_.size() == 2 && model_open_) {
      model_key_ = k == "vocab" ? kVocab : k == "merges" ? kMerges : kDom;
    }
    member_ = &(*stack_.back())[k];
    return true;
  }

  bool start_object(std::size_t /*size*/) {
    if (mode_ != kDom || skip_ > 0) return enter_nested(Json::value_t::object);
    if (stack_.size() == 1 && stack_[0]->is_object() && root_key_is_model_) {
      model_open_ = true;  // root.model: a repeated key replaces what an earlier one streamed
      out_->text.clear();
      out_->vocab.clear();
      out_->merges.clear();
    } else if (stack_.size() == 2 && model_open_ && model_key_ == kVocab) {
      place(Json::object());  // the DOM keeps an empty object
      out_->vocab.clear();
      mode_ = kVocab;
      return true;
    }
    stack_.push_back(place(Json::object()));
    return true;
  }
  bool start_array(std::size_t /*size*/) {
    if (mode_ != kDom || skip_ > 0) return enter_nested(Json::value_t::array);
    if (stack_.size() == 2 && model_open_ && model_key_ == kMerges) {
      place(Json::array());  // the DOM keeps an empty array
      out_->merges.clear();
      mode_ = kMerges;
      return true;
    }
    stack_.push_back(place(Json::array()));
    return true;
  }
  bool end_object() { return end_container(); }
  bool end_array() { return end_container(); }

  template <class Exception>
  bool parse_error(std::size_t /*pos*/, const std::string& /*token*/, const Exception& ex) {
    throw ex;  // as json::parse does
  }

 private:
  enum Mode { kDom, kVocab, kMerges, kMergePair };

  // Where the next DOM value goes (the root, an array's end or the last key's member).
  Json* place(Json v) {
    if (stack_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    if (stack_.back()->is_array()) {
      stack_.back()->push_back(std::move(v));
      return &stack_.back()->back();
    }
    *member_ = std::move(v);
    return member_;
  }

  bool scalar(Json v) {
    if (skip_ > 0) return true;
    switch (mode_) {
      case kDom:
        place(std::move(v));
        break;
      case kVocab:
        out_->vocab.back().type = v.type();
        if (v.is_number_integer()) out_->vocab.back().id = v.get<int64_t>();
        break;
      case kMerges:
        out_->merges.push_back({MergeElement::kInvalid, 0, 0, 0});
        break;
      case kMergePair:
        pair_ok_ = false;
        ++pair_count_;
        break;
    }
    return true;
  }

  // A container inside a streamed member (or inside one being skipped).
  bool enter_nested(Json::value_t type) {
    if (skip_ > 0) {
      ++skip_;
    } else if (mode_ == kVocab) {
      out_->vocab.back().type = type;
      skip_ = 1;
    } else if (mode_ == kMerges && type == Json::value_t::array) {
      mode_ = kMergePair;
      pair_ = {MergeElement::kPair, out_->text.size(), 0, 0};
      pair_count_ = 0;
      pair_ok_ = true;
    } else if (mode_ == kMerges) {
      out_->merges.push_back({MergeElement::kInvalid, 0, 0, 0});
      skip_ = 1;
    } else {  // kMergePair
      pair_ok_ = false;
      ++pair_count_;
      skip_ = 1;
    }
    return true;
  }

  bool end_container() {
    if (skip_ > 0) {
      --skip_;
    } else if (mode_ == kMergePair) {
      if (!pair_ok_ || pair_count_ != 2) pair_.form = MergeElement::kInvalid;
      out_->merges.push_back(pair_);
      mode_ = kMerges;
    } else if (mode_ != kDom) {
      mode_ = kDom;  // the end of model.vocab or model.merges
    } else {
      if (stack_.size() == 2 && model_open_) model_open_ = false;
      stack_.pop_back();
    }
    return true;
  }

  StreamedModel* out_;
  Json root_;
  std::vector<Json*> stack_;  // the open DOM containers, root first
  Json* member_ = nullptr;    // the slot of the last key in the innermost open object
  bool root_key_is_model_ = false;
  bool model_open_ = false;  // stack_[1] is root.model
  Mode model_key_ = kDom;    // which streamed member the last key of root.model names
  Mode mode_ = kDom;
  int64_t skip_ = 0;  // depth inside a container that is skipped
  MergeElement pair_;
  int pair_count_ = 0;
  bool pair_ok_ = true;
};

}  // namespace

Json parse(const std::string& text, StreamedModel* streamed) {
  *streamed = StreamedModel();
  // The streamed strings are shorter than their JSON spelling: no reallocation, and the pages of
  // the reserve that are never written cost nothing.
  streamed->text.reserve(text.size());
  // A byte-level BPE file spends about 70 bytes per vocabulary entry and merge together (Qwen3:
  // 11 MB, 151k of each): room for those counts, so that the tables are written once.
  streamed->vocab.reserve(text.size() / 64);
  streamed->merges.reserve(text.size() / 64);
  StreamingHandler handler(streamed);
  Json::sax_parse(text, &handler);
  return handler.take_root();
}

std::string type_name(Json::value_t type) {
  return type == Json::value_t::null ? "null" : Json(type).type_name();
}

}  // namespace q4::data::tokenizer_json
