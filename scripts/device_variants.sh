#!/usr/bin/env bash
# Kernel experiments on the GPU machine: each packed fusedps-kernel-bench* binary (variants of
# the apply kernel) on each configuration, in one run, alternating binaries within a round so
# that drift hits them alike. Prints one line per (round, binary, configuration, workload).
#   CONFIGS  newline-separated kernel-bench flags (default: fp32, then bf16 grads + bf16 copy)
#   ROUNDS   rounds of every binary and configuration (default 1)
#   ENVS     newline-separated environments (VAR=value ...) to run the current build
#            (fusedps-kernel-bench) under, each as a variant of its own (default: one, empty)
set -uo pipefail
out=${OUT:-/tmp/fusedps-out}
configs=${CONFIGS:-$'fp32\n--grad-dtype=bf16 --param-copy=bf16'}
for round in $(seq 1 "${ROUNDS:-1}"); do
  while IFS= read -r cfg; do
    [[ $cfg == fp32 ]] && cfg=""
    tag=$(echo "${cfg:-fp32}" | tr -d '-' | tr ' =' '_.')
    while IFS= read -r variant; do
      exe=${variant%%|*}
      env_vars=${variant#*|}
      label=$exe${env_vars:+[$env_vars]}
      name="$(echo "$label" | tr -c 'A-Za-z0-9_.-' '_')-$tag-r$round"
      env $env_vars .device-pack/run "$exe" --backend=cuda --workload=${WORKLOADS:-all} \
        --warmup=10 --iters=${ITERS:-30} $cfg --json </dev/null >"$out/$name.json" 2>"$out/$name.log" ||
        { tail -3 "$out/$name.log"; continue; }
      python3 -c "
import json
d=json.load(open('$out/$name.json'))
for r in d['results']:
    print(f\"r$round {'$label':60} {'$tag':24} {r['workload']:11} dev {r['device_ms_median']:.4f} ms {100*r['device_gbps']/r['copy_gbps']:.1f}% of {r['copy_gbps']:.0f} | queued {r['queued_device_ms_median']:.4f} ms {100*r['queued_device_gbps']/r['queued_copy_gbps']:.1f}% of {r['queued_copy_gbps']:.0f}  cupti {r['cupti_kernels_per_step']:.1f}\")
"
    done < <(for exe in $(ls .device-pack/bin | grep -E "fusedps-kernel-bench|kb-"); do
               if [[ $exe == fusedps-kernel-bench ]]; then
                 while IFS= read -r e; do echo "$exe|$e"; done <<<"${ENVS:-}"
               else
                 echo "$exe|"
               fi
             done)
  done <<<"$configs"
done
