#!/usr/bin/env bash
# The rollout benchmark, one GPU call: a Qwen3-4B-shaped NVFP4 .dat (q4dat init), q4train's
# sampler on it (bench_model: every parameter trainable, as GRPO's full fine-tune) and HF
# transformers generate() on the same weights dequantized to BF16 (peer_hf_generate.py, static
# cache), both sampling 64 prompts x 8 generations x 512 new tokens. Prints one RESULT line each.
#   scripts/bench/rollout_vs_peer.sh [OUT_DIR]
# Env: CONFIG (tests/fixtures/qwen3_4b.config.json), PROMPTS, NUM_GEN, PROMPT_LEN, NEW_TOKENS,
# SKIP_BUILD=1, SKIP_PEER=1, BUILD (build-gpu), PEER_CACHES ("static").
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(mkdir -p "${1:-${OUT:-$root/runs/bench-rollout}}" && cd "${1:-${OUT:-$root/runs/bench-rollout}}" && pwd)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4rollout}
config=${CONFIG:-$root/tests/fixtures/qwen3_4b.config.json}
export PROMPTS=${PROMPTS:-64} NUM_GEN=${NUM_GEN:-8} PROMPT_LEN=${PROMPT_LEN:-128} NEW_TOKENS=${NEW_TOKENS:-512}
mkdir -p "$work"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  q4_phase build q4_gpu_build "$build" "$work/build.log" "q4dat bench_model" -DQ4_BUILD_TESTS=OFF
fi
bin=$build/bin
[ -x "$bin/bench_model" ] || bin=$build/scripts/bench
[ -f "$work/model.dat" ] || q4_phase init "$build/bin/q4dat" init --config "$config" \
  --out "$work/model.dat" --seed 0 >/dev/null
"$bin/bench_model" --config "$config" --weights "$work/model.dat" --prompts "$PROMPTS" \
  --generations "$NUM_GEN" --prompt-len "$PROMPT_LEN" --new-tokens "$NEW_TOKENS" \
  2>&1 | tee "$out/q4train.txt" | grep -E "RESULT|timed"
[ "${SKIP_PEER:-0}" = 1 ] && exit 0
if [ ! -f "$work/hf/model.safetensors" ]; then
  "$build/bin/q4dat" dequantize "$work/model.dat" "$work/bf16.dat" --dtype bf16 >/dev/null
  python3 "$root/scripts/interop/dat_to_safetensors.py" "$work/bf16.dat" "$work/hf" "$config"
  rm -f "$work/bf16.dat"
fi
for c in ${PEER_CACHES:-static}; do
  CACHE=$c python3 "$root/scripts/bench/peer_hf_generate.py" "$work/hf" 2>&1 \
    | tee "$out/peer_$c.txt" | grep -E "RESULT|timed|Error|error" | tail -n 4
done
