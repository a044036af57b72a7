// Corrupt .dat input: each kind of damage docs/design.md names is built by hand and must raise a
// one-line c10::Error naming the file, the entry index and the key as far as it was read; a
// truncation sweep (every prefix of a valid file) and seeded random byte flips must produce
// either a valid file or such an error, never a crash, a hang or another exception type.
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "dat_bytes.h"
#include "q4/io/dat_file.h"

namespace q4::io {
namespace {

using dat_bytes::Bytes;
using dat_bytes::put_header;
using dat_bytes::put_uleb;

void put_zeros(Bytes& b, size_t n) { b.insert(b.end(), n, 0); }

class DatCorruptTest : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = ::testing::TempDir() + "/q4_dat_corrupt_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name() + ".dat";
  }
  void TearDown() override { std::remove(path_.c_str()); }

  // Rewrites the file in place; truncates only when the size changes (truncation is what
  // makes thousands of small rewrites slow on ext4).
  void write(const Bytes& b) {
    const int fd = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    ASSERT_GE(fd, 0) << path_;
    struct stat st;
    ASSERT_EQ(::fstat(fd, &st), 0);
    if (static_cast<uint64_t>(st.st_size) != b.size()) {
      ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(b.size())), 0);
    }
    ASSERT_EQ(::pwrite(fd, b.data(), b.size(), 0), static_cast<ssize_t>(b.size()));
    ::close(fd);
  }

  // Loads every entry; returns the c10::Error message or "" when the file is valid.
  std::string try_load(const Bytes& b) {
    write(b);
    try {
      DatReader r(path_);
      for (const DatEntry& e : r.entries()) r.load(e);
      return "";
    } catch (const c10::Error& e) {
      std::string msg = e.what_without_backtrace();
      return msg.empty() ? "<empty message>" : msg;
    }
  }

  // Expects a rejection whose message holds the file name and every needle, on one line.
  void expect_error(const Bytes& b, std::initializer_list<std::string> needles) {
    const std::string msg = try_load(b);
    ASSERT_FALSE(msg.empty()) << "corrupt file accepted";
    EXPECT_EQ(msg.find(path_), 0u) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    for (const std::string& n : needles)
      EXPECT_NE(msg.find(n), std::string::npos) << n << " / " << msg;
  }

  std::string path_;
};

// Two good entries, then whatever the test appends as entry 2.
Bytes prefix(uint64_t count) {
  Bytes b;
  put_uleb(b, count);
  put_header(b, "good.a", 6, {2});
  put_zeros(b, 8);
  put_header(b, "good.b", 0, {3});
  put_zeros(b, 3);
  return b;
}

TEST_F(DatCorruptTest, EmptyFileAndBadCount) {
  expect_error({}, {"entry count", "empty"});
  expect_error({0x80}, {"entry count", "truncated header"});
  Bytes b = prefix(3);  // count says 3, file holds 2
  expect_error(b, {"entry 2", "file ends after 2 entries but the count says 3"});
  b = prefix(1);  // count says 1, file holds 2: the rest is garbage
  expect_error(b, {"trailing garbage", "entry 0 (key 'good.a')"});
  b = prefix(2);
  b.push_back(0);
  expect_error(b, {"trailing garbage", "1 bytes", "entry 1 (key 'good.b')"});
  EXPECT_EQ(try_load(prefix(2)), "");
  EXPECT_EQ(try_load({0}), "");  // zero entries is a valid (empty) file
}

TEST_F(DatCorruptTest, TruncatedHeaderAndPayload) {
  Bytes b = prefix(3);
  put_uleb(b, 5);
  b.insert(b.end(), {'a', 'b'});  // key needs 5 bytes, file has 2
  expect_error(b, {"entry 2 (key not read yet)", "truncated header", "key needs 5 bytes"});
  b = prefix(3);
  put_header(b, "w", 6, {4, 4});
  put_zeros(b, 63);  // needs 64
  expect_error(b, {"entry 2 (key 'w')", "truncated payload", "needs 64 bytes"});
  b = prefix(3);
  put_uleb(b, 1);
  b.push_back('w');
  put_uleb(b, 6);
  put_uleb(b, 2);
  put_uleb(b, 4);  // second dimension missing
  expect_error(b, {"entry 2 (key 'w')", "truncated header", "dimension"});
}

