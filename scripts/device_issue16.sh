#!/usr/bin/env bash
# Issue 16's GPU checks and numbers in one device call, with .device-pack (fusedps-server,
# fusedps, libfusedps_c.so, cuda_backend_test, fusedps-kernel-bench, the corpus) and the Python
# package (PY_PATH) carried. In order, each with a time limit so that the later parts still run,
# each skipped when its variable is 0:
#   1. TEST:     cuda_backend_test: every storage option against the CPU backend, bit for bit;
#                stochastic rounding replayed after a restore;
#   2. BENCH:    the kernel benchmark for each storage option (scripts/device_state_bench.sh);
#   3. TORCH:    torch's fused and compiled steps on the same workloads
#                (bench/torch_gpu_baseline.py), and how close a copy of a step's bytes comes to
#                a large copy (bench/copy_size_ceiling.py);
#   4. NCU:      Nsight Compute on the int8 step of GPT-2 small (scripts/device_ncu.sh);
#   5. E2E:      the e2e tests of the storage options against CUDA servers
#                (FUSEDPS_TEST_DEVICE=cuda);
#   6. QUALITY:  training quality (scripts/device_quality.sh).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
if [[ ${TEST:-1} == 1 ]]; then
  echo "== 1. cuda_backend_test"
  timeout ${TEST_SECONDS:-150} .device-pack/run cuda_backend_test --gtest_brief=1 > "$out/cuda_backend_test.log" 2>&1
  echo "cuda_backend_test exit $?"; grep -E "PASSED|FAILED|Failure|device bytes" "$out/cuda_backend_test.log" | head -20
fi
if [[ ${BENCH:-1} == 1 ]]; then
  echo "== 2. kernel benchmark per storage option"
  ITERS=${ITERS:-30} GRADS=${GRADS:-fp32} FIT=0 timeout ${BENCH_SECONDS:-200} bash scripts/device_state_bench.sh > "$out/state.txt" 2>&1
  tail -45 "$out/state.txt"
fi
if [[ ${TORCH:-1} == 1 ]]; then
  echo "== 3. torch's steps; a copy of a step's bytes"
  timeout ${TORCH_SECONDS:-200} python3 bench/torch_gpu_baseline.py --workload=all --iters=30 \
    --compile-workloads=one_large > "$out/torch.json" 2> "$out/torch.log"
  echo "torch exit $?"
  python3 -c "
import json
for r in json.load(open('$out/torch.json'))['rows']:
    print(f\"{r['workload']:11} {r['variant']:22} {r['ms']:9.4f} ms  {r['pct_copy']:5.1f}% copy  {r['kernels']} kernels\")"
  timeout 60 python3 bench/copy_size_ceiling.py --step-bytes=${CEILING_BYTES:-280e6,2.8e9} \
    > "$out/copy_ceiling.json" 2>&1; cat "$out/copy_ceiling.json"
fi
if [[ ${NCU:-1} == 1 ]]; then
  echo "== 4. Nsight Compute, int8 state, GPT-2 small"
  WORKLOAD=gpt2 ARGS="--state-dtype=int8" TAG=-int8 timeout 200 bash scripts/device_ncu.sh |
    grep -E "Duration|Executed Instructions  |Executed Ipc Active|Issue Slots|DRAM Throughput"
fi
if [[ ${E2E:-1} == 1 ]]; then
  echo "== 5. e2e tests against CUDA servers"
  source scripts/device_lib.sh
  (python_env
   FUSEDPS_TEST_DEVICE=cuda timeout ${E2E_SECONDS:-120} python3 -m pytest -q -p no:cacheprovider \
     ${E2E_TESTS:-tests/e2e/test_state_dtypes.py tests/e2e/test_checkpoint_state_dtypes.py \
       tests/e2e/test_remote_adamw_state_dtypes.py} > "$out/e2e_cuda.log" 2>&1)
  echo "e2e exit $?"; tail -4 "$out/e2e_cuda.log"
fi
if [[ ${QUALITY:-1} == 1 ]]; then
  echo "== 6. training quality"
  timeout ${QUALITY_SECONDS:-280} bash scripts/device_quality.sh > "$out/quality.txt" 2>&1
  tail -40 "$out/quality.txt"
fi
