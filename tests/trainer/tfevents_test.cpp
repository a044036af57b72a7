// TensorBoard event files: CRC32C against the standard check value, the protobuf bytes of a
// scalar event against a hand-derived encoding, and a file written by TfEventsWriter read back
// by an independent parser here (record framing, both masked CRCs, Event/Summary decoding).
#include "q4/trainer/report/tfevents.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "q4/io/remove_tree.h"

namespace fs = std::filesystem;

namespace q4::trainer {
namespace {

TEST(Crc32c, StandardCheckValue) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  // 32 zero bytes (RFC 3720 B.4 test vector).
  const std::string zeros(32, '\0');
  EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu);
  // Incremental == one shot.
  EXPECT_EQ(crc32c("6789", 4, crc32c("12345", 5)), 0xE3069283u);
}

TEST(TfEvents, ScalarEventBytes) {
  // Event{wall_time: 1.5, step: 3, summary {value {tag: "loss", simple_value: 2.0}}}
  const std::string expect(
      "\x09\x00\x00\x00\x00\x00\x00\xF8\x3F"  // 1: fixed64 double 1.5
      "\x10\x03"                              // 2: varint 3
      "\x2A\x0D"                              // 5: Summary, 13 bytes
      "\x0A\x0B"                              //   1: Value, 11 bytes
      "\x0A\x04loss"                          //     1: tag
      "\x15\x00\x00\x00\x40",                 //     2: fixed32 float 2.0
      26);
  EXPECT_EQ(encode_scalar_event(1.5, 3, "loss", 2.0f), expect);
  const std::string fv = encode_file_version_event(0.0, "brain.Event:2");
  EXPECT_EQ(fv.substr(9), std::string("\x1A\x0D") + "brain.Event:2");
}

TEST(TfEvents, RecordFraming) {
  const std::string rec = frame_tfrecord("abc");
  ASSERT_EQ(rec.size(), 8u + 4 + 3 + 4);
  uint64_t len = 0;
  std::memcpy(&len, rec.data(), 8);
  EXPECT_EQ(len, 3u);
  uint32_t c = 0;
  std::memcpy(&c, rec.data() + 8, 4);
  EXPECT_EQ(c, masked_crc32c(rec.data(), 8));
  const uint32_t raw = crc32c("abc", 3);
  std::memcpy(&c, rec.data() + 15, 4);
  EXPECT_EQ(c, ((raw >> 15) | (raw << 17)) + 0xa282ead8u);
}

// ---- an independent reader: framing + a generic protobuf walk

struct Field {
  uint32_t number = 0;
  uint32_t wire = 0;
  uint64_t varint = 0;
  std::string bytes;  // length-delimited payload or the raw fixed32/64 bytes
};

uint64_t read_varint(const std::string& s, size_t& i) {
  uint64_t v = 0;
  for (int shift = 0; i < s.size(); shift += 7) {
    const auto b = static_cast<unsigned char>(s[i++]);
    v |= static_cast<uint64_t>(b & 0x7F) << shift;
    if (!(b & 0x80)) return v;
  }
  ADD_FAILURE() << "truncated varint";
  return v;
}

std::vector<Field> parse_message(const std::string& s) {
  std::vector<Field> out;
  size_t i = 0;
  while (i < s.size()) {
    const uint64_t key = read_varint(s, i);
    Field f;
    f.number = static_cast<uint32_t>(key >> 3);
    f.wire = static_cast<uint32_t>(key & 7);
    if (f.wire == 0) {
      f.varint = read_varint(s, i);
    } else if (f.wire == 1 || f.wire == 5) {
      const size_t n = f.wire == 1 ? 8 : 4;
      f.bytes = s.substr(i, n);
      i += n;
    } else if (f.wire == 2) {
      const uint64_t n = read_varint(s, i);
      f.bytes = s.substr(i, n);
      i += n;
    } else {
      ADD_FAILURE() << "unexpected wire type " << f.wire;
      return out;
    }
    out.push_back(f);
  }
  EXPECT_EQ(i, s.size()) << "message overruns its bytes";
  return out;
}

