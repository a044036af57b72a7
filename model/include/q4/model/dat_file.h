// The .dat tensor container (DESIGN.md "The .dat container"): a uleb128 entry count, then per
// entry a uleb128 key length, UTF-8 key, uleb128 element type, uleb128 ndim, uleb128 dims and a
// little-endian row-major payload. No magic, no padding. DatReader indexes a file in one pass
// without reading payloads; DatWriter streams entries into a temp file and renames it into place.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace q4::model {

enum class ElemType : uint32_t {
  kUInt8 = 0,
  kInt8 = 1,
  kInt16 = 2,
  kInt32 = 3,
  kInt64 = 4,
  kFloat16 = 5,
  kFloat32 = 6,
  kFloat64 = 7,
  kBool = 11,
  kBFloat16 = 15,
  kE2M1Packed = 100,  // two E2M1 codes per byte (uint8 storage)
  kE4M3Scale = 101,   // FP8 E4M3FN bits (uint8 storage)
};

size_t elem_size_bytes(ElemType t);
const char* elem_type_name(ElemType t);  // "uint8", "fp16", "e2m1", "e4m3", ...
at::ScalarType elem_scalar_type(ElemType t);  // storage dtype (kByte for 100/101)
ElemType elem_type_for(at::ScalarType t);     // inverse for plain dtypes; error otherwise

struct DatEntry {
  std::string key;
  ElemType type;
  std::vector<int64_t> shape;
  uint64_t offset;  // byte offset of the payload in the file
  uint64_t nbytes;  // payload size
  int64_t numel() const;
};

class DatReader {
 public:
  // Indexes the whole file; any corruption throws c10::Error naming file, entry index and key.
  explicit DatReader(std::string path);
  ~DatReader();
  DatReader(const DatReader&) = delete;
  DatReader& operator=(const DatReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<DatEntry>& entries() const { return entries_; }
  uint64_t file_size_bytes() const { return file_size_; }
  const DatEntry* find(const std::string& key) const;  // nullptr when absent
  const DatEntry& at(const std::string& key) const;    // error naming file and key when absent

  // Payload as a CPU tensor of the entry's storage dtype and shape (reads on demand).
  at::Tensor load(const DatEntry& e) const;
  at::Tensor load(const std::string& key) const { return load(at(key)); }
  // Raw payload bytes into dst (e.nbytes bytes).
  void read_bytes(const DatEntry& e, void* dst) const;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t file_size_ = 0;
  std::vector<DatEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// Streaming writer. Entries are written in call order to `<path>.tmp.<pid>`; commit() checks that
// exactly `count` entries were written, fsyncs and renames onto `path`. Destruction without
// commit() removes the temp file and leaves `path` untouched.
class DatWriter {
 public:
  DatWriter(std::string path, uint64_t count);
  ~DatWriter();
  DatWriter(const DatWriter&) = delete;
  DatWriter& operator=(const DatWriter&) = delete;

  // Writes a CPU tensor (made contiguous) as `type`; the tensor's dtype must be the storage
  // dtype of `type`.
  void add(const std::string& key, const at::Tensor& t, ElemType type);
  void add(const std::string& key, const at::Tensor& t) { add(key, t, elem_type_for(t.scalar_type())); }
  // Copies an entry (header and payload) byte-exactly from another file, under its own key.
  void copy_from(const DatReader& src, const DatEntry& e);
  void commit();

 private:
  std::string path_;
  std::string tmp_path_;
  uint64_t count_;
  uint64_t written_ = 0;
  int fd_ = -1;
  bool committed_ = false;
  std::vector<std::string> keys_;
  void write_all(const void* p, size_t n);
};

}  // namespace q4::model
