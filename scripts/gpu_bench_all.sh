#!/usr/bin/env bash
# The issue 3/4 GPU runs in one go: latency sweeps at three image sizes and an offline throughput sweep, each with
# the eager reference path, the Triton + CUDA-graph path and the transformers baseline. Results: $OUT/*.tgz.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
configs='[{"name": "eager-reference", "attention_backend": "reference", "kernel_backend": "torch", "enforce_eager": true}, {"name": "triton-graphs", "attention_backend": "triton"}]'
run() {  # scenario size requests max_num_seqs
  python3 -m flashvlm.cli bench sweep --sweep-scenario "$1" --configs "$configs" --benchmark-model qwen2-vl-7b \
    --image-size "$2" --num-requests "$3" --max-num-seqs "$4" --text-tokens 64 --output-tokens 128 \
    --gpu-memory-utilization 0.5 --max-num-batched-tokens 4096 --max-model-len 4096 --no-progress \
    --baseline transformers --out "bench_out/$1_$2" 2>&1 | grep -v "incorrect regex"
  tar czf "${OUT:-/tmp}/bench_out.tgz" bench_out
}
for size in ${SIZES-448x448 1008x756 1344x1344}; do run latency "$size" "${LAT_N:-3}" 16; done
[ -n "${SKIP_TPUT:-}" ] || run throughput 1008x756 "${TPUT_N:-32}" 32
