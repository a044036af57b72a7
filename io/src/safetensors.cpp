// safetensors reader, folder index and atomic streaming writer (safetensors.h). The header is
// parsed with nlohmann-json (a callback catches duplicate names, which the object would
// otherwise silently merge); every field is validated before any offset is used.
#include "q4/io/safetensors.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "q4/io/atomic_file.h"
#include "q4/io/bounded_read.h"
#include "q4/io/message_text.h"

namespace q4::io {

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "safetensors data is little-endian");

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

struct DtypeInfo {
  StDtype t;
  const char* name;
  size_t size;
  at::ScalarType storage;
};
const DtypeInfo kDtypes[] = {
    {StDtype::kBool, "BOOL", 1, at::kBool},    {StDtype::kU8, "U8", 1, at::kByte},
    {StDtype::kI8, "I8", 1, at::kChar},        {StDtype::kI16, "I16", 2, at::kShort},
    {StDtype::kI32, "I32", 4, at::kInt},       {StDtype::kI64, "I64", 8, at::kLong},
    {StDtype::kF16, "F16", 2, at::kHalf},      {StDtype::kBF16, "BF16", 2, at::kBFloat16},
    {StDtype::kF32, "F32", 4, at::kFloat},     {StDtype::kF64, "F64", 8, at::kDouble},
    {StDtype::kF8E4M3, "F8_E4M3", 1, at::kByte}, {StDtype::kF8E5M2, "F8_E5M2", 1, at::kByte},
};

const DtypeInfo& info(StDtype t) {
  for (const auto& d : kDtypes) {
    if (d.t == t) return d;
  }
  TORCH_INTERNAL_ASSERT(false, "unknown StDtype");
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string o = "[";
  for (size_t i = 0; i < s.size(); ++i) o += (i ? ", " : "") + std::to_string(s[i]);
  return o + "]";
}

}  // namespace

const char* st_dtype_name(StDtype t) { return info(t).name; }
size_t st_dtype_size(StDtype t) { return info(t).size; }
at::ScalarType st_storage_scalar_type(StDtype t) { return info(t).storage; }

std::optional<StDtype> st_dtype_from_name(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return d.t;
  }
  return std::nullopt;
}

int64_t StTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsFile

