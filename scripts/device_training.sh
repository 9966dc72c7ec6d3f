#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack carried (scripts/pack_device.sh makes
# it). The training step through fusedps against local training, in one run, logs to $OUT:
#   1. transport: fusedps-transport-bench (gRPC push and pull with 1 and 8 streams, raw loopback
#      TCP beside them), fp32 and bf16, against a CUDA server;
#   2. examples/train_gpt.py, presets small (19.2M) and gpt2 (85.4M), bf16 autocast: torch's
#      AdamW (two seeds: the run-to-run spread), then RemoteAdamW(overlap=True) against a fresh
#      CUDA server per run: fp32 grads, bf16 grads (+ bf16 pulls), bf16 grads with delay=1,
#      each through a same-host workspace (RemoteAdamW's data_plane "auto"); fp32grpc and
#      bf16grpc (VARIANTS only) the same over gRPC;
#   3. the self-check, python -m fusedps.bench e2e, against a CUDA server;
#   4. the overlap e2e tests on the GPU (FUSEDPS_TEST_DEVICE=cuda) against CUDA servers.
#   5. probe (only when ONLY names it): bench/contention_probe.py.
# A table of step times is printed last (bench/training_report.py).
# Env: ONLY="transport train selfcheck tests" (the parts to run; default all but tuning), PRESETS
# ("small gpt2"), STEPS_small (200), STEPS_gpt2 (100), VARIANTS (every one: local local2 fp32
# bf16 delay), STREAMS (the client's; RemoteAdamW's default otherwise), TRAIN_FLAGS (more flags
# of the remote runs), MPS=1 (the trainer and the server share the GPU through MPS),
# TRAIN_PREFIX and SERVER_PREFIX (commands before the trainer and the server, e.g. "taskset -c
# 0-7"), SERVER_DEVICE (the servers' --device, cuda:0 by default; cuda:1 on a machine of two GPUs puts
# them on their own GPU, the trainer staying on cuda:0), WORKSPACE_DIR (the servers'
# --workspace-dir; /dev/shm by default).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
source scripts/device_lib.sh
PY_PATH=$PWD/.device-pack/python python_env
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, fusedps._native as n; print('torch', torch.__version__, \
'native', n.library() is not None, n.load_error())"
part() { [[ (-z ${ONLY:-} && $1 != tuning && $1 != probe) || " ${ONLY:-} " == *" $1 "* ]]; }
if [[ ${MPS:-0} == 1 ]]; then
  # Trainer and server share the GPU: without MPS their kernels and copies take turns in time
  # slices; with it they run side by side (docs/operations.md, "One GPU for the trainer and the
  # server").
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d && echo "MPS on" || echo "MPS did not start"
  trap 'echo quit | nvidia-cuda-mps-control' EXIT
fi
server_flags=(--device="${SERVER_DEVICE:-cuda:0}" --metrics-listen= --staging-pool-bytes=$((4 << 30))
              ${WORKSPACE_DIR:+--workspace-dir="$WORKSPACE_DIR"})

if part transport; then
  echo "== 1. transport"
  start_server transport fusedps-server "${server_flags[@]}" --param-copy-dtype=bf16 || exit 1
  for dtype in fp32 bf16; do
    timeout 300 .device-pack/run fusedps-transport-bench --target=127.0.0.1:$(cat \
      /tmp/transport.port) --mib=256 --streams=1,8 --iters=5 --dtype=$dtype \
      --prefix=t-$dtype/ | tee "$out/transport_$dtype.txt"
  done
  kill -TERM $server_pid; wait $server_pid
fi

# tuning: fusedps-transport-bench under each FUSEDPS_GRPC_ARGS setting of TUNING_ARGS
# (";"-separated; "-" for none), server and client alike.
if part tuning; then
  echo "== tuning"
  IFS=';' read -ra settings <<< "${TUNING_ARGS:--}"
  for setting in "${settings[@]}"; do
    [[ $setting == - ]] && setting=""
    echo "-- FUSEDPS_GRPC_ARGS=$setting ${TUNING_BENCH_FLAGS:-}"
    FUSEDPS_GRPC_ARGS=$setting start_server tuning fusedps-server "${server_flags[@]}" \
      --max-message-bytes=$((16 << 20)) || continue
    FUSEDPS_GRPC_ARGS=$setting timeout 200 .device-pack/run fusedps-transport-bench \
      --target=127.0.0.1:$(cat /tmp/tuning.port) --mib=256 --streams=1,8 --iters=4 \
      ${TUNING_BENCH_FLAGS:-} | grep gRPC
    kill -TERM $server_pid; wait $server_pid
  done
