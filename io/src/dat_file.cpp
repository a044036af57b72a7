// .dat container reader and writer. The reader parses headers through a small pread window
// (4 KiB), jumping over payloads by offset arithmetic, so indexing a multi-GB file touches only
// its headers; every field is bounds-checked against the file size before use. The writer
// coalesces small writes, copies unchanged entries with copy_file_range (pread/write fallback,
// 8 MiB chunks) and publishes the file atomically: temp file, fsync, rename, fsync directory.
#include "q4/io/dat_file.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <sstream>

#include "q4/io/atomic_file.h"
#include "q4/io/bounded_read.h"
#include "q4/io/message_text.h"
#include "q4/io/utf8.h"
#include "posix_common.h"

namespace q4::io {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, ".dat payloads are little-endian");

namespace {

constexpr size_t kHeaderWindowBytes = 4096;            // reader's header read-ahead
constexpr size_t kCopyChunkBytes = size_t{8} << 20;    // pread/write copy fallback
constexpr size_t kWriteBufferBytes = size_t{1} << 20;  // writer coalescing buffer

void encode_uleb128(uint64_t v, std::vector<uint8_t>& out) {
  do {
    uint8_t b = v & 0x7F;
    v >>= 7;
    if (v != 0) b |= 0x80;
    out.push_back(b);
  } while (v != 0);
}

// Header parser over a pread window. `fail` adds file / entry / key context to every message.
class HeaderParser {
 public:
  HeaderParser(int fd, uint64_t size, const std::string& path)
      : fd_(fd), size_(size), path_(path), window_(kHeaderWindowBytes) {}

  uint64_t pos() const { return pos_; }
  void seek(uint64_t pos) { pos_ = pos; }
  uint64_t remaining() const { return pos_ <= size_ ? size_ - pos_ : 0; }

  // Context for messages: entry index (-1 = the count field) and key as far as known.
  void set_context(int64_t entry, const std::string* key) {
    entry_ = entry;
    key_ = key;
  }

  [[noreturn]] void fail(const std::string& what) const {
    std::ostringstream os;
    os << path_ << ": ";
    if (entry_ < 0) {
      os << "entry count";
    } else {
      os << "entry " << entry_;
      if (key_ != nullptr && !key_->empty()) {
        os << " (key '" << printable(*key_) << "')";
      } else {
        os << " (key not read yet)";
      }
    }
    os << ": " << what;
    TORCH_CHECK(false, os.str());
  }

  uint8_t byte(const char* field) {
    if (pos_ >= size_) {
      fail(std::string("truncated header: file ends at byte ") + std::to_string(size_) +
           " while reading " + field);
    }
    if (pos_ < win_start_ || pos_ >= win_start_ + win_len_) refill();
    return window_[pos_++ - win_start_];
  }

  uint64_t uleb128(const char* field) {
    uint64_t v = 0;
    for (int i = 0; i < 10; ++i) {
      const uint8_t b = byte(field);
      const uint64_t bits = b & 0x7F;
      if (i == 9 && bits > 1) {
        fail(std::string("LEB128 overflow in ") + field + ": value exceeds 64 bits");
      }
      v |= bits << (7 * i);
      if ((b & 0x80) == 0) return v;
    }
    fail(std::string("LEB128 overflow in ") + field + ": more than 10 bytes");
  }

  void bytes(std::string& out, uint64_t n, const char* field) {
    if (n > remaining()) {
      fail(std::string("truncated header: ") + field + " needs " + std::to_string(n) +
           " bytes at offset " + std::to_string(pos_) + ", file has " +
           std::to_string(remaining()) + " left");
    }
    out.resize(n);
    for (uint64_t i = 0; i < n; ++i) out[i] = static_cast<char>(byte(field));
  }

 private:
  void refill() {
    win_start_ = pos_;
    const uint64_t n = std::min<uint64_t>(window_.size(), size_ - pos_);
    int err = 0;
    if (!pread_full(fd_, window_.data(), n, pos_, &err)) {
      fail(err ? "read error: " + errno_text(err) : std::string("file shrank while indexing"));
    }
    win_len_ = n;
  }