TEST_F(DatCorruptTest, Leb128Overflow) {
  Bytes b = prefix(3);
  put_uleb(b, 1);
  b.push_back('w');
  put_uleb(b, 0);
  put_uleb(b, 1);
  // 10 bytes whose last carries bit 64: > 64 bits.
  for (int i = 0; i < 9; ++i) b.push_back(0xFF);
  b.push_back(0x02);
  expect_error(b, {"entry 2 (key 'w')", "LEB128 overflow", "64 bits"});
  b = prefix(3);
  for (int i = 0; i < 11; ++i) b.push_back(0x80);  // keylen with 11 continuation bytes
  b.push_back(0x00);
  expect_error(b, {"entry 2", "LEB128 overflow", "more than 10 bytes"});
  Bytes c;
  for (int i = 0; i < 12; ++i) c.push_back(0x81);
  expect_error(c, {"entry count", "LEB128 overflow"});
  // 2^64 - 1 as a dimension is a valid uleb128 but not an int64.
  b = prefix(3);
  put_header(b, "w", 0, {UINT64_MAX});
  expect_error(b, {"entry 2 (key 'w')", "exceeds int64"});
}

TEST_F(DatCorruptTest, DimensionProductOverflow) {
  Bytes b = prefix(3);
  put_header(b, "w", 6, {uint64_t{1} << 32, uint64_t{1} << 32});
  expect_error(b, {"entry 2 (key 'w')", "dimension product overflows"});
  b = prefix(3);  // a zero dimension does not excuse an overflowing product
  put_header(b, "w", 6, {0, uint64_t{1} << 40, uint64_t{1} << 40});
  expect_error(b, {"entry 2 (key 'w')", "overflows"});
  b = prefix(3);  // numel fits int64, numel * 8 does not
  put_header(b, "w", 7, {uint64_t{1} << 61});
  expect_error(b, {"entry 2 (key 'w')", "payload size overflows"});
  b = prefix(3);  // plausible size, just larger than the file
  put_header(b, "w", 6, {uint64_t{1} << 20, 1024});
  expect_error(b, {"entry 2 (key 'w')", "truncated payload"});
}

TEST_F(DatCorruptTest, UnknownElementTypeAndAbsurdFields) {
  for (uint64_t t : {8u, 9u, 16u, 102u, 1u << 20}) {
    Bytes b = prefix(3);
    put_header(b, "w", t, {1});
    put_zeros(b, 8);
    expect_error(b, {"entry 2 (key 'w')", "unknown element type " + std::to_string(t)});
  }
  Bytes b = prefix(3);
  put_header(b, "w", 0, std::vector<uint64_t>(17, 1));
  expect_error(b, {"entry 2 (key 'w')", "absurd ndim 17"});
  b = prefix(3);
  put_uleb(b, uint64_t{1} << 40);
  expect_error(b, {"entry 2 (key not read yet)", "absurd key length"});
  b = prefix(3);
  put_uleb(b, 0);
  expect_error(b, {"entry 2", "empty key"});
  // ndim 16 (the limit) with unit dimensions is fine.
  b = prefix(3);
  put_header(b, "w", 0, std::vector<uint64_t>(16, 1));
  b.push_back(7);
  EXPECT_EQ(try_load(b), "");
}

