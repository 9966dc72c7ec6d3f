#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack carried: the GPU tests, then the
# kernel benchmark (fp32, and bf16 grads with a bf16 copy) and the torch baselines on the same
# workloads in the same run, then the table. Logs and JSON go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
iters=${ITERS:-50}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader | tee "$out/gpu.txt"
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  .device-pack/run cuda_backend_test --gtest_brief=1 2>&1 | tee "$out/cuda_backend_test.log" | tail -3
fi
bench=".device-pack/run fusedps-kernel-bench --backend=cuda --workload=${WORKLOADS:-all} --warmup=10 --iters=$iters --json"
$bench >"$out/fusedps_fp32.json" 2>"$out/fusedps_fp32.log" || { echo "bench fp32 failed"; tail "$out/fusedps_fp32.log"; }
$bench --grad-dtype=bf16 --param-copy=bf16 >"$out/fusedps_bf16.json" 2>"$out/fusedps_bf16.log" || { echo "bench bf16 failed"; tail "$out/fusedps_bf16.log"; }
timeout 400 python3 bench/torch_gpu_baseline.py --workload=${WORKLOADS:-all} --iters=$iters \
  --compile-workloads=${COMPILE:-one_large,gpt2,t1000x100k} >"$out/torch.json" 2>"$out/torch.log" || { echo "torch baseline failed"; tail "$out/torch.log"; }
python3 bench/gpu_report.py "$out/fusedps_fp32.json" "$out/fusedps_bf16.json" "$out/torch.json" | tee "$out/table.md"