  int fd_;
  uint64_t size_;
  const std::string& path_;
  std::vector<uint8_t> window_;
  uint64_t win_start_ = 0;
  uint64_t win_len_ = 0;
  uint64_t pos_ = 0;
  int64_t entry_ = -1;
  const std::string* key_ = nullptr;
};

}  // namespace

namespace {

// The element types: code, storage dtype (which gives the element size) and name. The first row
// of a dtype is the element type elem_type_for() gives it.
struct ElemInfo {
  ElemType type;
  at::ScalarType storage;
  const char* name;
};
constexpr ElemInfo kElemTypes[] = {
    {ElemType::kUInt8, at::kByte, "uint8"},     {ElemType::kInt8, at::kChar, "int8"},
    {ElemType::kInt16, at::kShort, "int16"},    {ElemType::kInt32, at::kInt, "int32"},
    {ElemType::kInt64, at::kLong, "int64"},     {ElemType::kFloat16, at::kHalf, "fp16"},
    {ElemType::kFloat32, at::kFloat, "fp32"},   {ElemType::kFloat64, at::kDouble, "fp64"},
    {ElemType::kBool, at::kBool, "bool"},       {ElemType::kBFloat16, at::kBFloat16, "bf16"},
    {ElemType::kE2M1Packed, at::kByte, "e2m1"}, {ElemType::kE4M3Scale, at::kByte, "e4m3"},
};

const ElemInfo* find_elem_info(uint64_t code) {
  for (const ElemInfo& e : kElemTypes) {
    if (static_cast<uint64_t>(e.type) == code) return &e;
  }
  return nullptr;
}

const ElemInfo& elem_info(ElemType t) {
  const ElemInfo* e = find_elem_info(static_cast<uint64_t>(t));
  TORCH_CHECK(e != nullptr, "unknown .dat element type ", static_cast<uint32_t>(t));
  return *e;
}

}  // namespace

bool is_known_elem_type(uint64_t code) { return find_elem_info(code) != nullptr; }
size_t elem_size_bytes(ElemType t) { return c10::elementSize(elem_info(t).storage); }
at::ScalarType elem_scalar_type(ElemType t) { return elem_info(t).storage; }

const char* elem_type_name(ElemType t) {
  const ElemInfo* e = find_elem_info(static_cast<uint64_t>(t));
  return e != nullptr ? e->name : "unknown";
}

ElemType elem_type_for(at::ScalarType t) {
  for (const ElemInfo& e : kElemTypes) {
    if (e.storage == t) return e.type;
  }
  TORCH_CHECK(false, "dtype ", t, " has no .dat element type");
}

int64_t DatEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;  // bounded when the entry was indexed or added
  return n;
}

// ---------------------------------------------------------------------------------------------
// DatReader