TEST_F(DatCorruptTest, DuplicateAndNonUtf8Keys) {
  Bytes b = prefix(3);
  put_header(b, "good.a", 0, {1});
  b.push_back(0);
  expect_error(b, {"entry 2 (key 'good.a')", "duplicate key", "entry 0"});
  const std::vector<std::string> bad = {
      std::string("k\xFF"),              // invalid byte
      std::string("k\xC0\xAF"),          // overlong '/'
      std::string("k\xED\xA0\x80"),      // UTF-16 surrogate
      std::string("k\xF4\x90\x80\x80"),  // above U+10FFFF
      std::string("k\xE4\xB8"),          // cut multi-byte sequence
  };
  for (const std::string& k : bad) {
    b = prefix(3);
    put_header(b, k, 0, {1});
    b.push_back(0);
    expect_error(b, {"entry 2 (key 'k\\x", "not valid UTF-8"});
  }
  b = prefix(3);
  put_header(b, "\xE6\x9D\x83\xE9\x87\x8D", 0, {1});  // "权重": valid
  b.push_back(0);
  EXPECT_EQ(try_load(b), "");
}

TEST_F(DatCorruptTest, BoolPayloadMustBeZeroOrOne) {
  Bytes b = prefix(3);
  put_header(b, "mask", 11, {3});
  b.insert(b.end(), {1, 0, 2});
  expect_error(b, {"'mask'", "bool payload byte 2 is 2"});
}

TEST_F(DatCorruptTest, MissingFile) {
  try {
    DatReader r(path_ + ".missing");
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find(path_ + ".missing"), std::string::npos);
  }
}

// A small file with every element type, a scalar, an empty tensor and multi-byte uleb128s.
Bytes sweep_file() {
  Bytes b;
  put_uleb(b, 8);
  put_header(b, "model.embed_tokens.weight", 5, {3, 4});
  for (int i = 0; i < 24; ++i) b.push_back(static_cast<uint8_t>(i * 7));
  put_header(b, "x.weight.qdata", 100, {2, 8});
  for (int i = 0; i < 16; ++i) b.push_back(static_cast<uint8_t>(i * 17));
  put_header(b, "x.weight.scale", 101, {2, 1});
  b.insert(b.end(), {0x38, 0x40});
  put_header(b, "ids", 3, {3});
  for (int i = 0; i < 12; ++i) b.push_back(static_cast<uint8_t>(i));
  put_header(b, "mask", 11, {2});
  b.insert(b.end(), {1, 0});
  put_header(b, "bf", 15, {2});
  b.insert(b.end(), {0x80, 0x3F, 0x00, 0xC0});
  put_header(b, "scalar", 7, {});
  put_zeros(b, 8);
  put_header(b, std::string(130, 'k'), 4, {0, 200});  // 2-byte keylen and dim, no payload
  return b;
}

TEST_F(DatCorruptTest, TruncationSweep) {
  const Bytes full = sweep_file();
  ASSERT_EQ(try_load(full), "");
  for (size_t n = 0; n < full.size(); ++n) {
    const std::string msg = try_load(Bytes(full.begin(), full.begin() + n));
    ASSERT_FALSE(msg.empty()) << "prefix of " << n << " bytes accepted";
    ASSERT_EQ(msg.find(path_), 0u) << msg;
    ASSERT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
}

TEST_F(DatCorruptTest, RandomByteFlips) {
  const Bytes full = sweep_file();
  std::mt19937_64 rng(20261125);
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes b = full;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int f = 0; f < flips; ++f) {
      b[rng() % b.size()] ^= static_cast<uint8_t>(1 + rng() % 255);
    }
    const std::string msg = try_load(b);  // only c10::Error may escape the reader
    if (msg.empty()) {
      ++accepted;
    } else {
      ++rejected;
      ASSERT_EQ(msg.find(path_), 0u) << msg;
      ASSERT_EQ(msg.find('\n'), std::string::npos) << msg;
    }
  }
  // Payload bytes are most of the file, so many flips leave a valid file; header flips must
  // be caught. Both outcomes have to occur for the test to mean anything.
  EXPECT_GT(accepted, 100);
  EXPECT_GT(rejected, 100);
}

}  // namespace
}  // namespace q4::io
