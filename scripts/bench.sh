#!/usr/bin/env bash
# `make bench`: fusedps's CPU backend against torch.optim.AdamW(foreach=True) on the same CPU,
# the same workloads (DESIGN.md, "Numbers to beat") and the same scale, in one run. For each
# workload it runs bench/torch_baseline.py, then fusedps-kernel-bench (which validates before it
# times), and ends with one Markdown table: ms/step and GB/s of both, and the speedup.
#
# Environment (defaults in brackets):
#   BENCH_SCALE     multiplies every tensor's element count [1.0: the workloads' full size]
#   BENCH_ITERS     timed steps, the median is reported [10]
#   BENCH_WARMUP    untimed steps first [3]
#   BENCH_THREADS   threads for both sides [nproc]
#   BENCH_WORKLOADS [one_large gpt2 t1000x100k t10000x1k]
#   BENCH_SKIP_BUILD=1  use the binary already in ${BUILD_DIR:-build} instead of building
#   PYTHON          [/usr/bin/python3, Debian's, with torch]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_DIR:-build}
python=${PYTHON:-/usr/bin/python3}
scale=${BENCH_SCALE:-1.0}
iters=${BENCH_ITERS:-10}
warmup=${BENCH_WARMUP:-3}
threads=${BENCH_THREADS:-$(nproc)}
read -r -a workloads <<<"${BENCH_WORKLOADS:-one_large gpt2 t1000x100k t10000x1k}"

[[ ${BENCH_SKIP_BUILD:-0} == 1 ]] || scripts/build.sh
kernel_bench=$build/bench/fusedps-kernel-bench
[[ -x $kernel_bench ]] || { echo "bench: $kernel_bench is missing; build first" >&2; exit 1; }

out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
common=(--scale="$scale" --iters="$iters" --warmup="$warmup" --threads="$threads" --json)
# Interleaved per workload, so that both sides of a row see the same machine.
for w in "${workloads[@]}"; do
  "$python" bench/torch_baseline.py --workload="$w" "${common[@]}" >"$out/torch_$w.json"
  "$kernel_bench" --backend=cpu --workload="$w" "${common[@]}" >"$out/fusedps_$w.json"
done

cpu_model=$(lscpu | sed -n 's/^Model name: *//p' | head -n1)
"$python" - "$out" "$cpu_model" "${workloads[@]}" <<'EOF'
import datetime, json, sys

out, cpu_model, workloads = sys.argv[1], sys.argv[2], sys.argv[3:]
rows = []
for w in workloads:
    torch_run = json.load(open(f"{out}/torch_{w}.json"))
    fusedps_run = json.load(open(f"{out}/fusedps_{w}.json"))
    t, f = torch_run["results"][0], fusedps_run["results"][0]
    if (t["tensors"], t["params"]) != (f["tensors"], f["params"]):
        sys.exit(f"bench: {w}: torch stepped {t['tensors']} tensors / {t['params']} params, "
                 f"fusedps {f['tensors']} / {f['params']}; bench/workloads.cc and "
                 "bench/torch_baseline.py disagree")
    rows.append((t, f, fusedps_run, torch_run))

first_torch, first_fusedps = rows[0][3], rows[0][2]
print()
print(f"CPU: {cpu_model}, {first_torch['threads']} threads; "
      f"torch {first_torch['torch']}; fusedps device: {first_fusedps['device']}; "
      f"scale {first_fusedps['scale']:g}, median of {first_fusedps['iters']} steps after "
      f"{first_fusedps['warmup']}; {first_fusedps['bytes_per_param']} bytes/param; "
      f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC")
print()
print("| workload (at scale 1) | tensors | params | torch foreach ms/step | torch GB/s "
      "| fusedps cpu ms/step | fusedps GB/s | copy GB/s | fusedps % copy | launches/step "
      "| speedup (torch/fusedps) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for t, f, _, _ in rows:
    copy = f["copy_gbps"]
    copy_cells = f"{copy:.2f} | {100 * f['gbps'] / copy:.0f}%" if copy else "- | -"
    print(f"| {t['description']} | {t['tensors']} | {t['params']:,} | {t['ms_median']:.2f} "
          f"| {t['gbps']:.2f} | {f['ms_median']:.2f} | {f['gbps']:.2f} | {copy_cells} "
          f"| {f['launches_per_step']:g} | {t['ms_median'] / f['ms_median']:.2f}x |")
EOF
