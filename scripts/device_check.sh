#!/usr/bin/env bash
# Runs on the GPU machine (the device tool), from the repository root, with .device-pack carried
# (the test binaries packed beside scripts/pack_device.sh's): the GPU tests. Logs go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
status=0
for t in cuda_backend_test cpu_backend_test; do
  if [[ -x .device-pack/bin/$t ]]; then
    echo "== $t"
    .device-pack/run "$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" | tail -25
    ((${PIPESTATUS[0]} == 0)) || status=1
  fi
done
# Servers on the CUDA backend, in-process: models side by side and deleted under load (each
# model's backend shares the server's staging arena).
for t in models_test; do
  if [[ -x .device-pack/bin/$t ]]; then
    echo "== $t (FUSEDPS_TEST_DEVICE=cuda)"
    FUSEDPS_TEST_DEVICE=cuda .device-pack/run "$t" --gtest_brief=1 2>&1 | tee "$out/$t.log" |
      tail -25
    ((${PIPESTATUS[0]} == 0)) || status=1
  fi
done
exit $status
