#!/usr/bin/env bash
# Issue 16's GPU checks and numbers in one device call, with .device-pack (fusedps-server,
# fusedps, libfusedps_c.so, cuda_backend_test, fusedps-kernel-bench, the corpus) and the Python
# package (PY_PATH) carried. In order, each with a time limit so that the later parts still run:
#   1. cuda_backend_test: every storage option against the CPU backend, bit for bit;
#      stochastic rounding replayed after a restore;
#   2. the kernel benchmark for each storage option (scripts/device_state_bench.sh);
#   3. the e2e tests of the storage options against CUDA servers (FUSEDPS_TEST_DEVICE=cuda);
#   4. training quality (scripts/device_quality.sh).
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$out/gpu.txt"
echo "== 1. cuda_backend_test"
timeout ${TEST_SECONDS:-150} .device-pack/run cuda_backend_test --gtest_brief=1 > "$out/cuda_backend_test.log" 2>&1
echo "cuda_backend_test exit $?"; grep -E "PASSED|FAILED|Failure|device bytes" "$out/cuda_backend_test.log" | head -20
echo "== 2. kernel benchmark per storage option"
ITERS=${ITERS:-30} GRADS=${GRADS:-fp32} FIT=0 timeout ${BENCH_SECONDS:-200} bash scripts/device_state_bench.sh > "$out/state.txt" 2>&1
tail -22 "$out/state.txt"
echo "== 3. e2e tests against CUDA servers"
source scripts/device_lib.sh
(python_env
 FUSEDPS_TEST_DEVICE=cuda timeout ${E2E_SECONDS:-120} python3 -m pytest -q -p no:cacheprovider \
   ${E2E_TESTS:-tests/e2e/test_state_dtypes.py tests/e2e/test_checkpoint_state_dtypes.py \
     tests/e2e/test_remote_adamw_state_dtypes.py} > "$out/e2e_cuda.log" 2>&1)
echo "e2e exit $?"; tail -4 "$out/e2e_cuda.log"
echo "== 4. training quality"
timeout ${QUALITY_SECONDS:-280} bash scripts/device_quality.sh > "$out/quality.txt" 2>&1
tail -40 "$out/quality.txt"
