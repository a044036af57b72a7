// q4dat info: one line per entry (index, key, type, shape, bytes), totals per element type, and
// for every NVFP4 pair the dense shape and bits per parameter ((qdata + scale) * 8 / (r * c),
// 4.5 for NVFP4). A mixture-of-experts layer's stacked expert matrix (mlp.experts.<proj>.weight,
// docs/model.md#mixture-of-experts) is listed with its expert count, E from --config or else from
// the layer's router entry (mlp.gate.weight, (E, H)); with --config the header gives the MoE
// summary. --json prints the same facts as one JSON object. Reads headers only.
#include <fmt/core.h>

#include <cctype>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>

#include "common.h"
#include "q4/model/qwen3_config.h"
#include "q4dat.h"

namespace q4::tools {

using q4::io::DatEntry;
using q4::io::DatReader;

namespace {

// The expert count of stacked expert matrix `name` ("model.layers.N.mlp.experts.gate_proj.weight":
// no expert index after "mlp.experts."), from the config when given, else from the rows of the
// layer's router entry; 0 for any other name or when neither says.
int64_t stacked_experts(const std::string& name, const DatReader& r,
                        const std::optional<q4::model::Qwen3Config>& cfg) {
  const std::string key = ".mlp.experts.";
  const size_t at = name.find(key);
  if (at == std::string::npos || at + key.size() >= name.size() ||
      std::isdigit(static_cast<unsigned char>(name[at + key.size()]))) {
    return 0;
  }
  if (cfg && cfg->is_moe()) return cfg->moe.num_experts;
  const DatEntry* router = r.find(name.substr(0, at) + ".mlp.gate.weight");
  return router != nullptr && router->shape.size() == 2 ? router->shape[0] : 0;
}

// "MoE: 8 experts, top-2, 2 of 3 layers sparse (0, 2)".
std::string moe_summary(const q4::model::Qwen3Config& c) {
  std::string layers;
  int64_t n = 0;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.is_moe_layer(l)) continue;
    layers += (n++ ? ", " : "") + std::to_string(l);
  }
  return fmt::format("MoE: {} experts, top-{}, {} of {} layers sparse ({})", c.moe.num_experts,
                     c.moe.num_experts_per_tok, n, c.num_hidden_layers, layers);
}

// The same facts for --json, on an MoE config only (else null).
nlohmann::json moe_json(const std::optional<q4::model::Qwen3Config>& c) {
  if (!c || !c->is_moe()) return nullptr;
  nlohmann::json sparse = nlohmann::json::array();
  for (int64_t l = 0; l < c->num_hidden_layers; ++l) {
    if (c->is_moe_layer(l)) sparse.push_back(l);
  }
  return {{"num_experts", c->moe.num_experts},
          {"num_experts_per_tok", c->moe.num_experts_per_tok},
          {"sparse_layers", std::move(sparse)}};
}

// "[rows, cols]", or "[E experts x rows/E, cols]" for a stacked expert matrix.
std::string pair_shape(const Nvfp4Pair& p, const DatReader& r,
                       const std::optional<q4::model::Qwen3Config>& cfg) {
  const int64_t e = stacked_experts(p.name, r, cfg);
  return e > 0 && p.rows % e == 0 ? fmt::format("[{} experts x {}, {}]", e, p.rows / e, p.cols)
                                  : fmt::format("[{}, {}]", p.rows, p.cols);
}

// One object per entry: index, key, type, type code, shape, offset, bytes.
nlohmann::json entries_json(const std::vector<DatEntry>& es) {
  nlohmann::json entries = nlohmann::json::array();
  for (size_t i = 0; i < es.size(); ++i) {
    const DatEntry& e = es[i];
    entries.push_back({{"index", i},
                       {"key", e.key},
                       {"type", q4::io::elem_type_name(e.type)},
                       {"type_code", static_cast<uint32_t>(e.type)},
                       {"shape", e.shape},
                       {"offset", e.offset},
                       {"bytes", e.nbytes}});
  }
  return entries;
}

}  // namespace

