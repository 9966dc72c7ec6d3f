#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack (fusedps-server, fusedps-bench,
# fusedps, libfusedps_c.so and their libraries) and build/python carried. Issue 13's numbers in
# one run, logs and JSON to $OUT:
#   1. push throughput of the Python client (native and grpcio transports) against the C++
#      client (fusedps-bench), one client, GPT-2 small bf16, 1 and 8 streams, on one CUDA
#      server, interleaved (C++, native, grpcio for each stream count);
#   2. examples/train_gpt.py with torch.optim.AdamW on the GPU, and with RemoteAdamW against a
#      fresh CUDA server, the same seed and batches (STEPS, default 300);
#   3. the e2e tests of the Python package (RemoteAdamW with a CUDA GradScaler and fp16 autocast,
#      both transports, LoadState) against CUDA servers, FUSEDPS_TEST_DEVICE=cuda.
# Env: ONLY=push (part 1 alone), DURATION (push seconds per row, 8), ROUNDS (1), STEPS,
# GPT_STREAMS (8), GPT_DATA (the corpus file, carried).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
source scripts/device_lib.sh
python_env
python3 -c "import fusedps._native as n; print('native transport:', n.library(), n.load_error())"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

echo "== 1. push throughput, GPT-2 small bf16, 1 client"
start_server push fusedps-server --device=cuda:0 --metrics-listen= \
  --staging-pool-bytes=$((4 << 30)) || exit 1
push_pid=$server_pid
target=127.0.0.1:$(cat /tmp/push.port)
for streams in 1 8; do
  for round in $(seq 1 ${ROUNDS:-1}); do
    timeout 120 .device-pack/run fusedps-bench --json --warmup-steps=2 --target=$target \
      --model=gpt2 --dtype=bf16 --clients=1 --streams=$streams --duration=${DURATION:-8}s \
      > "$out/push_cpp_s${streams}_r${round}.json" 2>>"$out/bench_cpp.log" \
      || echo "cpp s$streams failed"
    for transport in native grpcio; do
      timeout 180 python3 bench/python_push_bench.py --target=$target --transport=$transport \
        --streams=$streams --duration=${DURATION:-8} --pulls=3 \
        > "$out/push_${transport}_s${streams}_r${round}.json" 2>>"$out/bench_py.log" \
        || echo "python $transport s$streams failed"
    done
  done
done
kill -TERM $push_pid; wait $push_pid
python3 - "$out" <<'PY'
import glob, json, os, sys
out = sys.argv[1]
rows = {}
for path in sorted(glob.glob(os.path.join(out, "push_*_s*_r*.json"))):
    name = os.path.basename(path)[5:-5]
    client, streams, rnd = name.rsplit("_", 2)
    try:
        r = json.loads(open(path).read())
    except Exception as e:
        print(f"{name}: unreadable ({e})"); continue
    rows[(client, streams, rnd)] = r
print("| streams | round | C++ GB/s | Python native GB/s | native / C++ | Python grpcio GB/s | grpcio / C++ | native pull GB/s | grpcio pull GB/s |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for streams in ("s1", "s8"):
    for rnd in sorted({k[2] for k in rows}):
        c, n, g = (rows.get((k, streams, rnd)) for k in ("cpp", "native", "grpcio"))
        f = lambda r, k="gbps": f"{r[k]:.3f}" if r and k in r else "-"
        q = lambda r: f"{r['gbps'] / c['gbps']:.2f}" if r and c else "-"
        print(f"| {streams[1:]} | {rnd[1:]} | {f(c)} | {f(n)} | {q(n)} | {f(g)} | {q(g)} | {f(n, 'pull_gbps')} | {f(g, 'pull_gbps')} |")
PY

[[ ${ONLY:-all} == push ]] && exit 0
echo "== 2. examples/train_gpt.py: torch.optim.AdamW and RemoteAdamW"
gpt_args="--device cuda --steps ${STEPS:-300} --seed 0 --amp bf16 --deterministic
  --data ${GPT_DATA:-.device-pack/corpus.txt.gz}"
timeout 400 python3 examples/train_gpt.py --optimizer torch $gpt_args \
  --log-json "$out/gpt_torch.json" > "$out/gpt_torch.log" 2>&1 || echo "gpt torch failed"
tail -3 "$out/gpt_torch.log"
timeout 500 python3 tests/e2e/server_fixture.py --device=cuda -- python3 examples/train_gpt.py \
  --optimizer remote --target {target} --streams ${GPT_STREAMS:-8} $gpt_args \
  --log-json "$out/gpt_remote.json" \
  > "$out/gpt_remote.log" 2>&1 || echo "gpt remote failed"
tail -3 "$out/gpt_remote.log"
python3 bench/compare_gpt_curves.py "$out/gpt_torch.json" "$out/gpt_remote.json" \
  > "$out/gpt_compare.md" 2>&1
cat "$out/gpt_compare.md"

echo "== 3. e2e tests of the Python package against CUDA servers"
FUSEDPS_TEST_DEVICE=cuda timeout 500 python3 -m pytest -q -p no:cacheprovider \
  tests/e2e/test_remote_adamw.py tests/e2e/test_transports.py tests/e2e/test_load_state.py \
  tests/e2e/test_parity.py tests/e2e/test_client.py 2>&1 | tee "$out/e2e_cuda.log" | tail -6
