// The .dat tensor container (docs/design.md#the-dat-container): a uleb128 entry count, then per
// entry a uleb128 key length, UTF-8 key, uleb128 element type, uleb128 ndim, uleb128 dims and a
// little-endian row-major payload. No magic, no padding. DatReader indexes a file in one pass
// without reading payloads; DatWriter streams entries into a temp file and renames it into place.
// Every check on file content throws c10::Error (one line: file, entry index, key, expected/found).
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "q4/io/bounded_read.h"
#include "q4/quant/nvfp4.h"

namespace q4::io {

class AtomicFile;

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

// Reader limits beyond which a header is treated as corrupt (real files are far below them).
inline constexpr uint64_t kDatMaxKeyBytes = 65535;
inline constexpr uint64_t kDatMaxNdim = 16;

bool is_known_elem_type(uint64_t code);  // one of the ElemType codes above
size_t elem_size_bytes(ElemType t);
const char* elem_type_name(ElemType t);       // "uint8", "fp16", "e2m1", "e4m3", ...
at::ScalarType elem_scalar_type(ElemType t);  // storage dtype (kByte for 100/101)
ElemType elem_type_for(at::ScalarType t);     // inverse for plain dtypes; error otherwise

struct DatEntry {
  std::string key;
  ElemType type;
  std::vector<int64_t> shape;
  uint64_t offset;  // byte offset of the payload in the file
  uint64_t nbytes;  // payload size
  // Byte offset of the entry's keylen: the header is [header_offset, offset).
  uint64_t header_offset = 0;
  int64_t numel() const;
};

// An NVFP4 pair: `name.qdata` (uint8 or e2m1, (rows, cols/2)) + `name.scale` (e4m3, (rows,
// cols/16)). The container reads and writes the pair as one thing (DatReader::load_nvfp4,
// DatWriter::add_nvfp4 / begin_nvfp4); nothing else spells out the two keys.
struct DatNvfp4Pair {
  std::string name;    // e.g. "model.layers.0.mlp.up_proj.weight"
  size_t qdata_index;  // entry index of name.qdata
  size_t scale_index;  // entry index of name.scale
  int64_t rows;
  int64_t cols;  // dense columns
};
inline constexpr const char* kDatQdataSuffix = ".qdata";
inline constexpr const char* kDatScaleSuffix = ".scale";

class DatReader {
 public:
  // Indexes the whole file; any corruption throws c10::Error naming file, entry index and key.
  explicit DatReader(std::string path);
  DatReader(const DatReader&) = delete;
  DatReader& operator=(const DatReader&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<DatEntry>& entries() const { return entries_; }
  uint64_t file_size_bytes() const { return file_size_; }
  const DatEntry* find(const std::string& key) const {  // nullptr when absent
    const auto it = index_.find(key);
    return it == index_.end() ? nullptr : &entries_[it->second];
  }
  const DatEntry& at(const std::string& key) const;    // error naming file and key when absent

  // Payload as a CPU tensor of the entry's storage dtype and shape (reads on demand; thread-safe,
  // pread only). A bool payload byte other than 0/1 is an error.
  at::Tensor load(const DatEntry& e) const;
  at::Tensor load(const std::string& key) const { return load(at(key)); }
  // Every entry loaded, keyed by name (small files: test fixtures).
  std::map<std::string, at::Tensor> load_all() const;
  // Raw payload bytes into dst (e.nbytes bytes).
  void read_bytes(const DatEntry& e, void* dst) const;
  // Raw bytes [offset, offset + n) of the file into dst (any size; loops over pread).
  void read_range(uint64_t offset, uint64_t n, void* dst) const {
    read_file_range(fd_.get(), path_, file_size_, offset, n, dst);
  }

  // The pair `name.qdata` + `name.scale`, checked (element types, consistent shapes). nullopt when
  // neither half exists; an error naming the file, entry and key when only one does or it is
  // ill-typed / ill-shaped.
  std::optional<DatNvfp4Pair> find_nvfp4(const std::string& name) const;
  // Every pair, in the order of the .qdata entries. strict: an orphan half or inconsistent
  // shapes are errors; otherwise such entries are simply not pairs.
  std::vector<DatNvfp4Pair> nvfp4_pairs(bool strict) const;
  // qdata (rows, cols/2) uint8 and scale (rows, cols/16) uint8, CPU.
  q4::quant::Nvfp4Tensor load_nvfp4(const DatNvfp4Pair& p) const;

 private:
  friend class DatWriter;  // copy_from reads the source descriptor directly
  std::string path_;
  ScopedFd fd_;
  uint64_t file_size_ = 0;
  std::vector<DatEntry> entries_;
  std::unordered_map<std::string, size_t> index_;
};

// Streaming writer. Entries are written in call order to `<path>.tmp.<pid>.<n>` (same directory,
// a q4::io::AtomicFile); commit() checks that exactly `count` entries were written, fsyncs the
// file, renames it onto `path` and fsyncs the directory. Destruction without commit() removes the
// temp file and leaves `path` untouched. A call rejected by its checks writes nothing and the
// writer stays usable; a failure while writing makes it unusable (commit() refuses). Keys must be
// unique, non-empty UTF-8.
class DatWriter {
 public:
  DatWriter(std::string path, uint64_t count);
  ~DatWriter();
  DatWriter(const DatWriter&) = delete;
  DatWriter& operator=(const DatWriter&) = delete;

