// keep_freed_host_blocks (q4/io/host_heap.h): glibc's mallopt thresholds.
#include "q4/io/host_heap.h"

#if defined(__GLIBC__)
#include <malloc.h>
#endif

namespace q4::io {

bool keep_freed_host_blocks() {
#if defined(__GLIBC__)
  const int bytes = static_cast<int>(kKeptHostBlockBytes);
  return mallopt(M_MMAP_THRESHOLD, bytes) == 1 && mallopt(M_TRIM_THRESHOLD, bytes) == 1;
#else
  return false;
#endif
}

}  // namespace q4::io
