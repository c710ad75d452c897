#!/usr/bin/env bash
# Retrain the shipped demo model on a GPU host (about 8.5 minutes on one H200). Default: retrain the shipped
# checkpoint (flashvlm/demo/checkpoint) from its seeds, with the step counts its training.json records (stage 1
# ran 3531 of a 5255-step schedule, cut by a safety stop; stage 2 1376 of 1814), then evaluate it next to the
# shipped one on the same 1,000 test questions. MODE=single: one budgeted run from scratch instead (BUDGET_S
# seconds of training, batch 256, lr 5e-4). SKIP_SHIPPED=1 evaluates only the retrained model; WORKERS:
# data-loader processes (12). MODE=large: train demo-large with its recipe (flashvlm/demo/variants.py: a fine-tune
# of the shipped embedded model, ~5 minutes of training loop) and evaluate it alone; unpack its demo.tgz into
# flashvlm/demo/checkpoint-large to ship it.
# Results under $OUT (default /tmp/out): demo.tgz (the checkpoint), train.log, eval_*.json.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
common="--batch-size 256 --log-every 500 --workers ${WORKERS:-12} --device cuda"
t0=$(date +%s)
# shellcheck disable=SC2086
if [ "${MODE:-reproduce}" = large ]; then
  SKIP_SHIPPED=1
  python3 -m flashvlm.demo.train --variant demo-large --out "$OUT/demo" $common 2>&1 | tee "$OUT/train.log"
elif [ "${MODE:-reproduce}" = single ]; then
  python3 -m flashvlm.demo.train --out "$OUT/demo" --time-budget-s "${BUDGET_S:-480}" \
    --max-seconds $(( ${BUDGET_S:-480} + 60 )) --lr 5e-4 --seed 0 $common 2>&1 | tee "$OUT/train.log"
else
  python3 -m flashvlm.demo.train --out /tmp/stage1 --steps 3531 --schedule-steps 5255 --lr 5e-4 --seed 0 $common \
    2>&1 | tee "$OUT/train.log"
  python3 -m flashvlm.demo.train --out "$OUT/demo" --init-from /tmp/stage1 --steps 1376 --schedule-steps 1814 \
    --lr 2e-4 --seed 1 $common 2>&1 | tee -a "$OUT/train.log"
fi
echo "training: $(( $(date +%s) - t0 )) s wall-clock, model building and probes included" | tee -a "$OUT/train.log"
models=retrained:$OUT/demo
[ -n "${SKIP_SHIPPED:-}" ] || models="$models shipped:flashvlm/demo/checkpoint"
for m in $models; do
  python3 -m flashvlm.cli eval --model "${m#*:}" --split test --num-examples 1000 --batch-size 250 \
    --json "$OUT/eval_${m%%:*}.json" 2>&1 | tail -6
done
tar czf "$OUT/demo.tgz" -C "$OUT" demo && rm -rf "$OUT/demo"
