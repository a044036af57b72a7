// Kineto trace of part of a run (--profile-trace FILE): start before a step, stop and save the
// Chrome-trace JSON after a later one. Available with LibTorch 2.x; 1.13 builds report false.
#pragma once

#include <string>

namespace q4::trainer {

bool profiler_available();
void profiler_start(bool cuda);
void profiler_stop_and_save(const std::string& path);

}  // namespace q4::trainer
