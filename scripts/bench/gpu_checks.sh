#!/usr/bin/env bash
# GPU-machine checks that need its Python packages (not CI): TensorBoard's own event reader on a
# short CUDA demo run's event file, q4chat on CUDA, and the HF export opened with safetensors and
# transformers and dequantized in Python (scripts/interop/check_hf_export.py) for a 4B-shaped model.
# Usage: OUT=dir scripts/bench/gpu_checks.sh   (build-gpu from scripts/bench/gpu_round.sh)
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
B=build-gpu/bin
work=${WORK:-/tmp/q4checks}; mkdir -p "$work"
{
  echo "== TensorBoard reader on a CUDA demo run"
  $B/q4train --config configs/demo.yaml --set model.device=cuda --set train.steps=60 \
    --set eval.every=30 --set "output.dir=$work/tbcheck" --overwrite >"$work/tb-train.log" 2>&1; echo "q4train rc=$?"
  python3 scripts/bench/read_tfevents.py "$work/tbcheck" --require train/loss train/lr train/grad_norm \
    train/tokens_per_s eval/0; echo "read_tfevents rc=$?"
  echo "== q4chat on CUDA"
  $B/q4chat --model "$work/tbcheck" --prompt 'Who are you?' --temperature 0 --device cuda; echo "q4chat rc=$?"
  echo "== HF export (4B shapes) read by safetensors + transformers"
  [ -f "$work/m.dat" ] || $B/q4dat init --config tests/fixtures/qwen3_4b.config.json --out "$work/m.dat"
  $B/q4dat dequantize "$work/m.dat" "$work/deq.dat" --dtype fp32
  for F in modelopt compressed-tensors; do
    rm -rf "$work/$F"
    /usr/bin/time -f "export-hf $F: %e s, peak RSS %M KB" $B/q4dat export-hf "$work/m.dat" "$work/$F" \
      --config tests/fixtures/qwen3_4b.config.json --format $F
    python3 scripts/interop/check_hf_export.py "$work/$F" "$work/deq.dat"; echo "check $F rc=$?"
    /usr/bin/time -f "import-hf $F: %e s, peak RSS %M KB" $B/q4dat import-hf "$work/$F" "$work/back-$F.dat"
    cmp "$work/m.dat" "$work/back-$F.dat" && echo "round trip $F: byte-identical"
  done
} 2>&1 | tee "$out/gpu-checks.log"
