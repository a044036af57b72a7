#!/usr/bin/env bash
# The fine-tune benchmark (docs/quality.md#the-fine-tune-benchmark): a user's NVFP4 base
# fine-tuned on new task data in q4train, against the peer path "fine-tune in plain precision,
# then quantize (PTQ)". Same token budget per arm, SEEDS (default 1 2 3) per arm.
#   pretrain: configs/quality_ft/pretrain.yaml, a 103.8M non-embedding Qwen3 in plain precision
#             on the corpus of tools/fetch_corpus.sh; its PTQ (q4dat quantize) is the NVFP4 base
#   arms:     configs/quality_ft/finetune.yaml on the SpamAssassin task:
#             a  plain-precision fine-tune of the plain base, then PTQ (the peer path)
#             b  QAT from the NVFP4 base
#             c  QAD from the NVFP4 base, (a)'s model of the same seed (before PTQ) the teacher
#             d  LoRA r16 merge-aware from the NVFP4 base (its merged NVFP4 export)
#             e  (b) with quant.block_rule=4over6
#             b32  (b) with fp32 masters and moments, as (a) has them (the precision confound)
#             bd   (b32) with model.master_init=dither (masters spread inside their rounding
#                  cells instead of on their codes' values; differs from b32 by that alone)
#             cd   (c) with fp32 masters and moments and model.master_init=dither
#   scores:   q4eval of every model: the task's held-out loss (answers of both instructions),
#             spam/ham exact match, the subject-line loss, and forgetting (held-out loss on the
#             pretraining text); scripts/bench/quality_ft_summary.py prints mean +- std per arm
#             and which differences exceed 2 sigma.
#   PHASE=pretrain|arms|all scripts/bench/quality_ft.sh [OUT_DIR]
# Every arm at once does not fit one GPU call of 10 minutes: PHASE=all ARMS="a b c d" (build,
# base, four arms: about 9 minutes on an H200 by the parts measured), then PHASE=arms
# ARMS="e b32 bd cd" on the warm machine, whose WORK (default runs/quality_ft-work, ignored by
# git) still holds the base and (a)'s models; the second call's table has every arm in WORK.
# SMOKE=1: the whole pipeline on CPU with the 64-wide demo model, a few steps and small data
# subsets (under a minute of training).
# Env: BUILD (default build-gpu; build with SMOKE=1), SKIP_BUILD=1, WORK, SEEDS, ARMS (default
# "a b c d e b32 bd cd"; c and cd need (a)'s model of each seed, from this call or WORK),
# STEPS (arm steps),
# PRETRAIN_STEPS, FT_SET (more --set arguments for every arm), EVAL_JOBS (q4eval runs at once
# beside the training, default 4; 1 with SMOKE=1). Needs assets/corpus (tools/fetch_corpus.sh)
# and assets/qwen3 (tools/fetch_tokenizer.sh); OUT_DIR gets at most 6 files.
set -euo pipefail
. "$(dirname "$0")/../lib.sh"
out=$(q4_out_dir "${1:-}" quality_ft)
phase=${PHASE:-all}
smoke=${SMOKE:-0}
work=${WORK:-$root/runs/quality_ft-work}
seeds=(${SEEDS:-1 2 3})
arms=" ${ARMS:-a b c d e b32 bd cd} "
cfg=$root/configs/quality_ft
corpus=$root/assets/corpus
mkdir -p "$work"
case $phase in pretrain|arms|all) ;; *) q4_die "PHASE: pretrain, arms or all, not '$phase'";; esac
for a in $arms; do
  case $a in a|b|c|d|e|b32|bd|cd) ;; *) q4_die "ARMS: a b c d e b32 bd cd, not '$a'";; esac
done
arm() { [[ $arms == *" $1 "* ]]; }  # arm NAME: whether ARMS selects it

if [ "$smoke" = 1 ]; then
  bin=${BUILD:-$root/build}/bin
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  model_cfg=$root/configs/models/demo-tiny.config.json
  device=cpu
  eval_jobs=${EVAL_JOBS:-1}
else
  build=${BUILD:-$root/build-gpu}
  q4_timed_build "$build" "$work/build.log" "q4train q4dat q4eval" -DQ4_BUILD_TESTS=OFF
  bin=$build/bin
  model_cfg=$cfg/base.config.json
  device=cuda
  eval_jobs=${EVAL_JOBS:-4}
fi
[ -f assets/qwen3/tokenizer.json ] || tools/fetch_tokenizer.sh
for f in pretrain_train pretrain_heldout task_train task_cls_heldout task_subject_heldout; do
  [ -f "$corpus/$f.jsonl.xz" ] || q4_die "$corpus/$f.jsonl.xz missing: run tools/fetch_corpus.sh"
