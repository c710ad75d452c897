#!/usr/bin/env bash
# The last GPU call of 2026-11-29 (session 3), one job per GPU through scripts/gpu_pair.sh:
#   fresh: the demo model trained from its seed (batch 256, lr 5e-4) in a single budgeted run;
#   cont:  the earlier run's checkpoint (carried in .demo_init/b) trained on for 170 s more, then caching on
#          (with and without waiting for in-flight blocks) vs off at 50% repeated 1008x756 images, 7B config.
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
case $1 in
  fresh)
    python3 -m flashvlm.demo.train --out "$OUT/ckpt_fresh" --time-budget-s "${BUDGET_S:-400}" \
      --max-seconds $(( ${BUDGET_S:-400} + 30 )) --batch-size 256 --lr 5e-4 --seed 0 --log-every 500 --workers 10 \
      --device cuda 2>&1 | tee "$OUT/train_fresh.log" ;;
  cont)
    python3 -m flashvlm.demo.train --out "$OUT/ckpt_cont" --time-budget-s 170 --max-seconds 190 --batch-size 256 \
      --lr 2e-4 --seed 1 --init-from .demo_init/b --log-every 500 --workers 10 --device cuda 2>&1 \
      | tee "$OUT/train_cont.log"
    python3 -m flashvlm.cli bench sweep --sweep-scenario throughput --benchmark-model qwen2-vl-7b \
      --image-size 1008x756 --text-tokens 64 --max-model-len 4096 --max-num-batched-tokens 4096 \
      --gpu-memory-utilization 0.5 --warmup 2 --no-progress --num-requests 64 --repeated-image-ratio 0.5 \
      --output-tokens 16 --max-num-seqs 64 --out "$OUT/cache_tput" --configs '[{"name": "caching-on"},
      {"name": "caching-on-no-wait", "shared_prefix_wait_tokens": 0},
      {"name": "caching-off", "enable_prefix_caching": false, "encoder_cache_tokens": 0}]' 2>&1 \
      | grep -v "incorrect regex" ;;
esac
