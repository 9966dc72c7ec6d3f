#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack and build/python carried: the checks
# and measurements of the shard-core issue, old binary against new in the same run. Packed
# executables: the new ones under their names, the base commit's with the suffix -old
# (fusedps-server-old, fusedps-kernel-bench-old). Logs and JSON go to $OUT; tables print last.
#   PARTS="tests kernel readers small"   which sections run (default: all; pushes old against
#   new: scripts/ab_push.sh)
#   DEVICE=cuda:0, DURATION=10s (small steps), SECONDS_PER_LOAD=10 (readers)
#   PIN=1 (readers): the server on cores 0-9, the pushing client on 10-13, the probe on 14-15,
#   as when trainers run on other hosts: the load generator cannot starve the server or probe.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
here=$(pwd)
export PYTHONPATH=$here/build/python
device=${DEVICE:-cuda:0}
parts=" ${PARTS:-tests kernel readers small} "
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv \
  | tee "$out/gpu.txt"
has() { [[ $parts == *" $1 "* ]]; }
pin() { [[ ${PIN:-0} == 1 ]] && echo "taskset -c $1"; }

source scripts/device_lib.sh
SERVER_PREFIX=$(pin 0-9)
# A server (new or old) on the GPU in the background; its port in /tmp/$1.port.
start_gpu_server() {  # name binary [flags...]
  local name=$1 binary=$2
  shift 2
  start_server "$name" "$binary" --metrics-listen= --device="$device" "$@"
}
stop_servers() { kill $(jobs -p) 2>/dev/null; wait 2>/dev/null; }

if has tests; then
  echo "== cuda_backend_test"
  .device-pack/run cuda_backend_test --gtest_brief=1 2>&1 | tee "$out/cuda_backend_test.log" \
    | tail -4
  echo "== metrics_cupti_test"
  .device-pack/run metrics_cupti_test --gtest_brief=1 2>&1 | tee "$out/cupti.log" | tail -2
  printf '#!/usr/bin/env bash\nexec "%s/.device-pack/run" fusedps-server "$@"\n' "$here" \
    >.device-pack/server-wrapper
  chmod +x .device-pack/server-wrapper
  echo "== e2e on --device=$device (PyTorch oracle, contract tests)"
  FUSEDPS_SERVER=$here/.device-pack/server-wrapper FUSEDPS_TEST_DEVICE=$device \
    timeout 500 python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 | tee "$out/e2e.log" \
    | tail -3
fi

if has kernel; then
  for v in "" -old; do
    for dt in fp32 bf16; do
      flags=""; [[ $dt == bf16 ]] && flags="--grad-dtype=bf16 --param-copy=bf16"
      .device-pack/run fusedps-kernel-bench$v --backend=cuda --workload=all --warmup=10 \
        --iters=${ITERS:-50} --json $flags >"$out/kernel${v}_$dt.json" 2>"$out/kernel${v}_$dt.log" \
        || { echo "kernel bench$v $dt failed"; tail -3 "$out/kernel${v}_$dt.log"; }
    done
  done
fi

bench=".device-pack/run fusedps-bench --json --warmup-steps=2"
for v in "" -old; do
  name=new; [[ $v == -old ]] && name=old
  if has readers; then  # GetInfo and a 1 MB pull, from a process of their own, while one
    # client streams GPT-2 small pushes (in 1 or 8 parts), and with no pushes.
    start_gpu_server $name fusedps-server$v --staging-pool-bytes=$((4 << 30)) && {
      t=127.0.0.1:$(cat /tmp/$name.port)
      $bench --target=$t --model=gpt2 --dtype=bf16 --steps=1 >/dev/null 2>&1  # Registers.
      for s in ${READER_STREAMS:-0 1 8}; do  # 0: no pushes, the probe's floor on this host.
        pusher=
        if ((s > 0)); then
          $(pin 10-13) $bench --target=$t --model=gpt2 --dtype=bf16 --register=false \
            --clients=1 --streams=$s --duration=$((${SECONDS_PER_LOAD:-10} + 3))s \
            >"$out/readers_push_${name}_s$s.json" 2>"$out/readers_push_${name}_s$s.log" &
          pusher=$!
          sleep 2
        fi
        timeout 100 $(pin 14-15) $bench --target=$t --clients=0 --probe-interval=5ms \
          --duration=${SECONDS_PER_LOAD:-10}s >"$out/readers_probe_${name}_s$s.json" \
          2>"$out/readers_probe_${name}_s$s.log" || echo "probe $name s$s failed"
        [[ -n $pusher ]] && wait $pusher
      done
    }
    stop_servers
  fi
  if has small; then  # Back-to-back pushes of 10000 x 1K, the whole model, bf16.
    start_gpu_server $name fusedps-server$v && for c in 1 4; do
      timeout 200 $bench --target=127.0.0.1:$(cat /tmp/$name.port) --model=t10000x1k \
        --dtype=bf16 --clients=$c --duration=${DURATION:-10s} \
        >"$out/small_${name}_c$c.json" 2>"$out/small_${name}_c$c.log" \
        || echo "small $name c$c failed"
    done
    stop_servers
  fi
done
python3 bench/core_report.py "$out"