done

# The data: the full files next to their .xz (the configs' paths), or with SMOKE=1 small
# subsets in WORK passed by --set (every 8th pretraining document, the first task records).
data_pre=() data_ft=()
d=$work/corpus
mkdir -p "$d"
if [ "$smoke" = 1 ]; then
  subset() {  # subset NAME AWK_PROGRAM OUT: whole lines of assets/corpus/NAME.jsonl.xz
    xz -dc "$corpus/$1.jsonl.xz" >"$d/full.tmp" && awk "$2" "$d/full.tmp" >"$d/$3"
  }
  subset pretrain_train 'NR % 8 == 1 { n += length($0); if (n > 400000) exit; print }' pre.jsonl
  subset pretrain_heldout 'NR == 30' pre_held.jsonl
  subset task_train 'NR % 40 == 1' task.jsonl
  subset task_cls_heldout 'NR <= 6' cls.jsonl
  subset task_subject_heldout 'NR <= 6' subj.jsonl
  rm -f "$d/full.tmp"
  tiny=(--set "model.config=$model_cfg" --set model.device=cpu --set model.compute_dtype=fp32
        --set model.loss_chunk_tokens=64)
  data_pre=("${tiny[@]}" --set "data.files=[$d/pre.jsonl]" --set "data.eval_files=[$d/pre_held.jsonl]"
            --set train.steps="${PRETRAIN_STEPS:-4}" --set train.batch_size=2 --set train.seq_len=64
            --set optim.lr=3e-3 --set optim.schedule.warmup_steps=2 --set eval.every=4 --set log.every=2)
  data_ft=("${tiny[@]}" --set "data.files=[$d/task.jsonl]"
           --set "data.eval_files=[$d/cls.jsonl,$d/subj.jsonl]" --set train.steps="${STEPS:-2}"
           --set train.batch_size=2 --set train.seq_len=256 --set optim.schedule.warmup_steps=1
           --set eval.every=2 --set log.every=1)
  held_cls=$d/cls.jsonl held_subj=$d/subj.jsonl held_pre=$d/pre_held.jsonl
else
  for f in pretrain_train pretrain_heldout task_train task_cls_heldout task_subject_heldout; do
    [ "$corpus/$f.jsonl" -nt "$corpus/$f.jsonl.xz" ] || xz -dkf "$corpus/$f.jsonl.xz"
  done
  data_ft=(${STEPS:+--set "train.steps=$STEPS"})
  data_pre=(${PRETRAIN_STEPS:+--set "train.steps=$PRETRAIN_STEPS"})
  held_cls=$corpus/task_cls_heldout.jsonl held_subj=$corpus/task_subject_heldout.jsonl
  held_pre=$corpus/pretrain_heldout.jsonl
fi

# run NAME CONFIG [--set ...]: one q4train run into $work/NAME (its log beside it).
run() {
  local name=$1 t0=$SECONDS
  q4_train_run "$bin" "$work" "$@"
  echo "$name: $((SECONDS - t0)) s, $(grep -E '^done:' "$work/$name.log" | head -c 160)"
}

# evaluate NAME MODEL_DAT [--no-exact-match]: three q4eval runs in the background (at most
# eval_jobs at once): the spam/ham answers (loss and exact match), the subject lines (loss), the
# pretraining text. The bases are scored without exact match: they never stop after a one-word
# answer, so greedy generation ran every prompt to its limit (minutes, for a score of 0).
evaluate() {
  local name=$1 model=$2 em=${3:-} common
  common=(--model "$model" --config "$model_cfg" --tokenizer assets/qwen3/tokenizer.json
          --device "$device" --quiet --json)
  while [ "$(jobs -rp | wc -l)" -ge "$eval_jobs" ]; do wait -n || true; done
  { "$bin/q4eval" "${common[@]}" --data "$held_cls" --seq-len 512 --batch-size 16 $em \
      >"$work/eval-$name-cls.json" 2>"$work/eval-$name-cls.err" &&
    "$bin/q4eval" "${common[@]}" --data "$held_subj" --seq-len 512 --batch-size 16 \
      --no-exact-match >"$work/eval-$name-subj.json" 2>"$work/eval-$name-subj.err" &&
    "$bin/q4eval" "${common[@]}" --data "$held_pre" --seq-len 1024 --truncation split \
      --batch-size 16 --no-exact-match >"$work/eval-$name-pre.json" 2>"$work/eval-$name-pre.err"
  } &
  if [ "$eval_jobs" = 1 ]; then wait; fi
}

