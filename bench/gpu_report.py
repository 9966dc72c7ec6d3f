#!/usr/bin/env python3
"""Prints the GPU kernel table: fusedps-kernel-bench JSON beside torch_gpu_baseline.py JSON.

All inputs come from one device run. Ratios are torch's median step time over fusedps's device
time (CUDA events around the step's kernels); "% copy" is against the same run's
device-to-device copy as each tool measured it.

  python3 bench/gpu_report.py fusedps_fp32.json fusedps_bf16.json torch.json
"""
import json
import sys


def main(paths):
    ours, torch_rows, torch_meta = [], {}, {}
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        if doc.get("tool") == "fusedps-kernel-bench":
            for r in doc["results"]:
                r["config"] = ("fp32 grads" if doc["grad_dtype"] == "fp32"
                               else "bf16 grads + bf16 copy")
                r["bytes_per_param"] = doc["bytes_per_param"]
                r["device"] = doc["device"]
                ours.append(r)
        else:
            torch_meta = doc
            for r in doc["rows"]:
                torch_rows[(r["workload"], r["variant"])] = r
    print(f"device: {ours[0]['device'] if ours else '?'}; torch {torch_meta.get('torch')} copy "
          f"{torch_meta.get('copy_gbps', 0):.0f} GB/s (torch), fusedps copy "
          f"{ours[0]['copy_gbps'] if ours else 0:.0f} GB/s")
    head = ("| workload | config | fusedps ms | GB/s | % copy | launches (ours/CUPTI) | "
            "torch fused ms (k) | torch.compile ms (k) | x fused | x compile |")
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in ours:
        base = "torch_fused" if r["config"] == "fp32 grads" else "torch_fused_bf16_path"
        fused = torch_rows.get((r["workload"], base))
        compiled = torch_rows.get((r["workload"], "torch_compile"))
        ms = r["device_ms_median"]
        pct = 100 * r["device_gbps"] / r["copy_gbps"] if r["copy_gbps"] else float("nan")
        fused_s = f"{fused['ms']:.3f} ({fused['kernels']})" if fused else "-"
        comp_s = (f"{compiled['ms']:.3f} ({compiled['kernels']})"
                  if compiled and r["config"] == "fp32 grads" else "-")
        x_fused = f"{fused['ms'] / ms:.2f}x" if fused else "-"
        x_comp = (f"{compiled['ms'] / ms:.2f}x"
                  if compiled and r["config"] == "fp32 grads" else "-")
        print(f"| {r['workload']} | {r['config']} | {ms:.3f} | {r['device_gbps']:.0f} | "
              f"{pct:.1f}% | {r['launches_per_step']:.0f}/{r['cupti_kernels_per_step']:.0f} | "
              f"{fused_s} | {comp_s} | {x_fused} | {x_comp} |")


if __name__ == "__main__":
    main(sys.argv[1:])