namespace {

// The header's JSON object. Duplicate top-level names would be merged silently by the parser:
// they are counted here.
json parse_header(const std::string& path, const std::string& header) {
  std::set<std::string> seen;
  std::string duplicate;
  json::parser_callback_t cb = [&](int depth, json::parse_event_t ev, json& parsed) {
    if (ev == json::parse_event_t::key && depth == 1 && duplicate.empty()) {
      const std::string k = parsed.get<std::string>();
      if (!seen.insert(k).second) duplicate = k;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(header, cb);
  } catch (const json::exception& e) {
    TORCH_CHECK(false, path, ": header is not valid JSON: ", e.what());
  }
  TORCH_CHECK(duplicate.empty(), path, ": tensor '", printable(duplicate),
              "' appears twice in the header");
  TORCH_CHECK(j.is_object(), path, ": header is not a JSON object");
  return j;
}

void read_metadata(const std::string& path, const json& v,
                   std::map<std::string, std::string>& metadata) {
  TORCH_CHECK(v.is_object(), path, ": __metadata__ is not an object of strings");
  for (auto m = v.begin(); m != v.end(); ++m) {
    TORCH_CHECK(m.value().is_string(), path, ": __metadata__ entry '", printable(m.key()),
                "' is not a string");
    metadata[m.key()] = m.value().get<std::string>();
  }
}

// A tensor's bytes [begin, end) in the data section, and its index in the header's order.
struct DataRange {
  uint64_t begin, end;
  size_t i;
};

// The header entry of tensor `name`, checked against the data section (`data_bytes` bytes from
// `data_offset`); r gets its data_offsets.
StTensor parse_tensor_entry(const std::string& path, const std::string& name, const json& v,
                            uint64_t data_offset, uint64_t data_bytes, DataRange& r) {
  const std::string where = path + ": tensor '" + printable(name) + "'";
  TORCH_CHECK(!name.empty(), path, ": a tensor has an empty name");
  TORCH_CHECK(v.is_object(), where, ": header entry is not an object");
  const auto dt = v.find("dtype");
  TORCH_CHECK(dt != v.end() && dt->is_string(), where, ": missing or non-string dtype");
  const auto dtype = st_dtype_from_name(dt->get<std::string>());
  TORCH_CHECK(dtype.has_value(), where, ": unsupported dtype '", printable(dt->get<std::string>()),
              "' (expected BOOL, U8, I8, I16, I32, I64, F16, BF16, F32, F64, F8_E4M3 or "
              "F8_E5M2)");
  const auto sh = v.find("shape");
  TORCH_CHECK(sh != v.end() && sh->is_array() && sh->size() <= 64, where,
              ": shape must be an array of at most 64 non-negative integers");
  StTensor t{name, *dtype, {}, 0, 0};
  uint64_t nbytes = st_dtype_size(*dtype);
  for (const json& d : *sh) {
    TORCH_CHECK(d.is_number_unsigned() && d.get<uint64_t>() <= uint64_t{INT64_MAX}, where,
                ": shape ", sh->dump(), " has an entry that is not a non-negative integer");
    const uint64_t du = d.get<uint64_t>();
    TORCH_CHECK(!__builtin_mul_overflow(nbytes, du, &nbytes), where, ": shape ", sh->dump(),
                " overflows 64-bit byte counts");
    t.shape.push_back(static_cast<int64_t>(du));
  }
  const auto off = v.find("data_offsets");
  TORCH_CHECK(off != v.end() && off->is_array() && off->size() == 2 &&
                  (*off)[0].is_number_unsigned() && (*off)[1].is_number_unsigned(),
              where, ": data_offsets must be two non-negative integers");
  const uint64_t b = (*off)[0].get<uint64_t>(), e = (*off)[1].get<uint64_t>();
  TORCH_CHECK(b <= e && e <= data_bytes, where, ": data_offsets [", b, ", ", e,
              "] outside the data section of ", data_bytes, " bytes");
  TORCH_CHECK(e - b == nbytes, where, ": data_offsets [", b, ", ", e, "] hold ", e - b,
              " bytes but ", st_dtype_name(*dtype), " ", shape_text(t.shape), " needs ", nbytes);
  t.offset = data_offset + b;
  t.nbytes = nbytes;
  r.begin = b;
  r.end = e;
  return t;
}

// Sorts the ranges by offset and checks that they cover the data section exactly: no overlap,
// no gap, nothing after the last tensor.
void check_data_coverage(const std::string& path, std::vector<DataRange>& ranges,
                         const std::vector<StTensor>& tensors, uint64_t data_bytes) {
  std::sort(ranges.begin(), ranges.end(), [](const DataRange& a, const DataRange& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t pos = 0;
  for (const DataRange& r : ranges) {
    const std::string& nm = tensors[r.i].name;
    TORCH_CHECK(r.begin >= pos, path, ": tensor '", printable(nm), "': data_offsets [", r.begin,
                ", ", r.end, "] overlap the previous tensor (ending at ", pos, ")");
    TORCH_CHECK(r.begin == pos, path, ": tensor '", printable(nm), "': data_offsets [", r.begin,
                ", ", r.end, "] leave a gap of ", r.begin - pos, " bytes after offset ", pos);
    pos = r.end;
  }
  TORCH_CHECK(pos == data_bytes, path, ": the tensors cover ", pos, " data bytes but the file ",
              "holds ", data_bytes, " (truncated or trailing bytes)");
}

}  // namespace

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  fd_.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC));
  TORCH_CHECK(fd_.get() >= 0, path_, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  TORCH_CHECK(::fstat(fd_.get(), &st) == 0, path_, ": stat failed: ", std::strerror(errno));
  TORCH_CHECK(S_ISREG(st.st_mode), path_, ": not a regular file");
  file_size_ = static_cast<uint64_t>(st.st_size);
  TORCH_CHECK(file_size_ >= 8, path_, ": not a safetensors file: ", file_size_,
              " bytes, shorter than the 8-byte header length");
  uint8_t len_bytes[8];
  read_range(0, 8, len_bytes);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | len_bytes[i];
  TORCH_CHECK(n >= 2 && n <= kStMaxHeaderBytes, path_, ": header length ", n, " outside [2, ",
              kStMaxHeaderBytes, "] (not a safetensors file, or corrupt)");
  TORCH_CHECK(n <= file_size_ - 8, path_, ": header length ", n, " exceeds the file (", file_size_,
              " bytes)");
  data_offset_ = 8 + n;
  std::string header(n, '\0');
  read_range(8, n, header.data());
  const json j = parse_header(path_, header);

  const uint64_t data_bytes = file_size_ - data_offset_;
  std::vector<DataRange> ranges;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (it.key() == "__metadata__") {
      read_metadata(path_, it.value(), metadata_);
      continue;
    }
    DataRange r{0, 0, tensors_.size()};
    StTensor t = parse_tensor_entry(path_, it.key(), it.value(), data_offset_, data_bytes, r);
    ranges.push_back(r);
    tensors_.push_back(std::move(t));
  }
  check_data_coverage(path_, ranges, tensors_, data_bytes);
  std::vector<StTensor> ordered;
  ordered.reserve(tensors_.size());
  for (const DataRange& r : ranges) ordered.push_back(std::move(tensors_[r.i]));
  tensors_ = std::move(ordered);
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

const StTensor& SafetensorsFile::at(const std::string& name) const {
  const StTensor* t = find(name);
  TORCH_CHECK(t != nullptr, path_, ": no tensor '", printable(name), "'");
  return *t;
}

at::Tensor SafetensorsFile::load(const StTensor& t) const {
  at::Tensor out = at::empty(t.shape, at::TensorOptions().dtype(st_storage_scalar_type(t.dtype)));
  TORCH_INTERNAL_ASSERT(static_cast<uint64_t>(out.nbytes()) == t.nbytes);
  if (t.dtype == StDtype::kBool) {
    at::Tensor raw = at::empty(t.shape, at::TensorOptions().dtype(at::kByte));
    read_range(t.offset, t.nbytes, raw.data_ptr());
    TORCH_CHECK(raw.numel() == 0 || raw.max().item<int64_t>() <= 1, path_, ": tensor '",
                printable(t.name), "': BOOL byte other than 0 or 1");
    return raw.to(at::kBool);
  }
  if (t.nbytes > 0) read_range(t.offset, t.nbytes, out.data_ptr());
  return out;
}

at::Tensor SafetensorsFile::load_rows(const StTensor& t, int64_t row0, int64_t n) const {
  TORCH_CHECK(!t.shape.empty() && row0 >= 0 && n >= 0 && row0 + n <= t.shape[0], path_,
              ": tensor '", printable(t.name), "': rows [", row0, ", ", row0 + n,
              ") outside its shape ", shape_text(t.shape));
  std::vector<int64_t> shape = t.shape;
  shape[0] = n;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(st_storage_scalar_type(t.dtype)));
  const uint64_t row_bytes = t.shape[0] ? t.nbytes / static_cast<uint64_t>(t.shape[0]) : 0;
  if (out.nbytes() > 0) {
    read_range(t.offset + static_cast<uint64_t>(row0) * row_bytes, out.nbytes(), out.data_ptr());
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsModel

SafetensorsModel::SafetensorsModel(const std::string& path) : path_(path) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    TORCH_CHECK(fs::is_regular_file(path, ec), path,
                ": not found (expected a folder with model.safetensors or "
                "model.safetensors.index.json, or a .safetensors file)");
    files_.push_back(std::make_unique<SafetensorsFile>(path));
  } else {
    const fs::path index_path = fs::path(path) / "model.safetensors.index.json";
    if (fs::exists(index_path, ec)) {
      json j;
      {
        std::ifstream in(index_path);
        TORCH_CHECK(in.good(), index_path.string(), ": cannot open");
        try {
          j = json::parse(in);
        } catch (const json::exception& e) {
          TORCH_CHECK(false, index_path.string(), ": not valid JSON: ", e.what());
        }
      }
      TORCH_CHECK(j.is_object() && j.contains("weight_map") && j["weight_map"].is_object(),
                  index_path.string(), ": missing weight_map object");
      std::map<std::string, size_t> shard_index;
      std::vector<std::pair<std::string, std::string>> wanted;
      for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
        TORCH_CHECK(it.value().is_string(), index_path.string(), ": weight_map entry '",
                    printable(it.key()), "' is not a file name");
        const std::string shard = it.value().get<std::string>();
        TORCH_CHECK(!shard.empty() && shard.find('/') == std::string::npos && shard != "." &&
                        shard != "..",
                    index_path.string(), ": weight_map entry '", printable(it.key()),
                    "' names '", printable(shard), "', not a file in the folder");
        if (!shard_index.count(shard)) {
          shard_index[shard] = files_.size();
          files_.push_back(
              std::make_unique<SafetensorsFile>((fs::path(path) / shard).string()));
        }
        wanted.emplace_back(it.key(), shard);
      }
      for (const auto& [name, shard] : wanted) {
        const SafetensorsFile& f = *files_[shard_index[shard]];
        TORCH_CHECK(f.find(name) != nullptr, index_path.string(), ": weight_map puts tensor '",
                    printable(name), "' in ", shard, ", which does not hold it");
      }
    } else {
      const fs::path single = fs::path(path) / "model.safetensors";
      TORCH_CHECK(fs::exists(single, ec), path,
                  ": no model.safetensors or model.safetensors.index.json in the folder");
      files_.push_back(std::make_unique<SafetensorsFile>(single.string()));
    }
  }
  for (const auto& f : files_) {
    for (const StTensor& t : f->tensors()) {
      auto [it, fresh] = index_.emplace(t.name, Ref{f.get(), &t});
      TORCH_CHECK(fresh, path_, ": tensor '", printable(t.name), "' is in both ",
                  it->second.file->path(), " and ", f->path());
    }
  }
}

