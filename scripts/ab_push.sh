#!/usr/bin/env bash
# Runs on the GPU machine with .device-pack (fusedps-server, fusedps-server-old: e.g. a base
# commit's build, fusedps-bench): both servers up at once, the same GPT-2 push loads sent to each
# in alternation, ROUNDS times, so that drift on a shared host hits both alike (the servers of
# `bench/run.py push` run one after the other). Prints each load's throughput, latency and the
# server's CPU time per push (utime + stime from /proc; round 1 includes the registration).
# Env: LOADS ("16x8 4x8": clients x streams), ROUNDS (3), DURATION (6s), DEVICE (cuda:0).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}; mkdir -p "$out"
source scripts/device_lib.sh
declare -A pid port
for v in new old; do
  bin=fusedps-server; [[ $v == old ]] && bin=fusedps-server-old
  start_server "ab_$v" $bin --metrics-listen= --device=${DEVICE:-cuda:0} \
    --staging-pool-bytes=$((4 << 30)) || exit 1
  pid[$v]=$server_pid
  port[$v]=$(cat /tmp/ab_$v.port)
done
cpu() { awk '{print $14 + $15}' /proc/$1/stat; }
tck=$(getconf CLK_TCK)
echo "| round | server | clients x streams | GB/s | pushes/s | p50 ms | p99 ms |" \
  "server CPU ms/push |"
echo "|---|---|---|---:|---:|---:|---:|---:|"
for r in $(seq 1 ${ROUNDS:-3}); do
  for load in ${LOADS:-16x8 4x8}; do
    c=${load%x*}; s=${load#*x}
    for v in new old; do
      a=$(cpu ${pid[$v]})
      .device-pack/run fusedps-bench --json --warmup-steps=1 --target=127.0.0.1:${port[$v]} \
        --model=gpt2 --dtype=bf16 --clients=$c --streams=$s --duration=${DURATION:-6s} \
        >"$out/ab_${v}_${load}_r$r.json" 2>>"$out/ab_$v.log"
      b=$(cpu ${pid[$v]})
      python3 - "$out/ab_${v}_${load}_r$r.json" $((b - a)) $tck $r $v $load <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); ticks, tck = int(sys.argv[2]), int(sys.argv[3])
n = d["timed_pushes"] + d.get("warmup_steps", 0) * d["clients"]
l = d["latency_ms"]
print(f"| {sys.argv[4]} | {sys.argv[5]} | {sys.argv[6]} | {d['gbps']:.3f} | "
      f"{d['pushes_per_s']:.2f} | {l['p50']:.1f} | {l['p99']:.1f} | "
      f"{1000 * ticks / tck / max(n, 1):.1f} |")
PY
    done
  done
done
kill ${pid[new]} ${pid[old]}; wait
