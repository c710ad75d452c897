#!/usr/bin/env bash
# Issues 5, 6 and 4 (agreement) on the GPU machine: caching on vs off (repeated-image TTFT, follow-up turn TTFT,
# throughput at 50% repeated images), the FCFS-vs-tiers overload run, and 7B token agreement with transformers.
# Carry .whl (fastapi, uvicorn, pydantic). SKIP_AGREEMENT=1 / SKIP_MULTITURN=1 skip
# those runs. Results: $OUT/bench_out.tgz, $OUT/run.log, $OUT/*.json.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT" bench_out
configs='[{"name": "caching-on"}, {"name": "caching-off", "enable_prefix_caching": false, "encoder_cache_tokens": 0}]'
common="--benchmark-model qwen2-vl-7b --image-size 1008x756 --text-tokens 64 --max-model-len 4096 \
  --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 --warmup 2 --no-progress"
sweep() {  # name scenario args...
  local name=$1 scenario=$2; shift 2
  # shellcheck disable=SC2086
  python3 -m flashvlm.cli bench sweep --sweep-scenario "$scenario" --configs "$configs" $common "$@" \
    --out "bench_out/$name" 2>&1 | grep -v "incorrect regex" | tee -a "$OUT/run.log"
  tar czf "$OUT/bench_out.tgz" bench_out
}
sweep cache_latency latency --num-requests 8 --repeated-image-ratio 0.5 --output-tokens 32 --max-num-seqs 16
[ -n "${SKIP_MULTITURN:-}" ] || sweep cache_multiturn multiturn --num-requests 4 --output-tokens 32 --max-num-seqs 16
sweep cache_tput throughput --num-requests 64 --repeated-image-ratio 0.5 --output-tokens 16 --max-num-seqs 64
OUT=$OUT/sla bash scripts/gpu_sla.sh 2>&1 | tee -a "$OUT/run.log"
tar czf "$OUT/bench_out.tgz" bench_out
[ -n "${SKIP_AGREEMENT:-}" ] || python3 scripts/gpu_agreement_7b.py 2>&1 | grep -v "incorrect regex" | tee -a "$OUT/run.log"
