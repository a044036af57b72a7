#!/usr/bin/env bash
# ASan + UBSan run of the CPU library unit tests that parse files and manage memory by hand: io,
# quant, the .dat container (in test_io, with the io library it belongs to), data (+ q4tok) and
# optim (state save/load), in build-asan/ (q4_asan_build, shared with scripts/fuzz.sh) at -O1, the
# level the sanitizers recommend: every check stays on and the ASan build compiles in ~60% of
# -O3's time. Compiled by clang (installed by q4_clang when missing, as libFuzzer needs it): its
# sanitized build of these targets takes about 55% of GCC's CPU time (270 against 480 CPU-s on a
# 2-core machine), and the plain build stays GCC's, so both compilers see every source. The Qwen3
# model tests with their three tools, trainer, e2e and convergence are left to the plain build:
# they would double the sanitized build on the 2-core CI machine. Any sanitizer report fails the
# test (halt_on_error). Usage: scripts/sanitize.sh
set -euo pipefail
. "$(dirname "$0")/lib.sh"
# The test binaries and the gtest suites they hold (tests of binaries not built here are not
# selected): when tests move between binaries, update both lists together.
targets=(test_io test_quant test_data test_optim)
suites='AppendFile|AtomicFile|BoundedRead|Crc32c|RemoveTree|E2m1Ref|E4m3Fast|E4m3Ref|Nvfp4[A-Za-z]*|DatCorruptTest|DatFileTest'
suites+='|Batcher|Chat|Dataset|DatasetFormats|Q4tok|Q4tokChat|Q4tokData|Tokenizer'
suites+='|LrSchedule|OptimCodec|PackedAdamW'
b=build-asan
q4_phase "sanitize: build" q4_asan_build "${targets[@]}"
# LibTorch allocates process-lifetime registries that LeakSanitizer would report at exit; leaks
# are therefore off, everything else (overflows, use-after-free, UB) halts the test.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
q4_phase "sanitize: tests" ctest --test-dir "$b" -j "$(nproc)" --output-on-failure --timeout 900 \
  -R "^($suites)\\." -E NOT_BUILT
