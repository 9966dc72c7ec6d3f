#!/usr/bin/env bash
# Runs on the GPU machine (device tool) with .device-pack carried: the kernel benchmark for each
# storage option (fp32, bf16 and int8 state; bf16 params with stochastic rounding), fp32
# gradients and bf16 gradients, then the largest GPT that fits per storage option
# (fusedps-gpt-fit), then the table (bench/state_report.py). Logs and JSON go to $OUT.
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
mkdir -p "$out"
iters=${ITERS:-30}
bench=".device-pack/run fusedps-kernel-bench --backend=cuda --workload=${WORKLOADS:-all} --warmup=5 --iters=$iters --json"
files=()
for grads in ${GRADS:-fp32 bf16}; do
  for storage in "fp32 fp32" "bf16 fp32" "int8 fp32" "fp32 bf16" "int8 bf16"; do
    set -- $storage
    name="state-$grads-$1-$2"
    $bench --grad-dtype="$grads" --state-dtype="$1" --params-dtype="$2" \
      >"$out/$name.json" 2>"$out/$name.log" || { echo "$name failed"; tail -3 "$out/$name.log"; continue; }
    files+=("$out/$name.json")
  done
done
if [[ ${FIT:-1} == 1 ]]; then
  .device-pack/run fusedps-gpt-fit --backend=cuda:0 --json >"$out/gpt_fit.json" 2>"$out/gpt_fit.log" ||
    { echo "gpt-fit failed"; tail -3 "$out/gpt_fit.log"; }
  cat "$out/gpt_fit.json"
fi
python3 bench/state_report.py "${files[@]}" | tee "$out/state_table.md"
