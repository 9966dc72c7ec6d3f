#!/usr/bin/env bash
# Runs on the GPU machine with .device-pack carried: Nsight Compute on one AdamWApply launch of
# each packed kernel-bench binary named in $EXES (one workload, fp32), for the stall and memory
# sections. Reports go to $OUT/ncu-<exe>.txt.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for exe in ${EXES:-fusedps-kernel-bench}; do
  LD_LIBRARY_PATH=$PWD/.device-pack/lib timeout 240 "$ncu" --kernel-name regex:AdamWApply \
    --launch-skip 4 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
    .device-pack/bin/"$exe" --backend=cuda --workload=${WORKLOAD:-one_large} --warmup=2 \
    --iters=2 --copy-reference=false >"$out/ncu-$exe.txt" 2>&1 || echo "ncu $exe failed"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Stall|Issued Warp|L2 Hit|Mem Busy|Max Bandwidth|Dynamic Shared" "$out/ncu-$exe.txt" | sed "s/^/$exe: /" | head -40
done