std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string s = ss.str();
  std::vector<std::string> recs;
  size_t i = 0;
  while (i < s.size()) {
    EXPECT_LE(i + 12, s.size()) << "truncated record header at " << i;
    if (i + 12 > s.size()) break;
    uint64_t len = 0;
    uint32_t len_crc = 0, data_crc = 0;
    std::memcpy(&len, s.data() + i, 8);
    std::memcpy(&len_crc, s.data() + i + 8, 4);
    EXPECT_EQ(len_crc, masked_crc32c(s.data() + i, 8)) << "length CRC at " << i;
    EXPECT_LE(i + 12 + len + 4, s.size()) << "truncated record at " << i;
    if (i + 12 + len + 4 > s.size()) break;
    std::memcpy(&data_crc, s.data() + i + 12 + len, 4);
    EXPECT_EQ(data_crc, masked_crc32c(s.data() + i + 12, len)) << "data CRC at " << i;
    recs.push_back(s.substr(i + 12, len));
    i += 12 + len + 4;
  }
  return recs;
}

struct Decoded {
  int64_t step = 0;
  double wall_time = 0;
  std::string file_version;
  std::string tag;
  float simple_value = 0;
  bool has_simple = false;
  std::string text;  // tensor string_val
  std::string plugin;
};

Decoded decode_event(const std::string& rec) {
  Decoded d;
  for (const Field& f : parse_message(rec)) {
    if (f.number == 1 && f.wire == 1) std::memcpy(&d.wall_time, f.bytes.data(), 8);
    if (f.number == 2 && f.wire == 0) d.step = static_cast<int64_t>(f.varint);
    if (f.number == 3 && f.wire == 2) d.file_version = f.bytes;
    if (f.number != 5 || f.wire != 2) continue;
    for (const Field& sv : parse_message(f.bytes)) {
      EXPECT_EQ(sv.number, 1u);
      for (const Field& v : parse_message(sv.bytes)) {
        if (v.number == 1) d.tag = v.bytes;
        if (v.number == 2 && v.wire == 5) {
          std::memcpy(&d.simple_value, v.bytes.data(), 4);
          d.has_simple = true;
        }
        if (v.number == 8) {
          for (const Field& t : parse_message(v.bytes)) {
            if (t.number == 1) {
              EXPECT_EQ(t.varint, 7u) << "dtype DT_STRING";
            }
            if (t.number == 8) d.text = t.bytes;
          }
        }
        if (v.number == 9) {
          for (const Field& m : parse_message(v.bytes)) {
            if (m.number != 1) continue;
            for (const Field& p : parse_message(m.bytes)) {
              if (p.number == 1) d.plugin = p.bytes;
            }
          }
        }
      }
    }
  }
  return d;
}

TEST(TfEvents, WriterFileReadsBack) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("q4_tfevents_" + std::to_string(::getpid()));
  q4::io::remove_tree(dir);
  fs::create_directories(dir);
  std::string path;
  {
    TfEventsWriter w;
    w.open(dir.string());
    path = w.path();
    EXPECT_EQ(fs::path(path).filename().string().rfind("events.out.tfevents.", 0), 0u);
    w.add_scalar("train/loss", 3.25, 1);
    w.add_scalar("train/loss", 2.5, 2);
    w.add_metrics({{"step", 3},
                   {"total_steps", 9},
                   {"loss", 1.75},
                   {"mfu", nullptr},
                   {"gpu_peak_bytes", 2147483648LL},
                   {"skipped", false}},
                  3);
    w.add_text("eval/0", "Who are you? => 我是 F# 之神。", 3);
  }
  const auto recs = read_records(path);
  ASSERT_EQ(recs.size(), 6u);
  const Decoded first = decode_event(recs[0]);
  EXPECT_EQ(first.file_version, "brain.Event:2");
  EXPECT_GT(first.wall_time, 1.6e9);
  std::map<std::pair<std::string, int64_t>, float> scalars;
  for (size_t i = 1; i < 5; ++i) {
    const Decoded d = decode_event(recs[i]);
    EXPECT_TRUE(d.has_simple) << i;
    scalars[{d.tag, d.step}] = d.simple_value;
  }
  EXPECT_EQ(scalars.size(), 4u);
  EXPECT_FLOAT_EQ((scalars[{"train/loss", 1}]), 3.25f);
  EXPECT_FLOAT_EQ((scalars[{"train/loss", 2}]), 2.5f);
  EXPECT_FLOAT_EQ((scalars[{"train/loss", 3}]), 1.75f);
  EXPECT_FLOAT_EQ((scalars[{"train/gpu_peak_gib", 3}]), 2.0f);
  const Decoded text = decode_event(recs[5]);
  EXPECT_EQ(text.tag, "eval/0");
  EXPECT_EQ(text.step, 3);
  EXPECT_EQ(text.text, "Who are you? => 我是 F# 之神。");
  EXPECT_EQ(text.plugin, "text");
  q4::io::remove_tree(dir);
}

}  // namespace
}  // namespace q4::trainer
