#!/usr/bin/env bash
# Kernel experiments on the GPU machine: each packed fusedps-kernel-bench* binary (variants of
# the apply kernel), fp32 and bf16+copy, in one run. Prints one line per workload.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
for exe in $(ls .device-pack/bin | grep -E "fusedps-kernel-bench|kb-"); do
  for cfg in "" "--grad-dtype=bf16 --param-copy=bf16"; do
    .device-pack/run "$exe" --backend=cuda --workload=${WORKLOADS:-all} --warmup=10 --iters=${ITERS:-30} $cfg --json \
      > "$out/$exe${cfg:+-bf16}.json" 2>"$out/$exe${cfg:+-bf16}.log" || tail -3 "$out/$exe${cfg:+-bf16}.log"
    python3 -c "
import json,sys
d=json.load(open('$out/$exe${cfg:+-bf16}.json'))
for r in d['results']:
    print(f\"$exe {d['grad_dtype']:4} {r['workload']:11} dev {r['device_ms_median']:.3f} ms  {r['device_gbps']:.0f} GB/s  {100*r['device_gbps']/r['copy_gbps']:.1f}% of {r['copy_gbps']:.0f}  cupti {r['cupti_kernels_per_step']:.1f}\")
"
  done
done
