#!/usr/bin/env bash
# Bit-identity of training losses between two q4train binaries on CPU: a LoRA run, an online
# distillation run (the teacher: a short run's export) and a preference run, each a few steps
# of the demo configs, with every logged number of metrics.jsonl compared exactly except times.
# For refactors that must not change numerics.
#   scripts/loss_ab.sh BEFORE_BIN AFTER_BIN [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
before=$(realpath "$1"); after=$(realpath "$2"); work=${3:-/tmp/q4-loss-ab}
rm -rf "$work"; mkdir -p "$work"
quiet=(--set eval.prompts=[] --set eval.at_end=false --set eval.at_start=false --set log.every=1
       --set output.checkpoint_every=0 --set output.checkpoint_minutes=0)
"$before" --config configs/demo.yaml "${quiet[@]}" --set train.steps=4 \
  --set output.dir="$work/teacher" --set output.export_path=teacher.dat >"$work/teacher.log" 2>&1
teacher=$work/teacher/teacher.dat
run() {  # run NAME CONFIG SETS...
  local name=$1 config=$2; shift 2
  for side in before after; do
    local bin=$before; [ "$side" = after ] && bin=$after
    "$bin" --config "$config" "${quiet[@]}" --set output.export_path=none \
      --set output.dir="$work/$name-$side" "$@" >"$work/$name-$side.log" 2>&1 \
      || { echo "loss_ab: $name ($side) failed:"; tail -n 5 "$work/$name-$side.log"; exit 1; }
  done
  python3 - "$work/$name-before/metrics.jsonl" "$work/$name-after/metrics.jsonl" "$name" <<'PY'
import json, sys
drop = {"step_ms", "tokens_per_s", "mfu", "eta_s", "rss_bytes", "gpu_peak_bytes",
        "gpu_reserved_bytes"}
a = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
b = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
def keep(r): return {k: v for k, v in r.items() if k not in drop and not k.endswith("_ms")}
same = len(a) == len(b) and all(keep(x) == keep(y) for x, y in zip(a, b))
losses = [r.get("loss") for r in a]
print(f"{sys.argv[3]}: {len(a)} steps, losses {losses[0]!r} .. {losses[-1]!r}: "
      + ("bit-identical" if same else "DIFFERENT"))
if not same:
    for x, y in zip(a, b):
        if keep(x) != keep(y): print("  before", keep(x), "\n  after ", keep(y)); break
    sys.exit(1)
PY
}
run lora configs/demo.yaml --set train.steps=6 --set lora.rank=4
run distill configs/demo.yaml --set train.steps=6 --set train.objective=distill \
  --set distill.teacher="$teacher" --set distill.teacher_config="$PWD/configs/models/demo-tiny.config.json"
run preference configs/demo-preference.yaml --set train.steps=6
