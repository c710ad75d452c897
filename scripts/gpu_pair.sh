#!/usr/bin/env bash
# Run two GPU jobs side by side on a two-GPU machine (nvidia-h200-x2), each bounded in time, and bring back one
# archive per job. Usage: bash scripts/gpu_pair.sh SECONDS "job for GPU 0" "job for GPU 1"
# Each job runs with OUT set to its own folder; $OUT/gpu0.tgz and $OUT/gpu1.tgz come back even when a job
# times out (each archive is written after its job ends or is stopped). A job's folders named ckpt_* come back
# as $OUT/gpuN-ckpt_*.tgz.
set -o pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
limit=$1; shift
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
i=0
for job in "$@"; do
  (
    mkdir -p "/tmp/job$i"
    CUDA_VISIBLE_DEVICES=$i OUT=/tmp/job$i timeout "$limit" bash -c "$job" > "/tmp/job$i/job.log" 2>&1
    echo "exit $?" >> "/tmp/job$i/job.log"
    # Checkpoints (folders named ckpt_*) come back one archive each: the 16 MiB cap is per file.
    for ck in /tmp/job$i/ckpt_*; do [ -d "$ck" ] && tar czf "$OUT/gpu$i-$(basename "$ck").tgz" -C "$ck" .; done
    tar czf "$OUT/gpu$i.tgz" --exclude='ckpt_*' -C /tmp "job$i"
  ) &
  i=$((i + 1))
done
wait
for j in $(seq 0 $((i - 1))); do echo "== gpu$j"; grep -v "incorrect regex" "/tmp/job$j/job.log" | tail -40; done
