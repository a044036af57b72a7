#!/usr/bin/env bash
# The cost of a preference step at Qwen3-4B shapes, one GPU call: the speed benchmark's training
# run (scripts/bench/step_vs_peer.sh, bench-4b.yaml: every parameter trainable, recompute by
# memory budget, int8 moments) with cross-entropy on 4 x 1024 packed tokens, then the same run with
# train.objective=preference (DPO) on 400 benchmark preference pairs (make_bench_data.py
# --preference; each answer is one row, rows end to end), 14 rows (7 pairs, about 4,100 tokens) a
# step. Both keep every layer's activations (gradient_checkpointing false: the estimate that auto
# plans with counts rows x seq_len slots, which unpacked rows do not fill). Prints median step time, tokens/s, tokens per step and peak memory of each, and the time
# of the reference pass (the starting model over every answer, once, before step 1).
#   scripts/bench/preference_step.sh [OUT_DIR]
# Env: as step_vs_peer.sh (BUILD, SKIP_BUILD, STEPS, WORK).
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" preference-step)
work=${WORK:-/tmp/q4bench}
mkdir -p "$work"
export SKIP_PEER=1 SKIP_PROBE=1 WORK=$work
[ -f "$work/bench-pref.jsonl" ] ||
  python3 scripts/bench/make_bench_data.py --preference --examples 400 >"$work/bench-pref.jsonl"
# step_vs_peer.sh's closing peer summary has no peer to read here: its exit status is not ours.
EXTRA_SET="--set train.gradient_checkpointing=false" \
  scripts/bench/step_vs_peer.sh "$out/sft" >"$out/sft.txt" 2>&1 || true
SKIP_BUILD=1 EXTRA_SET="--set train.gradient_checkpointing=false --set train.objective=preference --set data.files=[$work/bench-pref.jsonl] \
  --set train.batch_size=14" scripts/bench/step_vs_peer.sh "$out/preference" >"$out/preference.txt" 2>&1 || true
for r in sft preference; do
  [ -s "$out/$r/train-metrics.jsonl" ] || { tail -n 30 "$out/$r.txt"; q4_die "$r run failed"; }
done
grep -h "reference log-probabilities of" "$out/preference/train.log" | tee "$out/reference.txt"
python3 - "$out" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out = sys.argv[1]
def stats(name):
    m = [json.loads(l) for l in open(f"{out}/{name}/train-metrics.jsonl") if '"step_ms"' in l]
    steady = [r for r in m if r["step"] >= 3]
    ms = statistics.median(r["step_ms"] for r in steady)
    tps = statistics.median(r["tokens_per_s"] for r in steady)
    tokens = statistics.median(r["tokens"] for r in steady)
    peak = max((r.get("gpu_peak_bytes") or 0) for r in m) / 2**30
    return ms, tps, tokens, peak
base = stats("sft")
print("| objective | median step ms | tokens/step | tokens/s | peak GiB | tokens/s vs cross-entropy |")
print("|---|---|---|---|---|---|")
for name, label in (("sft", "cross_entropy (4 x 1024 packed)"),
                    ("preference", "preference, DPO (7 pairs, unpacked)")):
    ms, tps, tokens, peak = stats(name)
    print(f"| {label} | {ms:.1f} | {tokens:,.0f} | {tps:,.0f} | {peak:.1f} | {tps / base[1]:.3f}x |")
PY
