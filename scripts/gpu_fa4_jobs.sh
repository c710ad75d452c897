#!/usr/bin/env bash
# Session 7's GPU jobs for FlashAttention-4 (flash-attn-4 importable, a Hopper GPU; results to $OUT).
# On the lent device, install it first as scripts/fa4_bundle.sh says.
#   JOB=verify      the GPU-relevant test folders with FA4 installed, each result line kept in $OUT/verify.log (so a
#                   run cut off at its limit still names its failures)
#   JOB=check       FA4 tests, the kernel table (scripts/gpu_fa4.py), greedy parity with PARITY_FA4=1
#   JOB=latency     1008x756 (20 requests, transformers baseline) and 1344x1344 (8 requests): sdpa+triton vs fa4
#   JOB=throughput  512 requests offline at the default flags (fa4 by auto), then with --attention-backend triton
#                   --vision-attention sdpa
set -uo pipefail
export PYTHONPATH="${PYTHONPATH:-.}" PYTHONUNBUFFERED=1
OUT="${OUT:-/tmp/out}"
mkdir -p "$OUT"
M=(--benchmark-model qwen2-vl-7b --text-tokens 64 --output-tokens 128 --max-model-len 4096)
OURS='[{"name": "triton+sdpa", "attention_backend": "triton", "vision_attention": "sdpa"}, {"name": "fa4"}]'
case "${JOB:-check}" in
  verify)
    timeout "${VERIFY_S:-520}" python3 -m pytest -n 8 -v -rfE -p no:cacheprovider -W ignore::UserWarning \
      tests/kernels tests/unit tests/e2e 2>&1 | grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" \
      > "$OUT/verify.log"
    grep -E "FAILED|ERROR" "$OUT/verify.log" | tail -20
    tail -1 "$OUT/verify.log"
    ;;
  check)
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_flash_attn4.py \
      tests/unit/test_attention_options.py tests/unit/test_vision_attention.py tests/unit/test_cuda_graph_ladder.py \
      2>&1 | tail -15
    timeout 150 python3 scripts/gpu_fa4.py 2>&1 | grep -v "UserWarning\|exe_args" | tail -30
    PARITY_FA4=1 STAGES=parity timeout 240 python3 scripts/gpu_check.py 2>&1 | grep -v "UserWarning\|exe_args" \
      | tail -20
    ;;
  latency)
    timeout 330 python3 -m flashvlm.cli bench sweep --sweep-scenario latency "${M[@]}" --image-size 1008x756 \
      --num-requests 20 --warmup 2 --max-num-seqs 16 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 \
      --baseline transformers --configs "$OURS" --out /tmp/lat1008 2>&1 | grep -v "it/s\]\|req/s\]\|Warn" | tail -12
    timeout 200 python3 -m flashvlm.cli bench sweep --sweep-scenario latency "${M[@]}" --image-size 1344x1344 \
      --num-requests 8 --warmup 2 --max-num-seqs 16 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 \
      --configs "$OURS" --out /tmp/lat1344 2>&1 | grep -v "it/s\]\|req/s\]\|Warn" | tail -10
    tar czf "$OUT/latency.tgz" -C /tmp lat1008 lat1344
    ;;
  throughput)
    for flags in "" "--attention-backend triton --vision-attention sdpa"; do
      # shellcheck disable=SC2086
      timeout 270 python3 -m flashvlm.cli bench throughput "${M[@]}" --image-size 1008x756 --num-requests 512 \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9 $flags \
        --out "/tmp/tp${flags:+_sdpa}" 2>&1 | grep -v "it/s\]\|req/s\]\|Warn" | tail -6
    done
    tar czf "$OUT/throughput.tgz" -C /tmp tp tp_sdpa
    ;;
esac
