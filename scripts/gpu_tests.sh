#!/usr/bin/env bash
# The test suite on a GPU host, where Triton kernels run compiled and the `slow` tests are taken too
# (tests/conftest.py):
#
#   bash scripts/gpu_tests.sh          # the tests that run on the GPU: tests/kernels, every other test file that
#                                      # picks a CUDA device or skips without one, and the floors (a few minutes)
#   bash scripts/gpu_tests.sh e2e      # the whole selection in two halves, each within a 10-minute command on
#   bash scripts/gpu_tests.sh rest     # one H200 with 16 cores: tests/e2e; kernels, unit, models, quant, floors
#
# Most of tests/e2e checks the engine against transformers on the CPU in float32: CI runs it, and on a GPU host it
# only repeats that work, so the default selection leaves it out.
# Each test's outcome and time goes to $OUT/<name>/durations.txt and each failure's report to
# $OUT/<name>/failures.txt as it happens (pytest --report-dir), so a run stopped at a time limit still says what
# failed; the summary line is in $OUT/<name>/log.txt. Env: OUT (default /tmp/out), WORKERS (pytest-xdist
# processes, 8), THREADS (torch threads per worker, 2: more oversubscribes the cores, which the CPU-side
# transformers references of the parity tests feel most), LIMIT_S (seconds per selection, 570).
# tests/server needs the [serve] extra; where it is installed, add it with EXTRA="tests/server".
set -uo pipefail
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${THREADS:-2}
OUT=${OUT:-/tmp/out}
run_tests() {  # name paths...  (one selection: its folder under $OUT)
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
case "${1:-gpu}" in
  # shellcheck disable=SC2046
  gpu) run_tests gpu tests/kernels $(grep -l cuda tests/unit/*.py tests/models/*.py tests/quant/*.py tests/e2e/*.py) \
         tests/bench/test_floors.py ${EXTRA:-} ;;
  e2e) run_tests e2e tests/e2e ${EXTRA:-} ;;
  rest) run_tests rest tests/kernels tests/unit tests/models tests/quant tests/bench/test_floors.py ;;
  *) echo "usage: bash scripts/gpu_tests.sh [gpu|e2e|rest]" >&2; exit 2 ;;
esac
