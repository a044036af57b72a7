#!/usr/bin/env bash
# One optimizer round on the lent GPU machine: build this tree (and, with PREV=<dir>, a baseline
# tree, e.g. `git archive <commit>` unpacked there) in parallel, run the CUDA optimizer and quant
# tests (kernels vs CPU, bit for bit) and bench_optim for both trees, alternating baseline/new so
# both see the same card state; optionally (NCU=1) an Nsight Compute pass over one block-kernel
# launch per mode (NCU_PREV=1: also the baseline's), an Nsys kernel summary of the new 4-bit step
# (NSYS=1) and the SASS of the bf16-grad / fp16-master fast block kernels (SASS=1). Logs under
# $OUT. Usage: OUT=... PREV=... scripts/bench/optim_round.sh
set -uo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out)
q4_gpu_env
t0=$(date +%s)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/card.txt"
cfg() { q4_gpu_configure "$1" "$2" >"$out/$3.log" 2>&1; }
prev_pid=""
if [ -n "${PREV:-}" ]; then
  (cfg "$PREV" build-prev prev && cmake --build build-prev -j6 --target bench_optim >>"$out/prev.log" 2>&1) &
  prev_pid=$!
fi
cfg . build-gpu build || { tail -n 30 "$out/build.log"; exit 1; }
cmake --build build-gpu -j12 --target ${TARGETS:-test_optim test_quant bench_optim} \
  >>"$out/build.log" 2>&1 || { grep -E "error" -A3 "$out/build.log" | head -n 60; exit 1; }
echo "build ok in $(( $(date +%s) - t0 )) s"
: >"$out/tests.log"
for t in ${TESTS:-test_optim test_quant}; do
  timeout 120 build-gpu/tests/$t --gtest_filter="*/cuda:*Cuda*" 2>&1 | tail -n 60 >>"$out/tests.log"
done
grep -E "^\[  (PASSED|FAILED) |FAILED|Failure|fp32-master" "$out/tests.log" | head -n 40
if [ -n "$prev_pid" ]; then
  wait "$prev_pid" || { tail -n 20 "$out/prev.log"; }
  echo "prev build done at $(( $(date +%s) - t0 )) s"
fi
b="--modes ${MODES:-int8,4bit,fp32} --steps ${STEPS:-10}"
: >"$out/bench.txt"
for r in 1 ${ROUNDS2:-}; do
  if [ -x build-prev/bin/bench_optim ]; then
    echo "== prev (round $r)" >>"$out/bench.txt"
    timeout 120 build-prev/bin/bench_optim $b >>"$out/bench.txt" 2>&1
  fi
  echo "== new (round $r)" >>"$out/bench.txt"
  timeout 120 build-gpu/bin/bench_optim $b >>"$out/bench.txt" 2>&1
done
grep -E "==|mode=|baseline" "$out/bench.txt"
echo "bench done at $(( $(date +%s) - t0 )) s"
ncu_one() {  # tree mode
  timeout 60 ncu --clock-control none -k regex:adamw_block_kernel --launch-skip 0 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section InstructionStats --section SchedulerStats \
    "$1"/bin/bench_optim --modes $2 --layers 1 --steps 2 --warmup 1 >"$out/ncu-$3-$2.txt" 2>&1
  echo "-- ncu $3 $2"
  grep -E "Duration|DRAM Throughput|Compute \(SM\)|Issued Warp Per|Achieved Occupancy|Executed Instructions  " \
    "$out/ncu-$3-$2.txt" | head -n 8
}
if [ "${NCU:-0}" = 1 ] && command -v ncu >/dev/null; then
  for m in int8 4bit; do
    ncu_one build-gpu $m new
    if [ "${NCU_PREV:-0}" = 1 ] && [ -x build-prev/bin/bench_optim ]; then ncu_one build-prev $m prev; fi
  done
fi
if [ "${NSYS:-0}" = 1 ] && command -v nsys >/dev/null; then
  timeout 120 nsys profile -o "$out/nsys-4bit" --force-overwrite true \
    build-gpu/bin/bench_optim --modes 4bit --steps 3 --warmup 1 >/dev/null 2>&1
  timeout 120 nsys stats -q --report cuda_gpu_kern_sum --format csv "$out/nsys-4bit.nsys-rep" \
    >"$out/nsys-4bit-kern.csv" 2>&1
  rm -f "$out/nsys-4bit.nsys-rep" "$out/nsys-4bit.sqlite"
  head -n 12 "$out/nsys-4bit-kern.csv" | cut -c1-200
fi
if [ "${SASS:-0}" = 1 ]; then
  obj=$(find build-gpu -name 'adamw_block_kernels.cu.o' | head -n 1)
  cuobjdump -sass "$obj" >/tmp/optim.sass 2>&1
  python3 - "$out" <<'PY'
import re, sys
s = open('/tmp/optim.sass').read()
for part in re.split(r'\n\s*Function : ', s)[1:]:
    name = part.split('\n', 1)[0]
    for tag, key in (('int8', 'adamw_block_kernelILi1ELb0ELb1E13__nv_bfloat166__half'),
                     ('4bit', 'adamw_block_kernelILi2ELb0ELb1E13__nv_bfloat166__half')):
        if key in name:
            open('%s/sass-%s.txt' % (sys.argv[1], tag), 'w').write(part)
            print('sass', tag, part.count('\n'), 'lines')
PY
fi
echo "all done at $(( $(date +%s) - t0 )) s"
