#!/usr/bin/env bash
# Every table of docs/BENCHMARKS.md from one command, on a GPU host (the Qwen2-VL-7B config with random weights,
# bf16; FlashAttention-4 is used where it is installed). Each job writes its results (results.json, report.md,
# plots, logs) under OUT/<tree>/<job>/.
#
#   bash scripts/bench_suite.sh [--out DIR] [--jobs "latency throughput512 ..."] [--baseline-tree DIR]
#                               [--model DIR | --benchmark-model NAME] [--scale F]
#
#   --out DIR            results folder (default bench_out/suite)
#   --jobs LIST          a subset of: latency throughput512 throughput caching sla agreement kernels profile
#                        vllm quant families structured pruning ray (default: the first seven; roughly half an hour
#                        on one H200, estimated from the jobs' separate runs). families measures Qwen3-VL-8B,
#                        LLaVA-v1.6-Mistral-7B and Fuyu-8B at 1008x756 and a 16-frame video on Qwen2.5-VL-7B and
#                        Qwen3-VL-8B against transformers, and 512 requests of each (about 10 minutes; --model
#                        does not apply); structured times batch-32 decode with and without structured outputs.
#                        vllm runs the throughput and long-prompt
#                        workloads beside vLLM (`--baseline vllm`; VLLM_PYTHON names an interpreter that imports
#                        it, default python3); quant compares bf16 with FP8, INT8 and INT4 weights and an FP8 KV
#                        cache, and times the quantized kernels; pruning times TTFT at 1344x1344 and 1920x1080
#                        with no pruning, pool and divprune at keep ratio 0.25 (divprune also with proportional
#                        attention), and 512 requests of 1344x1344 offline unpruned and with divprune 0.25, with and
#                        without proportional attention (about 6 minutes a model); ray runs scripts/gpu_ray_overhead.sh
#                        at 448x448 and 1008x756 (about 8 minutes)
#   --baseline-tree DIR  a second source tree (e.g. `git worktree add /tmp/before HEAD~1`): each job runs there
#                        first, then here, and OUT/compare_<job>.txt holds `flashvlm bench compare` of the two
#   --model DIR          a checkpoint folder instead of the 7B config (e.g. flashvlm/demo/checkpoint to try the
#                        suite on a CPU: --jobs "latency throughput")
#   --benchmark-model NAME  a random-weight config of `flashvlm bench --benchmark-model` instead of
#                        qwen2-vl-7b (e.g. qwen2.5-vl-7b)
#   --scale F            multiply every request count by F (e.g. 0.25 for a quick pass)
set -uo pipefail
OUT=bench_out/suite JOBS="latency throughput512 throughput caching sla agreement kernels" BASE_TREE="" MODEL="" SCALE=1
BENCH_MODEL=qwen2-vl-7b
while [ $# -gt 0 ]; do
  case $1 in
    --out) OUT=$2; shift 2 ;;
    --jobs) JOBS=$2; shift 2 ;;
    --baseline-tree) BASE_TREE=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --model) MODEL=$(cd "$2" && pwd) || exit 2; shift 2 ;;
    --benchmark-model) BENCH_MODEL=$2; shift 2 ;;
    --scale) SCALE=$2; shift 2 ;;
    -h|--help) sed -n 2,29p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
HERE=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
n() { python3 -c "import sys; print(max(1, round(int(sys.argv[1]) * float(sys.argv[2]))))" "$1" "$SCALE"; }
if [ -n "$MODEL" ]; then M=(--model "$MODEL"); else M=(--benchmark-model "$BENCH_MODEL"); fi
M+=(--text-tokens 64 --max-model-len 4096 --no-progress)
# The path a machine without FlashAttention-4 runs, beside the default (FA4 where it is installed); a CPU runs
# only the default.
OURS='[{"name": "triton+sdpa", "attention_backend": "triton", "vision_attention": "sdpa"}, {"name": "default"}]'
if ! python3 -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then OURS='[{"name": "default"}]'; fi
CACHING='[{"name": "caching-on"}, {"name": "caching-off", "enable_prefix_caching": false, "encoder_cache_tokens": 0}]'

