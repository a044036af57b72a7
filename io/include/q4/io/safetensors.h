// safetensors (docs/interop.md): an 8-byte little-endian header length N, N bytes of JSON
// ({name: {dtype, shape, data_offsets: [begin, end]}, optional "__metadata__": {str: str}}),
// then the data, offsets relative to its start. SafetensorsFile indexes one file (header only;
// payloads are read on demand with pread) and rejects anything inconsistent: header larger than
// the file or 100 MB, invalid JSON, duplicate names, unknown dtypes, negative or overflowing
// shapes, offsets that disagree with the shape, overlap, leave gaps or do not end at the end of
// the file. SafetensorsModel opens a Hugging Face folder (one model.safetensors, or shards
// through model.safetensors.index.json). SafetensorsWriter streams one file atomically with the
// data 8-byte aligned. Every error is one line naming the file and, where known, the tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "q4/io/bounded_read.h"

namespace q4::io {

enum class StDtype {
  kBool,
  kU8,
  kI8,
  kI16,
  kI32,
  kI64,
  kF16,
  kBF16,
  kF32,
  kF64,
  kF8E4M3,  // "F8_E4M3" (E4M3FN bits)
  kF8E5M2,  // "F8_E5M2"
};

const char* st_dtype_name(StDtype t);  // "BF16", "F8_E4M3", ...
size_t st_dtype_size(StDtype t);       // bytes per element
std::optional<StDtype> st_dtype_from_name(const std::string& name);
// Storage dtype of a loaded payload: the matching ATen type; F8 kinds load as uint8 bits.
at::ScalarType st_storage_scalar_type(StDtype t);

// Header limit of the reference implementation (larger headers are rejected there too).
inline constexpr uint64_t kStMaxHeaderBytes = 100'000'000;

struct StTensor {
  std::string name;
  StDtype dtype;
  std::vector<int64_t> shape;
  uint64_t offset;  // absolute byte offset of the data in the file
  uint64_t nbytes;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  explicit SafetensorsFile(std::string path);  // indexes the header; errors name the file
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  uint64_t file_size_bytes() const { return file_size_; }
  uint64_t data_offset() const { return data_offset_; }  // 8 + header length
  // Tensors in data order (ascending offsets).
  const std::vector<StTensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const StTensor* find(const std::string& name) const {  // nullptr when absent
    const auto it = index_.find(name);
    return it == index_.end() ? nullptr : &tensors_[it->second];
  }
  const StTensor& at(const std::string& name) const;    // error naming file and tensor

  // CPU tensor of st_storage_scalar_type(dtype) and the tensor's shape (one pread).
  at::Tensor load(const StTensor& t) const;
  // Rows [row0, row0 + n) of a tensor of rank >= 1 (streaming of large matrices).
  at::Tensor load_rows(const StTensor& t, int64_t row0, int64_t n) const;
  void read_range(uint64_t offset, uint64_t n, void* dst) const {
    read_file_range(fd_.get(), path_, file_size_, offset, n, dst);
  }

 private:
  std::string path_;
  ScopedFd fd_;
  uint64_t file_size_ = 0;
  uint64_t data_offset_ = 0;
  std::vector<StTensor> tensors_;
  std::unordered_map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// A Hugging Face checkpoint folder (or a single .safetensors file): with
// model.safetensors.index.json every shard its weight_map names is opened and each tensor must be
// in the shard the map says (and nowhere else); otherwise the folder's model.safetensors.
class SafetensorsModel {
 public:
  explicit SafetensorsModel(const std::string& path);

  const std::string& path() const { return path_; }
  struct Ref {
    const SafetensorsFile* file;
    const StTensor* tensor;
  };
  std::optional<Ref> find(const std::string& name) const;
  Ref at(const std::string& name) const;  // error naming the folder and tensor
  std::vector<std::string> names() const;  // sorted
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::unordered_map<std::string, Ref> index_;
};

// Streaming writer for one file. All tensors are declared up front (the header precedes the
// data); data is then appended in declaration order and must add up exactly. Header keys are
// written sorted (as the reference does); offsets follow declaration order; the header is padded
// with spaces so the data starts 8-byte aligned. Atomic (AtomicFile).
class SafetensorsWriter {
 public:
  struct Decl {
    std::string name;
    StDtype dtype;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(std::string path, std::vector<Decl> tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;

  void append(const void* data, size_t nbytes);
  // CPU tensor whose dtype is the storage dtype of the current tensor (uint8 for F8 kinds).
  void append(const at::Tensor& chunk);
  void commit();  // all data written; publish

  const std::string& path() const { return path_; }
  static uint64_t tensor_bytes(const Decl& d);  // numel * element size, overflow-checked

 private:
  std::string path_;
  std::vector<Decl> decls_;
  std::vector<uint64_t> sizes_;
  size_t current_ = 0;       // tensor being written
  uint64_t left_ = 0;        // bytes still owed by the current tensor
  struct Impl;
  std::unique_ptr<Impl> impl_;
  void advance();
};

}  // namespace q4::io
