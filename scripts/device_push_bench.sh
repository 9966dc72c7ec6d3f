#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack (fusedps-server, fusedps-grpc-sink,
# fusedps-bench) and build/python carried: the three servers of issue 4 under the same client
# load from fusedps-bench, on the same host, in one run, then the table with the ratios. When
# the pack holds fusedps-server-old (another build of fusedps, e.g. a base commit's), it runs
# as a fourth server, "old", with the same flags.
# Env: SERVERS, CLIENTS ("1 4 16"), STREAMS ("1"; e.g. "1 8"), DURATION (8s), SCALE,
# LATENCY_STEPS (200), DEVICE, PEER_DEVICE.
#   fusedps-server --device=cuda:0 | fusedps-grpc-sink (the ceiling) | bench/peers/torch_peer.py
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/build/python
duration=${DURATION:-8s}
rm -f /tmp/*.port
.device-pack/run fusedps-server --listen=127.0.0.1:0 --port-file=/tmp/fusedps.port \
  --device=${DEVICE:-cuda:0} --metrics-listen=127.0.0.1:0 --metrics-port-file=/tmp/metrics.port \
  --staging-pool-bytes=$((4 << 30)) \
  >"$out/server_fusedps.log" 2>&1 &
.device-pack/run fusedps-grpc-sink --listen=127.0.0.1:0 --port-file=/tmp/sink.port \
  >"$out/server_sink.log" 2>&1 &
servers=${SERVERS:-fusedps sink peer}
if [[ -x .device-pack/bin/fusedps-server-old && -z ${SERVERS:-} ]]; then
  servers="fusedps old sink peer"
  .device-pack/run fusedps-server-old --listen=127.0.0.1:0 --port-file=/tmp/old.port \
    --device=${DEVICE:-cuda:0} --metrics-listen= --staging-pool-bytes=$((4 << 30)) \
    >"$out/server_old.log" 2>&1 &
fi
python3 bench/peers/torch_peer.py --listen=127.0.0.1:0 --port-file=/tmp/peer.port \
  --device=${PEER_DEVICE:-cuda} --max-workers=320 >"$out/server_peer.log" 2>&1 &
for s in $servers; do
  for _ in $(seq 1 120); do [[ -s /tmp/$s.port ]] && break; sleep 0.5; done
  [[ -s /tmp/$s.port ]] || { echo "$s did not start"; tail "$out/server_$s.log"; }
done
bench=".device-pack/run fusedps-bench --json --warmup-steps=1"
# fusedps's /metrics, to $1 (its stage durations before and after each load).
scrape() {
  python3 -c "import urllib.request,sys; sys.stdout.write(urllib.request.urlopen(
      'http://127.0.0.1:' + open('/tmp/metrics.port').read().strip() + '/metrics').read().decode())" \
    >"$1" 2>/dev/null || true
}
# STREAMS: each value v sends every push as v concurrent calls (parts) from each client; all
# three servers take parts (the sink answers each part as a push of its own).
for s in $servers; do
  target=127.0.0.1:$(cat /tmp/$s.port)
  for streams in ${STREAMS:-1}; do
    for c in ${CLIENTS:-1 4 16}; do
      echo "== $s gpt2 bf16, $c clients x $streams streams" >&2
      [[ $s == fusedps ]] && scrape "$out/${s}_gpt2_c${c}_s${streams}.before.txt"
      timeout 120 $bench --target=$target --model=gpt2 --scale=${SCALE:-1} --dtype=bf16 \
        --clients=$c --streams=$streams --duration=$duration \
        >"$out/${s}_gpt2_c${c}_s${streams}.json" 2>>"$out/bench_$s.log" || echo "$s c$c s$streams failed"
      [[ $s == fusedps ]] && scrape "$out/${s}_gpt2_c${c}_s${streams}.after.txt"
    done
  done
  echo "== $s 1M latency" >&2
  [[ $s == fusedps ]] && scrape "$out/${s}_1m_c1_s1.before.txt"
  timeout 120 $bench --target=$target --model=synthetic --tensors=1 --numel=1000000 --dtype=bf16 \
    --clients=1 --steps=${LATENCY_STEPS:-200} --warmup-steps=10 \
    >"$out/${s}_1m_c1_s1.json" 2>>"$out/bench_$s.log" || echo "$s 1m failed"
  [[ $s == fusedps ]] && scrape "$out/${s}_1m_c1_s1.after.txt"
done
kill $(jobs -p) 2>/dev/null; wait
python3 bench/push_report.py "$out"
