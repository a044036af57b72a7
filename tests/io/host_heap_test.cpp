// keep_freed_host_blocks: after it, a block far above glibc's default mmap threshold is served
// from the heap (no mapping of its own) and stays there, free, once released.
#include "q4/io/host_heap.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace q4::test::host_heap_test {
namespace {

#if defined(__GLIBC__) && (__GLIBC__ > 2 || __GLIBC_MINOR__ >= 33)
TEST(HostHeap, LargeBlocksComeFromTheHeapAndStayThere) {
  ASSERT_TRUE(io::keep_freed_host_blocks());
  ASSERT_TRUE(io::keep_freed_host_blocks()) << "idempotent";
  const size_t n = size_t{96} << 20;  // 3x glibc's largest default threshold
  const size_t mapped_before = mallinfo2().hblkhd;
  void* p = std::malloc(n);
  ASSERT_NE(p, nullptr);
  std::memset(p, 1, n);
  EXPECT_EQ(mallinfo2().hblkhd, mapped_before) << "the block was mapped on its own";
  std::free(p);
  EXPECT_GE(mallinfo2().fordblks, n) << "the freed block left the heap";
}
#endif

}  // namespace
}  // namespace q4::test::host_heap_test
