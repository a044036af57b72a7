#!/usr/bin/env bash
# One GRPO step at Qwen3-4B shapes and its breakdown, one GPU call: the speed benchmark's model
# (bench-4b.yaml: every parameter trainable, int8 moments; a random q4dat init) trained with
# train.objective=grpo on PROMPTS prompts of ~PROMPT_LEN tokens x NUM_GEN completions of
# NEW_TOKENS tokens per step (a length reward; random weights rarely stop, so nearly every row runs
# to the limit), then the same model supervised over micro-batches of the same shape (rows of
# PROMPT_LEN + NEW_TOKENS tokens, train.batch_size and grad_accum as GRPO's). Prints the median
# GRPO step with its generate / score / train parts (metrics time/generate_s, time/score_s; train
# = the rest) and the supervised step, and their ratio.
#   scripts/bench/grpo_step.sh [OUT_DIR]
# Env: PROMPTS (32), NUM_GEN (8), PROMPT_LEN (128), NEW_TOKENS (512), ROWS (16: rows per
# micro-batch), STEPS (4), BUILD (build-gpu), SKIP_BUILD=1, WORK (/tmp/q4bench), EXTRA_SET.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" grpo-step)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4bench}
prompts=${PROMPTS:-32} gen=${NUM_GEN:-8} plen=${PROMPT_LEN:-128} new=${NEW_TOKENS:-512}
rows=${ROWS:-16} steps=${STEPS:-4}
accum=$(( prompts * gen / rows ))
seq=$(( plen + new + 16 ))
mkdir -p "$work"
if [ "${SKIP_BUILD:-0}" != 1 ]; then
  q4_phase build q4_gpu_build "$build" "$work/build.log" "q4train q4dat" -DQ4_BUILD_TESTS=OFF
fi
bin=$build/bin
[ -f "$work/q4b.dat" ] || "$bin/q4dat" init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0 >/dev/null
# Prompts of ~plen tokens (words from a fixed list, seeded), each with an answer field; the
# supervised rows: the same prompts with a NEW_TOKENS-token answer, one conversation per row.
python3 - "$work" "$plen" "$new" $(( prompts * steps )) <<'PY'
import json, random, sys
work, plen, new, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(0)
words = "the of and to in is was for on that with as by at from this be are an it or".split()
words += "model weight token train group reward answer sample number value".split()
with open(f"{work}/grpo-prompts.jsonl", "w") as p, open(f"{work}/grpo-sft.jsonl", "w") as s:
    for i in range(n):
        q = " ".join(rng.choice(words) for _ in range(plen - 12))
        a = " ".join(rng.choice(words) for _ in range(new - 4))
        p.write(json.dumps({"prompt": [{"role": "user", "content": q}], "answer": "x"}) + "\n")
        s.write(json.dumps({"messages": [{"role": "user", "content": q},
                                         {"role": "assistant", "content": a}]}) + "\n")
PY
common=(--config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat"
        --set "train.steps=$steps" --set "train.batch_size=$rows" --set "train.grad_accum=$accum"
        --set "train.seq_len=$seq" --set data.packing=false ${EXTRA_SET:-})
rm -rf "$work/grpo" "$work/grpo-sft"
"$bin/q4train" "${common[@]}" --set train.objective=grpo --set "grpo.num_generations=$gen" \
  --set "grpo.max_completion_length=$new" --set grpo.loss_type=dapo \
  --set "reward.functions=[{name: length, kind: length, target_tokens: 64}]" \
  --set "data.files=[$work/grpo-prompts.jsonl]" --set "output.dir=$work/grpo" \
  >"$out/grpo.log" 2>&1 || { tail -n 30 "$out/grpo.log"; q4_die "the GRPO run failed"; }
"$bin/q4train" "${common[@]}" --set "data.files=[$work/grpo-sft.jsonl]" \
  --set "output.dir=$work/grpo-sft" >"$out/sft.log" 2>&1 \
  || { tail -n 30 "$out/sft.log"; q4_die "the supervised run failed"; }
cp "$work/grpo/metrics.jsonl" "$out/grpo-metrics.jsonl"
cp "$work/grpo-sft/metrics.jsonl" "$out/sft-metrics.jsonl"
python3 - "$out" "$prompts" "$gen" "$new" <<'PY' | tee "$out/summary.md"
import json, statistics, sys
out, prompts, gen, new = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def rows(name):
    return [json.loads(l) for l in open(f"{out}/{name}-metrics.jsonl") if '"step_ms"' in l]
g, s = rows("grpo"), rows("sft")
med = lambda xs: statistics.median(xs)
later = lambda m: [r for r in m if r["step"] >= 2] or m
step = med([r["step_ms"] / 1e3 for r in later(g)])
gen_s = med([r.get("time/generate_s", 0) for r in later(g)])
score_s = med([r.get("time/score_s", 0) for r in later(g)])
train_s = step - gen_s - score_s
sft = med([r["step_ms"] / 1e3 for r in later(s)])
toks = med([r.get("completions/mean_length", 0) for r in later(g)]) * prompts * gen
print(f"| part | seconds | |\n| --- | --- | --- |")
print(f"| GRPO step ({prompts} prompts x {gen}, {new} new tokens) | {step:.2f} | |")
print(f"| generate | {gen_s:.2f} | {toks / max(gen_s, 1e-9):,.0f} generated tok/s |")
print(f"| score | {score_s:.3f} | |")
print(f"| train | {train_s:.2f} | {train_s / sft:.3f}x the supervised step |")
print(f"| supervised step, same micro-batches | {sft:.2f} | |")
PY