int run_info(const InfoOptions& o) {
  const auto cfg = as_input([&]() -> std::optional<q4::model::Qwen3Config> {
    if (o.config.empty()) return std::nullopt;
    return q4::model::Qwen3Config::from_json_file(o.config);
  });
  const auto r = as_input([&] { return std::make_unique<DatReader>(o.file); });
  const auto& es = r->entries();
  const std::vector<Nvfp4Pair> pairs = find_nvfp4_pairs(*r, /*strict=*/false);

  std::vector<bool> in_pair(es.size(), false);
  uint64_t nvfp4_params = 0, nvfp4_bytes = 0;
  for (const Nvfp4Pair& p : pairs) {
    in_pair[p.qdata_index] = in_pair[p.scale_index] = true;
    nvfp4_params += static_cast<uint64_t>(p.rows * p.cols);
    nvfp4_bytes += es[p.qdata_index].nbytes + es[p.scale_index].nbytes;
  }
  uint64_t payload = 0, params = nvfp4_params;
  struct TypeTotal {
    uint64_t entries = 0, bytes = 0;
  };
  std::map<std::string, TypeTotal> by_type;
  for (size_t i = 0; i < es.size(); ++i) {
    payload += es[i].nbytes;
    if (!in_pair[i]) params += static_cast<uint64_t>(es[i].numel());
    TypeTotal& t = by_type[q4::io::elem_type_name(es[i].type)];
    ++t.entries;
    t.bytes += es[i].nbytes;
  }
  const uint64_t header_bytes = r->file_size_bytes() - payload;
  auto bits = [](uint64_t bytes, uint64_t n) { return n ? 8.0 * bytes / n : 0.0; };

  if (o.json) {
    nlohmann::json j;
    j["file"] = o.file;
    j["file_size_bytes"] = r->file_size_bytes();
    j["num_entries"] = es.size();
    j["entries"] = entries_json(es);
    nlohmann::json jp = nlohmann::json::array();
    for (const Nvfp4Pair& p : pairs) {
      const uint64_t b = es[p.qdata_index].nbytes + es[p.scale_index].nbytes;
      jp.push_back({{"name", p.name},
                    {"rows", p.rows},
                    {"cols", p.cols},
                    {"qdata_type", q4::io::elem_type_name(es[p.qdata_index].type)},
                    {"bytes", b},
                    {"bits_per_param", bits(b, static_cast<uint64_t>(p.rows * p.cols))}});
      if (const int64_t e = stacked_experts(p.name, *r, cfg)) jp.back()["experts"] = e;
    }
    j["nvfp4"] = std::move(jp);
    if (cfg && cfg->is_moe()) j["moe"] = moe_json(cfg);
    nlohmann::json bt = nlohmann::json::object();
    for (const auto& [name, t] : by_type) bt[name] = {{"entries", t.entries}, {"bytes", t.bytes}};
    j["totals"] = {{"payload_bytes", payload},
                   {"header_bytes", header_bytes},
                   {"parameters", params},
                   {"bits_per_param", bits(payload, params)},
                   {"by_type", std::move(bt)},
                   {"nvfp4_pairs", pairs.size()},
                   {"nvfp4_parameters", nvfp4_params},
                   {"nvfp4_bytes", nvfp4_bytes},
                   {"nvfp4_bits_per_param", bits(nvfp4_bytes, nvfp4_params)}};
    fmt::print("{}\n", j.dump(2));
    return 0;
  }

  size_t key_w = 3;
  for (const DatEntry& e : es) key_w = std::max(key_w, e.key.size());
  key_w = std::min<size_t>(key_w, 72);
  fmt::print("{}: {} bytes, {} entries\n", o.file, r->file_size_bytes(), es.size());
  if (cfg && cfg->is_moe()) fmt::print("{}\n", moe_summary(*cfg));
  fmt::print("{:>5}  {:<{}}  {:<5}  {:<20}  {:>14}\n", "#", "key", key_w, "type", "shape", "bytes");
  for (size_t i = 0; i < es.size(); ++i) {
    const DatEntry& e = es[i];
    fmt::print("{:>5}  {:<{}}  {:<5}  {:<20}  {:>14}\n", i, e.key, key_w,
               q4::io::elem_type_name(e.type), shape_str(e.shape), e.nbytes);
  }
  fmt::print(
      "totals: {} entries, payload {} bytes, headers {} bytes, {} parameters, "
      "{:.3f} bits/param\n",
      es.size(), payload, header_bytes, params, bits(payload, params));
  for (const auto& [name, t] : by_type) {
    fmt::print("  {:<5} {:>6} entries {:>16} bytes\n", name, t.entries, t.bytes);
  }
  if (!pairs.empty()) {
    fmt::print("nvfp4: {} pairs, {} parameters, {} bytes, {:.3f} bits/param\n", pairs.size(),
               nvfp4_params, nvfp4_bytes, bits(nvfp4_bytes, nvfp4_params));
    for (const Nvfp4Pair& p : pairs) {
      const uint64_t b = es[p.qdata_index].nbytes + es[p.scale_index].nbytes;
      fmt::print("  {:<{}}  {}  {:.3f} bits/param\n", p.name, key_w, pair_shape(p, *r, cfg),
                 bits(b, static_cast<uint64_t>(p.rows * p.cols)));
    }
  }
  return 0;
}

}  // namespace q4::tools
