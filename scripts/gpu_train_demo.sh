#!/usr/bin/env bash
# Issue 7 on the GPU machine: train the embedded demo model within a time budget, evaluate it with our engine,
# and bring the checkpoint back as $OUT/demo.tgz. TRAIN_BUDGET_S: training seconds (the probe picks --steps);
# BATCH: batch size (128: a step of this small model is launch-bound on the H200, so larger batches are nearly free).
# INIT_FROM=DIR (a carried checkpoint) with SEED=1, 2, ...: continue an earlier run on new scenes.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
python3 -m flashvlm.demo.train --out "$OUT/demo" --time-budget-s "${TRAIN_BUDGET_S:-380}" --max-seconds "$(( ${TRAIN_BUDGET_S:-380} + 45 ))" --batch-size "${BATCH:-128}" \
  --log-every 250 --workers 12 --device cuda --seed "${SEED:-0}" ${INIT_FROM:+--init-from "$INIT_FROM"} 2>&1 \
  | tee "$OUT/train.log"
python3 -m flashvlm.cli eval --model "$OUT/demo" --split test --num-examples 1000 --batch-size 250 \
  --json "$OUT/eval_test.json" 2>&1 | tail -7
# The same on the plain-torch reference path: the fast path must not cost accuracy.
python3 -m flashvlm.cli eval --model "$OUT/demo" --split test --num-examples 200 --batch-size 200 \
  --attention-backend reference --kernel-backend torch --enforce-eager --json "$OUT/eval_ref.json" 2>&1 | tail -7
tar czf "$OUT/demo.tgz" -C "$OUT" demo && rm -rf "$OUT/demo"
ls -la "$OUT"
