#!/usr/bin/env bash
# Issue 7: retrain the shipped demo checkpoint (flashvlm/demo/checkpoint) on one H200 from its seeds, with the
# step counts its training.json records, then evaluate it next to the shipped one on the same 1,000 test
# questions. Stage 1 ran 3531 of a 5255-step schedule (a safety stop cut it), stage 2 1376 of 1814.
# Results: $OUT/demo.tgz (the retrained checkpoint), $OUT/train.log, $OUT/eval_*.json.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
t0=$(date +%s)
python3 -m flashvlm.demo.train --out /tmp/stage1 --steps 3531 --schedule-steps 5255 --batch-size 256 --lr 5e-4 \
  --seed 0 --log-every 500 --workers "${WORKERS:-12}" --device cuda 2>&1 | tee "$OUT/train.log"
python3 -m flashvlm.demo.train --out "$OUT/demo" --init-from /tmp/stage1 --steps 1376 --schedule-steps 1814 \
  --batch-size 256 --lr 2e-4 --seed 1 --log-every 500 --workers "${WORKERS:-12}" --device cuda 2>&1 | tee -a "$OUT/train.log"
echo "both stages: $(( $(date +%s) - t0 )) s wall-clock" | tee -a "$OUT/train.log"
for m in retrained:"$OUT/demo" shipped:flashvlm/demo/checkpoint; do
  python3 -m flashvlm.cli eval --model "${m#*:}" --split test --num-examples 1000 --batch-size 250 \
    --json "$OUT/eval_${m%%:*}.json" 2>&1 | tail -6
done
tar czf "$OUT/demo.tgz" -C "$OUT" demo && rm -rf "$OUT/demo"
