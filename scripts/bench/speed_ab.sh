#!/usr/bin/env bash
# The speed benchmark's training run (scripts/bench/bench-4b.yaml, Qwen3-4B shapes, every
# parameter trainable, int8 moments) of this tree and of a baseline tree, interleaved on one GPU
# (new, old, new, old, ...): median tokens/s over steps 3..N and the peak GPU memory of each run,
# and the new/old ratios. Each tree trains with its own bench-4b.yaml.
#   OUT=dir PREV_TREE=/path/to/baseline/tree [ROUNDS=2] [STEPS=16] [SKIP_BUILD=1] scripts/bench/speed_ab.sh
# (make the baseline with: git archive <commit> | tar -x -C /path/to/baseline/tree)
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
prev=$(cd "${PREV_TREE:?PREV_TREE: a baseline source tree}" && pwd)
steps=${STEPS:-16}
q4_gpu_env
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  (q4_gpu_configure "$prev" build-prev -DQ4_BUILD_TESTS=OFF && cmake --build build-prev -j8 \
     --target q4train q4dat) >"$out/prev-build.log" 2>&1 &
  (q4_gpu_configure . build-gpu -DQ4_BUILD_TESTS=${BUILD_TESTS:-OFF} && cmake --build build-gpu -j8 \
     --target q4train q4dat) >"$out/build.log" 2>&1
  wait || true
fi
work=/tmp/q4-speed-ab; mkdir -p "$work"
[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/q4b.dat" ] || build-gpu/bin/q4dat init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0 >/dev/null
run() {  # run BUILD_DIR TREE NAME
  local b=$1 tree=$2 name=$3
  rm -rf "$work/$name"
  (cd "$tree" && "$root/$b/bin/q4train" --config scripts/bench/bench-4b.yaml \
    --set "model.weights=$work/q4b.dat" --set "data.files=[$work/bench.jsonl]" \
    --set "train.steps=$steps" --set "output.dir=$work/$name") >"$work/$name.log" 2>&1 \
    || { echo "$name failed"; tail -n 20 "$work/$name.log"; return 1; }
  cp "$work/$name/metrics.jsonl" "$out/metrics-$name.jsonl" 2>/dev/null
  python3 - "$work/$name/metrics.jsonl" "$name" <<'PY' | tee -a "$out/speed-ab.txt"
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
tps = [r["tokens_per_s"] for r in m if r["step"] >= 3]
peak = max(r.get("gpu_peak_bytes") or 0 for r in m)
print(f"{sys.argv[2]} {statistics.median(tps):.1f} {peak}")
PY
}
for r in $(seq 1 "${ROUNDS:-2}"); do run build-gpu . "new$r"; run build-prev "$prev" "old$r"; done
python3 - "$out/speed-ab.txt" <<'PY' | tee "$out/speed-ab.md"
import statistics, sys
rows = [l.split() for l in open(sys.argv[1]) if l.strip()]
def side(p): return [(float(t), int(m)) for n, t, m in rows if n.startswith(p)]
new, old = side("new"), side("old")
tn, to = statistics.median(t for t, _ in new), statistics.median(t for t, _ in old)
mn, mo = max(m for _, m in new), max(m for _, m in old)
print("| tree | runs | median tok/s (steps 3..N) | peak GPU memory (GiB) |")
print("|---|---|---|---|")
print(f"| before | {len(old)} | {to:.0f} | {mo / 2**30:.2f} |")
print(f"| after | {len(new)} | {tn:.0f} | {mn / 2**30:.2f} |")
print(f"| after / before | | {tn / to:.4f} | {mn / mo:.4f} |")
PY
