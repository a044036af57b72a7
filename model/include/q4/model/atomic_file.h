// Atomic file publication for files the model library writes besides .dat (safetensors shards,
// JSON): bytes go to `<path>.tmp.<pid>.<n>` in the same directory; commit() flushes, fsyncs,
// renames onto `path` and fsyncs the directory. Destruction without commit() removes the temp
// file, so a crash or an error never leaves a half-written `path`.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace q4::model {

class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t nbytes);  // buffered; errors name the temp file
  void commit();
  const std::string& path() const { return path_; }
  uint64_t bytes_written() const { return bytes_; }

 private:
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  bool committed_ = false;
  uint64_t bytes_ = 0;
  std::vector<uint8_t> buf_;
  void flush();
  void abort() noexcept;
};

// Whole small file (JSON, text) written atomically.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace q4::model
