// DatReader/DatWriter against independently built bytes: files written by DatWriter must equal
// byte-for-byte the encoding assembled by hand here from the docs/design.md grammar, the fixtures
// (written by the GPU machine's Python tooling) must index to their known layout, copy_from must
// reproduce source bytes exactly, and a writer that does not commit must leave no trace.
#include "q4/io/dat_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <dirent.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "dat_bytes.h"
#include "q4/test/temp_dir.h"

namespace q4::io {
namespace {

using dat_bytes::Bytes;
using dat_bytes::put_header;
using dat_bytes::put_uleb;

void put_raw(Bytes& b, const void* p, size_t n) {
  const auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}

Bytes read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return Bytes(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

void write_file(const std::string& path, const Bytes& b) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// A fresh, empty directory per test so that leftover temp files can be detected.
class DatFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<q4::test::ScopedTempDir>("q4_dat_");
    ASSERT_TRUE(tmp_->ok());
    dir_ = tmp_->dir();
  }
  void TearDown() override { tmp_.reset(); }
  std::vector<std::string> list_dir() const { return tmp_->list(); }
  std::string path(const std::string& name) const { return tmp_->path(name); }
  std::unique_ptr<q4::test::ScopedTempDir> tmp_;
  std::string dir_;
};

TEST_F(DatFileTest, WritesTheGrammarByteExactlyForEveryElementType) {
  // One entry per element type, plus a scalar (ndim 0) and an empty (dim 0) tensor.
  struct Case {
    std::string key;
    ElemType type;
    at::Tensor t;
  };
  const auto opts = at::TensorOptions();
  std::vector<Case> cases = {
      {"u8", ElemType::kUInt8, at::arange(0, 6, opts.dtype(at::kByte)).reshape({2, 3})},
      {"i8", ElemType::kInt8, at::arange(-3, 3, opts.dtype(at::kChar))},
      {"i16", ElemType::kInt16, at::arange(-300, 300, 100, opts.dtype(at::kShort))},
      {"i32", ElemType::kInt32, at::arange(-5, 5, opts.dtype(at::kInt)).reshape({5, 2})},
      {"i64", ElemType::kInt64, at::tensor({int64_t{1} << 40, int64_t{-7}}, opts.dtype(at::kLong))},
      {"f16", ElemType::kFloat16, at::linspace(-2, 2, 8, opts.dtype(at::kHalf)).reshape({2, 2, 2})},
      {"f32", ElemType::kFloat32, at::tensor({1.5f, -0.0f, 3.25f}, opts.dtype(at::kFloat))},
      {"f64", ElemType::kFloat64, at::tensor({3.14159265358979}, opts.dtype(at::kDouble))},
      {"b", ElemType::kBool, at::tensor({1, 0, 1}, opts.dtype(at::kByte)).to(at::kBool)},
      {"bf16", ElemType::kBFloat16, at::linspace(-1, 1, 4, opts.dtype(at::kBFloat16))},
      {"w.qdata", ElemType::kE2M1Packed, at::arange(0, 16, opts.dtype(at::kByte)).reshape({2, 8})},
      {"w.scale", ElemType::kE4M3Scale,
       at::tensor({0x38, 0x7E}, opts.dtype(at::kByte)).reshape({2, 1})},
      {"scalar", ElemType::kFloat32, at::scalar_tensor(42.0f, opts.dtype(at::kFloat))},
      {"empty", ElemType::kInt32, at::empty({3, 0}, opts.dtype(at::kInt))},
      {"ключ.权重", ElemType::kUInt8, at::ones({1}, opts.dtype(at::kByte))},  // UTF-8 key
  };
  Bytes expected;
  put_uleb(expected, cases.size());
  std::vector<uint64_t> offsets;
  for (const Case& c : cases) {
    std::vector<uint64_t> dims(c.t.sizes().begin(), c.t.sizes().end());
    put_header(expected, c.key, static_cast<uint64_t>(c.type), dims);
    offsets.push_back(expected.size());
    put_raw(expected, c.t.data_ptr(), c.t.nbytes());
  }
  const std::string p = path("all.dat");
  {
    DatWriter w(p, cases.size());
    for (const Case& c : cases) w.add(c.key, c.t, c.type);
    EXPECT_EQ(w.written(), cases.size());
    w.commit();
  }
  EXPECT_EQ(read_file(p), expected);
  EXPECT_EQ(list_dir(), std::vector<std::string>{"all.dat"});

  DatReader r(p);
  ASSERT_EQ(r.entries().size(), cases.size());
  EXPECT_EQ(r.file_size_bytes(), expected.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const DatEntry& e = r.entries()[i];
    const Case& c = cases[i];
    EXPECT_EQ(e.key, c.key);
    EXPECT_EQ(e.type, c.type);
    EXPECT_EQ(e.shape, std::vector<int64_t>(c.t.sizes().begin(), c.t.sizes().end()));
    EXPECT_EQ(e.offset, offsets[i]);
    EXPECT_EQ(e.nbytes, static_cast<uint64_t>(c.t.nbytes()));
    EXPECT_EQ(e.numel(), c.t.numel());
    EXPECT_EQ(r.find(c.key), &e);
    const at::Tensor got = r.load(e);
    EXPECT_EQ(got.scalar_type(), elem_scalar_type(c.type)) << c.key;
    EXPECT_TRUE(at::equal(got, c.t)) << c.key;
  }
  EXPECT_EQ(r.find("nope"), nullptr);
  try {
    r.at("nope");
    ADD_FAILURE();
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("'nope'"), std::string::npos);
  }
}

