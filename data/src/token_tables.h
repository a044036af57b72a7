// Private to the tokenizer: the two hash tables its load fills and BPE reads, both open
// addressing with linear probing over flat arrays (no allocation per entry).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "q4/data/tokenizer.h"

namespace q4::data::token_tables {

struct Merge {
  int32_t rank;
  TokenId merged;
};

// (left id, right id) -> Merge: open addressing with linear probing at load factor <= 0.5.
// The BPE inner loop is dominated by these lookups; this is ~3x faster than std::unordered_map.
class MergeTable {
 public:
  void reserve(size_t n) {
    size_t cap = 16;
    shift_ = 60;
    while (cap < 2 * n) {
      cap <<= 1;
      --shift_;
    }
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, Merge{0, 0});
    mask_ = cap - 1;
  }
  // Inserts or overwrites (a later duplicate merge wins, as in HF's HashMap collect).
  void put(uint64_t key, Merge m) {
    if (2 * (size_ + 1) > keys_.size()) grow();
    size_t i = slot(key);
    while (keys_[i] != kEmpty && keys_[i] != key) i = (i + 1) & mask_;
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    vals_[i] = m;
  }
  const Merge* find(uint64_t key) const {
    if (keys_.empty()) return nullptr;
    for (size_t i = slot(key);; i = (i + 1) & mask_) {
      if (keys_[i] == key) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }

 private:
  static constexpr uint64_t kEmpty = ~uint64_t{0};  // ids are < 2^30, so never a real key
  size_t slot(uint64_t key) const {
    return static_cast<size_t>((key * 0x9E3779B97F4A7C15ULL) >> shift_);  // Fibonacci hashing
  }
  void grow() {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<Merge> vals = std::move(vals_);
    reserve(std::max<size_t>(16, keys.size()));
    size_ = 0;
    for (size_t i = 0; i < keys.size(); ++i) {
      if (keys[i] != kEmpty) put(keys[i], vals[i]);
    }
  }
  std::vector<uint64_t> keys_;
  std::vector<Merge> vals_;
  size_t mask_ = 0;
  int shift_ = 60;
  size_t size_ = 0;
};

// Raw bytes -> id of the BPE vocabulary: open addressing with linear probing at load factor
// <= 0.5 over entries whose keys lie back to back in one buffer, so that loading a 151k-token
// vocabulary allocates a few buffers instead of a node and often a string per token, and a
// lookup takes a string_view.
class VocabIndex {
 public:
  void reset(size_t expected) {
    keys_.clear();
    entries_.clear();
    entries_.reserve(expected);
    size_t cap = 16;
    while (cap < 2 * expected) cap <<= 1;
    slots_.assign(cap, kEmpty);
  }
  // Adds `bytes` -> id; false, changing nothing, when `bytes` is already a key.
  bool insert(std::string_view bytes, TokenId id) {
    const size_t h = std::hash<std::string_view>{}(bytes);
    size_t i = h & mask();
    for (; slots_[i] != kEmpty; i = (i + 1) & mask()) {
      if (key_is(entries_[slots_[i]], h, bytes)) return false;
    }
    slots_[i] = static_cast<int32_t>(entries_.size());
    entries_.push_back({keys_.size(), bytes.size(), h, id});
    keys_.append(bytes);
    if (2 * entries_.size() > slots_.size()) grow();
    return true;
  }
  std::optional<TokenId> find(std::string_view bytes) const {
    if (slots_.empty()) return std::nullopt;
    const size_t h = std::hash<std::string_view>{}(bytes);
    for (size_t i = h & mask(); slots_[i] != kEmpty; i = (i + 1) & mask()) {
      const Entry& e = entries_[slots_[i]];
      if (key_is(e, h, bytes)) return e.id;
    }
    return std::nullopt;
  }

 private:
  static constexpr int32_t kEmpty = -1;
  struct Entry {
    size_t offset, size, hash;
    TokenId id;
  };
  size_t mask() const { return slots_.size() - 1; }
  bool key_is(const Entry& e, size_t hash, std::string_view bytes) const {
    return e.hash == hash && std::string_view(keys_).substr(e.offset, e.size) == bytes;
  }
  void grow() {
    slots_.assign(2 * slots_.size(), kEmpty);
    for (size_t k = 0; k < entries_.size(); ++k) {
      size_t i = entries_[k].hash & mask();
      while (slots_[i] != kEmpty) i = (i + 1) & mask();
      slots_[i] = static_cast<int32_t>(k);
    }
  }
  std::string keys_;
  std::vector<Entry> entries_;
  std::vector<int32_t> slots_;  // index into entries_, kEmpty for a free slot
};

}  // namespace q4::data::token_tables
