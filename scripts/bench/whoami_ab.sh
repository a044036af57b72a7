#!/usr/bin/env bash
# The whoami job (configs/whoami.yaml on a Qwen3-4B-shaped .dat) of this tree and of a baseline
# tree, interleaved on one GPU (new, old, new, old, ...), then one profiled run of each with the
# kernel table and the GPU's idle gaps (kernel_table.py). whoami is host-bound and varies ±15%
# from run to run, so a single run of each says little: compare the interleaved medians.
#   OUT=dir PREV_TREE=/path/to/baseline/tree [ROUNDS=3] scripts/bench/whoami_ab.sh
# (make the baseline with: git archive <commit> | tar -x -C /path/to/baseline/tree)
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
prev=${PREV_TREE:?PREV_TREE: a baseline source tree}
q4_gpu_env
(q4_gpu_configure "$prev" build-prev -DQ4_BUILD_TESTS=OFF && cmake --build build-prev -j8 \
   --target q4train q4dat) >"$out/prev-build.log" 2>&1 &
(q4_gpu_configure . build-gpu -DQ4_BUILD_TESTS=OFF && cmake --build build-gpu -j8 \
   --target q4train q4dat) >"$out/build.log" 2>&1
wait || true
dat=/tmp/q4b-whoami.dat
[ -f "$dat" ] || build-gpu/bin/q4dat init --config tests/fixtures/qwen3_4b.config.json --out "$dat" \
  --seed 0 >/dev/null
run() {  # run BUILD_DIR NAME [EXTRA...]
  local b=$1 name=$2; shift 2
  rm -rf "/tmp/whoami-$name"
  "$b/bin/q4train" --config configs/whoami.yaml \
    --set "model.config=$root/tests/fixtures/qwen3_4b.config.json" \
    --set "model.tokenizer=$root/assets/qwen3/tokenizer.json" --set "model.weights=$dat" \
    --set "output.dir=/tmp/whoami-$name" --set train.steps=30 --set eval.at_start=false \
    --set output.checkpoint_every=0 "$@" >"/tmp/whoami-$name.log" 2>&1
  python3 - "/tmp/whoami-$name/metrics.jsonl" "$name" <<'PY' | tee -a "$out/whoami-ab.txt"
import json, statistics, sys
m = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
ms = [r["step_ms"] for r in m if r["step"] >= 3]
print(f"{sys.argv[2]}: median step (3..30) {statistics.median(ms):.1f} ms, slowest {max(ms):.1f} ms")
PY
}
for r in $(seq 1 "${ROUNDS:-3}"); do run build-gpu "new$r"; run build-prev "old$r"; done
run build-gpu newp --profile-trace /tmp/whoami-new.json
run build-prev oldp --profile-trace /tmp/whoami-old.json
python3 scripts/bench/kernel_table.py /tmp/whoami-new.json 30 >"$out/whoami-new.md"
python3 scripts/bench/kernel_table.py /tmp/whoami-old.json 30 >"$out/whoami-old.md"
head -n 1 "$out/whoami-new.md" "$out/whoami-old.md"
