#!/usr/bin/env bash
# Long context, one GPU call: trains the speed benchmark's Qwen3-4B-shaped model
# (scripts/bench/bench-4b.yaml, 4.41e9 trainable parameters) on ONE sequence of SEQ tokens
# (default 131,072): a single document made of the public-domain texts of assets/datasets/
# (tools/fetch_datasets.sh), cut to SEQ tokens. Prints each step's time, tok/s, MFU and peak
# memory beside the memory estimate, and writes OUT/long.log and OUT/long-metrics.jsonl.
#   scripts/bench/long_context.sh [OUT_DIR]
# Env: SEQ (131072), STEPS (3), BUILD (build-gpu), SKIP_BUILD=1, STATE (int8), EXTRA_SET.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" long)
build=${BUILD:-$root/build-gpu}
work=${WORK:-/tmp/q4long}
seq=${SEQ:-131072}
mkdir -p "$work"

q4_timed_build "$build" "$work/build.log" "q4train q4dat" -DQ4_BUILD_TESTS=OFF
bin=$build/bin
[ -f "$work/q4b.dat" ] || "$bin/q4dat" init --config tests/fixtures/qwen3_4b.config.json \
  --out "$work/q4b.dat" --seed 0
# One document: every text of the corpora, in file order (about 3M tokens; cut to SEQ).
python3 - "$work/long.jsonl" assets/datasets/moby_dick_train.jsonl assets/datasets/sotu_train.jsonl <<'PY'
import json, sys
texts = [json.loads(l)["text"] for f in sys.argv[2:] for l in open(f) if l.strip()]
with open(sys.argv[1], "w") as f:
    f.write(json.dumps({"text": "\n\n".join(texts)}) + "\n")
PY
rm -rf "$work/train"
"$bin/q4train" --config scripts/bench/bench-4b.yaml --set "model.weights=$work/q4b.dat" \
  --set "data.files=[$work/long.jsonl]" --set data.truncation=cut_right \
  --set "train.seq_len=$seq" --set train.batch_size=1 --set "train.steps=${STEPS:-3}" \
  --set "optim.state=${STATE:-int8}" --set "output.dir=$work/train" ${EXTRA_SET:-} 2>&1 \
  | grep -v "^#\|^  \|^[a-z_]*:$" | tee "$out/long.log" | tail -n 12
cp "$work/train/metrics.jsonl" "$out/long-metrics.jsonl"
python3 - "$out/long-metrics.jsonl" <<'PY'
import json, sys
for r in (json.loads(l) for l in open(sys.argv[1]) if l.strip()):
    peak = r.get("gpu_peak_bytes") or 0
    print(f"step {r['step']}: {r['tokens']} tokens, {r['step_ms'] / 1000:.1f} s, "
          f"{r['tokens_per_s']:.0f} tok/s, mfu {100 * (r.get('mfu') or 0):.1f}%, "
          f"peak {peak / 2**30:.1f} GiB")
PY
