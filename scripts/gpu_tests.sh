#!/usr/bin/env bash
# The test suite on a GPU host, where Triton kernels run compiled and the `slow` tests are taken too
# (tests/conftest.py), in two halves that each fit a 10-minute command on one H200 with 16 cores:
#
#   bash scripts/gpu_tests.sh e2e      # tests/e2e: every family's parity, caching, quantized engines, TP over gloo
#   bash scripts/gpu_tests.sh rest     # kernels, unit, models, quant, the floors
#   bash scripts/gpu_tests.sh          # both, one after the other
#
# Each test's outcome and time goes to $OUT/<half>/durations.txt and each failure's report to
# $OUT/<half>/failures.txt as it happens (pytest --report-dir), so a run stopped at a time limit still says what
# failed; the summary line is in $OUT/<half>/log.txt. Env: OUT (default /tmp/out), WORKERS (pytest-xdist
# processes, 8), THREADS (torch threads per worker, 2: more oversubscribes the cores, which the CPU-side
# transformers references of the parity tests feel most), LIMIT_S (seconds per half, 570).
# tests/server needs the [serve] extra; where it is installed, add it with EXTRA="tests/server".
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2}
OUT=${OUT:-/tmp/out}
run_half() {  # name paths...
  local name=$1; shift
  mkdir -p "$OUT/$name"
  timeout "${LIMIT_S:-570}" python3 -m pytest -q -n "${WORKERS:-8}" -rf -p no:cacheprovider \
    --report-dir "$OUT/$name" "$@" > "$OUT/$name/log.txt" 2>&1
  local rc=$?
  [ $rc -eq 124 ] && echo "$name: stopped at ${LIMIT_S:-570} s" >> "$OUT/$name/log.txt"
  echo "== $name (rc $rc): $(grep -c ' call ' "$OUT/$name/durations.txt" 2>/dev/null || echo 0) tests reported"
  grep -E "^(FAILED|ERROR)|passed|failed|stopped at" "$OUT/$name/log.txt" | tail -30
  grep "^=====" "$OUT/$name/failures.txt" 2>/dev/null
}
case "${1:-all}" in
  e2e) run_half e2e tests/e2e ${EXTRA:-} ;;
  rest) run_half rest tests/kernels tests/unit tests/models tests/quant tests/bench/test_floors.py ;;
  all) run_half e2e tests/e2e ${EXTRA:-}
       run_half rest tests/kernels tests/unit tests/models tests/quant tests/bench/test_floors.py ;;
  *) echo "usage: bash scripts/gpu_tests.sh [e2e|rest|all]" >&2; exit 2 ;;
esac
