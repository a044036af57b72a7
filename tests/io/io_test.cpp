// q4_io: CRC32C against published test vectors, AtomicFile (publish, abort, failed writes leave
// the target and no temp file), stale-temp cleanup (at start and at the next write of a path),
// the output-path rule (output_path.h) and AppendFile on a full device.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "q4/io/atomic_file.h"
#include "q4/io/crc32c.h"
#include "q4/io/output_path.h"
#include "q4/io/remove_tree.h"

namespace fs = std::filesystem;

namespace q4::io {
namespace {

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

fs::path fresh_dir(const std::string& name) {
  const fs::path d =
      fs::path(::testing::TempDir()) / ("q4io_" + name + "_" + std::to_string(::getpid()));
  q4::io::remove_tree(d);
  fs::create_directories(d);
  return d;
}

std::vector<std::string> names_in(const fs::path& d) {
  std::vector<std::string> v;
  for (const auto& e : fs::directory_iterator(d)) v.push_back(e.path().filename().string());
  std::sort(v.begin(), v.end());
  return v;
}

// RFC 3720 appendix B.4 and the "check" value of the CRC catalogue (CRC-32/ISCSI).
TEST(RemoveTree, RemovesTreesWithoutFollowingLinks) {
  // remove_tree replaces std::filesystem::remove_all, which crashes when LibTorch 2.x is loaded
  // (remove_tree.h). A tree with nested directories, files, a link to a directory outside the
  // tree (removed, its target kept), a dangling link and an empty directory; a single file; a
  // missing path (0, no error); a path below a regular file (an error naming it, both overloads).
  const fs::path base = fresh_dir("rmtree");
  const fs::path outside = base / "outside";
  fs::create_directories(outside);
  std::ofstream(outside / "keep.txt") << "keep";
  const fs::path tree = base / "tree";
  fs::create_directories(tree / "a" / "b" / "c");
  fs::create_directories(tree / "empty");
  std::ofstream(tree / "top.txt") << "1";
  std::ofstream(tree / "a" / "x.bin") << "2";
  std::ofstream(tree / "a" / "b" / "c" / "deep.txt") << "3";
  fs::create_directory_symlink(outside, tree / "a" / "link_to_outside");
  fs::create_symlink(tree / "nowhere", tree / "dangling");
  // tree, a, b, c, empty, top.txt, x.bin, deep.txt, the two links: 10 entries
  EXPECT_EQ(remove_tree(tree), 10u);
  EXPECT_FALSE(fs::exists(fs::symlink_status(tree)));
  EXPECT_TRUE(fs::exists(outside / "keep.txt"));

  std::ofstream(base / "file.txt") << "f";
  EXPECT_EQ(remove_tree(base / "file.txt"), 1u);
  EXPECT_FALSE(fs::exists(base / "file.txt"));

  std::error_code ec;
  EXPECT_EQ(remove_tree(base / "missing", ec), 0u);
  EXPECT_FALSE(ec);
  EXPECT_EQ(remove_tree(base / "missing"), 0u);

  std::ofstream(base / "plain") << "p";
  EXPECT_EQ(remove_tree(base / "plain" / "child", ec), 0u);
  EXPECT_EQ(ec, std::errc::not_a_directory);
  try {
    remove_tree(base / "plain" / "child");
    FAIL() << "expected an exception";
  } catch (const fs::filesystem_error& e) {
    EXPECT_NE(std::string(e.what()).find("plain/child"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::exists(base / "plain"));
  remove_tree(base);
  EXPECT_FALSE(fs::exists(base));
}

TEST(Crc32c, PublishedVectors) {
  EXPECT_EQ(crc32c("123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c("", 0), 0u);
  std::vector<uint8_t> zeros(32, 0), ones(32, 0xFF), inc(32), dec(32);
  for (int i = 0; i < 32; ++i) {
    inc[i] = static_cast<uint8_t>(i);
    dec[i] = static_cast<uint8_t>(31 - i);
  }
  EXPECT_EQ(crc32c(zeros.data(), 32), 0x8A9136AAu);
  EXPECT_EQ(crc32c(ones.data(), 32), 0x62A8AB43u);
  EXPECT_EQ(crc32c(inc.data(), 32), 0x46DD794Eu);
  EXPECT_EQ(crc32c(dec.data(), 32), 0x113FDB5Cu);
  // Incremental = whole, at every split (exercises the 8-byte and the byte loop).
  const std::string s = "The quick brown fox jumps over the lazy dog, twice over.";
  const uint32_t whole = crc32c(s.data(), s.size());
  for (size_t k = 0; k <= s.size(); ++k) {
    EXPECT_EQ(crc32c(s.data() + k, s.size() - k, crc32c(s.data(), k)), whole) << k;
  }
  const fs::path d = fresh_dir("crc");
  std::ofstream(d / "f", std::ios::binary) << s;
  EXPECT_EQ(crc32c_file((d / "f").string()), whole);
  q4::io::remove_tree(d);
}

TEST(AtomicFile, PublishesOnCommitOnly) {
  const fs::path d = fresh_dir("atomic");
  const std::string target = (d / "out.bin").string();
  write_file_atomic(target, "old");
  {
    AtomicFile f(target);
    f.write("new contents");
    EXPECT_EQ(read_text(target), "old");  // not yet
    EXPECT_TRUE(fs::exists(f.tmp_path()));
  }  // destroyed without commit
  EXPECT_EQ(read_text(target), "old");
  EXPECT_EQ(names_in(d), std::vector<std::string>{"out.bin"});
  AtomicFile g(target);
  g.write("new");
  g.commit();
  EXPECT_EQ(read_text(target), "new");
  EXPECT_EQ(names_in(d), std::vector<std::string>{"out.bin"});
  EXPECT_THROW(g.write("x"), c10::Error);
  q4::io::remove_tree(d);
}

// A write that fails midway (file size limit: EFBIG, as a full disk gives ENOSPC) throws, and
// the target and directory are as before. Run in a child so the limit stays there.
// Outputs replace regular files only: a FIFO, a directory, a symbolic link to a FIFO or to a
// character device (/dev/null: as root, a rename would replace the device node) are refused before
// a temp file exists; AppendFile refuses the FIFO and the directory (it appends into a device,
// never over it). A link to a regular file is replaced.
TEST(AtomicFile, RefusesNonRegularTargets) {
  const fs::path d = fresh_dir("nonregular");
  ASSERT_EQ(::mkfifo((d / "fifo").c_str(), 0644), 0);
  fs::create_directories(d / "dir");
  fs::create_symlink("/dev/null", d / "devnull");
  fs::create_symlink(d / "fifo", d / "to_fifo");
  EXPECT_EQ(non_regular_kind((d / "fifo").string()), "a FIFO");
  EXPECT_EQ(non_regular_kind((d / "devnull").string()), "a symbolic link to a character device");
  EXPECT_EQ(non_regular_kind((d / "absent").string()), "");
  for (const char* name : {"fifo", "dir", "devnull", "to_fifo"}) {
    const std::string p = (d / name).string();
    EXPECT_THROW({ AtomicFile f(p); }, c10::Error) << name;
    EXPECT_THROW(write_file_atomic(p, "x"), c10::Error) << name;
    AppendFile a;
    if (std::string(name) != "devnull") {
      EXPECT_THROW(a.open(p, /*truncate=*/false), c10::Error) << name;
    }
  }
  try {
    write_file_atomic((d / "devnull").string(), "x");
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what_without_backtrace()).find("symbolic link to a character device"),
              std::string::npos)
        << e.what_without_backtrace();
  }
  EXPECT_TRUE(fs::is_symlink(d / "devnull"));
  EXPECT_TRUE(fs::is_fifo(d / "fifo"));
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(d)) names.push_back(e.path().filename().string());
  EXPECT_EQ(names.size(), 4u) << "a temp file was left behind";
  // A regular file, and a link to one, are replaced as before.
  write_file_atomic((d / "plain").string(), "old");
  fs::create_symlink(d / "plain", d / "to_plain");
  write_file_atomic((d / "to_plain").string(), "new");
  EXPECT_EQ(read_text(d / "to_plain"), "new");
  EXPECT_EQ(read_text(d / "plain"), "old");
}

TEST(AtomicFile, FailedWriteLeavesNothing) {
  const fs::path d = fresh_dir("efbig");
  const std::string target = (d / "big.dat").string();
  write_file_atomic(target, "previous");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    std::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{4096, 4096};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    int code = 1;
    try {
      AtomicFile f(target);
      const std::string chunk(3000, 'x');
      f.write(chunk);
      f.write(chunk);  // passes the limit
      f.commit();
    } catch (const c10::Error& e) {
      code = std::string(e.what()).find("write failed") != std::string::npos ? 0 : 2;
    }
    ::_exit(code);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0);
  EXPECT_EQ(read_text(target), "previous");
  EXPECT_EQ(names_in(d), std::vector<std::string>{"big.dat"});
  q4::io::remove_tree(d);
}

TEST(AtomicFile, StaleTempCleanup) {
  const fs::path d = fresh_dir("stale");
  EXPECT_TRUE(is_temp_file_name("model.dat.tmp.123.4"));
  EXPECT_TRUE(is_temp_file_name("state.json.tmp.99"));
  EXPECT_FALSE(is_temp_file_name("model.dat"));
  EXPECT_FALSE(is_temp_file_name("notes.tmp.txt"));
  EXPECT_FALSE(is_temp_file_name(".tmp.1"));
  // pid 999999999 does not exist; our parent (the shell or ctest) is alive.
  for (const std::string n : {"model.dat.tmp.999999999.0", "optim.state.tmp.999999999", "keep.txt",
                              "other.dat.tmp.999999999.1"}) {
    std::ofstream(d / n) << "x";
  }
  const std::string live = "model.dat.tmp." + std::to_string(::getppid()) + ".0";
  std::ofstream(d / live) << "x";
  auto removed = remove_stale_temp_files(d.string(), "model.dat");
  EXPECT_EQ(removed.size(), 1u);
  EXPECT_FALSE(fs::exists(d / "model.dat.tmp.999999999.0"));
  EXPECT_TRUE(fs::exists(d / "other.dat.tmp.999999999.1"));
  removed = remove_stale_temp_files(d.string());
  EXPECT_EQ(removed.size(), 2u);
  EXPECT_EQ(names_in(d), (std::vector<std::string>{"keep.txt", live}));
  q4::io::remove_tree(d);
}

// A writer killed before commit() left `<path>.tmp.<pid>.<n>`; the next write of that path removes
// it (never another path's, a live process's, or this process's own).
TEST(AtomicFile, NextWriteOfAPathRemovesItsDeadWritersTemps) {
  const fs::path d = fresh_dir("next_write");
  const std::string own = "model.dat.tmp." + std::to_string(::getpid()) + ".77";
  const std::string live = "model.dat.tmp." + std::to_string(::getppid()) + ".0";
  for (const std::string n :
       {std::string("model.dat.tmp.999999999.0"), std::string("model.dat.tmp.999999998"),
        std::string("other.dat.tmp.999999999.1"), own, live}) {
    std::ofstream(d / n) << "x";
  }
  write_file_atomic((d / "model.dat").string(), "new");
  EXPECT_EQ(read_text(d / "model.dat"), "new");
  auto want = std::vector<std::string>{"model.dat", own, live, "other.dat.tmp.999999999.1"};
  std::sort(want.begin(), want.end());
  EXPECT_EQ(names_in(d), want);
  q4::io::remove_tree(d);
}

// Outputs are compared with inputs resolved: the same path, a symbolic link, a hard link, a
// folder holding the input, a file inside an input folder; apart otherwise.
TEST(OutputPath, RelationToAnInput) {
  const fs::path d = fresh_dir("relation");
  fs::create_directories(d / "model-hf");
  std::ofstream(d / "model-hf" / "config.json") << "{}";
  std::ofstream(d / "data.tsv") << "a\tb\n";
  fs::create_symlink(d / "data.tsv", d / "link.tsv");
  fs::create_hard_link(d / "data.tsv", d / "hard.tsv");
  const std::string data = (d / "data.tsv").string(), hf = (d / "model-hf").string();
  EXPECT_EQ(output_input_relation(data, data), "is");
  EXPECT_EQ(output_input_relation((d / "." / "data.tsv").string(), data), "is");
  EXPECT_EQ(output_input_relation((d / "link.tsv").string(), data), "is");
  EXPECT_EQ(output_input_relation((d / "hard.tsv").string(), data), "is");
  EXPECT_EQ(output_input_relation(d.string(), data), "holds");
  EXPECT_EQ(output_input_relation((d / "model-hf" / "x.dat").string(), hf), "lies inside");
  EXPECT_EQ(output_input_relation((d / "model.dat").string(), data), "");
  EXPECT_EQ(output_input_relation((d / "model-hf2").string(), hf), "");
  EXPECT_EQ(output_input_relation("", data), "");

  EXPECT_EQ(output_file_problem((d / "new.dat").string()), "");
  EXPECT_EQ(output_file_problem(data), "");
  EXPECT_EQ(output_file_problem(hf), "is a directory");
  EXPECT_EQ(output_file_problem("/dev/null"), "is a character device");
  EXPECT_NE(output_file_problem((d / "missing" / "x.dat").string()).find("does not exist"),
            std::string::npos);
  q4::io::remove_tree(d);
}

TEST(AppendFile, FullDiskIsAnError) {
  AppendFile f;
  f.open("/dev/full", false);
  EXPECT_THROW(f.write("{\"step\": 1}\n"), c10::Error);
  const fs::path d = fresh_dir("append");
  AppendFile g;
  g.open((d / "m.jsonl").string(), true);
  g.write("a\n");
  g.write("b\n");
  g.sync();
  g.close();
  EXPECT_EQ(read_text(d / "m.jsonl"), "a\nb\n");
  q4::io::remove_tree(d);
}

}  // namespace
}  // namespace q4::io