DatReader::DatReader(std::string path) : path_(std::move(path)) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; fstat below refuses it.
  fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK));
  TORCH_CHECK(fd_.get() >= 0, path_, ": cannot open .dat file: ", errno_text(errno));
  struct stat st;
  TORCH_CHECK(::fstat(fd_.get(), &st) == 0, path_, ": fstat failed: ", errno_text(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), path_, ": not a regular file");
  file_size_ = static_cast<uint64_t>(st.st_size);

  HeaderParser p(fd_.get(), file_size_, path_);
  p.set_context(-1, nullptr);
  TORCH_CHECK(file_size_ > 0, path_, ": entry count: empty file (expected a uleb128 count)");
  const uint64_t count = p.uleb128("entry count");
  // Every entry has at least 4 header bytes (keylen, key, type, ndim): bound the reservation
  // by the file size, not by a count that may be corrupt.
  entries_.reserve(static_cast<size_t>(std::min<uint64_t>(count, file_size_ / 4 + 1)));
  std::string key;
  for (uint64_t i = 0; i < count; ++i) {
    key.clear();
    p.set_context(static_cast<int64_t>(i), &key);
    if (p.remaining() == 0) {
      p.fail("file ends after " + std::to_string(i) + " entries but the count says " +
             std::to_string(count));
    }
    DatEntry e;
    e.header_offset = p.pos();
    const uint64_t keylen = p.uleb128("key length");
    if (keylen == 0) p.fail("empty key");
    if (keylen > kDatMaxKeyBytes) {
      p.fail("absurd key length " + std::to_string(keylen) + " (limit " +
             std::to_string(kDatMaxKeyBytes) + ")");
    }
    std::string raw;
    p.bytes(raw, keylen, "key");
    key = raw;
    const size_t bad = utf8::find_invalid(key);
    if (bad != std::string::npos) {
      p.fail("key is not valid UTF-8 (byte " + std::to_string(bad) + ")");
    }
    const uint64_t code = p.uleb128("element type");
    if (!is_known_elem_type(code)) p.fail("unknown element type " + std::to_string(code));
    e.type = static_cast<ElemType>(code);
    const uint64_t ndim = p.uleb128("ndim");
    if (ndim > kDatMaxNdim) {
      p.fail("absurd ndim " + std::to_string(ndim) + " (limit " + std::to_string(kDatMaxNdim) +
             ")");
    }
    e.shape.resize(ndim);
    int64_t numel = 1;  // product of max(dim, 1): rejects overflow even when a dim is 0
    bool empty = false;
    for (uint64_t d = 0; d < ndim; ++d) {
      const uint64_t dim = p.uleb128("dimension");
      if (dim > static_cast<uint64_t>(INT64_MAX)) {
        p.fail("dimension " + std::to_string(d) + " = " + std::to_string(dim) + " exceeds int64");
      }
      e.shape[d] = static_cast<int64_t>(dim);
      if (dim == 0) {
        empty = true;
      } else if (__builtin_mul_overflow(numel, e.shape[d], &numel)) {
        p.fail("dimension product overflows int64 at dimension " + std::to_string(d));
      }
    }
    if (empty) numel = 0;
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(static_cast<uint64_t>(numel),
                               static_cast<uint64_t>(elem_size_bytes(e.type)), &nbytes) ||
        nbytes > static_cast<uint64_t>(INT64_MAX)) {
      p.fail("payload size overflows (" + std::to_string(numel) + " elements)");
    }
    e.offset = p.pos();
    e.nbytes = nbytes;
    if (nbytes > p.remaining()) {
      p.fail("truncated payload: needs " + std::to_string(nbytes) + " bytes at offset " +
             std::to_string(e.offset) + ", file has " + std::to_string(p.remaining()) + " left");
    }
    auto [it, inserted] = index_.emplace(key, entries_.size());
    if (!inserted) p.fail("duplicate key (first seen as entry " + std::to_string(it->second) + ")");
    e.key = key;
    entries_.push_back(std::move(e));
    p.seek(entries_.back().offset + nbytes);
  }
  if (p.pos() != file_size_) {
    const std::string last = entries_.empty() ? std::string("no entries")
                                              : "entry " + std::to_string(count - 1) + " (key '" +
                                                    printable(entries_.back().key) + "')";
    TORCH_CHECK(false, path_, ": trailing garbage: ", file_size_ - p.pos(), " bytes at offset ",
                p.pos(), " after ", last, ", the last of ", count, " entries");
  }
}

const DatEntry& DatReader::at(const std::string& key) const {
  const DatEntry* e = find(key);
  TORCH_CHECK(e != nullptr, path_, ": no entry with key '", printable(key), "'");
  return *e;
}

void DatReader::read_bytes(const DatEntry& e, void* dst) const {
  TORCH_CHECK(e.offset <= file_size_ && e.nbytes <= file_size_ - e.offset, path_, ": entry '",
              printable(e.key), "': payload of ", e.nbytes, " bytes at offset ", e.offset,
              " is past the end (", file_size_, " bytes)");
  int err = 0;
  TORCH_CHECK(pread_full(fd_.get(), dst, e.nbytes, e.offset, &err), path_, ": entry '",
              printable(e.key), "': reading ", e.nbytes, " bytes at offset ", e.offset, ": ",
              err ? errno_text(err) : std::string("file shrank after indexing"));
}

at::Tensor DatReader::load(const DatEntry& e) const {
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(elem_scalar_type(e.type)));
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(t.nbytes()) == e.nbytes);
  if (e.nbytes == 0) return t;
  if (e.type == ElemType::kBool) {
    // A bool byte other than 0/1 is undefined behaviour for every consumer: check as bytes.
    at::Tensor raw = at::empty(e.shape, at::TensorOptions().dtype(at::kByte));
    read_bytes(e, raw.data_ptr());
    const auto* b = raw.data_ptr<uint8_t>();
    for (uint64_t i = 0; i < e.nbytes; ++i) {
      TORCH_CHECK(b[i] <= 1, path_, ": entry '", printable(e.key), "': bool payload byte ", i,
                  " is ", static_cast<int>(b[i]), " (expected 0 or 1)");
    }
    std::memcpy(t.data_ptr(), b, e.nbytes);
    return t;
  }
  read_bytes(e, t.data_ptr());
  return t;
}

