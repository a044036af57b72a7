// end_process (q4/io/process_exit.h).
#include "q4/io/process_exit.h"

#include <cstdio>
#include <cstdlib>
#include <iostream>

namespace q4::io {

void end_process(int code) {
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  std::fflush(nullptr);
  std::_Exit(code);
}

}  // namespace q4::io
