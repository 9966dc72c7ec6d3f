#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack (fusedps-server, fusedps-bench,
# fusedps) and build/python carried: pulls of GPT-2 small's params from fusedps-server
# (--device=cuda:0) and from the torch peer, under the same client (the fusedps CLI writing a
# safetensors file to /tmp), fp32 and bf16 over 1 and STREAMS connections. Prints a table of
# the median of REPS wall times per pull, and MB/s of wire payload. When the pack holds
# fusedps-server-old (e.g. a base commit's build), it is measured too, as server "old".
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
export PYTHONPATH=$PWD/build/python
reps=${REPS:-5}
rm -f /tmp/pull_*.port
.device-pack/run fusedps-server --listen=127.0.0.1:0 --port-file=/tmp/pull_fusedps.port \
  --device=${DEVICE:-cuda:0} --metrics-listen= >"$out/pull_server_fusedps.log" 2>&1 &
servers="fusedps peer"
if [[ -x .device-pack/bin/fusedps-server-old ]]; then
  servers="fusedps old peer"
  .device-pack/run fusedps-server-old --listen=127.0.0.1:0 --port-file=/tmp/pull_old.port \
    --device=${DEVICE:-cuda:0} --metrics-listen= >"$out/pull_server_old.log" 2>&1 &
fi
python3 bench/peers/torch_peer.py --listen=127.0.0.1:0 --port-file=/tmp/pull_peer.port \
  --device=${PEER_DEVICE:-cuda} --max-workers=64 >"$out/pull_server_peer.log" 2>&1 &
for s in $servers; do
  for _ in $(seq 1 120); do [[ -s /tmp/pull_$s.port ]] && break; sleep 0.5; done
  # Registers GPT-2 small (normal(0, 0.02) values) and applies one push.
  .device-pack/run fusedps-bench --target=127.0.0.1:$(cat /tmp/pull_$s.port) --model=gpt2 --scale=${SCALE:-1} \
    --steps=1 --warmup-steps=0 >/dev/null 2>>"$out/pull_bench_$s.log" || echo "$s: register failed"
done
SERVERS=$servers REPS=$reps STREAMS=${STREAMS:-8} OUT_DIR=$out python3 - <<'PY'
import os, statistics, subprocess, time
reps, streams = int(os.environ["REPS"]), int(os.environ["STREAMS"])
print("| server | dtype | streams | median s | MB/s of payload |\n|---|---|---:|---:|---:|")
for server in os.environ["SERVERS"].split():
    target = "127.0.0.1:" + open(f"/tmp/pull_{server}.port").read().strip()
    for dtype, size in [("fp32", 4), ("bf16", 2)]:
        for n in [1, streams]:
            times = []
            for _ in range(reps):
                start = time.perf_counter()
                r = subprocess.run([".device-pack/run", "fusedps", f"--target={target}",
                                    f"--streams={n}", f"--dtype={dtype}", "pull",
                                    "--out=/tmp/pull.safetensors"], capture_output=True, text=True)
                times.append(time.perf_counter() - start)
                if r.returncode != 0:
                    print(f"{server} {dtype} {n}: pull failed: {r.stderr.strip()[-300:]}")
            m = statistics.median(times)
            # The file holds every value as fp32 after a small header.
            params = os.path.getsize("/tmp/pull.safetensors") // 4
            print(f"| {server} | {dtype} | {n} | {m:.3f} | {params * size / m / 1e6:.0f} |")
PY
kill $(jobs -p) 2>/dev/null; wait
