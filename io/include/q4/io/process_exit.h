// How a q4 program ends once its work is done. std::exit would run every static destructor of
// the ~290 libraries LibTorch loads (its operator registry alone deregisters each kernel one by
// one: about 0.07 CPU-s, a tenth of a short process's life) and would race them against threads
// that outlive main (Gloo's, OpenMP's). end_process flushes what the program wrote and ends the
// process without them. Everything the program owns is closed before: its files are written
// through scoped objects (AtomicFile, std::ofstream) that main's scope has already destroyed.
#pragma once

namespace q4::io {

// Flushes std::cout, std::cerr, std::clog and every C stdio stream, then ends the process with
// `code`, skipping atexit handlers and static destructors.
[[noreturn]] void end_process(int code);

}  // namespace q4::io