  // Writes a CPU tensor (made contiguous) as `type`; the tensor's dtype must be the storage
  // dtype of `type`.
  void add(const std::string& key, const at::Tensor& t, ElemType type);
  void add(const std::string& key, const at::Tensor& t) {
    add(key, t, elem_type_for(t.scalar_type()));
  }
  // Copies an entry (header and payload) byte-exactly from another file, under its own key.
  void copy_from(const DatReader& src, const DatEntry& e);
  // Streamed entry: the header now, the payload in pieces (e.g. row chunks of a tensor too
  // large to hold whole); the pieces must add up to prod(shape) * size(type) bytes before the
  // next entry or commit().
  void begin_streamed(const std::string& key, ElemType type, const std::vector<int64_t>& shape);
  void append(const void* data, size_t nbytes);
  void append(const at::Tensor& chunk);  // CPU, contiguous, dtype = storage dtype of the entry

  // NVFP4 pair `name.qdata` (qdata_type: kUInt8 or kE2M1Packed) + `name.scale` (kE4M3Scale).
  void add_nvfp4(const std::string& name, const q4::quant::Nvfp4Tensor& t,
                 ElemType qdata_type = ElemType::kE2M1Packed);
  // Streamed pair of a (rows, cols) matrix: append_nvfp4() takes consecutive row chunks; qdata is
  // written as it comes, the scales (1/8 of the qdata bytes) are kept and written as
  // `name.scale` after the last row. Counts as two entries.
  void begin_nvfp4(const std::string& name, int64_t rows, int64_t cols,
                   ElemType qdata_type = ElemType::kE2M1Packed);
  void append_nvfp4(const q4::quant::Nvfp4Tensor& rows_chunk);
  void commit();

  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_path_; }
  uint64_t written() const { return written_; }
  uint64_t bytes_written() const { return bytes_; }

 private:
  std::string path_;
  std::string tmp_path_;
  uint64_t count_;
  uint64_t written_ = 0;
  uint64_t bytes_ = 0;                // bytes handed to the file so far (buffered or written)
  std::unique_ptr<AtomicFile> file_;  // the temp file, published by commit()
  int fd_ = -1;                       // file_->fd() while writable, else -1
  bool committed_ = false;
  bool failed_ = false;       // a call threw midway; the temp file is unusable
  uint64_t stream_left_ = 0;  // payload bytes still owed by a begin_streamed() entry
  std::string stream_key_;
  ElemType stream_type_ = ElemType::kUInt8;
  std::unordered_set<std::string> keys_;
  std::vector<uint8_t> buf_;  // small writes (headers, small payloads) are coalesced here
  std::string pair_name_;     // begin_nvfp4() pair in progress (empty: none)
  at::Tensor pair_scale_;     // (rows, cols/16) uint8 scales of that pair
  int64_t pair_rows_done_ = 0;
  void begin_entry(const std::string& key);
  void write_header(const std::string& key, ElemType type, const std::vector<int64_t>& shape);
  void write_all(const void* p, size_t n);  // through buf_
  void flush();
  void write_fd(const void* p, size_t n);  // straight to fd_
  void abort() noexcept;
};

}  // namespace q4::io
