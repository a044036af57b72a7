// safetensors reader and writer: files hand-assembled byte by byte from the format's spec (no
// Python safetensors package here; scripts/interop/check_hf_export.py checks our writer's output
// with the real package on the GPU machine), hostile headers (each must fail with one line naming
// the file and the tensor), and writer -> reader round trips, including a sharded folder.
#include "q4/io/safetensors.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "q4/io/remove_tree.h"
#include "temp_dir.h"

namespace q4::io {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = q4::model::test::fresh_test_dir("q4_st_"); }
  void TearDown() override { q4::io::remove_tree(dir_); }
  std::string path(const std::string& n) const { return (dir_ / n).string(); }

  // Raw file: 8-byte LE header length, header text, data bytes.
  std::string write_raw(const std::string& name, const std::string& header, const std::string& data,
                        int64_t len_override = -1) {
    std::string bytes(8, '\0');
    const uint64_t n = len_override >= 0 ? static_cast<uint64_t>(len_override) : header.size();
    for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((n >> (8 * i)) & 0xFF);
    bytes += header + data;
    std::ofstream(path(name), std::ios::binary) << bytes;
    return path(name);
  }
  fs::path dir_;
};

std::string error_of(const std::string& p) {
  try {
    SafetensorsFile f(p);
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST_F(SafetensorsTest, ReadsHandAssembledFile) {
  // Two tensors, data in the opposite order of the (sorted) header keys, plus metadata.
  const std::string header =
      R"({"__metadata__":{"format":"pt"},"a":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]},)"
      R"("b":{"dtype":"F8_E4M3","shape":[2,2],"data_offsets":[8,12]},)"
      R"("c":{"dtype":"I16","shape":[2],"data_offsets":[0,4]}})";
  std::string data;
  data += std::string("\x01\x00\xFF\x7F", 4);  // c: int16 {1, 32767}
  data += std::string("\x80\x3F\x00\xC0", 4);  // a: bf16 {1.0, -2.0}
  data += std::string("\x38\x7E\x00\x01", 4);  // b: e4m3 bits
  const SafetensorsFile f(write_raw("x.safetensors", header, data));
  ASSERT_EQ(f.tensors().size(), 3u);
  EXPECT_EQ(f.tensors()[0].name, "c");  // data order
  EXPECT_EQ(f.metadata().at("format"), "pt");
  const at::Tensor a = f.load(f.at("a"));
  EXPECT_EQ(a.scalar_type(), at::kBFloat16);
  EXPECT_EQ(a.to(at::kFloat)[0].item<float>(), 1.0f);
  EXPECT_EQ(a.to(at::kFloat)[1].item<float>(), -2.0f);
  const at::Tensor c = f.load(f.at("c"));
  EXPECT_EQ(c[1].item<int16_t>(), 32767);
  const at::Tensor b = f.load(f.at("b"));
  EXPECT_EQ(b.scalar_type(), at::kByte);
  EXPECT_EQ(b.sizes(), at::IntArrayRef({2, 2}));
  EXPECT_EQ(b[0][1].item<uint8_t>(), 0x7E);
  const at::Tensor rows = f.load_rows(f.at("b"), 1, 1);
  EXPECT_EQ(rows[0][1].item<uint8_t>(), 0x01);
}

TEST_F(SafetensorsTest, EveryDtypeHasItsSize) {
  const std::pair<const char*, size_t> all[] = {
      {"BOOL", 1}, {"U8", 1},   {"I8", 1},  {"I16", 2}, {"I32", 4},     {"I64", 8},
      {"F16", 2},  {"BF16", 2}, {"F32", 4}, {"F64", 8}, {"F8_E4M3", 1}, {"F8_E5M2", 1}};
  for (const auto& [name, size] : all) {
    const auto t = st_dtype_from_name(name);
    ASSERT_TRUE(t.has_value()) << name;
    EXPECT_EQ(st_dtype_size(*t), size) << name;
    EXPECT_STREQ(st_dtype_name(*t), name);
  }
  EXPECT_FALSE(st_dtype_from_name("F4").has_value());
}

// A header's entry for tensor `name`, its fields as JSON text (so a case can hold values no
// writer makes): "name":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}.
std::string entry(const std::string& name, const std::string& dtype, const std::string& shape,
                  const std::string& offsets) {
  return "\"" + name + "\":{\"dtype\":\"" + dtype + "\",\"shape\":" + shape +
         ",\"data_offsets\":" + offsets + "}";
}

// The header of one tensor "w".
std::string one_w(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return "{" + entry("w", dtype, shape, offsets) + "}";
}

TEST_F(SafetensorsTest, HostileHeadersAreOneLineErrors) {
  struct Case {
    std::string header, data;
    int64_t len;
    std::string needle;
  };
  const std::string ok = one_w("F32", "[2]", "[0,8]");
  const std::string d8(8, '\0');
  const std::vector<Case> cases = {
      {ok, d8, 1000, "exceeds the file"},
      {ok, d8, 200'000'000, "outside [2, 100000000]"},
      {"{\"w\":", d8, -1, "not valid JSON"},
      {"[1,2]", d8, -1, "not a JSON object"},
      {"{" + entry("w", "F32", "[2]", "[0,8]") + "," + entry("w", "F32", "[2]", "[0,8]") + "}", d8,
       -1, "tensor 'w' appears twice"},
      {one_w("F4", "[2]", "[0,8]"), d8, -1, "tensor 'w': unsupported dtype 'F4'"},
      {one_w("F32", "[-2]", "[0,8]"), d8, -1, "tensor 'w': shape [-2]"},
      {one_w("F32", "[2]", "[0,12]"), d8, -1,
       "tensor 'w': data_offsets [0, 12] outside the data section of 8 bytes"},
      {one_w("F32", "[3]", "[0,8]"), d8, -1,
       "tensor 'w': data_offsets [0, 8] hold 8 bytes but F32 [3] needs 12"},
      {one_w("F32", "[1]", "[4,8]"), d8, -1,
       "tensor 'w': data_offsets [4, 8] leave a gap of 4 bytes"},
      {"{" + entry("v", "F32", "[2]", "[0,8]") + "," + entry("w", "F32", "[1]", "[4,8]") + "}", d8,
       -1, "tensor 'w': data_offsets [4, 8] overlap"},
      {one_w("F32", "[1]", "[0,4]"), d8, -1, "cover 4 data bytes but the file holds 8"},
      {one_w("F32", "[4294967296,4294967296]", "[0,8]"), d8, -1, "tensor 'w': shape"},
      {R"({"w":{"dtype":"F32","shape":[2]}})", d8, -1, "tensor 'w': data_offsets must be"},
      {R"({"__metadata__":{"k":1},)" + entry("w", "F32", "[2]", "[0,8]") + "}", d8, -1,
       "__metadata__ entry 'k' is not a string"},
      {"{" + entry(R"(w\n)", "F32", "[2]", "[0,9]") + "}", d8, -1, "tensor 'w\\x0A'"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string p = write_raw("c" + std::to_string(i) + ".safetensors", cases[i].header,
                                    cases[i].data, cases[i].len);
    const std::string msg = error_of(p);
    EXPECT_NE(msg.find(p), std::string::npos) << i << ": " << msg;
    EXPECT_NE(msg.find(cases[i].needle), std::string::npos) << i << ": " << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << i << ": " << msg;
  }
  std::ofstream(path("short.safetensors")) << "abc";
  EXPECT_NE(error_of(path("short.safetensors")).find("shorter than the 8-byte"), std::string::npos);
}

TEST_F(SafetensorsTest, WriterRoundTripAlignedAndAtomic) {
  const at::Tensor a = at::arange(6, at::kFloat).reshape({2, 3}).to(at::kBFloat16);
  const at::Tensor b = at::tensor({1, 2, 3}, at::kLong);
  const at::Tensor e = at::empty({0, 4}, at::kHalf);
  {
    SafetensorsWriter w(path("w.safetensors"),
                        {{"b", StDtype::kI64, {3}},
                         {"a", StDtype::kBF16, {2, 3}},
                         {"e", StDtype::kF16, {0, 4}},
                         {"s", StDtype::kF32, {}}},
                        {{"format", "pt"}});
    w.append(b);
    w.append(a.narrow(0, 0, 1));  // row chunks
    w.append(a.narrow(0, 1, 1));
    const float one = 1.0f;
    w.append(&one, 4);
    EXPECT_FALSE(fs::exists(path("w.safetensors")));  // nothing visible before commit
    w.commit();
  }
  const SafetensorsFile f(path("w.safetensors"));
  EXPECT_EQ(f.data_offset() % 8, 0u);
  EXPECT_TRUE(at::equal(f.load(f.at("a")), a));
  EXPECT_TRUE(at::equal(f.load(f.at("b")), b));
  EXPECT_EQ(f.load(f.at("e")).sizes(), e.sizes());
  EXPECT_EQ(f.load(f.at("s")).dim(), 0);
  EXPECT_EQ(f.load(f.at("s")).item<float>(), 1.0f);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  // A writer that is not committed leaves nothing behind.
  {
    SafetensorsWriter w(path("x.safetensors"), {{"b", StDtype::kI64, {3}}});
    EXPECT_THROW(w.append(at::zeros({4}, at::kLong)), c10::Error);  // more than declared
  }
  for (const auto& ent : fs::directory_iterator(dir_)) {
    EXPECT_EQ(ent.path().filename().string().find(".tmp."), std::string::npos);
  }
  EXPECT_FALSE(fs::exists(path("x.safetensors")));
}

TEST_F(SafetensorsTest, ShardedFolderThroughIndex) {
  const fs::path d = dir_ / "m";
  fs::create_directories(d);
  {
    SafetensorsWriter w((d / "s1.safetensors").string(), {{"x", StDtype::kF32, {2}}});
    w.append(at::ones({2}));
    w.commit();
    SafetensorsWriter w2((d / "s2.safetensors").string(), {{"y", StDtype::kU8, {3}}});
    w2.append(at::zeros({3}, at::kByte));
    w2.commit();
  }
  nlohmann::json idx = {{"weight_map", {{"x", "s1.safetensors"}, {"y", "s2.safetensors"}}}};
  std::ofstream(d / "model.safetensors.index.json") << idx.dump();
  const SafetensorsModel m(d.string());
  EXPECT_EQ(m.names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(m.at("y").file->path(), (d / "s2.safetensors").string());

  idx["weight_map"]["y"] = "s1.safetensors";  // the map lies
  std::ofstream(d / "model.safetensors.index.json") << idx.dump();
  try {
    SafetensorsModel bad(d.string());
    ADD_FAILURE() << "accepted a wrong weight_map";
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("tensor 'y' in s1.safetensors"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  idx["weight_map"]["y"] = "../s2.safetensors";  // outside the folder
  std::ofstream(d / "model.safetensors.index.json") << idx.dump();
  EXPECT_THROW(SafetensorsModel(d.string()), c10::Error);
}

}  // namespace
}  // namespace q4::io
