#!/usr/bin/env bash
# What Ray Serve costs, on a GPU host: the same seeded workload sent by `flashvlm bench serve` first to
# `flashvlm serve` and then to one replica of `flashvlm serve --ray`, same flags, same GPU, one after the other;
# `flashvlm bench compare` of the two at a 5% threshold. Needs the [serve] and [ray] extras (on an air-gapped
# host: scripts/serve_bundle.sh). Results under $OUT (default /tmp/out): direct_<size>_<rate>/ and
# ray_<size>_<rate>/ (bench serve's reports), compare_<size>_<rate>.txt, the servers' logs.
# Env: RATES (req/s, "8 inf": a steady load and everything at once), NUM (requests, 300), SIZES ("448x448"),
# OUTPUT_TOKENS (64), MODEL_ARGS (default: the Qwen2-VL-7B config with random weights), RAY_ARGS (more flags for
# the Ray arm, e.g. "--stream-batching-interval-ms 20"), PORT (8012).
set -o pipefail
OUT=${OUT:-/tmp/out} PORT=${PORT:-8012}
. "$(dirname "$0")/serve_common.sh"
RATES=${RATES:-8 inf} SIZES=${SIZES:-448x448}

bench_serve() {  # size rate num out
  python3 -m flashvlm.cli bench serve --base-url "http://127.0.0.1:$PORT" --served-model bench \
    --num-requests "$3" --request-rate "$2" --image-size "$1" --text-tokens 64 \
    --output-tokens "${OUTPUT_TOKENS:-64}" --seed 0 --no-progress --out "$4" 2>&1 | grep -v "incorrect regex"
}

measure() {  # arm extra-serve-flags...: start the server, warm it, run every rate against it, stop it
  local arm=$1 size rate; shift
  start_server "$arm" --max-num-seqs 64 --max-num-batched-tokens 4096 --max-model-len 4096 "$@" || return 1
  for size in $SIZES; do
    bench_serve "$size" inf 16 "$OUT/warmup_${arm}_$size" > /dev/null  # compiles, graphs, the first routes
    for rate in $RATES; do
      echo "== $arm, $size, $rate req/s"
      bench_serve "$size" "$rate" "${NUM:-300}" "$OUT/${arm}_${size}_$rate" | tail -12
    done
  done
  stop_server
}

measure direct || exit 1
# shellcheck disable=SC2086
measure ray --ray --num-replicas 1 ${RAY_ARGS:-} || exit 1
for size in $SIZES; do
  for rate in $RATES; do
    echo "== ray / direct, $size at $rate req/s (ratio b/a; 5% threshold)"
    python3 -m flashvlm.cli bench compare "$OUT/direct_${size}_$rate/results.json" \
      "$OUT/ray_${size}_$rate/results.json" --threshold 0.05 | tee "$OUT/compare_${size}_$rate.txt"
  done
done
