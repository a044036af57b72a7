#!/usr/bin/env bash
# The release check on one GPU, one call: build, the CUDA test binaries, bench_optim, the speed
# benchmark with the peer in its three modes and the whoami job (step_vs_peer.sh), the memory of a
# whole run with 4bit moments, and TensorBoard's own reader on a run's event file. At most 8 files
# come back from a device call, so the outputs are gathered into a few.
#   OUT=dir scripts/bench/release_round.sh   (env: TARGETS, TESTS, SKIP_OPTIM_BENCH=1, SKIP_SPEED=1,
#   SKIP_PROBE=0, PREV_TREE=dir: a baseline source tree whose q4train runs the same training and
#   whoami job after the new one, same card, appended to summary.md)
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
work=${WORK:-/tmp/q4bench}; mkdir -p "$work"
q4_gpu_env
t0=$(date +%s)
prev_pid=""
if [ -n "${PREV_TREE:-}" ]; then
  (q4_gpu_configure "$PREV_TREE" build-prev -DQ4_BUILD_TESTS=OFF && cmake --build build-prev -j8 \
     --target q4train q4dat) >"$work/prev-build.log" 2>&1 &
  prev_pid=$!
fi
q4_gpu_configure . build-gpu >"$work/build.log" 2>&1 || { tail -n 30 "$work/build.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" --target ${TARGETS:-q4train q4dat bench_optim test_model test_optim test_quant} \
  >>"$work/build.log" 2>&1 || { grep -E "error" -A3 "$work/build.log" | head -n 60; exit 1; }
echo "build ok in $(( $(date +%s) - t0 )) s"

# 1. CUDA tests.
for t in ${TESTS:-test_quant test_optim test_model}; do
  [ -x build-gpu/tests/$t ] && build-gpu/tests/$t --gtest_filter="*/cuda:*Cuda*" 2>&1 | tail -n 60
done >"$out/cuda-tests.log"
grep -E "FAILED|PASSED|Failure" "$out/cuda-tests.log" | head -20

# 2. Optimizer kernels against the copy bandwidth.
[ "${SKIP_OPTIM_BENCH:-0}" = 1 ] || build-gpu/bin/bench_optim --steps 10 --arithmetic both 2>&1 | tee "$out/bench-optim.txt" \
  | grep -E "mode=|baseline"

# The benchmark's data and 4B .dat (step_vs_peer.sh reuses them).
[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/q4b.dat" ] || build-gpu/bin/q4dat init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0 >/dev/null

# 3. A whole run's peak with 4bit and int8 moments (load, steps, export, export check).
for st in 4bit int8; do
  rm -rf "$work/mem-$st"
  build-gpu/bin/q4train --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
    --set "data.files=[$work/bench.jsonl]" --set train.steps=6 --set "optim.state=$st" \
    --set "output.dir=$work/mem-$st" --set output.export_path=model.dat 2>&1 \
    | grep -E "^step +6|export|peak GPU memory|done" | sed "s/^/$st: /"
done 2>&1 | tee "$out/memory.txt"
# The int8 run's export as a Hugging Face folder (the end-of-run serve hint's command).
rm -rf "$work/hf-int8"
build-gpu/bin/q4dat export-hf "$work/mem-int8/model.dat" "$work/hf-int8" \
  --config tests/fixtures/qwen3_4b.config.json --tokenizer-dir assets/qwen3 --format modelopt \
  >"$work/export-hf.log" 2>&1
echo "q4dat export-hf: exit $? ($(ls "$work/hf-int8" 2>/dev/null | wc -l) files; $(tail -n 1 "$work/export-hf.log"))" \
  | tee -a "$out/memory.txt"

# 4. Speed benchmark: q4train on the dataset, probes, whoami, peer x 3 (SKIP_SPEED=1: none).
if [ "${SKIP_SPEED:-0}" != 1 ]; then
WHOAMI=1 SKIP_BUILD=1 SKIP_PROBE=${SKIP_PROBE:-1} PEER=${PEER:-$root/.devshared/peer_hf_step.py} WORK=$work \
  scripts/bench/step_vs_peer.sh "$work/bench" >"$work/step_vs_peer.log" 2>&1
tail -n 25 "$work/step_vs_peer.log"
cat "$work/bench/summary.md" "$work/bench/whoami.log" >"$out/summary.md" 2>/dev/null
cat "$work/bench/train.log" "$work/bench/peer.log" >"$out/train-and-peer.log" 2>/dev/null
cp "$work/bench/probe-data.json" "$work/bench/kernels.md" "$out/" 2>/dev/null
fi

# 5. TensorBoard's loader on the run's event file.
python3 scripts/bench/read_tfevents.py "$work/mem-int8" >"$out/tfevents.txt" 2>&1 || true
head -n 20 "$out/tfevents.txt"

# 6. The baseline tree on the same card: training on the bench data and the whoami job.
if [ -n "$prev_pid" ]; then
  if wait "$prev_pid"; then
    WHOAMI=1 SKIP_BUILD=1 SKIP_PEER=1 SKIP_PROBE=1 BUILD="$root/build-prev" WORK=$work \
      scripts/bench/step_vs_peer.sh "$work/prev" >"$work/prev.log" 2>&1
    { echo; echo "== baseline tree ($PREV_TREE), same card, after the new tree's runs"
      cat "$work/prev/summary.md" 2>/dev/null; grep -E "^whoami" "$work/prev/whoami.log"; } \
      | tee -a "$out/summary.md"
  else
    tail -n 20 "$work/prev-build.log"
  fi
fi