TEST_F(DatFileTest, ElemTypeTables) {
  EXPECT_EQ(elem_size_bytes(ElemType::kInt32), 4u);
  EXPECT_EQ(elem_size_bytes(ElemType::kBFloat16), 2u);
  EXPECT_EQ(elem_size_bytes(ElemType::kE4M3Scale), 1u);
  EXPECT_EQ(elem_size_bytes(ElemType::kFloat64), 8u);
  EXPECT_STREQ(elem_type_name(ElemType::kE2M1Packed), "e2m1");
  EXPECT_STREQ(elem_type_name(ElemType::kBFloat16), "bf16");
  EXPECT_EQ(elem_scalar_type(ElemType::kE2M1Packed), at::kByte);
  EXPECT_EQ(elem_type_for(at::kBFloat16), ElemType::kBFloat16);
  EXPECT_EQ(elem_type_for(at::kBool), ElemType::kBool);
  EXPECT_THROW(elem_type_for(at::kComplexFloat), c10::Error);
  for (uint64_t c : {0, 1, 2, 3, 4, 5, 6, 7, 11, 15, 100, 101}) EXPECT_TRUE(is_known_elem_type(c));
  for (uint64_t c : {8, 9, 10, 12, 13, 14, 16, 99, 102, 1000}) EXPECT_FALSE(is_known_elem_type(c));
}

