// Bounded reads: regular files up to a limit, every other kind of file refused by name before a
// byte is read (a FIFO without a writer must not block), lines cut at a limit.
#include "q4/io/bounded_read.h"

#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "q4/io/remove_tree.h"

namespace fs = std::filesystem;

namespace q4::io {
namespace {

std::string error_of(const std::string& path, size_t max_bytes) {
  try {
    read_regular_file(path, max_bytes, "config file");
  } catch (const c10::Error& e) {
    return e.what_without_backtrace();
  }
  return "";
}

TEST(BoundedRead, RegularFilesUpToTheLimit) {
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("q4_bounded_" + std::to_string(::getpid()));
  remove_tree(dir);
  fs::create_directories(dir);
  const std::string f = (dir / "a.yaml").string();
  std::ofstream(f) << "abc\n";
  EXPECT_EQ(read_regular_file(f, 4, "config file"), "abc\n");
  EXPECT_NE(error_of(f, 3).find("config file " + f + " has 4 bytes; the limit is 3 bytes"),
            std::string::npos)
      << error_of(f, 3);
  EXPECT_NE(error_of((dir / "none").string(), 9).find(": no such file"), std::string::npos);
  EXPECT_NE(error_of(dir.string(), 9).find("is a directory; expected a regular file"),
            std::string::npos);
  const std::string fifo = (dir / "p").string();
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  EXPECT_NE(error_of(fifo, 9).find("is a FIFO (named pipe)"), std::string::npos);
  EXPECT_NE(error_of("/dev/zero", 9).find("is a character device"), std::string::npos);
  // check_regular_file: the same verdicts from stat alone.
  EXPECT_NO_THROW(check_regular_file(f, 4, "tokenizer"));
  EXPECT_THROW(check_regular_file(f, 3, "tokenizer"), c10::Error);
  EXPECT_THROW(check_regular_file(fifo, 9, "tokenizer"), c10::Error);
  EXPECT_THROW(check_regular_file("/dev/zero", 9, "tokenizer"), c10::Error);
  remove_tree(dir);
}

TEST(BoundedRead, LinesStopAtTheLimit) {
  std::istringstream in("ab\nabcdef\nxyz");
  std::string line;
  EXPECT_EQ(read_line_bounded(in, line, 4), LineRead::kLine);
  EXPECT_EQ(line, "ab");
  EXPECT_EQ(read_line_bounded(in, line, 4), LineRead::kTooLong);
  EXPECT_EQ(line, "abcd");
  std::istringstream rest("xyz");
  EXPECT_EQ(read_line_bounded(rest, line, 4), LineRead::kLine);
  EXPECT_EQ(line, "xyz");
  EXPECT_EQ(read_line_bounded(rest, line, 4), LineRead::kEof);
  EXPECT_EQ(format_byte_limit(size_t{16} << 20), "16 MiB");
  EXPECT_EQ(format_byte_limit(1024), "1 KiB");
}

}  // namespace
}  // namespace q4::io
