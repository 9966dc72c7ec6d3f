#!/usr/bin/env python3
"""Prints the state-dtype table: fusedps-kernel-bench JSON of one device run, one file per
storage option (state_dtype, params_dtype, grad_dtype), each workload against the fp32-state
run of the same gradient dtype in the same run.

"GB/s" is the actual traffic of an ideal step of that storage (the bench's bytes_per_param:
the stored sizes read and written, the int8 scales included); "% copy" is it over the same
run's device-to-device copy; "x fp32" is the fp32 run's step time over this one's.

  python3 bench/state_report.py fp32.json int8.json bf16.json ...
"""
import json
import sys


def main(paths):
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    if not runs:
        return
    print(f"device: {runs[0]['device']}")
    base = {}
    for doc in runs:
        if doc["state_dtype"] == "fp32" and doc["params_dtype"] == "fp32":
            for r in doc["results"]:
                base[(doc["grad_dtype"], r["workload"])] = r["device_ms_median"]
    print("| workload | grads | state | params | ms/step | bytes/param moved | GB/s | % copy | "
          "x fp32 state | device bytes/param | launches |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for doc in runs:
        for r in doc["results"]:
            ms = r["device_ms_median"]
            fp32 = base.get((doc["grad_dtype"], r["workload"]))
            pct = 100 * r["device_gbps"] / r["copy_gbps"] if r.get("copy_gbps") else float("nan")
            speedup = f"{fp32 / ms:.2f}x" if fp32 else "-"
            print(f"| {r['workload']} | {doc['grad_dtype']} | {doc['state_dtype']} | "
                  f"{doc['params_dtype']} | {ms:.3f} | {r['bytes_per_param']:.2f} | "
                  f"{r['device_gbps']:.0f} | {pct:.1f}% | {speedup} | "
                  f"{r['device_bytes_per_param']:.3f} | {r['launches_per_step']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
