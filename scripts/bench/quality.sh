#!/usr/bin/env bash
# The quality benchmark (docs/quality.md), one GPU call: how much of the loss that NVFP4
# post-training quantization (PTQ) costs a model q4train wins back, by QAT (straight-through
# fine-tuning) and by QAD (distillation from the full-precision model), on held-out real text.
#   1. teacher: configs/quality/teacher.yaml, a 75.5M non-embedding Qwen3 trained in plain
#      precision from a random init on State of the Union + Moby-Dick (tools/fetch_datasets.sh)
#   2. PTQ: its linears and lm_head quantized by the export quantizer (q4dat quantize), as shipped
#   3. QAT: PTQ fine-tuned with cross-entropy through the quantizer (configs/quality/finetune.yaml)
#   4. QAD: the same budget with train.objective=distill, the teacher as distill.teacher; and
#      offline: the same from the teacher's top-64 file (q4train --write-teacher-topk)
#   5. LoRA, the same budget: rank-16 adapters on every projection (norms train too, lm_head
#      frozen, lr 5e-4), merge-aware (the merged NVFP4 export is what trained) and plain (its
#      merged export requantized)
#   6. q4eval of the models on the held-out addresses and chapters (1024-token windows),
#      and recovery = (L_PTQ - L_x) / (L_PTQ - L_teacher)
#   scripts/bench/quality.sh [OUT_DIR]
# Env: BUILD (build dir, default build-gpu), SKIP_BUILD=1, WORK (/tmp/q4quality), SKIP_TEACHER=1
# (reuse WORK/teacher), FT_SET (more --set arguments for both fine-tunes), QAD_SET (for QAD only),
# STEPS (fine-tune steps, default the config's).
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" quality)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4quality}
mkdir -p "$work"

q4_timed_build "$build" "$work/build.log" "q4train q4dat q4eval" -DQ4_BUILD_TESTS=OFF
bin=$build/bin
tools/fetch_tokenizer.sh
tools/fetch_datasets.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
cfg=configs/quality
heldout=(assets/datasets/sotu_heldout.jsonl assets/datasets/moby_dick_heldout.jsonl)

# run NAME CONFIG [--set ...]: one q4train run into $work/NAME (its log beside it), its
# metrics.jsonl copied to $out/NAME-metrics.jsonl.
run() {
  local name=$1 t0=$SECONDS
  q4_train_run "$bin" "$work" "$@"
  grep -E "^done:|^peak GPU" "$work/$name.log"
  echo "$name: $((SECONDS - t0)) s, $(grep -c '"step"' "$work/$name/metrics.jsonl") logged steps"
  cp "$work/$name/metrics.jsonl" "$out/$name-metrics.jsonl"
}

[ "${SKIP_TEACHER:-0}" = 1 ] || run teacher "$cfg/teacher.yaml"
[ -f "$out/teacher-metrics.jsonl" ] || cp "$work/teacher/metrics.jsonl" "$out/teacher-metrics.jsonl"
teacher=$work/teacher/model.dat
rm -f "$work/ptq.dat"
"$bin/q4dat" quantize "$teacher" "$work/ptq.dat" --match '(_proj|lm_head)\.weight$' >/dev/null
ft=(--set "model.weights=$work/ptq.dat" ${STEPS:+--set "train.steps=$STEPS"} ${FT_SET:-})
run qat "$cfg/finetune.yaml" "${ft[@]}"
run qad "$cfg/finetune.yaml" "${ft[@]}" --set train.objective=distill \
  --set "distill.teacher=$teacher" ${QAD_SET:-}