std::map<std::string, at::Tensor> DatReader::load_all() const {
  std::map<std::string, at::Tensor> out;
  for (const DatEntry& e : entries_) out.emplace(e.key, load(e));
  return out;
}

std::optional<DatNvfp4Pair> DatReader::find_nvfp4(const std::string& name) const {
  const DatEntry* q = find(name + kDatQdataSuffix);
  const DatEntry* s = find(name + kDatScaleSuffix);
  if (q == nullptr && s == nullptr) return std::nullopt;
  auto where = [&](const DatEntry* e) {
    return path_ + ": entry " + std::to_string(e - entries_.data()) + " '" + printable(e->key) +
           "'";
  };
  TORCH_CHECK(q != nullptr, where(s), ": NVFP4 scale without its '",
              printable(name + kDatQdataSuffix), "' entry");
  TORCH_CHECK(s != nullptr, where(q), ": NVFP4 qdata without its '",
              printable(name + kDatScaleSuffix), "' entry");
  TORCH_CHECK(q->type == ElemType::kUInt8 || q->type == ElemType::kE2M1Packed, where(q),
              ": expected element type uint8 or e2m1 (0 or 100), got ", elem_type_name(q->type));
  TORCH_CHECK(s->type == ElemType::kE4M3Scale, where(s), ": expected element type e4m3 (101), got ",
              elem_type_name(s->type));
  TORCH_CHECK(q->shape.size() == 2 && s->shape.size() == 2 && q->shape[0] == s->shape[0] &&
                  q->shape[1] == 8 * s->shape[1],
              path_, ": NVFP4 pair '", printable(name), "': qdata ", at::IntArrayRef(q->shape),
              " and scale ", at::IntArrayRef(s->shape),
              " are inconsistent (expected (r, c/2) and (r, c/16))");
  return DatNvfp4Pair{name, static_cast<size_t>(q - entries_.data()),
                      static_cast<size_t>(s - entries_.data()), q->shape[0], 2 * q->shape[1]};
}

std::vector<DatNvfp4Pair> DatReader::nvfp4_pairs(bool strict) const {
  std::vector<DatNvfp4Pair> pairs;
  auto ends_with = [](const std::string& k, const char* suffix) {
    const size_t n = std::strlen(suffix);
    return k.size() > n && k.compare(k.size() - n, n, suffix) == 0;
  };
  for (const DatEntry& e : entries_) {
    const bool qdata = ends_with(e.key, kDatQdataSuffix) &&
                       (e.type == ElemType::kUInt8 || e.type == ElemType::kE2M1Packed);
    const bool scale = ends_with(e.key, kDatScaleSuffix) && e.type == ElemType::kE4M3Scale;
    if (!qdata && !scale) continue;
    const std::string name = e.key.substr(0, e.key.size() - 6);
    if (strict) {
      const auto p = find_nvfp4(name);
      if (qdata) pairs.push_back(*p);
      continue;
    }
    if (!qdata) continue;
    try {
      pairs.push_back(*find_nvfp4(name));
    } catch (const c10::Error&) {  // not a pair (lenient mode)
    }
  }
  return pairs;
}

q4::quant::Nvfp4Tensor DatReader::load_nvfp4(const DatNvfp4Pair& p) const {
  return {load(entries_.at(p.qdata_index)).view({p.rows, p.cols / 2}),
          load(entries_.at(p.scale_index)).view({p.rows, p.cols / q4::quant::kNvfp4BlockSize})};
}

// ---------------------------------------------------------------------------------------------
// DatWriter

DatWriter::DatWriter(std::string path, uint64_t count) : path_(std::move(path)), count_(count) {
  TORCH_CHECK(!path_.empty(), "DatWriter: empty output path");
  file_ = std::make_unique<AtomicFile>(path_);
  tmp_path_ = file_->tmp_path();
  fd_ = file_->fd();
  buf_.reserve(kWriteBufferBytes);
  std::vector<uint8_t> head;
  encode_uleb128(count_, head);
  try {
    write_all(head.data(), head.size());
  } catch (...) {
    abort();
    throw;
  }
}

