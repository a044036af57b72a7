#!/usr/bin/env bash
# The speed benchmark, one GPU call: builds q4train against the machine's LibTorch, writes the
# deterministic chat dataset (make_bench_data.py) and a Qwen3-4B-shaped NVFP4 .dat (q4dat init,
# untied lm_head as shipped), trains scripts/bench/bench-4b.yaml on it (same 4,411,424,256
# parameters as the peer), runs the probe on the same data and on synthetic rows, then the peer
# (HF transformers + STE + checkpointing + fused AdamW) in its three modes, and prints one table
# with ratios (scripts/bench/summarize_step_vs_peer.py).
#   scripts/bench/step_vs_peer.sh [OUT_DIR]
# Env: PEER (peer_hf_step.py; default ../shared/bench/peer_hf_step.py), BUILD (build dir,
# default build-gpu), STATE (int8), STEPS (16), SKIP_BUILD=1, SKIP_PEER=1, PEER_MODES
# ("ste compile plain plain-nockpt"), EXTRA_SET (more --set arguments for q4train).
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" bench)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4bench}
peer=${PEER:-$root/../shared/bench/peer_hf_step.py}
state=${STATE:-int8}
steps=${STEPS:-16}
mkdir -p "$work"

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  t0=$(date +%s)
  q4_gpu_configure . "$build" -DQ4_BUILD_TESTS=${BUILD_TESTS:-OFF} >"$work/build.log" 2>&1
  cmake --build "$build" -j "$(nproc)" ${BUILD_TARGETS:+--target $BUILD_TARGETS} >>"$work/build.log" 2>&1 \
    || { tail -n 60 "$work/build.log"; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
bin=$build/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"

[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/q4b.dat" ] || "$bin/q4dat" init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0
common=(--config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat"
        --set "data.files=[$work/bench.jsonl]" --set "optim.state=$state" ${EXTRA_SET:-})

# 1. Training on the dataset (the headline), 2. the probe on the same data, 3. the probe on
# synthetic rows (same step function).
rm -rf "$work/train"
"$bin/q4train" "${common[@]}" --set "train.steps=$steps" --set "output.dir=$work/train" \
  ${PROFILE:+--profile-trace "$work/trace.json"} 2>&1 | grep -v "^#\|^  \|^[a-z_]*:$" \
  | tee "$out/train.log" | tail -n 8
cp "$work/train/metrics.jsonl" "$out/train-metrics.jsonl"
if [ -n "${PROFILE:-}" ]; then
  python3 scripts/bench/kernel_table.py "$work/trace.json" 45 >"$out/kernels.md"
  head -n 30 "$out/kernels.md"
fi
[ "${SKIP_PROBE:-0}" = 1 ] || "$bin/q4train" "${common[@]}" --set "output.dir=$work/probe-data" --probe --probe-steps 6 \
  --probe-report "$out/probe-data.json" >/dev/null 2>"$work/probe-data.log"
[ "${SKIP_PROBE:-0}" = 1 ] || "$bin/q4train" "${common[@]}" --set "data.files=[]" --set "output.dir=$work/probe-synth" --probe \
  --probe-steps 6 --probe-report "$out/probe-synth.json" >/dev/null 2>"$work/probe-synth.log"

# The headline job: configs/whoami.yaml (8 short examples a step, unpacked) on the 4B .dat.
if [ "${WHOAMI:-0}" = 1 ]; then
  rm -rf "$work/whoami"
  "$bin/q4train" --config configs/whoami.yaml --set "model.config=$root/tests/fixtures/qwen3_4b.config.json" \
    --set "model.tokenizer=$root/assets/qwen3/tokenizer.json" --set "model.weights=$work/q4b.dat" \
    --set "output.dir=$work/whoami" --set train.steps=${WHOAMI_STEPS:-30} --set eval.at_start=false \
    --set output.checkpoint_every=0 ${WHOAMI_PROFILE:+--profile-trace "$work/whoami-trace.json"} \
    2>&1 | grep -v "^#\|^  \|^[a-z_]*:$" >"$out/whoami.log"
  if [ -n "${WHOAMI_PROFILE:-}" ]; then
    python3 scripts/bench/kernel_table.py "$work/whoami-trace.json" 25 | tee -a "$out/whoami.log" | head -n 20
  fi
  python3 - "$work/whoami/metrics.jsonl" <<'PY' | tee -a "$out/whoami.log"
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = [r["step_ms"] for r in m if r["step"] >= 3]
print(f"whoami: {len(m)} steps, median step (3..N) {statistics.median(ms):.1f} ms, slowest {max(ms):.1f} ms, "
      f"mean tokens/step {statistics.mean(r['tokens'] for r in m):.0f}")
PY
  grep -E "^export|export check|differs" "$out/whoami.log" | head -n 12
fi

if [ "${SKIP_PEER:-0}" != 1 ]; then
  : >"$out/peer.log"
  for m in ${PEER_MODES:-ste compile plain plain-nockpt}; do
    case $m in
      ste) env=(MODE=ste) ;;
      compile) env=(MODE=ste COMPILE=1) ;;
      plain) env=(MODE=plain) ;;
      plain-nockpt) env=(MODE=plain CKPT=0) ;;  # the peer's fastest mode when memory allows
    esac
    env "${env[@]}" SEEDOPT=0 PYTHONUNBUFFERED=1 python3 "$peer" 2>&1 | tee -a "$out/peer.log" \
      | grep -E '^(RESULT|params)' || true
  done
fi
python3 scripts/bench/summarize_step_vs_peer.py "$out" | tee "$out/summary.md"
