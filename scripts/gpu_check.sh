#!/usr/bin/env bash
# Build + test + benchmark on a CUDA host (the lent H100/H200 machine), in one go.
# Usage: scripts/gpu_check.sh [build] [test] [bench] [probe] [peer] [demo]   (default: all)
# Env: TARGETS (cmake targets to build; default all + the benchmarks), CTEST_ARGS (e.g. "-L cuda"),
# PEER (path), CUDA_ARCH (default native). Logs and JSON go to $OUT (or ./gpu-out). Expects
# LibTorch 2.x with CUDA from python3's torch; PCRE2/utf8proc debs may be carried in .debs/.
set -uo pipefail
. "$(dirname "$0")/lib.sh"
out=$(q4_out)
steps=${*:-build test bench probe peer demo}
has() { [[ " $steps " == *" $1 "* ]]; }
q4_gpu_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

if has build; then
  q4_gpu_configure . build-gpu >"$out/configure.log" 2>&1 || { tail -n 30 "$out/configure.log"; exit 1; }
  tgt=""; for t in ${TARGETS:-all bench_quant bench_optim}; do tgt="$tgt --target $t"; done
  cmake --build build-gpu -j "$(nproc)" $tgt >"$out/build.log" 2>&1 || { grep -E "error|Error" "$out/build.log" | head -n 40; exit 1; }
  echo "build ok"
fi
B=build-gpu/bin
if has test; then
  ctest --test-dir build-gpu --output-on-failure -j4 --timeout 300 ${CTEST_ARGS:-} >"$out/ctest.log" 2>&1
  echo "ctest rc=$?"; grep -E "tests passed|tests failed|\*\*\*Failed|Failed  |Timeout|Not Run" "$out/ctest.log" | head -n 30
fi
if has bench; then
  [ -x $B/bench_quant ] && $B/bench_quant 2>&1 | tee "$out/bench_quant.txt"
  [ -x $B/bench_optim ] && $B/bench_optim 2>&1 | tee "$out/bench_optim.txt"
fi
if has probe; then
  [ -x $B/q4train ] && $B/q4train --config configs/probe-4b.yaml --probe \
    --set output.dir="$out/probe-run" 2>&1 | tee "$out/probe.txt"
fi
if has peer; then
  p=${PEER:-shared/bench/peer_hf_step.py}
  [ -f "$p" ] && PYTHONUNBUFFERED=1 python3 "$p" 2>&1 | tee "$out/peer.txt" | tail -n 5
fi
if has demo; then
  [ -x $B/q4train ] && $B/q4train --config configs/demo.yaml --set model.device=cuda \
    --set output.dir="$out/demo-run" --overwrite 2>&1 | tail -n 30 | tee "$out/demo.txt"
fi
