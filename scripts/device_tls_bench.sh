#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack carried (fusedps-server, fusedps-bench,
# and certs/ from tests/integration/make_test_certs.sh): what TLS costs a push. Three servers
# on one GPU, the same flags but the gRPC port's security:
#   plain  plaintext
#   tls    --tls-cert/--tls-key (the clients check the server against the CA)
#   mtls   and --tls-client-ca: the clients present bench-client.crt, whose SANs are the bench's
#          client_ids, so every push also passes the identity check
# Rounds, interleaved (plain, tls, mtls in each): GPT-2 small bf16 pushes from 1 and from 16
# clients (each with each of STREAMS connections) for DURATION each, then LATENCY_STEPS pushes
# of one 1M-parameter bf16 tensor from one client. Each server's /metrics is scraped before and
# after each load (its stage durations). Then bench/tls_report.py prints the table, ratios to
# plain within each round.
# Env: ROUNDS (2), CLIENTS ("1 16"), STREAMS ("1"), DURATION (8s), LATENCY_STEPS (300),
# MODES ("plain tls mtls"), DEVICE (cuda:0),
# GPT2 (the model flags, "--model=gpt2"; e.g. "--model=gpt2 --scale=0.01" for a CPU smoke run).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
certs=${CERTS:-.device-pack/certs}
modes=${MODES:-plain tls mtls}
declare -A server_flags=(
  [plain]=""
  [tls]="--tls-cert=$certs/server.crt --tls-key=$certs/server.key"
  [mtls]="--tls-cert=$certs/server.crt --tls-key=$certs/server.key --tls-client-ca=$certs/ca.crt"
)
declare -A client_flags=(
  [plain]=""
  [tls]="--tls-ca=$certs/ca.crt"
  [mtls]="--tls-ca=$certs/ca.crt --tls-cert=$certs/bench-client.crt
          --tls-key=$certs/bench-client.key"
)
source scripts/device_lib.sh
rm -f /tmp/tls_*.mport
for mode in $modes; do
  # shellcheck disable=SC2086  # flags, one per word
  start_server "tls_$mode" fusedps-server --device=${DEVICE:-cuda:0} \
    --metrics-listen=127.0.0.1:0 --metrics-port-file=/tmp/tls_$mode.mport \
    --staging-pool-bytes=$((4 << 30)) ${server_flags[$mode]}
done
bench=".device-pack/run fusedps-bench --json --warmup-steps=1"
# The /metrics of server $1 to file $2.
scrape() {
  python3 -c "import urllib.request, sys; sys.stdout.write(urllib.request.urlopen(
      'http://127.0.0.1:' + open('/tmp/tls_$1.mport').read().strip() + '/metrics')
      .read().decode())" >"$2" 2>/dev/null || true
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  for mode in $modes; do
    target=localhost:$(cat /tmp/tls_$mode.port)
    for streams in ${STREAMS:-1}; do
      for c in ${CLIENTS:-1 16}; do
        stem=$out/r${round}_${mode}_gpt2_c${c}_s$streams
        echo "== round $round $mode gpt2 bf16, $c clients x $streams streams" >&2
        scrape "$mode" "$stem.before.txt"
        # shellcheck disable=SC2086
        timeout 150 $bench --target=$target ${client_flags[$mode]} ${GPT2:---model=gpt2} \
          --dtype=bf16 --clients=$c --streams=$streams --duration=${DURATION:-8s} \
          >"$stem.json" 2>>"$out/bench_$mode.log" || echo "$stem failed"
        scrape "$mode" "$stem.after.txt"
      done
    done
    stem=$out/r${round}_${mode}_1m_c1_s1
    echo "== round $round $mode 1M latency" >&2
    scrape "$mode" "$stem.before.txt"
    # shellcheck disable=SC2086
    timeout 150 $bench --target=$target ${client_flags[$mode]} --model=synthetic --tensors=1 \
      --numel=1000000 --dtype=bf16 --clients=1 --steps=${LATENCY_STEPS:-300} --warmup-steps=10 \
      >"$stem.json" 2>>"$out/bench_$mode.log" || echo "$stem failed"
    scrape "$mode" "$stem.after.txt"
  done
done
kill $(jobs -p) 2>/dev/null
wait
python3 bench/tls_report.py "$out"