TEST_F(DatFileTest, IndexesTheTinyFixture) {
  DatReader r(std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.weights.dat");
  ASSERT_EQ(r.entries().size(), 40u);  // embed + 2 x 18 + norm + lm_head pair
  const DatEntry& emb = r.entries()[0];
  EXPECT_EQ(emb.key, "model.embed_tokens.weight");
  EXPECT_EQ(emb.type, ElemType::kFloat16);
  EXPECT_EQ(emb.shape, (std::vector<int64_t>{384, 64}));
  const DatEntry& q = r.at("model.layers.1.mlp.down_proj.weight.qdata");
  EXPECT_EQ(q.type, ElemType::kE2M1Packed);
  EXPECT_EQ(q.shape, (std::vector<int64_t>{64, 96}));
  const DatEntry& s = r.at("model.layers.1.mlp.down_proj.weight.scale");
  EXPECT_EQ(s.type, ElemType::kE4M3Scale);
  EXPECT_EQ(s.shape, (std::vector<int64_t>{64, 12}));
  EXPECT_EQ(r.entries().back().key, "lm_head.weight.scale");
  // Entries tile the file: each header starts where the previous payload ended.
  uint64_t pos = 1;  // count 40 is one uleb byte
  for (const DatEntry& e : r.entries()) {
    EXPECT_EQ(e.header_offset, pos) << e.key;
    pos = e.offset + e.nbytes;
  }
  EXPECT_EQ(pos, r.file_size_bytes());
  // RMSNorm weights of a freshly exported HF model: finite fp16.
  EXPECT_TRUE(at::isfinite(r.load("model.norm.weight").to(at::kFloat)).all().item<bool>());
}

TEST_F(DatFileTest, CopyFromReproducesFixturesByteExactly) {
  for (const char* name :
       {"qwen3_tiny.weights.dat", "nvfp4_golden.dat", "qwen3_tiny.expected.dat"}) {
    const std::string src = std::string(Q4_FIXTURES_DIR) + "/" + name;
    DatReader r(src);
    const std::string out = path(name);
    DatWriter w(out, r.entries().size());
    for (const DatEntry& e : r.entries()) w.copy_from(r, e);
    w.commit();
    EXPECT_EQ(read_file(out), read_file(src)) << name;
  }
}

TEST_F(DatFileTest, CopyFromKeepsNonMinimalHeadersAndLargePayloads) {
  // A header whose uleb128 fields use padded (non-minimal) encodings, and a 3 MiB payload that
  // goes through the copy_file_range path rather than the small-write buffer.
  Bytes b;
  put_uleb(b, 2);
  b.insert(b.end(), {0x81, 0x00});  // keylen 1, padded
  b.push_back('a');
  b.insert(b.end(), {0x86, 0x80, 0x00});  // type 6 (fp32), padded
  b.push_back(1);
  b.push_back(2);
  put_raw(b, "\x00\x00\x80\x3F\x00\x00\x00\xC0", 8);  // 1.0f, -2.0f
  const uint64_t big = 3u << 20;
  put_header(b, "big", 0, {big});
  for (uint64_t i = 0; i < big; ++i) b.push_back(static_cast<uint8_t>((i * 2654435761u) >> 13));
  const std::string src = path("src.dat");
  write_file(src, b);
  DatReader r(src);
  EXPECT_TRUE(at::equal(r.load("a"), at::tensor({1.0f, -2.0f})));
  // Reverse the order while copying: each entry still carries its own header bytes.
  const std::string out = path("out.dat");
  {
    DatWriter w(out, 2);
    w.copy_from(r, r.entries()[1]);
    w.copy_from(r, r.entries()[0]);
    w.commit();
  }
  Bytes expected;
  put_uleb(expected, 2);
  const uint64_t split = r.entries()[1].header_offset;
  expected.insert(expected.end(), b.begin() + split, b.end());
  expected.insert(expected.end(), b.begin() + 1, b.begin() + split);
  EXPECT_EQ(read_file(out), expected);
}

TEST_F(DatFileTest, MixesAddedAndCopiedEntries) {
  const std::string src = std::string(Q4_FIXTURES_DIR) + "/qwen3_tiny.weights.dat";
  DatReader r(src);
  const std::string out = path("mixed.dat");
  const at::Tensor norm = at::full({64}, 2.0, at::TensorOptions().dtype(at::kHalf));
  {
    DatWriter w(out, r.entries().size());
    for (const DatEntry& e : r.entries()) {
      if (e.key == "model.norm.weight") {
        w.add(e.key, norm, e.type);
      } else {
        w.copy_from(r, e);
      }
    }
    w.commit();
  }
  DatReader o(out);
  ASSERT_EQ(o.entries().size(), r.entries().size());
  for (size_t i = 0; i < r.entries().size(); ++i) {
    const DatEntry& a = r.entries()[i];
    const DatEntry& b = o.entries()[i];
    EXPECT_EQ(a.key, b.key);
    EXPECT_EQ(a.offset, b.offset);  // same sizes, same headers: same layout
    if (a.key == "model.norm.weight") {
      EXPECT_TRUE(at::equal(o.load(b), norm));
    } else {
      EXPECT_TRUE(at::equal(o.load(b), r.load(a))) << a.key;
    }
  }
}

TEST_F(DatFileTest, UncommittedWriterLeavesTargetUntouched) {
  const std::string out = path("model.dat");
  const Bytes original = {1, 2, 3, 4, 5};
  write_file(out, original);
  const at::Tensor t = at::ones({4}, at::TensorOptions().dtype(at::kFloat));
  {
    DatWriter w(out, 2);
    w.add("x", t);
    EXPECT_EQ(list_dir().size(), 2u);  // target + temp
  }                                    // destroyed without commit
  EXPECT_EQ(read_file(out), original);
  EXPECT_EQ(list_dir(), std::vector<std::string>{"model.dat"});

  // An exception midway (wrong dtype for the declared type), then unwinding.
  try {
    DatWriter w(out, 2);
    w.add("x", t);
    w.add("y", t, ElemType::kFloat16);
    ADD_FAILURE() << "dtype mismatch accepted";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("'y'"), std::string::npos);
  }
  EXPECT_EQ(read_file(out), original);
  EXPECT_EQ(list_dir(), std::vector<std::string>{"model.dat"});

  // Too few entries: commit refuses; too many: add refuses; a failed writer cannot commit.
  {
    DatWriter w(out, 2);
    w.add("x", t);
    EXPECT_THROW(w.commit(), c10::Error);
  }
  {
    DatWriter w(out, 1);
    w.add("x", t);
    EXPECT_THROW(w.add("y", t), c10::Error);
    w.commit();  // the refused add wrote nothing
  }
  EXPECT_TRUE(at::equal(DatReader(out).load("x"), t));
  {
    DatWriter w(out, 1);
    EXPECT_THROW(w.add("x", t, ElemType::kInt32), c10::Error);
    EXPECT_THROW(w.commit(), c10::Error);
  }
  EXPECT_TRUE(at::equal(DatReader(out).load("x"), t));
  EXPECT_EQ(list_dir(), std::vector<std::string>{"model.dat"});
}

