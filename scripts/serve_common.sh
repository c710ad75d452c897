# Sourced by the scripts that measure a running `flashvlm serve` on a GPU host (gpu_sla.sh, gpu_ray_overhead.sh):
# the model flags, and starting and stopping one server. Reads OUT, MODEL_ARGS (default: the Qwen2-VL-7B config
# with random weights) and PORT; sets SERVER_PID.
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
mkdir -p "$OUT"
if [ -z "${MODEL_ARGS:-}" ]; then
  python3 -c "from flashvlm.bench.model_configs import write_benchmark_model as w; w('qwen2-vl-7b', '/tmp/q7b')"
  MODEL_ARGS="--model /tmp/q7b --load-format dummy --dtype bfloat16 --gpu-memory-utilization 0.6"
fi

start_server() {  # name serve-flags...: `flashvlm serve` on PORT, log in OUT/server_NAME.log; returns once healthy
  local name=$1; shift
  # shellcheck disable=SC2086
  python3 -m flashvlm.cli serve $MODEL_ARGS "$@" --served-model-name bench --port "$PORT" \
    --max-waiting-requests 2000 --disable-log-requests --uvicorn-log-level warning > "$OUT/server_$name.log" 2>&1 &
  SERVER_PID=$!
  for _ in $(seq 900); do
    curl -sf "http://127.0.0.1:$PORT/health" > /dev/null && return 0
    kill -0 $SERVER_PID 2> /dev/null || { echo "server $name died"; tail -30 "$OUT/server_$name.log"; return 1; }
    sleep 0.5
  done
  echo "server $name not healthy after 450 s"; return 1
}

stop_server() {  # SIGTERM (a script's background jobs ignore SIGINT), a minute to stop, then SIGKILL
  kill $SERVER_PID
  for _ in $(seq 120); do kill -0 $SERVER_PID 2> /dev/null || { wait $SERVER_PID 2> /dev/null; return 0; }; sleep 0.5; done
  kill -9 $SERVER_PID 2> /dev/null; wait $SERVER_PID 2> /dev/null
  # A killed `--ray` server leaves its local Ray cluster (and the replicas' GPU memory) behind.
  python3 -m ray.scripts.scripts stop --force > /dev/null 2>&1 || true
}