std::optional<SafetensorsModel::Ref> SafetensorsModel::find(const std::string& name) const {
  auto it = index_.find(name);
  if (it == index_.end()) return std::nullopt;
  return it->second;
}

SafetensorsModel::Ref SafetensorsModel::at(const std::string& name) const {
  auto r = find(name);
  TORCH_CHECK(r.has_value(), path_, ": no tensor '", printable(name), "'");
  return *r;
}

std::vector<std::string> SafetensorsModel::names() const {
  std::vector<std::string> out;
  for (const auto& kv : index_) out.push_back(kv.first);
  std::sort(out.begin(), out.end());
  return out;
}

// ---------------------------------------------------------------------------------------------
// SafetensorsWriter

struct SafetensorsWriter::Impl {
  explicit Impl(const std::string& p) : file(p) {}
  AtomicFile file;
};

uint64_t SafetensorsWriter::tensor_bytes(const Decl& d) {
  uint64_t n = st_dtype_size(d.dtype);
  for (int64_t v : d.shape) {
    TORCH_CHECK(v >= 0 && !__builtin_mul_overflow(n, static_cast<uint64_t>(v), &n),
                "safetensors: tensor '", printable(d.name), "': invalid shape ",
                shape_text(d.shape));
  }
  return n;
}

SafetensorsWriter::SafetensorsWriter(std::string path, std::vector<Decl> tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(std::move(path)), decls_(std::move(tensors)) {
  json h = json::object();
  if (!metadata.empty()) h["__metadata__"] = metadata;
  uint64_t pos = 0;
  for (const Decl& d : decls_) {
    TORCH_CHECK(!d.name.empty() && d.name != "__metadata__", path_, ": invalid tensor name '",
                printable(d.name), "'");
    TORCH_CHECK(!h.contains(d.name), path_, ": tensor '", printable(d.name), "' declared twice");
    const uint64_t n = tensor_bytes(d);
    sizes_.push_back(n);
    h[d.name] = {{"dtype", st_dtype_name(d.dtype)}, {"shape", d.shape},
                 {"data_offsets", {pos, pos + n}}};
    pos += n;
  }
  std::string text = h.dump();
  while ((8 + text.size()) % 8 != 0) text.push_back(' ');  // data 8-byte aligned
  impl_ = std::make_unique<Impl>(path_);
  uint8_t len[8];
  uint64_t n = text.size();
  for (int i = 0; i < 8; ++i) len[i] = static_cast<uint8_t>(n >> (8 * i));
  impl_->file.write(len, 8);
  impl_->file.write(text.data(), text.size());
  left_ = decls_.empty() ? 0 : sizes_[0];
  advance();
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::advance() {
  while (left_ == 0 && current_ < decls_.size()) {
    ++current_;
    if (current_ < decls_.size()) left_ = sizes_[current_];
  }
}

void SafetensorsWriter::append(const void* data, size_t nbytes) {
  TORCH_CHECK(current_ < decls_.size() || nbytes == 0, path_, ": ", nbytes,
              " bytes appended after the last declared tensor");
  while (nbytes > 0) {
    const size_t take = static_cast<size_t>(std::min<uint64_t>(nbytes, left_));
    impl_->file.write(data, take);
    data = static_cast<const uint8_t*>(data) + take;
    nbytes -= take;
    left_ -= take;
    advance();
    TORCH_CHECK(nbytes == 0 || current_ < decls_.size(), path_, ": ", nbytes,
                " bytes appended after the last declared tensor");
  }
}

void SafetensorsWriter::append(const at::Tensor& chunk) {
  TORCH_CHECK(current_ < decls_.size(), path_, ": tensor data appended after the last tensor");
  const Decl& d = decls_[current_];
  TORCH_CHECK(chunk.defined() && chunk.device().is_cpu() &&
                  chunk.scalar_type() == st_storage_scalar_type(d.dtype),
              path_, ": tensor '", printable(d.name), "': append needs a CPU ",
              st_storage_scalar_type(d.dtype), " tensor");
  TORCH_CHECK(static_cast<uint64_t>(chunk.nbytes()) <= left_, path_, ": tensor '",
              printable(d.name), "': chunk of ", chunk.nbytes(), " bytes exceeds the ", left_,
              " bytes still owed");
  const at::Tensor c = chunk.contiguous();
  append(c.data_ptr(), c.nbytes());
}

void SafetensorsWriter::commit() {
  TORCH_CHECK(current_ >= decls_.size(), path_, ": tensor '",
              printable(decls_[std::min(current_, decls_.size() - 1)].name), "' still owes ",
              left_, " bytes");
  impl_->file.commit();
}

}  // namespace q4::io
