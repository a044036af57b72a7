// How many decoder layers a weights file stores, from its tensor names (private to q4_model):
// the load of a .dat and the import of an HF folder compare it with num_hidden_layers, so that
// a config.json describing fewer layers than the weights is an error rather than a silent drop.
#pragma once

#include <cstdint>
#include <string>

namespace q4::model {

// 1 + the largest N of the keys "model.layers.<N>.*" seen so far, given as `count`; call once
// per key. Keys of another form leave `count` unchanged.
inline int64_t count_stored_layer(const std::string& key, int64_t count) {
  static const std::string kPrefix = "model.layers.";
  if (key.compare(0, kPrefix.size(), kPrefix) != 0) return count;
  int64_t n = 0;
  size_t i = kPrefix.size();
  if (i >= key.size() || key[i] < '0' || key[i] > '9') return count;
  for (; i < key.size() && key[i] >= '0' && key[i] <= '9' && n < (int64_t{1} << 40); ++i) {
    n = n * 10 + (key[i] - '0');
  }
  if (i >= key.size() || key[i] != '.') return count;
  return n + 1 > count ? n + 1 : count;
}

}  // namespace q4::model