TEST_F(DatFileTest, WriterRejectsBadKeys) {
  const at::Tensor t = at::zeros({2}, at::TensorOptions().dtype(at::kFloat));
  DatWriter w(path("k.dat"), 3);
  w.add("a", t);
  EXPECT_THROW(w.add("a", t), c10::Error);  // duplicate
  DatWriter w2(path("k2.dat"), 3);
  EXPECT_THROW(w2.add("", t), c10::Error);
  DatWriter w3(path("k3.dat"), 3);
  EXPECT_THROW(w3.add(std::string("bad\xFFkey"), t), c10::Error);
  DatWriter w4(path("k4.dat"), 3);
  EXPECT_THROW(w4.add("c", at::zeros({2}, at::TensorOptions().dtype(at::kComplexFloat))),
               c10::Error);
}

TEST_F(DatFileTest, StreamedEntriesEqualWholeOnes) {
  const at::Tensor t = at::randn({10, 32}).to(at::kHalf);
  const std::string whole = path("whole.dat"), streamed = path("streamed.dat");
  {
    DatWriter w(whole, 2);
    w.add("t", t);
    w.add("u", at::ones({3}, at::TensorOptions().dtype(at::kInt)));
    w.commit();
  }
  {
    DatWriter w(streamed, 2);
    w.begin_streamed("t", ElemType::kFloat16, {10, 32});
    EXPECT_THROW(w.add("u", t), c10::Error);  // "t" still owes its payload
    w.append(t.narrow(0, 0, 3));
    EXPECT_THROW(w.append(at::zeros({3, 32})), c10::Error);  // fp32 chunk for an fp16 entry
    w.append(t.narrow(0, 3, 7));
    EXPECT_THROW(w.append(t.narrow(0, 0, 1)), c10::Error);  // past the declared size
    w.add("u", at::ones({3}, at::TensorOptions().dtype(at::kInt)));
    w.commit();
  }
  EXPECT_EQ(read_file(streamed), read_file(whole));
  {
    DatWriter w(path("short.dat"), 1);
    w.begin_streamed("t", ElemType::kFloat16, {10, 32});
    w.append(t.narrow(0, 0, 9));
    EXPECT_THROW(w.commit(), c10::Error);  // one row missing
  }
  EXPECT_FALSE(std::ifstream(path("short.dat")).good());
}