DatWriter::~DatWriter() {
  if (!committed_) abort();
}

void DatWriter::abort() noexcept {
  fd_ = -1;
  if (file_ && !committed_) file_->abort();
  failed_ = true;
}

void DatWriter::write_fd(const void* p, size_t n) {
  try {
    file_->write(p, n);
  } catch (...) {
    failed_ = true;
    throw;
  }
}

void DatWriter::flush() {
  if (buf_.empty()) return;
  write_fd(buf_.data(), buf_.size());
  buf_.clear();
}

void DatWriter::write_all(const void* p, size_t n) {
  bytes_ += n;
  if (buf_.size() + n <= kWriteBufferBytes) {
    const auto* c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
    return;
  }
  flush();
  if (n < kWriteBufferBytes) {
    const auto* c = static_cast<const uint8_t*>(p);
    buf_.insert(buf_.end(), c, c + n);
  } else {
    write_fd(p, n);
  }
}

void DatWriter::begin_entry(const std::string& key) {
  TORCH_CHECK(fd_ >= 0 && !committed_ && !failed_, path_,
              ": DatWriter used after commit() or after a failed call");
  TORCH_CHECK(pair_name_.empty(), path_, ": NVFP4 pair '", printable(pair_name_), "' has ",
              pair_rows_done_, " of ", pair_scale_.defined() ? pair_scale_.size(0) : 0,
              " rows before entry '", printable(key), "' can start");
  TORCH_CHECK(stream_left_ == 0, path_, ": entry '", printable(stream_key_), "' still owes ",
              stream_left_, " payload bytes before entry '", printable(key), "' can start");
  TORCH_CHECK(written_ < count_, path_, ": entry '", printable(key),
              "' would exceed the declared count of ", count_, " entries");
  TORCH_CHECK(!key.empty() && key.size() <= kDatMaxKeyBytes, path_, ": entry ", written_,
              ": key length ", key.size(), " outside [1, ", kDatMaxKeyBytes, "]");
  TORCH_CHECK(utf8::find_invalid(key) == std::string::npos, path_, ": entry ", written_, " (key '",
              printable(key), "'): key is not valid UTF-8");
  TORCH_CHECK(keys_.count(key) == 0, path_, ": entry ", written_, " (key '", printable(key),
              "'): duplicate key");
}

void DatWriter::write_header(const std::string& key, ElemType type,
                             const std::vector<int64_t>& shape) {
  std::vector<uint8_t> h;
  h.reserve(key.size() + 16 + 10 * shape.size());
  encode_uleb128(key.size(), h);
  h.insert(h.end(), key.begin(), key.end());
  encode_uleb128(static_cast<uint32_t>(type), h);
  encode_uleb128(shape.size(), h);
  for (int64_t d : shape) encode_uleb128(static_cast<uint64_t>(d), h);
  write_all(h.data(), h.size());
}

void DatWriter::add(const std::string& key, const at::Tensor& t, ElemType type) {
  begin_entry(key);
  TORCH_CHECK(t.defined(), path_, ": entry '", printable(key), "': undefined tensor");
  TORCH_CHECK(t.device().is_cpu(), path_, ": entry '", printable(key),
              "': expected a CPU tensor, found ", t.device());
  TORCH_CHECK(t.scalar_type() == elem_scalar_type(type), path_, ": entry '", printable(key),
              "': element type ", elem_type_name(type), " needs dtype ", elem_scalar_type(type),
              ", found ", t.scalar_type());
  TORCH_CHECK(static_cast<uint64_t>(t.dim()) <= kDatMaxNdim, path_, ": entry '", printable(key),
              "': ", t.dim(), " dimensions exceed the limit ", kDatMaxNdim);
  const at::Tensor c = t.contiguous();
  const std::vector<int64_t> shape(c.sizes().begin(), c.sizes().end());
  try {
    write_header(key, type, shape);
    if (c.numel() > 0) write_all(c.data_ptr(), c.nbytes());
  } catch (...) {
    failed_ = true;
    throw;
  }
  keys_.insert(key);
  ++written_;
}

