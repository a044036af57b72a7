#!/usr/bin/env bash
# LoRA on mixture-of-experts experts against peft, on the GPU machine (python3 with torch,
# transformers 5, peft, safetensors; no network):
#   1. a tiny random Qwen3MoeForCausalLM saved by transformers (peft_moe_check.py make-base),
#      imported to NVFP4 (q4dat import-hf) and exported dequantized (q4dat export-hf --format
#      bf16: exact for the NVFP4 linears);
#   2. per mode (plain, merge-aware): STEPS steps of q4train on configs/demo-moe.yaml's data with
#      train.method lora, lora.targets [q_proj, experts] and the norms trained beside them, which
#      exports the merged .dat and its PEFT folder (<run>/model-adapter);
#   3. q4grad --adapter (q4train's plain-LoRA forward, fp32) and q4grad of the merged export on
#      fixed ids; peft_moe_check.py compare: the folder's keys and shapes against a fresh
#      get_peft_model on this peft, the folder loaded by PeftModel.from_pretrained, and its logits
#      against q4grad's (see the .py's docstring for the tolerance and the controls).
#   scripts/interop/peft_moe_check.sh [OUT_DIR]
# Needs assets/qwen3/tokenizer.json (the demo's tokenizer) and, to build, .debs/ as gpu_check.sh.
# Env: Q4_BUILD (build; q4train, q4dat and q4grad are built there with q4_gpu_build when one is
# missing), WORK (/tmp/q4peftmoe), STEPS (6), MODES ("plain merge"), DEVICE (cuda when nvidia-smi
# sees a GPU, else cpu; on cuda the runs compute in bf16: rank 16 takes the grouped GEMMs).
# Prints one RESULT line per mode; exit 1 when a mode's check fails.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" peft-moe)
build=$(cd "$root" && mkdir -p "${Q4_BUILD:-build}" && cd "${Q4_BUILD:-build}" && pwd)
work=${WORK:-/tmp/q4peftmoe}
steps=${STEPS:-6}
py="python3 $root/scripts/interop/peft_moe_check.py"
if [ -z "${DEVICE:-}" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then DEVICE=cuda; else DEVICE=cpu; fi
fi
mkdir -p "$work"
for tool in q4train q4dat q4grad; do
  if [ ! -x "$build/bin/$tool" ]; then
    q4_log "building q4train q4dat q4grad in $build"
    q4_gpu_env
    q4_gpu_build "$build" "$work/build.log" "q4train q4dat q4grad"
    break
  fi
done
bin=$build/bin
python3 -c 'import torch, transformers, peft, safetensors; print("torch", torch.__version__,
  "transformers", transformers.__version__, "peft", peft.__version__)' | tee "$out/versions.txt"

# 1. The base: transformers' folder, NVFP4 .dat, dequantized BF16 folder.
rm -rf "$work/hf" "$work/base-bf16"
$py make-base "$work/hf" 2>&1 | tee "$out/make-base.log"
"$bin/q4dat" import-hf "$work/hf" "$work/base.dat" --overwrite 2>&1 | tee "$out/import.log"
"$bin/q4dat" export-hf "$work/base.dat" "$work/base-bf16" --config "$work/hf/config.json" \
  --format bf16 2>&1 | tee "$out/export-bf16.log"
vocab=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["vocab_size"])' \
  "$work/hf/config.json")
$py ids "$work/ids.dat" "$vocab"

dev_set=(--set "model.device=$DEVICE")
if [ "$DEVICE" = cuda ]; then
  dev_set+=(--set model.master_dtype=fp32 --set model.compute_dtype=bf16)
fi
fail=0
for mode in ${MODES:-plain merge}; do
  merge=false
  [ "$mode" = merge ] && merge=true
  run=$work/run-$mode
  rm -rf "$run"
  # 2. Training: adapters on q_proj and the experts, the norms trained beside them.
  if ! "$bin/q4train" --config configs/demo-moe.yaml --set model.init=file \
      --set "model.weights=$work/base.dat" --set "model.config=$work/hf/config.json" \
      "${dev_set[@]}" --set train.method=lora --set lora.rank=16 --set lora.alpha=32 \
      --set "lora.targets=[q_proj, experts]" --set "lora.merge_aware=$merge" \
      --set train.trainable.norms=true --set train.trainable.lm_head=false \
      --set train.trainable.embeddings=false --set "train.steps=$steps" --set log.every=1 \
      --set optim.schedule.warmup_steps=1 \
      --set "eval.prompts=[]" --set "output.dir=$run" >"$out/train-$mode.log" 2>&1; then
    tail -n 30 "$out/train-$mode.log"
    q4_die "q4train ($mode) failed: $out/train-$mode.log"
  fi
  grep -E "^step|adapter|LoRA|export check" "$out/train-$mode.log" | tail -n 12 || true
  [ -f "$run/model-adapter/adapter_config.json" ] || q4_die "no $run/model-adapter"
  # 3. q4's logits: the adapter on the base (fp32), and the merged export.
  "$bin/q4grad" --config "$work/hf/config.json" --weights "$work/base.dat" \
    --adapter "$run/model-adapter" --inputs "$work/ids.dat" --out "$work/q4-$mode.dat" \
    --overwrite --device "$DEVICE" 2>&1 | tee "$out/q4grad-$mode.log"
  "$bin/q4grad" --config "$work/hf/config.json" --weights "$run/model.dat" \
    --inputs "$work/ids.dat" --out "$work/q4-merged-$mode.dat" --overwrite \
    --device "$DEVICE" 2>&1 | tee -a "$out/q4grad-$mode.log"
  if ! $py compare "$work/base-bf16" "$run/model-adapter" "$work/ids.dat" "$work/q4-$mode.dat" \
      --base-dat "$work/base.dat" --merged "$work/q4-merged-$mode.dat" --label "$mode" \
      2>&1 | tee "$out/compare-$mode.log"; then
    fail=1
  fi
done
grep -h "^RESULT" "$out"/compare-*.log | tee "$out/results.txt"
[ "$fail" = 0 ] && echo "peft_moe_check: all modes agree with peft" || echo "peft_moe_check: MISMATCH"
exit "$fail"