TEST_F(DatFileTest, WriterHandlesNonContiguousInput) {
  const at::Tensor t = at::arange(0, 12, at::TensorOptions().dtype(at::kFloat)).reshape({3, 4});
  const std::string out = path("t.dat");
  {
    DatWriter w(out, 1);
    w.add("t", t.t());  // (4, 3) transposed view
    w.commit();
  }
  EXPECT_TRUE(at::equal(DatReader(out).load("t"), t.t().contiguous()));
}

// A uint8 payload of 2 GiB + 64 bytes in a sparse file: sizes and offsets past int32 and past
// one pread call (1 GiB chunks). The file is sparse, so the full 2 GiB load reads mostly holes
// (a few seconds; 2 GiB of memory).
TEST_F(DatFileTest, PayloadOver2GiB) {
  const uint64_t n = (uint64_t{1} << 31) + 64;
  Bytes head;
  put_uleb(head, 2);
  put_header(head, "huge", 0, {n});
  const uint64_t huge_off = head.size();
  Bytes tail;
  put_header(tail, "after", 3, {1});
  const int32_t v = -123456;
  put_raw(tail, &v, 4);
  const std::string p = path("huge.dat");
  const uint64_t mid_at = (uint64_t{1} << 30) + 3;
  {
    FILE* f = std::fopen(p.c_str(), "wb");
    ASSERT_NE(f, nullptr);
    ASSERT_EQ(std::fwrite(head.data(), 1, head.size(), f), head.size());
    const uint8_t first = 0xAB, last = 0xCD, mid = 0x5A;
    std::fwrite(&first, 1, 1, f);
    ASSERT_EQ(::fseeko(f, static_cast<off_t>(huge_off + mid_at), SEEK_SET), 0);
    std::fwrite(&mid, 1, 1, f);
    ASSERT_EQ(::fseeko(f, static_cast<off_t>(huge_off + n - 1), SEEK_SET), 0);
    std::fwrite(&last, 1, 1, f);
    ASSERT_EQ(std::fwrite(tail.data(), 1, tail.size(), f), tail.size());
    std::fclose(f);
  }
  DatReader r(p);
  ASSERT_EQ(r.entries().size(), 2u);
  const DatEntry& e = r.at("huge");
  EXPECT_EQ(e.nbytes, n);
  EXPECT_EQ(e.numel(), static_cast<int64_t>(n));
  EXPECT_EQ(e.offset, huge_off);
  EXPECT_EQ(r.at("after").offset, huge_off + n + tail.size() - 4);
  EXPECT_EQ(r.load("after").item<int32_t>(), v);  // pread at an offset > 2^31
  uint8_t end2[2];
  r.read_range(huge_off + n - 2, 2, end2);
  EXPECT_EQ(end2[0], 0);
  EXPECT_EQ(end2[1], 0xCD);
  EXPECT_THROW(r.read_range(huge_off + n - 2, 1u << 20, end2), c10::Error);  // past the end

  const at::Tensor t = r.load(e);
  ASSERT_EQ(static_cast<uint64_t>(t.numel()), n);
  const uint8_t* d = t.data_ptr<uint8_t>();
  EXPECT_EQ(d[0], 0xAB);
  EXPECT_EQ(d[mid_at], 0x5A);
  EXPECT_EQ(d[n - 1], 0xCD);
  EXPECT_EQ(d[n - 2], 0);
  EXPECT_EQ(d[(uint64_t{1} << 31) - 1], 0);
}

}  // namespace
}  // namespace q4::io
