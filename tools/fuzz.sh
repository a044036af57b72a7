#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz, clang, build-fuzz/) and runs each for SECONDS
# (default 60) from its committed seed corpus (tests/fuzz/corpus/<target>; new inputs go to a
# scratch copy, the committed corpus is not modified). A crash, leak, UB report or timeout is a
# finding: its input is saved under build-fuzz/findings/ and the script exits 1 (commit the input
# to the corpus as a regression once fixed). Usage: tools/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_dat fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_dataset)
if ! command -v clang++ >/dev/null 2>&1 || ! ls /usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-x86_64.a >/dev/null 2>&1; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends clang libclang-rt-14-dev >/dev/null
fi
cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER=clang \
  -DCMAKE_CXX_COMPILER=clang++ -DQ4_FUZZ=ON -DQ4_BUILD_TESTS=OFF -DQ4_USE_PCH=OFF >/dev/null
cmake --build build-fuzz -j "$(nproc)" --target "${targets[@]}"
mkdir -p build-fuzz/findings
status=0
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1
for t in "${targets[@]}"; do
  seeds=tests/fuzz/corpus/${t#fuzz_}
  work=build-fuzz/corpus/${t#fuzz_}
  mkdir -p "$work"
  log=build-fuzz/$t.log
  if build-fuzz/fuzz/$t "$work" "$seeds" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 \
       -max_len=65536 -artifact_prefix=build-fuzz/findings/$t- -print_final_stats=1 >"$log" 2>&1; then
    echo "fuzz: $t: $(grep -a -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') runs in ${secs}s, no finding"
  else
    echo "fuzz: $t: FINDING (see $log and build-fuzz/findings/)"; tail -n 30 "$log"; status=1
  fi
done
exit $status
