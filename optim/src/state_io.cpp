// PackedAdamW state file. Little-endian, no padding:
//   "Q4ADAMW\0", u32 version (3), u32 state_mode, u32 rounding, u32 0, u64 seed,
//   i64 small_tensor_threshold, f64 lr, beta1, beta2, eps, weight_decay (informational),
//   i64 step, skipped_total, consecutive_nonfinite, u32 num_params, then per parameter:
//   u32 name_len, name, u32 ndim, i64 dim[ndim], u8 master dtype (.dat code 5/6/15), u8 mode,
//   u8 weight_decay, u8 has_master, blobs (u64 nbytes + raw bytes): m, v (fp32 mode) or
//   m codes, m scales, v codes, v scales (packed), then the master if has_master; "Q4ADEND\0".
// Written to a temp file, fsync'ed and renamed; load() validates every header before changing
// any state.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "optim_state.h"
#include "q4/io/atomic_file.h"
#include "q4/optim/adamw.h"

namespace q4::optim {
namespace {

constexpr char kMagic[8] = {'Q', '4', 'A', 'D', 'A', 'M', 'W', '\0'};
constexpr char kEnd[8] = {'Q', '4', 'A', 'D', 'E', 'N', 'D', '\0'};
// Version 2: the 4-bit v codes index the sqrt-domain map (k/16)^2 (version 1: k/16).
// Version 3: 4-bit m code 0 decodes to -1 (was -0.8875, torchao's map). The byte layout never
// changed; files whose codes would decode differently are refused (versions 1-2 of a 4bit state),
// version-2 files of the other modes mean the same and are read.
constexpr uint32_t kVersion = 3;
constexpr int64_t kStageBytes = int64_t{64} << 20;  // device -> host staging per write/read

uint8_t dtype_code(at::ScalarType t) {
  switch (t) {
    case at::kHalf:
      return 5;
    case at::kFloat:
      return 6;
    case at::kBFloat16:
      return 15;
    default:
      TORCH_INTERNAL_ASSERT(false, "unexpected master dtype");
  }
}

std::string dtype_name(uint8_t code) {
  switch (code) {
    case 5:
      return "fp16";
    case 6:
      return "fp32";
    case 15:
      return "bf16";
    default:
      return "code " + std::to_string(code);
  }
}

// The tensors of one parameter in file order.
std::vector<at::Tensor> blobs_of(const detail::ParamState& p) {
  if (p.info.mode == StateMode::kFp32) return {p.m32, p.v32};
  return {p.m.codes, p.m.scales, p.v.codes, p.v.scales};
}

int64_t nbytes_of(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// Serializes into one AtomicFile (checked writes, fsync, rename; removed on failure).
class Writer {
 public:
  explicit Writer(const std::string& path) : file_(path) {}
  void raw(const void* data, int64_t n) { file_.write(data, static_cast<size_t>(n)); }
  template <typename T>
  void pod(T v) {
    raw(&v, sizeof(T));
  }
  void tensor(const at::Tensor& t) {
    const int64_t n = nbytes_of(t);
    pod<uint64_t>(static_cast<uint64_t>(n));
    const at::Tensor bytes = t.contiguous().view({-1}).view(at::kByte);
    if (bytes.is_cpu()) {
      raw(bytes.data_ptr(), n);
      return;
    }
    for (int64_t off = 0; off < n; off += kStageBytes) {
      const at::Tensor host = bytes.narrow(0, off, std::min(kStageBytes, n - off)).cpu();
      raw(host.data_ptr(), host.numel());
    }
  }
  void commit() { file_.commit(); }

 private:
  q4::io::AtomicFile file_;
};

class Reader {
 public:
  explicit Reader(std::string path) : path_(std::move(path)) {
    f_ = std::fopen(path_.c_str(), "rb");
    TORCH_CHECK(f_ != nullptr, "PackedAdamW::load: cannot open '", path_,
                "': ", std::strerror(errno));
  }
  ~Reader() {
    if (f_) std::fclose(f_);
  }
  void raw(void* data, int64_t n, const std::string& what) {
    TORCH_CHECK(std::fread(data, 1, static_cast<size_t>(n), f_) == static_cast<size_t>(n),
                "PackedAdamW::load: '", path_, "' is truncated while reading ", what);
  }
  template <typename T>
  T pod(const std::string& what) {
    T v;
    raw(&v, sizeof(T), what);
    return v;
  }
  int64_t tell() const { return static_cast<int64_t>(::ftello(f_)); }
  void seek(int64_t off) {
    TORCH_CHECK(::fseeko(f_, static_cast<off_t>(off), SEEK_SET) == 0,
                "PackedAdamW::load: seek in '", path_, "' failed");
  }
  int64_t size() {
    const int64_t here = tell();
    ::fseeko(f_, 0, SEEK_END);
    const int64_t s = tell();
    seek(here);
    return s;
  }
  // Reads n bytes into t (contiguous, any device).
  void into(const at::Tensor& t, int64_t n, const std::string& what) {
    const at::Tensor bytes = t.view({-1}).view(at::kByte);
    if (bytes.is_cpu()) {
      raw(bytes.data_ptr(), n, what);
      return;
    }
    for (int64_t off = 0; off < n; off += kStageBytes) {
      const int64_t len = std::min(kStageBytes, n - off);
      at::Tensor host = at::empty({len}, at::kByte);
      raw(host.data_ptr(), len, what);
      bytes.narrow(0, off, len).copy_(host);
    }
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::FILE* f_ = nullptr;
};

}  // namespace

void PackedAdamW::save(const std::string& path, bool include_masters) const {
  const Impl& d = *impl_;
  const AdamWOptions& o = d.opt;
  detail::wait_for_host_moments(d.ps);
  {
    Writer w(path);
    w.raw(kMagic, 8);
    w.pod<uint32_t>(kVersion);
    w.pod<uint32_t>(static_cast<uint32_t>(o.state_mode));
    w.pod<uint32_t>(static_cast<uint32_t>(o.rounding));
    w.pod<uint32_t>(0);
    w.pod<uint64_t>(o.seed);
    w.pod<int64_t>(o.small_tensor_threshold);
    for (double v : {o.lr, o.beta1, o.beta2, o.eps, o.weight_decay}) w.pod<double>(v);
    w.pod<int64_t>(d.step);
    w.pod<int64_t>(d.skipped);
    w.pod<int64_t>(d.consecutive);
    w.pod<uint32_t>(static_cast<uint32_t>(d.ps.size()));
    for (const auto& p : d.ps) {
      w.pod<uint32_t>(static_cast<uint32_t>(p.info.name.size()));
      w.raw(p.info.name.data(), static_cast<int64_t>(p.info.name.size()));
      w.pod<uint32_t>(static_cast<uint32_t>(p.info.shape.size()));
      for (int64_t s : p.info.shape) w.pod<int64_t>(s);
      w.pod<uint8_t>(dtype_code(p.info.master_dtype));
      w.pod<uint8_t>(static_cast<uint8_t>(p.info.mode));
      w.pod<uint8_t>(p.info.weight_decay ? 1 : 0);
      w.pod<uint8_t>(include_masters ? 1 : 0);
      for (const at::Tensor& t : blobs_of(p)) w.tensor(t);
      if (include_masters) w.tensor(p.host_flat());
    }
    w.raw(kEnd, 8);
    w.commit();
  }
}

namespace {

// One parameter's record in a state file: its header and where its blobs are.
struct Entry {
  std::string name;
  std::vector<int64_t> shape;
  uint8_t dtype = 0, mode = 0, weight_decay = 0;
  bool has_master = false;
  std::vector<std::pair<int64_t, int64_t>> blobs;  // (offset, nbytes) in file order
};

// A state file's header fields and parameter records, every size checked against the file.
struct FileIndex {
  int64_t step = 0, skipped = 0, consecutive = 0;
  std::vector<Entry> entries;
};

// Number of blobs a parameter record has before its master: fp32 mode m, v; packed modes m
// codes, m scales, v codes, v scales.
size_t moment_blob_count(uint8_t mode) { return mode == 0 ? 2 : 4; }

FileIndex index_file(Reader& r, const AdamWOptions& o) {
  const std::string& f = r.path();
  const int64_t file_size = r.size();
  char magic[8];
  r.raw(magic, 8, "the magic number");
  TORCH_CHECK(std::memcmp(magic, kMagic, 8) == 0, "PackedAdamW::load: '", f,
              "' is not a q4 optimizer state file (bad magic)");
  const auto version = r.pod<uint32_t>("the version");
  TORCH_CHECK(version == kVersion || version == 2, "PackedAdamW::load: '", f,
              "' has format version ", version, ", this build reads versions 2 and ", kVersion);
  const auto mode = r.pod<uint32_t>("the state mode");
  TORCH_CHECK(mode <= 3, "PackedAdamW::load: '", f, "': invalid state mode ", mode);
  TORCH_CHECK(version == kVersion || static_cast<StateMode>(mode) != StateMode::k4Bit,
              "PackedAdamW::load: '", f, "' is a version-", version,
              " 4bit state: its first-moment codes used the previous 4-bit map (code 0 = -0.8875, "
              "now -1) and cannot be resumed exactly; restart the optimizer state");
  TORCH_CHECK(static_cast<StateMode>(mode) == o.state_mode, "PackedAdamW::load: '", f,
              "' was written with AdamWOptions.state_mode = ", to_string(static_cast<StateMode>(mode)),
              " but this optimizer uses ", to_string(o.state_mode));
  r.pod<uint32_t>("the rounding mode");  // a rounding change is allowed on resume
  r.pod<uint32_t>("a reserved field");
  const auto seed = r.pod<uint64_t>("the seed");
  TORCH_CHECK(seed == o.seed, "PackedAdamW::load: '", f, "' was written with AdamWOptions.seed = ", seed,
              " but this optimizer uses ", o.seed, " (stochastic rounding would not continue)");
  const auto threshold = r.pod<int64_t>("small_tensor_threshold");
  TORCH_CHECK(threshold == o.small_tensor_threshold, "PackedAdamW::load: '", f,
              "' was written with AdamWOptions.small_tensor_threshold = ", threshold,
              ", this optimizer uses ", o.small_tensor_threshold);
  for (int i = 0; i < 5; ++i) r.pod<double>("the hyper-parameters");
  FileIndex idx;
  idx.step = r.pod<int64_t>("the step count");
  idx.skipped = r.pod<int64_t>("the skipped count");
  idx.consecutive = r.pod<int64_t>("the consecutive non-finite count");
  TORCH_CHECK(idx.step >= 0 && idx.skipped >= 0 && idx.consecutive >= 0, "PackedAdamW::load: '",
              f, "': negative counters");
  const auto count = r.pod<uint32_t>("the parameter count");
  TORCH_CHECK(count < (1u << 24), "PackedAdamW::load: '", f, "' has an implausible parameter count ",
              count);
  for (uint32_t i = 0; i < count; ++i) {
    Entry e;
    const std::string where = "parameter " + std::to_string(i);
    const auto name_len = r.pod<uint32_t>(where + " name length");
    TORCH_CHECK(name_len < (1u << 20), "PackedAdamW::load: '", f, "': ", where,
                " has an implausible name length ", name_len);
    e.name.assign(name_len, '\0');
    r.raw(e.name.data(), name_len, where + " name");
    const std::string wp = "parameter '" + e.name + "'";
    const auto ndim = r.pod<uint32_t>(wp + " ndim");
    TORCH_CHECK(ndim <= 16, "PackedAdamW::load: '", f, "': ", wp, " has ndim ", ndim);
    e.shape.resize(ndim);
    for (auto& s : e.shape) s = r.pod<int64_t>(wp + " shape");
    e.dtype = r.pod<uint8_t>(wp + " dtype");
    e.mode = r.pod<uint8_t>(wp + " mode");
    TORCH_CHECK(e.mode <= 3, "PackedAdamW::load: '", f, "': ", wp, " has an invalid mode ",
                static_cast<int>(e.mode));
    e.weight_decay = r.pod<uint8_t>(wp + " weight_decay flag");
    e.has_master = r.pod<uint8_t>(wp + " has_master flag") != 0;
    const size_t nblobs = moment_blob_count(e.mode) + (e.has_master ? 1 : 0);
    for (size_t b = 0; b < nblobs; ++b) {
      const auto nbytes = static_cast<int64_t>(r.pod<uint64_t>(wp + " blob size"));
      const int64_t off = r.tell();
      TORCH_CHECK(nbytes >= 0 && off + nbytes <= file_size, "PackedAdamW::load: '", f,
                  "' is truncated in ", wp);
      e.blobs.emplace_back(off, nbytes);
      r.seek(off + nbytes);
    }
    idx.entries.push_back(std::move(e));
  }
  char end[8];
  r.raw(end, 8, "the end marker");
  TORCH_CHECK(std::memcmp(end, kEnd, 8) == 0 && r.tell() == file_size, "PackedAdamW::load: '", f,
              "' has a bad end marker or trailing bytes (corrupt file)");
  return idx;
}

// Checks a file's record against the registered parameter it is loaded into.
void check_entry(const std::string& f, const Entry& e, const detail::ParamState& p) {
  const std::string wp = "parameter '" + e.name + "'";
  TORCH_CHECK(e.shape == p.info.shape, "PackedAdamW::load: '", f, "': ", wp, " has shape ",
              c10::IntArrayRef(e.shape), ", the registered master has ",
              c10::IntArrayRef(p.info.shape));
  TORCH_CHECK(e.dtype == dtype_code(p.info.master_dtype), "PackedAdamW::load: '", f, "': ", wp,
              " master dtype is ", dtype_name(e.dtype), ", the registered master is ",
              dtype_name(dtype_code(p.info.master_dtype)));
  TORCH_CHECK(e.mode == static_cast<uint8_t>(p.info.mode), "PackedAdamW::load: '", f, "': ", wp,
              " moments are stored as mode ", static_cast<int>(e.mode), ", expected ",
              to_string(p.info.mode));
  TORCH_CHECK(e.weight_decay == (p.info.weight_decay ? 1 : 0), "PackedAdamW::load: '", f, "': ",
              wp, " weight_decay flag is ", static_cast<int>(e.weight_decay), ", registered ",
              p.info.weight_decay);
  std::vector<at::Tensor> expect = blobs_of(p);
  if (e.has_master) expect.push_back(p.host_flat());
  for (size_t b = 0; b < expect.size(); ++b) {
    TORCH_CHECK(e.blobs[b].second == nbytes_of(expect[b]), "PackedAdamW::load: '", f, "': ", wp,
                " blob ", b, " has ", e.blobs[b].second, " bytes, expected ",
                nbytes_of(expect[b]));
  }
}

}  // namespace

void PackedAdamW::load(const std::string& path, bool restore_masters) {
  load_files(*impl_, {path}, restore_masters, /*strict=*/true);
}

void PackedAdamW::load_shards(const std::vector<std::string>& paths, bool restore_masters) {
  load_files(*impl_, paths, restore_masters, /*strict=*/false);
}

// strict: every parameter of the files must be registered (a one-file load of this optimizer's
// own state).
void PackedAdamW::load_files(Impl& d, const std::vector<std::string>& paths,
                             bool restore_masters, bool strict) {
  TORCH_CHECK(!paths.empty(), "PackedAdamW::load: no state file given");
  detail::wait_for_host_moments(d.ps);
  // Pass 1: index every file and match its records to the registered parameters by name,
  // validating everything before any state changes.
  std::vector<std::unique_ptr<Reader>> readers;
  std::vector<FileIndex> files;
  for (const auto& path : paths) {
    readers.push_back(std::make_unique<Reader>(path));
    files.push_back(index_file(*readers.back(), d.opt));
  }
  for (size_t k = 1; k < files.size(); ++k) {
    TORCH_CHECK(files[k].step == files[0].step && files[k].skipped == files[0].skipped &&
                    files[k].consecutive == files[0].consecutive,
                "PackedAdamW::load: '", paths[k], "' is at optimizer step ", files[k].step,
                " but '", paths[0], "' is at step ", files[0].step,
                " (shards of different checkpoints)");
  }
  std::unordered_map<std::string, size_t> registered;
  for (size_t i = 0; i < d.ps.size(); ++i) registered[d.ps[i].info.name] = i;
  struct Source {
    size_t file = 0;
    const Entry* entry = nullptr;
  };
  std::vector<Source> source(d.ps.size());
  for (size_t k = 0; k < files.size(); ++k) {
    for (const Entry& e : files[k].entries) {
      const auto it = registered.find(e.name);
      if (it == registered.end()) {
        TORCH_CHECK(!strict, "PackedAdamW::load: '", paths[k], "' holds parameter '",
                    e.name, "', which this optimizer does not have");
        continue;
      }
      TORCH_CHECK(source[it->second].entry == nullptr, "PackedAdamW::load: parameter '", e.name,
                  "' is in both '", paths[source[it->second].file], "' and '", paths[k], "'");
      check_entry(paths[k], e, d.ps[it->second]);
      source[it->second] = {k, &e};
    }
  }
  for (size_t i = 0; i < d.ps.size(); ++i) {
    TORCH_CHECK(source[i].entry != nullptr, "PackedAdamW::load: parameter '", d.ps[i].info.name,
                "' is in none of the state files (", paths.size() == 1 ? paths[0] : "the shards",
                ")");
  }

  // Pass 2: read the blobs into place.
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < d.ps.size(); ++i) {
    detail::ParamState& p = d.ps[i];
    const Entry& e = *source[i].entry;
    Reader& r = *readers[source[i].file];
    std::vector<at::Tensor> dst = blobs_of(p);
    if (e.has_master && restore_masters) dst.push_back(p.host_flat());
    for (size_t b = 0; b < dst.size(); ++b) {
      r.seek(e.blobs[b].first);
      r.into(dst[b], e.blobs[b].second, "parameter '" + p.info.name + "'");
    }
  }
  d.step = files[0].step;
  d.skipped = files[0].skipped;
  d.consecutive = files[0].consecutive;
  d.frozen = true;
}

}  // namespace q4::optim
