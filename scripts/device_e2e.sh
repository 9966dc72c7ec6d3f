#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack and build/python carried: the
# metric-vs-CUPTI test, the PyTorch-oracle e2e tests and the digits demo against a server on
# the CUDA backend, and an Nsight Compute profile of the apply kernel. Logs go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
here=$(pwd)
printf '#!/usr/bin/env bash\nexec "%s/.device-pack/run" fusedps-server "$@"\n' "$here" \
  > .device-pack/fusedps-server-wrapper
chmod +x .device-pack/fusedps-server-wrapper
export FUSEDPS_SERVER=$here/.device-pack/fusedps-server-wrapper PYTHONPATH=$here/build/python
echo "== metrics_cupti_test"
.device-pack/run metrics_cupti_test 2>&1 | tee "$out/metrics_cupti.log" | grep -E "pushes|OK|FAILED|PASSED|SKIPPED"
echo "== e2e (PyTorch oracle) on --device=cuda"
FUSEDPS_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/e2e 2>&1 | tee "$out/e2e_cuda.log" | tail -4
echo "== digits demo on --device=cuda"
python3 tests/e2e/server_fixture.py --device=cuda -- python3 examples/train_digits.py --target {target} \
  2>&1 | tee "$out/demo_cuda.log" | tail -6
echo "== ncu"
for w in one_large t10000x1k; do
  timeout 200 ncu --kernel-name regex:AdamWApply --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
    .device-pack/run fusedps-kernel-bench --backend=cuda --workload=$w --warmup=2 --iters=2 \
    --copy-reference=false > "$out/ncu_$w.txt" 2>&1
  grep -E "DRAM Throughput|Memory Throughput|Duration|Achieved Occupancy|Theoretical Occupancy|Registers Per|Block Limit Registers|Warp Cycles Per Issued|Stall|One or More Eligible|Issued Warp" "$out/ncu_$w.txt" | head -20
done
