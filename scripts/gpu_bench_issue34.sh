#!/usr/bin/env bash
# Issues 3 and 4 on the GPU machine, most needed first: throughput at 448x448 and 1344x1344 with the transformers
# baseline, batch-1 latency at 1008x756 with the baseline and at 1344x1344, a profile of where decode and TTFT time goes, 512
# requests offline, and the bf16 parity/kernel check. Results: $OUT/bench_out.tgz, $OUT/*.json, $OUT/run.log.
# Run it on an otherwise idle host: host-bound numbers (TPOT, preprocessing) move with CPU load.
# Env: TPUT_SIZES (throughput sizes; empty skips), LAT_CONFIGS (the 1008x756 sweep's configs), CUDA_TESTS=1 (first run
# the kernel, graph and sampler tests on the GPU), SKIP_CHECK=1 (no gpu_check.py),
# LAT_ONLY=1 (stop after the 1008x756 latency sweep), LAT_REQUESTS (its request count, 5), LAT1344_CONFIGS, SKIP_PROFILE=1,
# TPUT_ONLY=1 (stop after the throughput runs).
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" bench_out
stamp() { echo "== $(date +%T) $*" | tee -a "$OUT/run.log"; }
if [ -n "${CUDA_TESTS:-}" ]; then
  stamp "pytest: kernels, graphs and sampler on the GPU"
  timeout 240 python3 -m pytest -q -x -p no:cacheprovider --timeout 120 tests/kernels tests/unit/test_cuda_graph_ladder.py \
    tests/unit/test_sampler.py 2>&1 | tail -25 | tee -a "$OUT/run.log"
fi
[ -n "${LAT_CONFIGS:-}" ] || LAT_CONFIGS='[{"name": "no-lookahead", "decode_lookahead": false}, {"name": "default"},
  {"name": "default+gpu-preprocess", "preprocess_on_gpu": true}]'
[ -n "${LAT1344_CONFIGS:-}" ] || LAT1344_CONFIGS='[{"name": "default"}, {"name": "default+gpu-preprocess", "preprocess_on_gpu": true}]'
common="--benchmark-model qwen2-vl-7b --text-tokens 64 --output-tokens 128 --max-model-len 4096 --no-progress"
bench() {  # name args...
  local name=$1; shift
  stamp "$name"
  # shellcheck disable=SC2086
  python3 -m flashvlm.cli bench "$@" $common --out "bench_out/$name" 2>&1 | grep -v "incorrect regex" | tee -a "$OUT/run.log"
  tar czf "$OUT/bench_out.tgz" bench_out
}
for size in ${TPUT_SIZES-448x448 1344x1344}; do
  bench "tput_$size" throughput --image-size "$size" --num-requests 32 --max-num-seqs 32 \
    --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 --baseline transformers
done
[ -z "${TPUT_ONLY:-}" ] || exit 0
bench lat_1008x756 sweep --sweep-scenario latency --image-size 1008x756 --num-requests "${LAT_REQUESTS:-5}" --warmup 2 --max-num-seqs 16 \
  --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 --baseline transformers \
  --configs "$LAT_CONFIGS"
[ -z "${LAT_ONLY:-}" ] || exit 0
bench lat_1344x1344 sweep --sweep-scenario latency --image-size 1344x1344 --num-requests 5 --warmup 2 \
  --max-num-seqs 16 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 \
  --configs "$LAT1344_CONFIGS"
stamp profile
[ -n "${SKIP_PROFILE:-}" ] || python3 scripts/gpu_profile.py 2>&1 | grep -v "incorrect regex" | tee -a "$OUT/run.log"
bench tput512_1008x756 throughput --image-size 1008x756 --num-requests 512 --max-num-seqs 256 \
  --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9
[ -n "${SKIP_CHECK:-}" ] && exit 0
stamp gpu_check
python3 scripts/gpu_check.py 2>&1 | grep -v "incorrect regex" | tee -a "$OUT/run.log"
