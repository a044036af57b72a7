// Graceful stop on SIGINT/SIGTERM: the handler only sets a flag; the run loop finishes the
// current step, writes a checkpoint and exits 0. A second signal restores the default action,
// so pressing Ctrl-C twice still kills a stuck process.
#pragma once

namespace q4::trainer {

void install_stop_handlers();  // idempotent
bool stop_requested();
int stop_signal();           // the signal that asked for the stop (0 when none)
void request_stop(int sig);  // what the handler does; tests call it directly
void clear_stop_request();   // tests

}  // namespace q4::trainer
