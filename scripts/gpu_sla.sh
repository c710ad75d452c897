#!/usr/bin/env bash
# SLA tiers under overload, on a GPU host: the same overload served first first-come-first-served
# (scripts/sla_fcfs_tiers.yaml: the tiers' labels, one priority) and then by the packaged SLA tiers
# (flashvlm/configs/sla_tiers.yaml), measured by `flashvlm bench serve` with a 20% gold / 80% bronze mix.
# Needs the [serve] extra. Results under $OUT (default /tmp/out): one `bench serve` folder per arm and load,
# the servers' logs and their preemption counters.
# Env: RATES (req/s, each run by both arms; "34 40": past the load at which FCFS still meets gold's target on
# one H200), NUM (requests, 300), MODEL_ARGS (default: the Qwen2-VL-7B config with random weights), SIZE
# (448x448), SEQS (max_num_seqs, 32), OUTPUT_TOKENS (64), PORT (8011).
set -o pipefail
OUT=${OUT:-/tmp/out} PORT=${PORT:-8011}
. "$(dirname "$0")/serve_common.sh"
serve_and_measure() {  # name sla-config-file
  start_server "$1" --max-num-seqs "${SEQS:-32}" --max-num-batched-tokens 4096 --max-model-len 4096 \
    --sla-config "$2" || return 1
  python3 -m flashvlm.cli bench serve --base-url "http://127.0.0.1:$PORT" --served-model bench \
    --num-requests "${NUM:-300}" --request-rate "$RATE" --image-size "${SIZE:-448x448}" --text-tokens 64 \
    --output-tokens "${OUTPUT_TOKENS:-64}" --tier gold:0.2,bronze:0.8 --seed 0 --no-progress \
    --goodput ttft:500 tpot:50 --out "$OUT/sla_$1" 2>&1 | grep -v "incorrect regex"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^flashvlm:(num_preemptions|request_success)' > "$OUT/metrics_$1.txt"
  stop_server
}
for RATE in ${RATES:-34 40}; do
  serve_and_measure "fcfs_$RATE" scripts/sla_fcfs_tiers.yaml
  serve_and_measure "tiered_$RATE" flashvlm/configs/sla_tiers.yaml
done
