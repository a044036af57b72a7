// Graceful stop on SIGINT/SIGTERM/SIGHUP, installed before set-up: the handler sets a flag and
// says on stderr what happens next; the run finishes the current step (or set-up), writes a
// checkpoint and exits 0. A second signal only repeats that the stop is under way (a checkpoint
// being written is not cut short); a third restores the default action, so a stuck process can
// still be killed from the keyboard.
#pragma once

namespace q4::trainer {

inline constexpr int kSignalsBeforeKill = 3;  // the third stop signal kills

void install_stop_handlers();  // idempotent
// What the first signal says on stderr (a string literal: the handler writes it as it is), for
// commands that stop otherwise than after a training step (--write-teacher-topk).
void set_stop_message(const char* text);
bool stop_requested();
int stop_signal();           // the signal that asked for the stop (0 when none)
void request_stop(int sig);  // what the handler does; tests call it directly
void clear_stop_request();   // tests

}  // namespace q4::trainer
