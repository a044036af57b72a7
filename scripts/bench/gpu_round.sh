#!/usr/bin/env bash
# One development round on the lent GPU machine: build the targets that matter, run the CUDA
# model tests, then the benchmark pieces named in STEPS (train, profile, probe, peer) via
# step_vs_peer.sh. Logs under $OUT. Usage: OUT=... STEPS="train profile" scripts/bench/gpu_round.sh
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
q4_gpu_env
t0=$(date +%s)
q4_gpu_configure . build-gpu >"$out/build.log" 2>&1 || { tail -n 30 "$out/build.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target ${TARGETS:-q4train q4dat test_model} >>"$out/build.log" 2>&1 \
  || { grep -E "error" -A3 "$out/build.log" | head -n 60; exit 1; }
echo "build ok in $(( $(date +%s) - t0 )) s"
if [[ " ${STEPS:-} " == *" test "* ]]; then
  : >"$out/cuda-tests.log"
  for t in ${TESTS:-test_model}; do
    build-gpu/tests/$t --gtest_filter="*/cuda:*Cuda*" 2>&1 | tail -n 40 >>"$out/cuda-tests.log"
  done
  grep -E "rel err|OK \]|FAILED|PASSED|Failure|error" "$out/cuda-tests.log" | head -40
fi
SKIP_BUILD=1 OUT=$out "$@"
