// SIGINT/SIGTERM -> an async-signal-safe flag (sig_atomic_t) polled by the run loop.
#include "q4/trainer/signals.h"

#include <csignal>

namespace q4::trainer {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;

extern "C" void q4_on_stop_signal(int sig) {
  if (g_stop_signal != 0) {
    std::signal(sig, SIG_DFL);  // second signal: default action on the next one
    std::raise(sig);
    return;
  }
  g_stop_signal = sig;
}

}  // namespace

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = q4_on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
}

bool stop_requested() { return g_stop_signal != 0; }
int stop_signal() { return static_cast<int>(g_stop_signal); }
void request_stop(int sig) { g_stop_signal = sig; }
void clear_stop_request() { g_stop_signal = 0; }

}  // namespace q4::trainer
