#!/usr/bin/env bash
# Runs on the GPU machine with .device-pack carried: Nsight Compute on one AdamWApply launch of
# each packed kernel-bench binary named in $EXES, for the stall, instruction and memory
# sections. WORKLOAD picks the workload (default one_large); ARGS adds kernel-bench flags
# (e.g. "--state-dtype=int8"); TAG names the reports: $OUT/ncu-<exe><TAG>.txt.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
for exe in ${EXES:-fusedps-kernel-bench}; do
  report="$out/ncu-$exe${TAG:-}.txt"
  LD_LIBRARY_PATH=$PWD/.device-pack/lib timeout 240 "$ncu" --kernel-name regex:AdamWApply \
    --launch-skip 4 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section LaunchStats \
    --section ComputeWorkloadAnalysis --section InstructionStats \
    --section MemoryWorkloadAnalysis_Tables \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
    .device-pack/bin/"$exe" --backend=cuda --workload=${WORKLOAD:-one_large} --warmup=2 \
    --iters=2 --copy-reference=false ${ARGS:-} >"$report" 2>&1 || echo "ncu $exe failed"
  grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Stall|Issued Warp|Issue Slots Busy|Executed Ipc|L2 Hit|Mem Busy|Max Bandwidth|Bank Conflict|Executed Instructions  |Dynamic Shared|issue_stalled" \
    "$report" | sed "s/^/$exe${TAG:-}: /" | head -80
done
