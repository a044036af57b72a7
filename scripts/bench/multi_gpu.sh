#!/usr/bin/env bash
# Data-parallel benchmark, one call on a multi-GPU machine:
#  1. weak scaling: scripts/bench/bench-4b.yaml (Qwen3-4B shapes, 4,411,424,256 trained parameters,
#     4 x 1024 packed slots per GPU, int8 moments) on the speed benchmark's dataset with
#     q4train --nproc N for N in NPROCS (default: 1, 2, 4 up to the GPU count): global and
#     per-GPU tokens/s, efficiency vs 1 GPU, median step, rank 0's peak allocated and every GPU's
#     peak used memory (nvidia-smi);
#  2. kill and resume: a small random-init Qwen3 trained on 2 GPUs with a checkpoint every 10
#     steps, rank 1 killed at step 15 (Q4_FAULT), resumed on 1 GPU (grad_accum doubles): its
#     losses against the uninterrupted 2-GPU run.
#   OUT=dir scripts/bench/multi_gpu.sh      (env: STEPS=12, NPROCS, SKIP_BUILD=1, BUILD, CUDA_ARCH,
#   SKIP_RESUME=1, EXTRA_SET: more --set arguments for the scaling runs)
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=${OUT:-$root/runs/multi-gpu}
mkdir -p "$out"
out=$(cd "$out" && pwd)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4dp}
steps=${STEPS:-12}
mkdir -p "$work"
gpus=$(nvidia-smi --list-gpus | wc -l)
nprocs=${NPROCS:-$(for n in 1 2 4 8; do if [ "$n" -le "$gpus" ]; then echo -n "$n "; fi; done)}

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  t0=$(date +%s)
  q4_gpu_configure . "$build" -DQ4_BUILD_TESTS=OFF >"$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log"; exit 1; }
  grep -E "process groups" "$work/build.log" || true
  cmake --build "$build" -j "$(nproc)" --target q4train q4dat >>"$work/build.log" 2>&1 \
    || { grep -E "error" -A3 "$work/build.log" | head -n 60; exit 1; }
  echo "build: $(( $(date +%s) - t0 )) s"
fi
bin=$build/bin
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader | tee "$work/gpu.txt"

[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/q4b.dat" ] || "$bin/q4dat" init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0 >/dev/null

# 1. Weak scaling.
for n in $nprocs; do
  rm -rf "$work/dp$n"
  nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits -lms 200 >"$work/smi$n.csv" &
  smi=$!
  t0=$(date +%s)
  "$bin/q4train" --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
    --set "data.files=[$work/bench.jsonl]" --set "train.steps=$steps" \
    --set "output.dir=$work/dp$n" --nproc "$n" ${EXTRA_SET:-} 2>&1 | grep -v "^#\|^  \|^[a-z_]*:$" \
    >"$work/dp$n.log" || { kill $smi; tail -n 30 "$work/dp$n.log"; exit 1; }
  kill $smi || true
  echo "nproc $n: $(( $(date +%s) - t0 )) s wall"
  cp "$work/dp$n/metrics.jsonl" "$out/dp$n-metrics.jsonl"
  python3 - "$work/smi$n.csv" >"$work/dp$n-smi.txt" <<'PY'
import collections, sys
peak = collections.defaultdict(int)
for line in open(sys.argv[1]):
    parts = [p.strip() for p in line.split(",")]
    if len(parts) == 2 and parts[1].isdigit():
        peak[int(parts[0])] = max(peak[int(parts[0])], int(parts[1]))
print(" ".join(f"gpu{k}:{v / 1024:.2f}" for k, v in sorted(peak.items())))
PY
done

# 2. Kill at step 15 on 2 GPUs, resume on 1.
if [ "$gpus" -ge 2 ] && [ "${SKIP_RESUME:-0}" != 1 ]; then
  cat >"$work/small.json" <<'JSON'
{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936,
 "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 4,
 "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-6,
 "rope_theta": 1000000.0, "max_position_embeddings": 4096, "tie_word_embeddings": false,
 "hidden_act": "silu", "attention_bias": false}
JSON
  small=(--config scripts/bench/bench-4b.yaml --set "model.config=$work/small.json" --set model.init=random
         --set "data.files=[$work/bench.jsonl]" --set train.steps=20 --set optim.lr=3e-4
         --set output.checkpoint_every=10 --set train.max_grad_norm=1.0)
  rm -rf "$work/full" "$work/killed"
  "$bin/q4train" "${small[@]}" --set "output.dir=$work/full" --nproc 2 >"$work/full.log" 2>&1
  Q4_FAULT=exit:1:15 "$bin/q4train" "${small[@]}" --set "output.dir=$work/killed" --nproc 2 \
    >"$work/killed.log" 2>&1 && { echo "the killed run did not fail"; exit 1; } || true
  grep -E "Q4_FAULT|exited with code" "$work/killed.log" | head -n 3
  "$bin/q4train" "${small[@]}" --set "output.dir=$work/killed" --resume "$work/killed" \
    >"$work/resumed.log" 2>&1 || { tail -n 20 "$work/resumed.log"; exit 1; }
  grep -E "resumed from|continues on" "$work/resumed.log"
  python3 - "$work/full/metrics.jsonl" "$work/killed/metrics.jsonl" <<'PY' | tee "$out/kill-resume.txt"
import json, sys
a = {r["step"]: r for r in map(json.loads, filter(str.strip, open(sys.argv[1])))}
b = {}
for r in map(json.loads, filter(str.strip, open(sys.argv[2]))):
    b[r["step"]] = r  # the resumed run's rows override the killed run's
print("step  loss 2 GPUs   loss killed+resumed on 1 GPU   rel diff")
worst = 0.0
for s in sorted(a):
    d = abs(b[s]["loss"] - a[s]["loss"]) / abs(a[s]["loss"])
    if s > 10: worst = max(worst, d)
    print(f"{s:4d}  {a[s]['loss']:.6f}     {b[s]['loss']:.6f}                     {d:.2e}")
print(f"max rel diff after the resume (steps 11-20): {worst:.2e}")
PY
fi

python3 - "$out" "$work" $nprocs <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, work, ns = sys.argv[1], sys.argv[2], [int(x) for x in sys.argv[3:]]
print("card:", open(f"{work}/gpu.txt").read().splitlines()[0].split(",")[1].strip(), "x", len(open(f"{work}/gpu.txt").read().splitlines()))
rows, base = [], None
for n in ns:
    m = [json.loads(l) for l in open(f"{out}/dp{n}-metrics.jsonl") if l.strip()]
    steady = [r for r in m if r["step"] >= 3]
    ms = statistics.median(r["step_ms"] for r in steady)
    tok = statistics.mean(r["tokens"] for r in steady)
    tps = tok / (ms / 1e3)
    per = tps / n
    base = base or per
    peak = max(r.get("gpu_peak_bytes") or 0 for r in m) / 2**30
    smi = open(f"{work}/dp{n}-smi.txt").read().strip()
    rows.append(f"| {n} | {tps:,.0f} | {per:,.0f} | {100 * per / base:.1f}% | {ms:.1f} | "
                f"{max(r['step_ms'] for r in steady):.1f} | {peak:.2f} | {smi} |")
print("| GPUs | tokens/s | tokens/s per GPU | weak-scaling efficiency | median step ms (3..N) | "
      "slowest | rank-0 peak allocated GiB | peak used per GPU (nvidia-smi, GiB) |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
PY