bench() {  # dir args...: one `flashvlm bench` run, its output kept in dir/log.txt
  local dir=$1; shift
  mkdir -p "$dir"
  python3 -m flashvlm.cli bench "$@" --out "$dir" 2>&1 | grep -v "incorrect regex" | tee "$dir/log.txt" | tail -25
}

script() {  # dir script args...: a measurement script of the tree, its output kept in dir/log.txt
  local dir=$1 file=$2; shift 2
  mkdir -p "$dir"
  if [ ! -f "$file" ]; then echo "skipped: $file is not in this tree" | tee "$dir/log.txt"; return 0; fi
  OUT=$dir python3 "$file" "$@" 2>&1 | grep -v "incorrect regex" | tee "$dir/log.txt" | tail -40
}

run_job() {  # job dir: run from inside the tree being measured
  local job=$1 d=$2
  case $job in
    latency)  # one image + 64 text tokens -> 128 tokens, one request at a time: TTFT, TPOT, E2E, stages
      for size in 1008x756 1344x1344; do
        bench "$d/$size" sweep --sweep-scenario latency "${M[@]}" --output-tokens 128 --image-size "$size" \
          --num-requests "$(n 20)" --warmup 2 --max-num-seqs 16 --max-num-batched-tokens 4096 \
          --gpu-memory-utilization 0.5 --baseline transformers --configs "$OURS"
      done ;;
    throughput512)  # 512 requests offline, 1008x756 + 64 -> 128 tokens, at the default flags and without FA4
      bench "$d/default" throughput "${M[@]}" --output-tokens 128 --image-size 1008x756 --num-requests "$(n 512)" \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9
      [ "$OURS" = '[{"name": "default"}]' ] || bench "$d/triton+sdpa" throughput "${M[@]}" --output-tokens 128 \
        --image-size 1008x756 --num-requests "$(n 512)" --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.9 --attention-backend triton --vision-attention sdpa ;;
    throughput)  # 32 requests offline at three image sizes, against transformers' static batches
      for size in 448x448 1008x756 1344x1344; do
        bench "$d/$size" throughput "${M[@]}" --output-tokens 128 --image-size "$size" --num-requests "$(n 32)" \
          --max-num-seqs 32 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 --baseline transformers
      done ;;
    caching)  # prefix + encoder caching on vs off: a repeated image, a follow-up turn, 50% repeated images
      local common=("${M[@]}" --image-size 1008x756 --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5
                    --warmup 2 --configs "$CACHING")
      bench "$d/repeated_image" sweep --sweep-scenario latency "${common[@]}" --num-requests "$(n 8)" \
        --repeated-image-ratio 0.5 --output-tokens 32 --max-num-seqs 16
      bench "$d/multiturn" sweep --sweep-scenario multiturn "${common[@]}" --num-requests "$(n 4)" \
        --output-tokens 32 --max-num-seqs 16
      bench "$d/throughput" sweep --sweep-scenario throughput "${common[@]}" --num-requests "$(n 64)" \
        --repeated-image-ratio 0.5 --output-tokens 16 --max-num-seqs 64 ;;
    sla)  # one overload served FCFS and by the SLA tiers (needs the [serve] extra)
      mkdir -p "$d"
      OUT=$d NUM=$(n 300) MODEL_ARGS="${MODEL:+--model $MODEL}" bash scripts/gpu_sla.sh 2>&1 | tee "$d/log.txt" \
        | tail -40 ;;
    ray)  # one Ray Serve replica against flashvlm serve, the same workload (needs the [serve] and [ray] extras)
      mkdir -p "$d"
      OUT=$d NUM=$(n 300) SIZES="448x448 1008x756" MODEL_ARGS="${MODEL:+--model $MODEL}" \
        bash scripts/gpu_ray_overhead.sh 2>&1 | tee "$d/log.txt" | tail -40 ;;
    agreement)  # greedy tokens against transformers on the same random 7B weights
      script "$d" scripts/gpu_agreement_7b.py ;;
    kernels)  # greedy parity of the backends, kernel times, the decode GEMV, FA4 against cuDNN (if installed)
      script "$d/check" scripts/gpu_check.py
      script "$d/gemv" scripts/gpu_gemv.py
      if python3 -c "import flash_attn.cute" 2> /dev/null; then script "$d/fa4" scripts/gpu_fa4.py; fi ;;
    vllm)  # the throughput and long-prompt workloads beside vLLM, one after the other on the same GPU, the same seeded requests
      local V=(--baseline vllm --baseline-python "${VLLM_PYTHON:-python3}")
      local OFF=(--output-tokens 128 --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.85)
      bench "$d/latency_1008x756" latency "${M[@]}" "${V[@]}" --output-tokens 128 --image-size 1008x756 \
        --num-requests "$(n 20)" --warmup 2 --max-num-seqs 16 --max-num-batched-tokens 4096 \
        --gpu-memory-utilization 0.5
      bench "$d/throughput512_1008x756" throughput "${M[@]}" "${V[@]}" "${OFF[@]}" --image-size 1008x756 \
        --num-requests "$(n 512)"
      bench "$d/throughput256_1920x1080" throughput "${M[@]}" "${V[@]}" "${OFF[@]}" --image-size 1920x1080 \
        --num-requests "$(n 256)"
      bench "$d/throughput256_mix" throughput "${M[@]}" "${V[@]}" "${OFF[@]}" \
        --image-size 448x448:0.3,1008x756:0.4,1920x1080:0.3 --num-requests "$(n 256)"
      bench "$d/long_context" latency --benchmark-model qwen2-vl-7b --no-progress "${V[@]}" --long-context \
        --num-requests "$(n 8)" --warmup 1 --max-model-len 20480 --max-num-seqs 4 \
        --max-num-batched-tokens 20480 --gpu-memory-utilization 0.5 ;;
    quant)  # bf16 against FP8 / INT8 / INT4 weights and an FP8 KV cache (random weights: speed only), kernels
      local Q='[{"name": "bf16"}, {"name": "fp8", "quantization": "fp8"}, {"name": "int8", "quantization": "int8"},
                {"name": "int4", "quantization": "int4"},
                {"name": "fp8+kv-fp8", "quantization": "fp8", "kv_cache_dtype": "fp8"}]'
      bench "$d/latency_1008x756" sweep --sweep-scenario latency "${M[@]}" --output-tokens 128 \
        --image-size 1008x756 --num-requests "$(n 20)" --warmup 2 --max-num-seqs 16 \
        --max-num-batched-tokens 4096 --gpu-memory-utilization 0.5 --configs "$Q"
      bench "$d/throughput512_1008x756" sweep --sweep-scenario throughput "${M[@]}" --output-tokens 128 \
        --image-size 1008x756 --num-requests "$(n 512)" --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.85 --configs '[{"name": "bf16"}, {"name": "fp8", "quantization": "fp8"}]'
      script "$d/fp8_gemv" scripts/gpu_fp8_gemv.py
      script "$d/int8_gemv" scripts/gpu_int8_gemv.py
      script "$d/int4_matmul" scripts/gpu_int4_matmul.py
      QUANTIZATION=fp8 script "$d/agreement_fp8" scripts/gpu_agreement_7b.py
      KV_CACHE_DTYPE=fp8 script "$d/agreement_kv_fp8" scripts/gpu_agreement_7b.py ;;
    profile)  # where a batch-1 request's time goes (kernels, host share)
      script "$d" scripts/gpu_profile.py ;;
    families)  # the other families and video: TTFT and TPOT against transformers, then 512 requests offline
      local F=(--text-tokens 64 --output-tokens 128 --max-model-len 8192 --no-progress)
      local item model input
      for item in qwen3-vl-8b:image llava-v1.6-mistral-7b:image fuyu-8b:image qwen2.5-vl-7b:video qwen3-vl-8b:video; do
        model=${item%%:*} input=(--image-size 1008x756)
        [ "${item##*:}" = video ] && input=(--image-size none --video 16x640x360)
        bench "$d/${model}_${item##*:}_latency" latency --benchmark-model "$model" "${F[@]}" "${input[@]}" \
          --num-requests "$(n 6)" --warmup 2 --gpu-memory-utilization 0.5 --baseline transformers
        bench "$d/${model}_${item##*:}_throughput" throughput --benchmark-model "$model" "${F[@]}" "${input[@]}" \
          --num-requests "$(n 512)" --max-num-seqs 256 --max-num-batched-tokens 8192 --gpu-memory-utilization 0.9
      done ;;
    pruning)  # visual-token pruning against unpruned in the same run: TTFT one request at a time, then offline
      local none='{"name": "none"}' size
      local pool='{"name": "pool-0.25", "mm_token_pruning": "pool", "mm_token_keep_ratio": 0.25}'
      local divprune='{"name": "divprune-0.25", "mm_token_pruning": "divprune", "mm_token_keep_ratio": 0.25}'
      local pa='{"name": "divprune-0.25-pa", "mm_token_pruning": "divprune", "mm_token_keep_ratio": 0.25,
                 "mm_token_proportional_attention": true}'
      for size in 1344x1344 1920x1080; do
        bench "$d/latency_$size" sweep --sweep-scenario latency "${M[@]}" --output-tokens 32 --image-size "$size" \
          --num-requests "$(n 10)" --warmup 2 --max-num-seqs 16 --max-num-batched-tokens 4096 \
          --gpu-memory-utilization 0.5 --configs "[$none, $pool, $divprune, $pa]"
      done
      bench "$d/throughput512_1344x1344" sweep --sweep-scenario throughput "${M[@]}" --output-tokens 128 \
        --image-size 1344x1344 --num-requests "$(n 512)" --max-num-seqs 256 --max-num-batched-tokens 8192 \
        --gpu-memory-utilization 0.85 --configs "[$none, $divprune, $pa]" ;;
    structured)  # batch-32 decode with and without structured outputs (needs xgrammar)
      script "$d" scripts/gpu_structured_throughput.py ;;
    *) echo "unknown job: $job" >&2; return 2 ;;
  esac
}