void DatWriter::copy_from(const DatReader& src, const DatEntry& e) {
  begin_entry(e.key);
  TORCH_CHECK(e.header_offset < e.offset && e.offset <= src.file_size_ &&
                  e.nbytes <= src.file_size_ - e.offset,
              path_, ": copy_from: entry '", printable(e.key), "' is not an entry of ", src.path());
  try {
    std::string header(e.offset - e.header_offset, '\0');
    src.read_range(e.header_offset, header.size(), header.data());
    write_all(header.data(), header.size());
    if (e.nbytes < kWriteBufferBytes) {
      std::vector<uint8_t> payload(e.nbytes);
      src.read_bytes(e, payload.data());
      write_all(payload.data(), payload.size());
    } else {
      flush();
      uint64_t done = 0;
      bool use_cfr = true;
      std::vector<uint8_t> chunk;
      while (done < e.nbytes) {
        const uint64_t want = std::min<uint64_t>(e.nbytes - done, kIoChunkBytes);
        if (use_cfr) {
          loff_t in_off = static_cast<loff_t>(e.offset + done);
          const ssize_t n = ::copy_file_range(src.fd_.get(), &in_off, fd_, nullptr, want, 0);
          if (n > 0) {
            done += static_cast<uint64_t>(n);
            continue;
          }
          if (n < 0 && errno == EINTR) continue;
          TORCH_CHECK(n != 0, path_, ": copy_from '", printable(e.key), "': ", src.path(),
                      " shrank after indexing");
          // EXDEV/ENOSYS/EINVAL/EOPNOTSUPP...: fall back to plain reads and writes.
          use_cfr = false;
        }
        const uint64_t n = std::min<uint64_t>(e.nbytes - done, kCopyChunkBytes);
        chunk.resize(n);
        src.read_range(e.offset + done, n, chunk.data());
        write_fd(chunk.data(), n);
        done += n;
      }
      bytes_ += e.nbytes;
    }
  } catch (...) {
    failed_ = true;
    throw;
  }
  keys_.insert(e.key);
  ++written_;
}

void DatWriter::begin_streamed(const std::string& key, ElemType type,
                               const std::vector<int64_t>& shape) {
  begin_entry(key);
  TORCH_CHECK(shape.size() <= kDatMaxNdim, path_, ": entry '", printable(key), "': ", shape.size(),
              " dimensions exceed the limit ", kDatMaxNdim);
  uint64_t nbytes = elem_size_bytes(type);
  for (int64_t d : shape) {
    TORCH_CHECK(d >= 0, path_, ": entry '", printable(key), "': negative dimension ", d);
    TORCH_CHECK(!__builtin_mul_overflow(nbytes, static_cast<uint64_t>(d), &nbytes) &&
                    nbytes <= static_cast<uint64_t>(INT64_MAX),
                path_, ": entry '", printable(key), "': payload size overflows");
  }
  try {
    write_header(key, type, shape);
  } catch (...) {
    failed_ = true;
    throw;
  }
  keys_.insert(key);
  ++written_;
  stream_left_ = nbytes;
  stream_key_ = key;
  stream_type_ = type;
}

void DatWriter::append(const void* data, size_t nbytes) {
  TORCH_CHECK(fd_ >= 0 && !committed_ && !failed_, path_,
              ": DatWriter used after commit() or after a failed call");
  TORCH_CHECK(nbytes <= stream_left_, path_, ": entry '", printable(stream_key_), "': append of ",
              nbytes, " bytes exceeds the ", stream_left_, " payload bytes still owed");
  try {
    write_all(data, nbytes);
  } catch (...) {
    failed_ = true;
    throw;
  }
  stream_left_ -= nbytes;
}

void DatWriter::append(const at::Tensor& chunk) {
  TORCH_CHECK(chunk.defined() && chunk.device().is_cpu() &&
                  chunk.scalar_type() == elem_scalar_type(stream_type_),
              path_, ": entry '", printable(stream_key_), "': append needs a CPU ",
              elem_scalar_type(stream_type_), " tensor, found ",
              chunk.defined() ? chunk.toString() : std::string("undefined"));
  const at::Tensor c = chunk.contiguous();
  if (c.numel() > 0) append(c.data_ptr(), c.nbytes());
}

