#!/usr/bin/env bash
# Issue 7: two demo-model trainings side by side on one GPU (the small model's steps are launch-bound, so
# they interleave), each followed by `flashvlm eval` on the test split. Env: BUDGET_S; VARIANT_A / VARIANT_B
# (extra arguments of flashvlm.demo.train). Results: $OUT/a/, $OUT/b/ (train.log, eval json) and the
# checkpoints in $OUT/ckpt_a/, $OUT/ckpt_b/.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
budget=${BUDGET_S:-420}
one() {  # name args...
  local name=$1; shift
  mkdir -p "$OUT/$name"
  python3 -m flashvlm.demo.train --out "$OUT/ckpt_$name" --time-budget-s "$budget" --max-seconds $((budget + 40)) \
    --log-every 250 --workers 6 --device cuda "$@" > "$OUT/$name/train.log" 2>&1
  python3 -m flashvlm.cli eval --model "$OUT/ckpt_$name" --split test --num-examples 1000 --batch-size 250 \
    --gpu-memory-utilization 0.25 --json "$OUT/$name/eval_test.json" > "$OUT/$name/eval.log" 2>&1
  tail -8 "$OUT/$name/eval.log"
}
# shellcheck disable=SC2086
one a ${VARIANT_A:---batch-size 128 --lr 3e-4} &
# shellcheck disable=SC2086
one b ${VARIANT_B:---batch-size 256 --lr 5e-4} &
wait