{
  date -u +"%F %T UTC"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2> /dev/null || echo "no GPU"
  python3 -c "import torch, transformers; print('torch', torch.__version__, '| transformers', transformers.__version__)"
  python3 -c "import flash_attn, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" \
    2> /dev/null || echo "flash-attn-4 not installed"
  echo "tree: $HERE ($(git -C "$HERE" rev-parse --short HEAD 2> /dev/null))"
  [ -z "$BASE_TREE" ] || echo "baseline tree: $BASE_TREE ($(git -C "$BASE_TREE" rev-parse --short HEAD 2> /dev/null))"
} | tee "$OUT/machine.txt"

status=0
for job in $JOBS; do
  trees=("current=$HERE")
  [ -z "$BASE_TREE" ] || trees=("baseline=$BASE_TREE" "current=$HERE")
  for entry in "${trees[@]}"; do
    label=${entry%%=*} tree=${entry#*=}
    echo "== $(date -u +%T) $job ($label)" | tee -a "$OUT/suite.log"
    (cd "$tree" && PYTHONPATH="$tree${PYTHONPATH:+:$PYTHONPATH}" run_job "$job" "$OUT/$label/$job") || status=1
  done
  if [ -n "$BASE_TREE" ]; then
    : > "$OUT/compare_$job.txt"
    while IFS= read -r before; do
      after=$OUT/current/${before#"$OUT/baseline/"}
      [ -f "$after" ] || continue
      echo "## ${before#"$OUT/baseline/"}" >> "$OUT/compare_$job.txt"
      python3 -m flashvlm.cli bench compare "$before" "$after" >> "$OUT/compare_$job.txt" 2>&1
    done < <(find "$OUT/baseline/$job" -name results.json | sort)
    cat "$OUT/compare_$job.txt"
  fi
done
echo "results: $OUT"
exit $status
