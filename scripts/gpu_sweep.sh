#!/usr/bin/env bash
# Latency of one configuration ladder on the 7B config: eager reference, Triton eager, Triton + CUDA graphs,
# with the transformers baseline in the same run. Results land in $OUT/sweep_<size>.tgz.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
size=${SIZE:-1008x756}
configs='[{"name": "eager-reference", "attention_backend": "reference", "kernel_backend": "torch", "enforce_eager": true},
          {"name": "triton-eager", "attention_backend": "triton", "enforce_eager": true},
          {"name": "triton-graphs", "attention_backend": "triton"}]'
python3 -m flashvlm.cli bench sweep --sweep-scenario "${SCENARIO:-latency}" --configs "$configs" \
  --benchmark-model qwen2-vl-7b --image-size "$size" --num-requests "${N:-3}" --text-tokens 64 --output-tokens 128 \
  --max-num-seqs "${SEQS:-16}" --gpu-memory-utilization 0.5 --max-num-batched-tokens 4096 --max-model-len 4096 \
  --no-progress ${BASELINE:+--baseline transformers} --out "bench_out/sweep_${SCENARIO:-latency}_$size" 2>&1 \
  | grep -v "incorrect regex"
tar czf "${OUT:-/tmp}/sweep_${SCENARIO:-latency}_$size.tgz" bench_out
