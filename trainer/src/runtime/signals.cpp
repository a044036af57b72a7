// SIGINT/SIGTERM/SIGHUP -> an async-signal-safe flag (sig_atomic_t) polled by the run, and a
// message written with write(2) (the only output a handler may do).
#include "q4/trainer/runtime/signals.h"

#include <unistd.h>

#include <csignal>
#include <cstring>

namespace q4::trainer {
namespace {

volatile std::sig_atomic_t g_stop_signal = 0;
volatile std::sig_atomic_t g_signal_count = 0;
// What the first signal announces; a string literal, set before the handlers can run.
const char* volatile g_first_message =
    "\nq4train: stop signal received: finishing the current step, then a checkpoint and exit (a "
    "third signal kills without a checkpoint)\n";

void say(const char* text) {
  [[maybe_unused]] const ssize_t n = ::write(STDERR_FILENO, text, std::strlen(text));
}

extern "C" void q4_on_stop_signal(int sig) {
  const int count = g_signal_count + 1;
  g_signal_count = count;
  if (count >= kSignalsBeforeKill) {
    say("\nq4train: third stop signal: killed without a checkpoint\n");
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  if (g_stop_signal == 0) g_stop_signal = sig;
  if (count == 1) {
    say(g_first_message);
  } else {
    say("\nq4train: already stopping (a checkpoint may be being written); one more signal kills "
        "without a checkpoint\n");
  }
}

}  // namespace

void set_stop_message(const char* text) { g_first_message = text; }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = q4_on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  sigaction(SIGINT, &sa, nullptr);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGHUP, &sa, nullptr);
}

bool stop_requested() { return g_stop_signal != 0; }
int stop_signal() { return static_cast<int>(g_stop_signal); }
void request_stop(int sig) { g_stop_signal = sig; }
void clear_stop_request() {
  g_stop_signal = 0;
  g_signal_count = 0;
}

}  // namespace q4::trainer
