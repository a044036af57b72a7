// TensorBoard event writer (see tfevents.h). The protobuf wire format is written by hand: a key
// is varint((field << 3) | wire_type) with wire types 0 varint, 1 fixed64, 2 length-delimited,
// 5 fixed32; fixed values are little-endian (this code assumes a little-endian host, as every
// supported machine is).
#include "q4/trainer/report/tfevents.h"

#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "q4/trainer/config/config.h"

namespace q4::trainer {
namespace {

void put_varint(std::string& s, uint64_t v) {
  while (v >= 0x80) {
    s.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  s.push_back(static_cast<char>(v));
}

void put_key(std::string& s, uint32_t field, uint32_t wire_type) {
  put_varint(s, (static_cast<uint64_t>(field) << 3) | wire_type);
}

template <class T>
void put_fixed(std::string& s, T v) {
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  s.append(b, sizeof(T));
}

void put_bytes(std::string& s, uint32_t field, const std::string& bytes) {
  put_key(s, field, 2);
  put_varint(s, bytes.size());
  s += bytes;
}

// Event fields 1 (wall_time) and 2 (step); the caller appends the payload field.
std::string event_header(double wall_time, int64_t step) {
  std::string e;
  put_key(e, 1, 1);
  put_fixed(e, wall_time);
  if (step != 0) {  // proto3 default 0 is omitted, as protobuf serializers do
    put_key(e, 2, 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame_tfrecord(const std::string& data) {
  std::string r;
  const uint64_t len = data.size();
  put_fixed(r, len);
  put_fixed(r, masked_crc32c(r.data(), 8));
  r += data;
  put_fixed(r, masked_crc32c(data.data(), data.size()));
  return r;
}

std::string encode_file_version_event(double wall_time, const std::string& version) {
  std::string e = event_header(wall_time, 0);
  put_bytes(e, 3, version);
  return e;
}

std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag,
                                float value) {
  std::string v;  // Summary.Value
  put_bytes(v, 1, tag);
  put_key(v, 2, 5);
  put_fixed(v, value);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

std::string encode_text_event(double wall_time, int64_t step, const std::string& tag,
                              const std::string& text) {
  std::string plugin;  // SummaryMetadata.PluginData
  put_bytes(plugin, 1, "text");
  std::string meta;  // SummaryMetadata
  put_bytes(meta, 1, plugin);
  std::string tensor;  // TensorProto: dtype DT_STRING (7), scalar shape, one string_val
  put_key(tensor, 1, 0);
  put_varint(tensor, 7);
  put_bytes(tensor, 2, "");
  put_bytes(tensor, 8, text);
  std::string v;  // Summary.Value
  put_bytes(v, 1, tag);
  put_bytes(v, 8, tensor);
  put_bytes(v, 9, meta);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e = event_header(wall_time, step);
  put_bytes(e, 5, summary);
  return e;
}

void TfEventsWriter::open(const std::string& dir) {
  char host[256] = {0};
  if (::gethostname(host, sizeof(host) - 1) != 0 || host[0] == '\0') std::strcpy(host, "localhost");
  const double t = now_s();
  path_ = (std::filesystem::path(dir) /
           fmt::format("events.out.tfevents.{}.{}", static_cast<int64_t>(t), host))
              .string();
  try {
    out_.open(path_, /*truncate=*/false);
  } catch (const c10::Error& e) {
    throw ConfigError("cannot create the TensorBoard event file " + path_ + ": " +
                      e.what_without_backtrace());
  }
  write_event(encode_file_version_event(t, "brain.Event:2"));
}

void TfEventsWriter::write_event(const std::string& event) {
  const std::string rec = frame_tfrecord(event);
  out_.write(rec);
}

void TfEventsWriter::add_scalar(const std::string& tag, double value, int64_t step) {
  if (!is_open()) return;
  write_event(encode_scalar_event(now_s(), step, tag, static_cast<float>(value)));
}

void TfEventsWriter::add_text(const std::string& tag, const std::string& text, int64_t step) {
  if (!is_open()) return;
  write_event(encode_text_event(now_s(), step, tag, text));
}

void TfEventsWriter::add_metrics(const nlohmann::json& record, int64_t step,
                                 const std::string& prefix) {
  if (!is_open()) return;
  for (auto it = record.begin(); it != record.end(); ++it) {
    const std::string& key = it.key();
    if (key == "step" || key == "total_steps" || key == "skipped") continue;
    if (!it.value().is_number()) continue;
    const double v = it.value().get<double>();
    if (!std::isfinite(v)) continue;
    constexpr const char* kBytes = "_bytes";
    if (key.size() > 6 && key.compare(key.size() - 6, 6, kBytes) == 0) {
      add_scalar(prefix + key.substr(0, key.size() - 6) + "_gib", v / (1024.0 * 1024.0 * 1024.0),
                 step);
    } else {
      add_scalar(prefix + key, v, step);
    }
  }
}

}  // namespace q4::trainer
