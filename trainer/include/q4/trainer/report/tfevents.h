// TensorBoard event files written without TensorFlow: `events.out.tfevents.<secs>.<host>` in the
// run directory, TFRecord framing (uint64 LE length, masked CRC32C of the length, data, masked
// CRC32C of the data) around hand-encoded tensorflow.Event protobufs. The few fields used keep
// TensorFlow's numbers (event.proto: wall_time=1 double, step=2 int64, file_version=3 string,
// summary=5; summary.proto: Summary.value=1, Value.tag=1, simple_value=2 float, tensor=8,
// metadata=9; tensor.proto: dtype=1, tensor_shape=2, string_val=8; text plugin metadata), so
// TensorBoard's own reader loads them (scripts/bench/read_tfevents.py checks that).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>

#include "q4/io/atomic_file.h"
#include "q4/io/crc32c.h"

namespace q4::trainer {

// TFRecord checksums are CRC-32C (q4/io/crc32c.h).
using io::crc32c;
// TFRecord's masking: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

// One TFRecord: length, masked CRC of the length, `data`, masked CRC of the data.
std::string frame_tfrecord(const std::string& data);

// Serialized tensorflow.Event messages.
std::string encode_file_version_event(double wall_time, const std::string& version);
std::string encode_scalar_event(double wall_time, int64_t step, const std::string& tag,
                                float value);
// A text summary (TensorBoard's text plugin: a DT_STRING scalar tensor, plugin_name "text").
std::string encode_text_event(double wall_time, int64_t step, const std::string& tag,
                              const std::string& text);

class TfEventsWriter {
 public:
  TfEventsWriter() = default;
  // Creates `<dir>/events.out.tfevents.<unix secs>.<hostname>` and writes the file_version event
  // ("brain.Event:2"). Every add_* call is one checked write(2) (q4::io::AppendFile, as
  // metrics.jsonl): a killed run keeps what it logged, and a failed write (full disk) throws
  // naming the file.
  void open(const std::string& dir);
  bool is_open() const { return out_.is_open(); }
  const std::string& path() const { return path_; }
  void add_scalar(const std::string& tag, double value, int64_t step);
  void add_text(const std::string& tag, const std::string& text, int64_t step);
  // Every finite number of a metrics.jsonl record (metrics_to_json) except step/total_steps/
  // skipped as the scalar `<prefix><key>`; *_bytes fields are written in GiB as `<key without
  // _bytes>_gib`. Null (unknown) values are left out.
  void add_metrics(const nlohmann::json& record, int64_t step,
                   const std::string& prefix = "train/");

 private:
  void write_event(const std::string& event);
  std::string path_;
  io::AppendFile out_;
};

}  // namespace q4::trainer