# Offline: the teacher's top-64 of every training position, written once per teacher.
if [ "${SKIP_TEACHER:-0}" != 1 ] || [ ! -f "$work/topk.dat" ]; then
  rm -f "$work/topk.dat"
  "$bin/q4train" --config "$cfg/finetune.yaml" "${ft[@]}" --set "output.dir=$work/topk-write" \
    --set train.objective=distill --set "distill.teacher=$teacher" \
    --set "distill.topk_file=$work/topk.dat" --set distill.topk=64 --write-teacher-topk \
    >"$work/topk-write.log" 2>&1 || { tail -n 20 "$work/topk-write.log"; q4_die "top-K write failed"; }
  grep "teacher top-" "$work/topk-write.log"
fi
run qad_topk "$cfg/finetune.yaml" "${ft[@]}" --set train.objective=distill \
  --set "distill.topk_file=$work/topk.dat" ${QAD_SET:-}

lora=(--set train.method=lora --set lora.rank=16 --set train.trainable.lm_head=false
      --set optim.lr=5e-4)
run lora_merge "$cfg/finetune.yaml" "${ft[@]}" "${lora[@]}"
run lora_plain "$cfg/finetune.yaml" "${ft[@]}" "${lora[@]}" --set lora.merge_aware=false
grep -h "plain LoRA: the merged" "$work/lora_plain.log" || true

evaluate() {  # evaluate NAME MODEL_DAT
  "$bin/q4eval" --model "$2" --config "$cfg/teacher.config.json" \
    --tokenizer assets/qwen3/tokenizer.json --data "${heldout[@]}" --seq-len 1024 \
    --truncation split --batch-size 16 --no-exact-match --device cuda --quiet --json \
    >"$work/eval-$1.json"
}
evaluate teacher "$teacher"
evaluate ptq "$work/ptq.dat"
evaluate qat "$work/qat/model.dat"
evaluate qad "$work/qad/model.dat"
evaluate qad_topk "$work/qad_topk/model.dat"
evaluate lora_merge "$work/lora_merge/model.dat"
evaluate lora_plain "$work/lora_plain/model.dat"
python3 - "$out" "$work" <<'EOF' | tee "$out/quality.md"
import json, sys
out, work = sys.argv[1:3]
names = ("teacher", "ptq", "qat", "qad", "qad_topk", "lora_merge", "lora_plain")
ev = {k: json.load(open(f"{work}/eval-{k}.json")) for k in names}
lt, lp = ev["teacher"]["loss"], ev["ptq"]["loss"]
def tokens_per_s(name):
    rows = [json.loads(l) for l in open(f"{out}/{name}-metrics.jsonl") if '"step"' in l]
    rows = [r for r in rows if "tokens_per_s" in r]
    return sum(r["tokens_per_s"] for r in rows[1:]) / max(1, len(rows) - 1) if rows else float("nan")
print(f"held-out tokens: {ev['teacher']['tokens']}")
print("| model | held-out loss | perplexity | recovery | train tokens/s |")
print("|---|---|---|---|---|")
for k, label in (("teacher", "teacher (plain precision)"), ("ptq", "PTQ (NVFP4)"),
                 ("qat", "QAT"), ("qad", "QAD"), ("qad_topk", "QAD, offline top-64"),
                 ("lora_merge", "LoRA r16, merge-aware (merged NVFP4 export)"),
                 ("lora_plain", "LoRA r16, plain (merged, requantized)")):
    l = ev[k]["loss"]
    rec = "" if k in ("teacher", "ptq") else f"{100 * (lp - l) / (lp - lt):.1f}%"
    tps = f"{tokens_per_s(k):,.0f}" if k not in ("ptq",) else ""
    print(f"| {label} | {l:.4f} | {ev[k]['perplexity']:.3f} | {rec} | {tps} |")
print()
for k in ("teacher", "qat", "qad", "qad_topk", "lora_merge", "lora_plain"):  # validation curves (data.eval_files, every eval.every)
    rows = [json.loads(l) for l in open(f"{out}/{k}-metrics.jsonl") if '"val_loss"' in l]
    print(f"{k} validation: " + ", ".join(f"{r['step']}: {r['val_loss']:.4f}" for r in rows))
EOF