quantize() {  # quantize PLAIN_DAT NVFP4_DAT: the export quantizer, as shipped checkpoints
  rm -f "$2"
  "$bin/q4dat" quantize "$1" "$2" --match '(_proj|lm_head)\.weight$' >/dev/null
}

if [ "$phase" != arms ]; then
  [ "$smoke" = 1 ] || nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
  run base "$cfg/pretrain.yaml" "${data_pre[@]}"
  cp "$work/base/metrics.jsonl" "$out/pretrain-metrics.jsonl"
  quantize "$work/base/model.dat" "$work/base_ptq.dat"
fi
[ -f "$work/base/model.dat" ] && [ -f "$work/base_ptq.dat" ] ||
  q4_die "$work/base/model.dat or base_ptq.dat missing: run PHASE=pretrain first (same WORK)"
# The base's scores are taken in the arms phase, beside the first arms' training.
[ "$phase" != pretrain ] || exit 0
[ -f "$work/eval-base-pre.json" ] || evaluate base "$work/base/model.dat" --no-exact-match
[ -f "$work/eval-base_ptq-pre.json" ] || evaluate base_ptq "$work/base_ptq.dat" --no-exact-match
ft=("${data_ft[@]}" ${FT_SET:-})
nvfp4=(--set "model.weights=$work/base_ptq.dat")
fp32=(--set model.master_dtype=fp32 --set optim.state=fp32)
for s in "${seeds[@]}"; do
  if arm a; then
    run "a$s" "$cfg/finetune.yaml" --set "model.weights=$work/base/model.dat" \
      --set model.fake_quant=false "${fp32[@]}" --set "train.seed=$s" "${ft[@]}"
    quantize "$work/a$s/model.dat" "$work/a${s}_ptq.dat"
    evaluate "a${s}_plain" "$work/a$s/model.dat"
    evaluate "a$s" "$work/a${s}_ptq.dat"
  fi
  if arm b; then
    run "b$s" "$cfg/finetune.yaml" "${nvfp4[@]}" --set "train.seed=$s" "${ft[@]}"
    evaluate "b$s" "$work/b$s/model.dat"
  fi
  if { arm c || arm cd; } && ! arm a && [ ! -f "$work/a$s/model.dat" ]; then
    q4_die "ARMS: c and cd (QAD) need (a)'s model of seed $s as teacher: add a, or keep WORK of a call that ran it"
  fi
  if arm c; then
    run "c$s" "$cfg/finetune.yaml" "${nvfp4[@]}" --set "train.seed=$s" "${ft[@]}" \
      --set train.objective=distill --set "distill.teacher=$work/a$s/model.dat"
    evaluate "c$s" "$work/c$s/model.dat"
  fi
  if arm d; then
    run "d$s" "$cfg/finetune.yaml" "${nvfp4[@]}" --set "train.seed=$s" "${ft[@]}" \
      --set train.method=lora --set lora.rank=16 --set train.trainable.lm_head=false \
      --set optim.lr=1e-3
    evaluate "d$s" "$work/d$s/model.dat"
  fi
  if arm e; then
    run "e$s" "$cfg/finetune.yaml" "${nvfp4[@]}" --set "train.seed=$s" "${ft[@]}" \
      --set quant.block_rule=4over6
    evaluate "e$s" "$work/e$s/model.dat"
  fi
  if arm b32; then
    run "b32_$s" "$cfg/finetune.yaml" "${nvfp4[@]}" "${fp32[@]}" --set "train.seed=$s" "${ft[@]}"
    evaluate "b32_$s" "$work/b32_$s/model.dat"
  fi
  if arm bd; then
    run "bd_$s" "$cfg/finetune.yaml" "${nvfp4[@]}" "${fp32[@]}" --set model.master_init=dither \
      --set "train.seed=$s" "${ft[@]}"
    evaluate "bd_$s" "$work/bd_$s/model.dat"
  fi
  if arm cd; then
    run "cd_$s" "$cfg/finetune.yaml" "${nvfp4[@]}" "${fp32[@]}" --set model.master_init=dither \
      --set "train.seed=$s" "${ft[@]}" --set train.objective=distill \
      --set "distill.teacher=$work/a$s/model.dat"
    evaluate "cd_$s" "$work/cd_$s/model.dat"
  fi
done
wait
for f in "$work"/eval-*.err; do
  [ -s "${f%.err}.json" ] || { cat "$f"; q4_die "q4eval failed: ${f%.err}.json is empty"; }
done
(cd "$work" && tar -czf "$out/runs.tar.gz" ./*.log ./eval-*.json ./*/metrics.jsonl)
python3 "$root/scripts/bench/quality_ft_summary.py" "$work" "${seeds[@]}" |
  tee "$out/quality_ft.md"