void DatWriter::add_nvfp4(const std::string& name, const q4::quant::Nvfp4Tensor& t,
                          ElemType qdata_type) {
  TORCH_CHECK(t.qdata.defined() && t.scale.defined() && t.qdata.dim() == 2 && t.scale.dim() == 2,
              path_, ": NVFP4 pair '", printable(name), "': expected 2-D qdata and scale");
  begin_nvfp4(name, t.qdata.size(0), 2 * t.qdata.size(1), qdata_type);
  append_nvfp4(t);
}

void DatWriter::begin_nvfp4(const std::string& name, int64_t rows, int64_t cols,
                            ElemType qdata_type) {
  TORCH_CHECK(qdata_type == ElemType::kUInt8 || qdata_type == ElemType::kE2M1Packed, path_,
              ": NVFP4 pair '", printable(name), "': qdata element type must be uint8 or ",
              "e2m1, got ", elem_type_name(qdata_type));
  TORCH_CHECK(rows >= 0 && cols >= 0 && cols % q4::quant::kNvfp4BlockSize == 0, path_,
              ": NVFP4 pair '", printable(name), "': shape [", rows, ", ", cols,
              "] needs a column count that is a multiple of ", q4::quant::kNvfp4BlockSize);
  TORCH_CHECK(keys_.count(name + kDatScaleSuffix) == 0, path_, ": entry '",
              printable(name + kDatScaleSuffix), "': duplicate key");
  begin_streamed(name + kDatQdataSuffix, qdata_type, {rows, cols / 2});
  pair_name_ = name;
  pair_scale_ =
      at::empty({rows, cols / q4::quant::kNvfp4BlockSize}, at::TensorOptions().dtype(at::kByte));
  pair_rows_done_ = 0;
  if (rows == 0) append_nvfp4({pair_scale_.new_empty({0, cols / 2}), pair_scale_});
}

void DatWriter::append_nvfp4(const q4::quant::Nvfp4Tensor& t) {
  TORCH_CHECK(!pair_name_.empty(), path_, ": append_nvfp4() without begin_nvfp4()");
  const int64_t rows = pair_scale_.size(0), sc = pair_scale_.size(1);
  const int64_t n = t.qdata.defined() && t.qdata.dim() == 2 ? t.qdata.size(0) : -1;
  TORCH_CHECK(n >= 0 && t.qdata.scalar_type() == at::kByte && t.qdata.size(1) * 2 == sc * 16 &&
                  t.scale.defined() && t.scale.scalar_type() == at::kByte &&
                  t.scale.sizes() == at::IntArrayRef({n, sc}) && pair_rows_done_ + n <= rows,
              path_, ": NVFP4 pair '", printable(pair_name_), "': chunk qdata ",
              t.qdata.defined() ? t.qdata.sizes() : at::IntArrayRef{}, " / scale ",
              t.scale.defined() ? t.scale.sizes() : at::IntArrayRef{}, " does not continue a [",
              rows, ", ", sc * 16, "] matrix at row ", pair_rows_done_);
  append(t.qdata.cpu());
  pair_scale_.narrow(0, pair_rows_done_, n).copy_(t.scale);
  pair_rows_done_ += n;
  if (pair_rows_done_ == rows) {
    const std::string name = pair_name_;
    pair_name_.clear();
    at::Tensor scale = std::move(pair_scale_);
    pair_scale_ = at::Tensor();
    add(name + kDatScaleSuffix, scale, ElemType::kE4M3Scale);
  }
}

void DatWriter::commit() {
  TORCH_CHECK(fd_ >= 0 && !committed_ && !failed_, path_,
              ": DatWriter::commit() after commit() or after a failed call");
  TORCH_CHECK(stream_left_ == 0, path_, ": entry '", printable(stream_key_), "' still owes ",
              stream_left_, " payload bytes");
  TORCH_CHECK(pair_name_.empty(), path_, ": NVFP4 pair '", printable(pair_name_),
              "' is incomplete");
  TORCH_CHECK(written_ == count_, path_, ": ", written_,
              " entries written but the header "
              "declares ",
              count_);
  try {
    flush();
    fd_ = -1;
    file_->commit();  // fsync, close, rename, directory fsync
  } catch (...) {
    abort();
    throw;
  }
  committed_ = true;
}

}  // namespace q4::io
