#!/usr/bin/env bash
# Issue 3 GPU runs: latency for three image sizes and offline throughput, Qwen2-VL-7B config, random weights,
# bf16, each with the transformers baseline in the same run. Results land in $OUT/bench_out.tgz.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUTDIR=${OUT:-/tmp}/bench_out_dir
mkdir -p "$OUTDIR"
common=(--benchmark-model qwen2-vl-7b --text-tokens 64 --output-tokens 128 --baseline transformers
        --gpu-memory-utilization 0.5 --max-num-batched-tokens 4096 --max-model-len 4096 --no-progress
        --attention-backend "${ATTN:-reference}" --kernel-backend "${KERN:-torch}")
for size in ${SIZES-448x448 1008x756 1344x1344}; do
  python3 -m flashvlm.cli bench latency "${common[@]}" --image-size "$size" --num-requests "${LAT_N:-3}" \
    --out "bench_out/latency_$size" 2>&1 | grep -v "incorrect regex"
  tar czf "$OUTDIR/../bench_out.tgz" bench_out
done
[ -n "${SKIP_TPUT:-}" ] && exit 0
python3 -m flashvlm.cli bench throughput "${common[@]}" --image-size 1008x756 --num-requests "${TPUT_N:-32}" \
  --max-num-seqs 32 --out bench_out/throughput_1008x756 2>&1 | grep -v "incorrect regex"
tar czf "$OUTDIR/../bench_out.tgz" bench_out
