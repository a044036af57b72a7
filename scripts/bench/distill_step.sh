#!/usr/bin/env bash
# The cost of a distillation step at Qwen3-4B shapes, one GPU call: the speed benchmark's
# training run (scripts/bench/step_vs_peer.sh, bench-4b.yaml: every parameter trainable, 4 x 1024
# packed tokens, checkpointing, int8 moments) with cross-entropy, then the same run with
# train.objective=distill and the benchmark's own 4B .dat as the teacher (frozen, bf16 compute,
# its NVFP4 linears dequantized: a BF16 teacher's cost), then offline from the teacher's top-K
# file (K = 64, written once by --write-teacher-topk over the same data). Prints median step time,
# tokens/s and peak memory of each, and the ratio.
#   scripts/bench/distill_step.sh [OUT_DIR]
# Env: as step_vs_peer.sh (BUILD, SKIP_BUILD, STEPS, WORK).
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" distill-step)
work=${WORK:-/tmp/q4bench}
export SKIP_PEER=1 SKIP_PROBE=1 WORK=$work
# step_vs_peer.sh's closing peer summary has no peer to read here: its exit status is not ours.
scripts/bench/step_vs_peer.sh "$out/sft" >"$out/sft.txt" 2>&1 || true
SKIP_BUILD=1 EXTRA_SET="--set train.objective=distill --set distill.teacher=$work/q4b.dat" \
  scripts/bench/step_vs_peer.sh "$out/distill" >"$out/distill.txt" 2>&1 || true
bin=${BUILD:-$root/build-gpu}/bin
rm -f "$work/topk.dat"
t0=$SECONDS
"$bin/q4train" --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
  --set "data.files=[$work/bench.jsonl]" --set "output.dir=$work/topk-write" \
  --set train.objective=distill --set "distill.teacher=$work/q4b.dat" \
  --set "distill.topk_file=$work/topk.dat" --set distill.topk=64 --write-teacher-topk \
  >"$out/topk-write.txt" 2>&1 || { tail -n 20 "$out/topk-write.txt"; q4_die "top-K write failed"; }
echo "top-K file written in $((SECONDS - t0)) s: $(grep 'teacher top-' "$out/topk-write.txt")" \
  | tee "$out/topk-write.summary"
SKIP_BUILD=1 EXTRA_SET="--set train.objective=distill --set distill.topk_file=$work/topk.dat" \
  scripts/bench/step_vs_peer.sh "$out/topk" >"$out/topk.txt" 2>&1 || true
for r in sft distill topk; do
  [ -s "$out/$r/train-metrics.jsonl" ] || { tail -n 30 "$out/$r.txt"; q4_die "$r run failed"; }
done
python3 - "$out" <<'EOF' | tee "$out/summary.md"
import json, statistics, sys
out = sys.argv[1]
def stats(name):
    m = [json.loads(l) for l in open(f"{out}/{name}/train-metrics.jsonl") if '"step_ms"' in l]
    ms = statistics.median(r["step_ms"] for r in m if r["step"] >= 3)
    tps = statistics.median(r["tokens_per_s"] for r in m if r["step"] >= 3)
    peak = max((r.get("gpu_peak_bytes") or 0) for r in m) / 2**30
    return ms, tps, peak
base = stats("sft")
print("| objective | median step ms | tokens/s | peak GiB | step vs cross-entropy |")
print("|---|---|---|---|---|")
for name, label in (("sft", "cross_entropy"), ("distill", "distill (online, 4B teacher)"),
                    ("topk", "distill (offline, top-64 file)")):
    ms, tps, peak = stats(name)
    print(f"| {label} | {ms:.1f} | {tps:,.0f} | {peak:.1f} | {ms / base[0]:.3f}x |")
EOF
