#!/usr/bin/env bash
# Builds the libFuzzer targets (tests/fuzz) in build-asan/, the sanitizer build shared with
# scripts/sanitize.sh (q4_asan_build: clang -O1, ASan+UBSan; the targets link its libraries, so
# after the sanitizer tests only their entry points compile), and runs each for SECONDS (default
# 60) from its committed seed corpus (tests/fuzz/corpus/<target>; new inputs go to a scratch copy,
# the committed corpus is not modified). JOBS targets run at once (default: one per core; each
# fuzzer is one process on one core, so every target still gets SECONDS of a core). A crash,
# leak, UB report or timeout is a finding: its input is saved under build-asan/findings/ and the
# script exits 1 (commit the input to the corpus as a regression once fixed; build-asan/fuzz/TARGET
# INPUT replays it).
# Usage: scripts/fuzz.sh [SECONDS] [TARGET...]
set -euo pipefail
. "$(dirname "$0")/lib.sh"
secs=${1:-60}
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(fuzz_dat fuzz_safetensors fuzz_config fuzz_tokenizer fuzz_dataset)
jobs=${JOBS:-$(nproc)}
b=build-asan
q4_phase "fuzz: build" q4_asan_build "${targets[@]}"
mkdir -p "$b/findings"
export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1

run_one() {  # run_one TARGET: one fuzzing session; prints one line, returns 1 on a finding
  local t=$1 seeds=tests/fuzz/corpus/${1#fuzz_} work=$b/corpus/${1#fuzz_} log=$b/$1.log
  mkdir -p "$work"
  if "$b/fuzz/$t" "$work" "$seeds" -max_total_time="$secs" -timeout=20 -rss_limit_mb=4096 \
       -max_len=65536 -artifact_prefix="$b/findings/$t-" -print_final_stats=1 >"$log" 2>&1; then
    echo "fuzz: $t: $(grep -a -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$') runs in ${secs}s, no finding"
  else
    echo "fuzz: $t: FINDING (see $log and $b/findings/)"; tail -n 30 "$log"; return 1
  fi
}

status=0 running=0 t0=$SECONDS
for t in "${targets[@]}"; do
  if [ "$running" -ge "$jobs" ]; then wait -n || status=1; running=$((running - 1)); fi
  run_one "$t" & running=$((running + 1))
done
while [ "$running" -gt 0 ]; do wait -n || status=1; running=$((running - 1)); done
echo "fuzz: runs done in $((SECONDS - t0))s (${#targets[@]} targets x ${secs}s, $jobs at a time)"
exit $status
