#!/usr/bin/env bash
# The mixture-of-experts speed benchmark, one GPU call: builds q4train, writes the benchmark's
# chat dataset and a Qwen3-30B-A3B-shaped NVFP4 .dat with LAYERS of its 48 decoder layers
# (q4dat init; the peer does not fit all 48 with fp32 AdamW state), trains
# scripts/bench/bench-30b-a3b.yaml on it (4 x 1024 packed tokens a step; then with
# train.grad_accum 8), times the optimizer alone against the card's copy floor (bench_optim
# --model 30b-a3b), and runs the peer (HF transformers Qwen3MoeForCausalLM, grouped_mm experts,
# fused AdamW) in its modes. Prints one line per run.
#   scripts/bench/moe_vs_peer.sh [OUT_DIR]
# Env: LAYERS (8), STEPS (12), PEER (../shared/bench/peer_hf_moe_step.py), PEER_MODES
# ("plain ste"), SKIP_BUILD=1, SKIP_PEER=1, BUILD (build-gpu), EXTRA_SET (more --set for q4train),
# PROFILE=1 (a Kineto trace of the first run and its kernel table, kernels.md), SKIP_ACCUM=1 (no
# grad_accum 8 run), SKIP_OPTIM=1 (no bench_optim).
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(mkdir -p "${1:-${OUT:-$root/runs/bench-moe}}" && cd "${1:-${OUT:-$root/runs/bench-moe}}" && pwd)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4moe}
peer=${PEER:-$root/../shared/bench/peer_hf_moe_step.py}
layers=${LAYERS:-8}
steps=${STEPS:-12}
mkdir -p "$work"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  q4_phase build q4_gpu_build "$build" "$work/build.log" "q4train q4dat bench_optim" -DQ4_BUILD_TESTS=OFF
fi
bin=$build/bin
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 - "$layers" "$work/config.json" <<'PY'
import json, sys
c = json.load(open("tests/fixtures/qwen3_30b_a3b.config.json"))
c["num_hidden_layers"] = int(sys.argv[1])
json.dump(c, open(sys.argv[2], "w"), indent=1)
PY
[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/moe.dat" ] || q4_phase init "$bin/q4dat" init --config "$work/config.json" \
  --out "$work/moe.dat" --seed 0 >/dev/null
common=(--config scripts/bench/bench-30b-a3b.yaml --set "model.config=$work/config.json"
        --set "model.weights=$work/moe.dat" --set "data.files=[$work/bench.jsonl]" ${EXTRA_SET:-})
# Median tok/s and the last step's other numbers from a run's step lines, skipping 2 warm-up steps.
summary() {
  python3 - "$1" "$2" <<'PY'
import re, statistics, sys
lines = [l for l in open(sys.argv[1]) if re.match(r"step\s+\d+/", l)]
tok = [float(re.search(r"(\d+) tok/s", l).group(1)) for l in lines[2:]] or [0.0]
ms = [float(re.search(r"\| ([\d.]+) (?:ms|s) \|", l).group(1)) for l in lines[2:]] or [0.0]
mem = re.search(r"mem ([\d.]+) GiB", lines[-1]).group(1) if lines else "?"
mfu = re.search(r"mfu ([\d.]+)%", lines[-1]).group(1) if lines and "mfu" in lines[-1] else "?"
print("q4train %-12s tok/s %8.0f  step %s  mfu %s%%  mem %s GiB  (%d steps)" % (
    sys.argv[2], statistics.median(tok), statistics.median(ms), mfu, mem, len(lines)))
PY
}
rm -rf "$work/train"
"$bin/q4train" "${common[@]}" --set "train.steps=$steps" --set "output.dir=$work/train" \
  ${PROFILE:+--profile-trace "$work/trace.json"} >"$out/train.log" 2>&1 \
  || { tail -n 30 "$out/train.log"; exit 1; }
summary "$out/train.log" "accum 1" | tee "$out/summary.txt"
[ -z "${PROFILE:-}" ] || python3 scripts/bench/kernel_table.py "$work/trace.json" 30 >"$out/kernels.md"
if [ "${SKIP_ACCUM:-0}" != 1 ]; then
rm -rf "$work/train8"
"$bin/q4train" "${common[@]}" --set "train.steps=4" --set train.grad_accum=8 \
  --set "output.dir=$work/train8" >"$out/train8.log" 2>&1 || { tail -n 30 "$out/train8.log"; exit 1; }
summary "$out/train8.log" "accum 8" | tee -a "$out/summary.txt"
fi
if [ "${SKIP_OPTIM:-0}" != 1 ]; then
  "$bin/bench_optim" --model 30b-a3b --layers "$layers" --modes int8 --steps 3 --warmup 1 \
    >"$out/optim.txt" 2>&1 || true
  grep -E "baseline|int8" "$out/optim.txt" | tee -a "$out/summary.txt"
fi
if [ "${SKIP_PEER:-0}" != 1 ]; then
  for mode in ${PEER_MODES:-plain ste}; do
    (cd /tmp && LAYERS=$layers MODE=$mode EXPERTS=grouped_mm CKPT=0 timeout 300 python3 "$peer" 2>&1 \
      | grep RESULT | sed "s/^/peer $mode /") | tee -a "$out/summary.txt"
  done
fi