fi

if part train; then
  echo "== 2. train_gpt"
  for preset in ${PRESETS:-small gpt2}; do
    steps_var=STEPS_$preset
    steps=${!steps_var:-$([[ $preset == small ]] && echo 200 || echo 100)}
    common=(--device cuda --amp bf16 --preset "$preset" --steps "$steps" --timing-warmup 20
            --data .device-pack/jargon.txt.gz --sample-bytes 0 --log-every 50
            --eval-every 0 --eval-batches 4)
    for variant in ${VARIANTS:-local local2 fp32 bf16 delay}; do
      log=$out/train_${preset}_$variant
      case $variant in
        local) ${TRAIN_PREFIX:-} python3 examples/train_gpt.py "${common[@]}" --optimizer torch \
                 --log-json "$log.jsonl" > "$log.txt" 2>&1 ;;
        local2) python3 examples/train_gpt.py "${common[@]}" --optimizer torch --seed 1 \
                  --log-json "$log.jsonl" > "$log.txt" 2>&1 ;;
        *)
          # bf16 pulls read the server's bf16 copy of the params, written by the step's kernel.
          copy=()
          [[ $variant != fp32* ]] && copy=(--param-copy-dtype=bf16)
          start_server "$variant" fusedps-server "${server_flags[@]}" "${copy[@]}" || continue
          flags=(--optimizer remote --overlap --target 127.0.0.1:$(cat /tmp/$variant.port)
                 ${STREAMS:+--streams "$STREAMS"} ${TRAIN_FLAGS:-})
          case $variant in
            fp32grpc) flags+=(--data-plane grpc) ;;
            bf16grpc) flags+=(--grad-dtype bfloat16 --pull-dtype bfloat16 --data-plane grpc) ;;
            bf16) flags+=(--grad-dtype bfloat16 --pull-dtype bfloat16) ;;
            delay) flags+=(--grad-dtype bfloat16 --pull-dtype bfloat16 --delay 1
                           --delay-warmup 10) ;;
          esac
          timeout 400 ${TRAIN_PREFIX:-} python3 examples/train_gpt.py "${common[@]}" "${flags[@]}" \
            --log-json "$log.jsonl" > "$log.txt" 2>&1 || echo "$preset $variant failed"
          kill -TERM $server_pid; wait $server_pid ;;
      esac
      tail -3 "$log.txt" | head -2
    done
  done
fi

if part selfcheck; then
  echo "== 3. self-check"
  start_server selfcheck fusedps-server "${server_flags[@]}" || exit 1
  timeout 300 python3 -m fusedps.bench e2e --target 127.0.0.1:$(cat /tmp/selfcheck.port) \
    --preset small | tee "$out/selfcheck_small.txt"
  kill -TERM $server_pid; wait $server_pid
fi

# probe: local training beside each kind of background load (bench/contention_probe.py).
if part probe; then
  echo "== probe"
  start_server probe fusedps-server "${server_flags[@]}" || exit 1
  port=$(cat /tmp/probe.port)
  timeout 300 python3 bench/contention_probe.py --target 127.0.0.1:$port \
    --preset "${PROBE_PRESET:-gpt2}" ${PROBE_LOADS:+--loads "$PROBE_LOADS"} --bench ".device-pack/run \
    fusedps-transport-bench --target=127.0.0.1:$port --mib=256 --streams=8 --iters=100000" \
    | tee "$out/probe.txt"
  kill -TERM $server_pid; wait $server_pid
fi

if part tests; then
  echo "== 4. overlap tests on the GPU"
  FUSEDPS_TEST_DEVICE=cuda timeout 400 python3 -m pytest \
    -q -p no:cacheprovider tests/e2e/test_overlap.py tests/e2e/test_workspace.py \
    ${TESTS_EXTRA:-} 2>&1 | tail -15 | tee "$out/tests.txt"
fi

python3 bench/training_report.py "$out"
# Every log in one file (the device tool brings back at most 8).
tar -C "$out" -czf "$out/logs.tgz" --exclude=logs.tgz . 2>/dev/null
