// Durable file output. AtomicFile is the single way a q4 file is published: bytes go to
// `<path>.tmp.<pid>.<n>` in the same directory, commit() fsyncs, closes, renames onto `path` and
// fsyncs the directory, checking every step (short writes and EINTR are retried; ENOSPC, EIO and
// a failed fsync/close throw naming the file). A writer destroyed or aborted before commit()
// removes its temp file, so a failed write leaves `path` as it was and nothing behind; only a
// kill -9 can leave a temp file, which the next AtomicFile of the same path deletes (as
// remove_stale_temp_files() does for a whole run directory at the next start).
// AppendFile is the checked counterpart for logs that grow line by line (metrics.jsonl).
// AtomicFile refuses a target that exists and is not a regular file (a device, FIFO, socket,
// directory, or a symbolic link to one): renaming over /dev/null as root would replace the
// device node. AppendFile, which never replaces its target, refuses FIFOs, sockets and
// directories and appends into a device.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace q4::io {

class AtomicFile {
 public:
  // Creates the temp file (O_EXCL) after removing the temp files of `path` whose writer is dead
  // (not this process's); throws on failure and when `path` exists as anything but a regular
  // file (see non_regular_kind).
  explicit AtomicFile(std::string path);
  ~AtomicFile();  // abort() unless committed
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;

  void write(const void* data, size_t nbytes);  // all bytes or throws (the file is then failed)
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }
  void commit();          // fsync + close + rename + directory fsync; throws, after abort()
  void abort() noexcept;  // closes and unlinks the temp file; `path` is untouched

  const std::string& path() const { return path_; }
  const std::string& tmp_path() const { return tmp_path_; }
  int fd() const { return fd_; }  // the temp file's descriptor (e.g. for copy_file_range); -1 after
  bool committed() const { return committed_; }
  bool failed() const { return failed_; }

 private:
  std::string path_;
  std::string tmp_path_;
  int fd_ = -1;
  bool committed_ = false;
  bool failed_ = false;
};

// What `path` is when it exists and is not a regular file ("a character device", "a FIFO",
// "a socket", "a directory", "a block device", "a symbolic link to a FIFO", ...); "" when it does
// not exist, is a regular file, or is a symbolic link to a regular file or to nothing. Outputs
// are replaced only when this is "".
std::string non_regular_kind(const std::string& path);

// The whole of `bytes` as `path`, atomically (AtomicFile).
void write_file_atomic(const std::string& path, const std::string& bytes);

// fsync of a directory (makes renames and creations in it durable); throws naming it.
void fsync_directory(const std::string& dir);

// True for the names AtomicFile (and older q4 writers) give temp files:
// "<name>.tmp.<pid>" or "<name>.tmp.<pid>.<n>".
bool is_temp_file_name(const std::string& file_name);

// Deletes the temp files directly in `dir` whose writer is dead (`<name>.tmp.<pid>[.<n>]` with no
// live process <pid>, or the current process's own pid). `only_for`: when not empty, only temps
// of that file name ("model.dat" -> "model.dat.tmp.*"). Returns the removed paths.
std::vector<std::string> remove_stale_temp_files(const std::string& dir,
                                                 const std::string& only_for = "");

// Append-only text file with checked writes: every write() is complete and flushed to the kernel
// or throws naming the file (a full disk is an error, never a silently cut line).
class AppendFile {
 public:
  AppendFile() = default;
  ~AppendFile();
  AppendFile(const AppendFile&) = delete;
  AppendFile& operator=(const AppendFile&) = delete;

  // Throws when it cannot be opened or is a FIFO, socket or directory (non_regular_kind).
  void open(const std::string& path, bool truncate);
  void write(const std::string& bytes);
  void sync();   // fsync; throws on failure
  void close();  // checked close
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace q4::io
