#!/usr/bin/env bash
# Runs on the GPU machine with .device-pack (fusedps-server, fusedps, fusedps-bench) and
# build/python: the checkpoint tests against the CUDA backend, then the checkpoint benchmark
# (docs/benchmarks.md, "Checkpoints"):
#   1. GPT-2 small pushes (fusedps-bench, CLIENTS x STREAMS, bf16) to a server that checkpoints
#      every 10 s and to one that does not, in alternation, ROUNDS times: the throughput ratio.
#      Each checkpoint's snapshot (the cut steps wait for) and write come from the server's log.
#   2. Restore: the checkpointing server restarted on its directory, the files' pages dropped
#      from the page cache first (posix_fadvise DONTNEED), so that the restore reads the disk.
#   3. dd on the same disk, same size: sequential write (conv=fsync; and O_DIRECT) and read
#      (cache dropped), idle; and the writes again under the bench's load (no checkpoints).
# Env: PARTS ("tests bench"), ROUNDS (2), DURATION (30s), LOAD (16x8), DEVICE (cuda:0),
# CKPT_DIR (/tmp/fusedps-ckpt: the disk measured).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}; mkdir -p "$out"
source scripts/device_lib.sh
here=$(pwd)
ckpt=${CKPT_DIR:-/tmp/fusedps-ckpt}
device=${DEVICE:-cuda:0}
for exe in fusedps-server fusedps; do
  printf '#!/usr/bin/env bash\nexec %s/.device-pack/run %s "$@"\n' "$here" "$exe" >"/tmp/$exe"
  chmod +x "/tmp/$exe"
done
drop_cache() {  # Drops the page cache of every file under $1 (no root needed).
  python3 - "$1" <<'PY'
import os, sys
for d, _, files in os.walk(sys.argv[1]):
    for f in files:
        fd = os.open(os.path.join(d, f), os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
PY
}

if [[ " ${PARTS:-tests bench} " == *" tests "* ]]; then
  echo "== cuda_backend_test"
  .device-pack/run cuda_backend_test 2>&1 | tail -3
  echo "== checkpoint tests, CUDA backend"
  FUSEDPS_TEST_DEVICE=cuda FUSEDPS_SERVER=/tmp/fusedps-server FUSEDPS_CLI=/tmp/fusedps \
    PYTHONPATH=build/python timeout 900 python3 -m pytest -q -p no:cacheprovider \
    tests/e2e/test_checkpoint_restart.py tests/e2e/test_checkpoint_interop.py \
    tests/e2e/test_checkpoint_torch.py 2>&1 | tail -15
fi

if [[ " ${PARTS:-tests bench} " == *" bench "* ]]; then
  rm -rf "$ckpt"; mkdir -p "$ckpt"
  load=${LOAD:-16x8}; c=${load%x*}; s=${load#*x}
  start_server ckpt_on fusedps-server --metrics-listen= --device="$device" \
    --staging-pool-bytes=$((4 << 30)) --checkpoint-dir="$ckpt" \
    --checkpoint-interval-seconds=10 || exit 1
  pid_on=$server_pid; port_on=$(cat /tmp/ckpt_on.port)
  start_server ckpt_off fusedps-server --metrics-listen= --device="$device" \
    --staging-pool-bytes=$((4 << 30)) || exit 1
  pid_off=$server_pid; port_off=$(cat /tmp/ckpt_off.port)
  echo "| round | server | pushes/s | GB/s | p50 ms | p99 ms | max ms |"
  echo "|---|---|---:|---:|---:|---:|---:|"
  for r in $(seq 1 "${ROUNDS:-2}"); do
    order="off on"; (( r % 2 == 0 )) && order="on off"  # Neither always goes first.
    for v in $order; do
      port=$port_off; [[ $v == on ]] && port=$port_on
      .device-pack/run fusedps-bench --json --warmup-steps=1 --target=127.0.0.1:$port \
        --model=gpt2 --dtype=bf16 --clients="$c" --streams="$s" --duration="${DURATION:-30s}" \
        >"$out/ckpt_${v}_r$r.json" 2>>"$out/ckpt_bench.log"
      python3 - "$out/ckpt_${v}_r$r.json" "$r" "$v" <<'PY'
import json, sys
d = json.load(open(sys.argv[1])); l = d["latency_ms"]
print(f"| {sys.argv[2]} | checkpoints {sys.argv[3]} | {d['pushes_per_s']:.2f} | "
      f"{d['gbps']:.3f} | {l['p50']:.1f} | {l['p99']:.1f} | {l.get('max', float('nan')):.1f} |")
PY
    done
  done
  # The disk's write rate under the same load: dd (buffered, and O_DIRECT) while the bench
  # pushes to the server without checkpoints.
  mb=$(( $(du -sb "$(ls -d "$ckpt"/checkpoint-* | tail -1)" | cut -f1) / (1 << 20) + 1 ))
  .device-pack/run fusedps-bench --json --warmup-steps=1 --target=127.0.0.1:$port_off \
    --model=gpt2 --dtype=bf16 --clients="$c" --streams="$s" --duration=40s \
    >"$out/ckpt_ddload.json" 2>>"$out/ckpt_bench.log" &
  bench_pid=$!
  sleep 12
  echo "== dd under the load, buffered (conv=fsync), then O_DIRECT:"
  dd if=/dev/zero of="$ckpt/dd.bin" bs=1M count=$mb conv=fsync 2>&1 | tail -1
  rm -f "$ckpt/dd.bin"; sleep 2
  dd if=/dev/zero of="$ckpt/dd.bin" bs=64M count=$(( mb / 64 + 1 )) oflag=direct conv=fsync \
    2>&1 | tail -1
  rm -f "$ckpt/dd.bin"
  wait $bench_pid
  kill -TERM "$pid_on" "$pid_off"; wait "$pid_on" "$pid_off"
  echo "== checkpoints written (server log):"
  grep -o "checkpoint: version.*\|checkpoint on exit.*" "$out/server_ckpt_on.log"
  bytes=$(du -sb "$(ls -d "$ckpt"/checkpoint-* | tail -1)" | cut -f1)
  echo "== restore of $bytes bytes, page cache dropped"
  drop_cache "$ckpt"
  start_server ckpt_restore fusedps-server --metrics-listen= --device="$device" \
    --checkpoint-dir="$ckpt" || exit 1
  kill -KILL $server_pid; wait $server_pid 2>/dev/null
  grep -o "restored version.*" "$out/server_ckpt_restore.log"
  echo "== dd on $ckpt, $bytes bytes"
  mb=$(( bytes / (1 << 20) + 1 ))
  dd if=/dev/zero of="$ckpt/dd.bin" bs=1M count=$mb conv=fsync 2>&1 | tail -1
  rm -f "$ckpt/dd.bin"
  dd if=/dev/zero of="$ckpt/dd.bin" bs=64M count=$(( mb / 64 + 1 )) oflag=direct conv=fsync \
    2>&1 | tail -1
  drop_cache "$ckpt"
  dd if="$ckpt/dd.bin" of=/dev/null bs=1M 2>&1 | tail -1
  rm -f "$ckpt/dd.bin"
  df -h "$ckpt" | tail -1
fi
