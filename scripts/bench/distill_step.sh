#!/usr/bin/env bash
# The cost of a distillation step against the cross-entropy step, one GPU call, at two shapes:
#   4b:  the speed benchmark's training run (scripts/bench/step_vs_peer.sh, bench-4b.yaml: Qwen3-4B
#        shapes, every parameter trainable, 4 x 1024 packed tokens, int8 moments); bar: a
#        distillation step <= 1.25x the cross-entropy step
#   768: the same run on the quality benchmark's Qwen3 of hidden 768 (configs/quality/
#        teacher.config.json: 12 layers, vocabulary 151,936, untied lm_head), 16 x 1024 tokens, where
#        the loss's passes over the (rows, 151,936) logits weigh most; bar: <= 1.5x
# Per shape: cross-entropy, then train.objective=distill with the shape's own .dat as the teacher
# (frozen, bf16 compute: a BF16 teacher's cost; forward KL, and reverse KL), then offline from the
# teacher's top-K file (K = 64, written once by --write-teacher-topk over the same data). Prints
# median step time, tokens/s and peak memory of each and the ratio to the cross-entropy step.
# On CUDA the divergence runs in the fused kernel (docs/model.md#the-loss); to measure the tree
# before it, point BUILD at that tree's build (SKIP_BUILD=1) or use speed_ab.sh.
#   scripts/bench/distill_step.sh [OUT_DIR]
# Env: SHAPES ("768 4b"), BUILD, SKIP_BUILD, STEPS (default 16), WORK.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" distill-step)
work=${WORK:-/tmp/q4bench}
bin=${BUILD:-$root/build-gpu}/bin
export SKIP_PEER=1 SKIP_PROBE=1 WORK=$work
mkdir -p "$work"

# shape_sets SHAPE: the --set arguments of the shape's runs, after step_vs_peer.sh's own.
shape_sets() {
  case $1 in
    4b) echo "" ;;
    768) echo "--set model.config=$root/configs/quality/teacher.config.json --set model.weights=$work/q768.dat --set train.batch_size=16" ;;
  esac
}
teacher_of() { [ "$1" = 4b ] && echo "$work/q4b.dat" || echo "$work/q768.dat"; }

if [ "${SKIP_BUILD:-0}" != 1 ]; then
  q4_gpu_configure . "${BUILD:-$root/build-gpu}" -DQ4_BUILD_TESTS=OFF >"$work/build.log" 2>&1
  cmake --build "${BUILD:-$root/build-gpu}" -j "$(nproc)" --target q4train q4dat \
    >>"$work/build.log" 2>&1 || { tail -n 60 "$work/build.log"; exit 1; }
fi
export SKIP_BUILD=1
[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"

for shape in ${SHAPES:-768 4b}; do
  base=$(shape_sets "$shape")
  dir=$out/$shape
  mkdir -p "$dir"
  [ "$shape" != 768 ] || [ -f "$work/q768.dat" ] || "$bin/q4dat" init \
    --config configs/quality/teacher.config.json --out "$work/q768.dat" --seed 0
  teacher=$(teacher_of "$shape")
  # step_vs_peer.sh's closing peer summary has no peer to read here: its exit status is not ours.
  EXTRA_SET="$base" scripts/bench/step_vs_peer.sh "$dir/sft" >"$dir/sft.txt" 2>&1 || true
  EXTRA_SET="$base --set train.objective=distill --set distill.teacher=$teacher" \
    scripts/bench/step_vs_peer.sh "$dir/distill" >"$dir/distill.txt" 2>&1 || true
  EXTRA_SET="$base --set train.objective=distill --set distill.teacher=$teacher --set distill.divergence=reverse_kl --set distill.temperature=2" \
    scripts/bench/step_vs_peer.sh "$dir/reverse" >"$dir/reverse.txt" 2>&1 || true
  rm -f "$work/topk-$shape.dat"
  # shellcheck disable=SC2086
  "$bin/q4train" --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
    --set "data.files=[$work/bench.jsonl]" $base --set "output.dir=$work/topk-write" \
    --set train.objective=distill --set "distill.teacher=$teacher" \
    --set "distill.topk_file=$work/topk-$shape.dat" --set distill.topk=64 --write-teacher-topk \
    >"$dir/topk-write.txt" 2>&1 || { tail -n 20 "$dir/topk-write.txt"; q4_die "top-K write failed"; }
  EXTRA_SET="$base --set train.objective=distill --set distill.topk_file=$work/topk-$shape.dat" \
    scripts/bench/step_vs_peer.sh "$dir/topk" >"$dir/topk.txt" 2>&1 || true
  for r in sft distill reverse topk; do
    [ -s "$dir/$r/train-metrics.jsonl" ] || { tail -n 30 "$dir/$r.txt"; q4_die "$shape $r run failed"; }
  done
done

python3 - "$out" ${SHAPES:-768 4b} <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, shapes = sys.argv[1], sys.argv[2:]
bars = {"768": 1.5, "4b": 1.25}
def stats(shape, name):
    m = [json.loads(l) for l in open(f"{out}/{shape}/{name}/train-metrics.jsonl") if '"step_ms"' in l]
    ms = statistics.median(r["step_ms"] for r in m if r["step"] >= 3)
    tps = statistics.median(r["tokens_per_s"] for r in m if r["step"] >= 3)
    peak = max((r.get("gpu_peak_bytes") or 0) for r in m) / 2**30
    return ms, tps, peak
print("| shape | objective | median step ms | tokens/s | peak GiB | step vs cross-entropy | bar |")
print("|---|---|---|---|---|---|---|")
for shape in shapes:
    base = stats(shape, "sft")[0]
    for name, label in (("sft", "cross_entropy"), ("distill", "distill forward_kl T=1"),
                        ("reverse", "distill reverse_kl T=2"), ("topk", "distill top-64 file")):
        ms, tps, peak = stats(shape, name)
        bar = "" if name == "sft" else f"<= {bars[shape]}x"
        print(f"| {shape} | {label} | {ms:.1f} | {tps:,.0f} | {peak:.1f} | {ms / base:.3f}x | {bar} |")
PY
