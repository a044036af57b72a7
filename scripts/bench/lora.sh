#!/usr/bin/env bash
# LoRA on the GPU, one call: builds, writes the speed benchmark's data and Qwen3-4B-shaped .dat
# (as step_vs_peer.sh), then
#   1. trains the benchmark (scripts/bench/bench-4b.yaml) in full and with rank-16 adapters on
#      every projection, merge-aware and plain (embeddings, norms and lm_head frozen), and prints
#      tokens/s and peak memory of each (summarize_step_vs_peer.py per run); then both adapters
#      again under a 6 GiB budget (guard.max_gpu_gb: recompute by budget);
#   2. checks the plain adapter against peft: a few plain-LoRA steps that also train the norms
#      (the default; the adapter carries them as modules_to_save) with an export, the base's
#      BF16 Hugging Face export (q4dat export-hf --format bf16), and lora_peft_check.py comparing
#      peft's logits with q4grad --adapter's.
#   scripts/bench/lora.sh [OUT_DIR]      Env: BUILD (build-gpu), WORK (/tmp/q4bench), STEPS (8),
#   SKIP_RUNS=1 (only the peft check), SKIP_PEFT=1 (only the runs)
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" lora-bench)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4bench}
steps=${STEPS:-8}
mkdir -p "$work"
q4_gpu_build "$build" "$work/build.log" "q4train q4dat q4grad"
export SKIP_BUILD=1 SKIP_PEER=1 SKIP_PROBE=1 STEPS=$steps BUILD=$build WORK=$work
frozen="--set train.trainable.norms=false --set train.trainable.lm_head=false --set train.trainable.embeddings=false"
if [ "${SKIP_RUNS:-0}" != 1 ]; then
EXTRA_SET="" scripts/bench/step_vs_peer.sh "$out/full" | tail -n 4
EXTRA_SET="--set train.method=lora --set lora.rank=16 $frozen" \
  scripts/bench/step_vs_peer.sh "$out/lora-merge" | tail -n 4
EXTRA_SET="--set train.method=lora --set lora.rank=16 --set lora.merge_aware=false $frozen" \
  scripts/bench/step_vs_peer.sh "$out/lora-plain" | tail -n 4
guard="--set guard.max_gpu_gb=6"
EXTRA_SET="--set train.method=lora --set lora.rank=16 $frozen $guard" \
  scripts/bench/step_vs_peer.sh "$out/lora-merge-6g" | tail -n 4
EXTRA_SET="--set train.method=lora --set lora.rank=16 --set lora.merge_aware=false $frozen $guard" \
  scripts/bench/step_vs_peer.sh "$out/lora-plain-6g" | tail -n 4
fi

# 2. The PEFT adapter against peft.
[ "${SKIP_PEFT:-0}" = 1 ] && exit 0
[ -f "$work/bench.jsonl" ] || python3 scripts/bench/make_bench_data.py >"$work/bench.jsonl"
[ -f "$work/q4b.dat" ] || "$build/bin/q4dat" init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0
rm -rf "$work/peft"
"$build/bin/q4train" --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
  --set "data.files=[$work/bench.jsonl]" --set train.method=lora --set lora.rank=16 \
  --set lora.merge_aware=false --set train.trainable.norms=true \
  --set train.trainable.lm_head=false --set train.trainable.embeddings=false \
  --set train.steps=3 --set optim.lr=1e-3 \
  --set "output.dir=$work/peft" --set "output.export_path=$work/peft/model.dat" \
  >"$out/peft-train.log" 2>&1
[ -d "$work/base-bf16" ] || "$build/bin/q4dat" export-hf "$work/q4b.dat" "$work/base-bf16" \
  --config tests/fixtures/qwen3_4b.config.json --format bf16 >"$out/peft-export.log" 2>&1
python3 scripts/bench/lora_peft_check.py ids "$work/peft-ids.dat" 151936
"$build/bin/q4grad" --config tests/fixtures/qwen3_4b.config.json --weights "$work/q4b.dat" \
  --adapter "$work/peft/model-adapter" --inputs "$work/peft-ids.dat" --out "$work/peft-q4.dat" \
  --overwrite --device cuda | tee -a "$out/peft-check.log"
python3 scripts/bench/lora_peft_check.py compare "$work/base-bf16" "$work/peft/model-adapter" \
  "$work/peft-ids.dat" "$work/peft-q4.dat" --base-dat "$work/q4b.dat" | tee -a "$out/peft-check.log"
