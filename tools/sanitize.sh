#!/usr/bin/env bash
# ASan + UBSan run of the CPU library unit tests that parse files and manage memory by hand: io,
# quant, the .dat container (test_model_dat: dat_file + dat_corrupt tests), data (+ q4tok) and
# optim (state save/load), in build-asan/ (Q4_SANITIZE=ON, Release so the tests stay fast). The
# Qwen3 model tests with their three tools, trainer, e2e and convergence are left to the plain
# build: they would double the sanitized build on the 2-core CI machine. Any sanitizer report
# fails the test (halt_on_error). Usage: tools/sanitize.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
targets=(test_io test_quant test_model_dat test_data test_optim)
cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Release -DQ4_SANITIZE=ON >/dev/null
cmake --build build-asan -j "$(nproc)" --target "${targets[@]}"
# LibTorch allocates process-lifetime registries that LeakSanitizer would report at exit; leaks
# are therefore off, everything else (overflows, use-after-free, UB) halts the test.
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:strict_string_checks=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
# The suites of the five binaries (tests of binaries not built here are not selected).
suites='AppendFile|AtomicFile|BoundedRead|Crc32c|RemoveTree|E2m1Ref|E4m3Fast|E4m3Ref|Nvfp4[A-Za-z]*|DatCorruptTest|DatFileTest'
suites+='|Batcher|Chat|Dataset|DatasetFormats|Q4tok|Tokenizer'
suites+='|LrSchedule|OptimCodec|PackedAdamW'
ctest --test-dir build-asan -j 2 --output-on-failure --timeout 900 -R "^($suites)\\." -E NOT_BUILT
