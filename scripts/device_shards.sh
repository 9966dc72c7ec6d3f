#!/usr/bin/env bash
# Runs on a GPU machine with two GPUs (device tool, kind nvidia-h200-x2) with .device-pack
# (fusedps-server, fusedps-bench, cuda_backend_test) and build/python carried: issue 12's
# numbers, in one run.
#   1. cuda_backend_test (the sync round's accumulate + mean step among it).
#   2. Aggregate push throughput, GPT-2 small, CLIENTS (16) clients through fusedps-bench's
#      ShardedClient: 1 shard (cuda:0) against 2 shards (cuda:0, cuda:1), ROUNDS times in the
#      order 1,2,2,1,... so that drift hits both alike.
#   3. Sync mode (K = N = CLIENTS) on 2 shards: the round time split into receive, accumulate,
#      apply and ack, from the servers' own fusedps_round_stage_duration_seconds.
# Env: CLIENTS (16), DURATION (20s), ROUNDS (2), SCALE (1). CPUS_A, CPUS_B, CPUS_BENCH: taskset
# core lists for the shard on cuda:0, the one on cuda:1 and fusedps-bench (unset: unpinned), so
# that each shard has cores of its own as on a host of its own; LABEL prefixes the results.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/build/python
source scripts/device_lib.sh
clients=${CLIENTS:-16}
duration=${DURATION:-20s}
nvidia-smi -L | tee "$out/gpus.txt"

if [[ -z ${SKIP_TESTS:-} ]]; then
  echo "== cuda_backend_test" >&2
  .device-pack/run cuda_backend_test >"$out/cuda_backend_test.log" 2>&1
  echo "cuda_backend_test rc=$?" | tee -a "$out/summary.txt"
  tail -3 "$out/cuda_backend_test.log"
fi

common=(--metrics-listen=127.0.0.1:0 --staging-pool-bytes=$((4 << 30)))
# start NAME DEVICE [FLAGS...]: a server with its metrics port in /tmp/NAME.metrics.
start() {
  local name=$1 device=$2 cpus=
  shift 2
  [[ $name == a ]] && cpus=${CPUS_A:-}
  [[ $name == b ]] && cpus=${CPUS_B:-}
  SERVER_PREFIX=${cpus:+taskset -c $cpus} start_server "$name" fusedps-server --device="$device" "${common[@]}" \
    --metrics-port-file="/tmp/$name.metrics" "$@"
}
scrape() {  # scrape NAME FILE
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(
      'http://127.0.0.1:' + open('/tmp/$1.metrics').read().strip() + '/metrics').read().decode())" \
    >"$2" 2>/dev/null || true
}
bench() {  # bench LABEL TARGETS [FLAGS...]
  local label=$1 targets=$2
  shift 2
  echo "== $label: $clients clients, targets $targets" >&2
  timeout 300 ${CPUS_BENCH:+taskset -c $CPUS_BENCH} .device-pack/run fusedps-bench --json --targets="$targets" --model=gpt2 \
    --scale=${SCALE:-1} --dtype=bf16 --clients=$clients --duration=$duration --warmup-steps=1 \
    "$@" >"$out/$label.json" 2>>"$out/bench.log" || echo "$label failed" | tee -a "$out/summary.txt"
}

# 2. Throughput: fresh servers for each measurement (a registered model stays).
for r in $(seq 1 ${ROUNDS:-2}); do
  order="1 2"
  ((r % 2 == 0)) && order="2 1"
  for shards in $order; do
    start a cuda:0 || continue
    targets=127.0.0.1:$(cat /tmp/a.port)
    if [[ $shards == 2 ]]; then
      start b cuda:1 || continue
      targets=$targets,127.0.0.1:$(cat /tmp/b.port)
    fi
    bench "async_s${shards}_r$r" "$targets"
    kill $(jobs -p) 2>/dev/null; wait
  done
done

# 3. Sync rounds on 2 shards: every client pushes every round (K = N = clients).
sync=(--mode=sync --total-replicas=$clients --round-timeout-seconds=5)
start a cuda:0 "${sync[@]}" && start b cuda:1 "${sync[@]}"
targets=127.0.0.1:$(cat /tmp/a.port),127.0.0.1:$(cat /tmp/b.port)
scrape a "$out/sync_a.before.txt"; scrape b "$out/sync_b.before.txt"
bench sync_s2 "$targets"
scrape a "$out/sync_a.after.txt"; scrape b "$out/sync_b.after.txt"
kill $(jobs -p) 2>/dev/null; wait
python3 bench/shard_report.py "$out"
