#!/usr/bin/env python3
"""Prints the tables of one scripts/device_shard_core.sh run: the base commit's binaries ("old")
against this tree's ("new"), all measured in that one run on one GPU machine.

  python3 bench/core_report.py OUT_DIR

  kernel   fusedps-kernel-bench, % of the same run's device-to-device copy, per workload
  readers  GetInfo and a 1 MB pull (the reader probe of fusedps-bench) while one client streams
           GPT-2 small pushes in 1 or 8 parts, and with no pushes (the host's floor); and those
           pushes' throughput
  small    back-to-back pushes of 10,000 tensors x 1K (the whole model, bf16)
"""
import json
import os
import sys


def load(path):
    """The JSON document at path, or None when it is missing or unreadable."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def ratio(new, old):
    return f"{new / old:.2f}x" if new and old else "-"


def table(header, rows, left=1):
    """Prints a markdown table: header cells, then rows (already formatted lines); the first
    `left` columns left-aligned, the rest right-aligned. Nothing when there are no rows."""
    if rows:
        print("\n| " + " | ".join(header) + " |")
        print("|---" * left + "|---:" * (len(header) - left) + "|")
        print("\n".join(rows))


def kernel(out):
    rows = []
    for dt in ("fp32", "bf16"):
        new, old = load(f"{out}/kernel_{dt}.json"), load(f"{out}/kernel-old_{dt}.json")
        if not new:
            continue
        olds = {r["workload"]: r for r in (old or {}).get("results", [])}
        for r in new["results"]:
            o = olds.get(r["workload"])
            pct = 100 * r["device_gbps"] / r["copy_gbps"]
            opct = 100 * o["device_gbps"] / o["copy_gbps"] if o else float("nan")
            rows.append(f"| {r['workload']} | {dt} | {r['device_ms_median']:.3f} | {pct:.1f}% | "
                        f"{o['device_ms_median'] if o else float('nan'):.3f} | {opct:.1f}% | "
                        f"{r['launches_per_step']:.0f} |")
    table(["workload", "grads", "new ms", "new % copy", "old ms", "old % copy", "launches"], rows,
          left=2)


def readers(out):
    rows = []
    for streams in (0, 1, 8):  # Streams of the pushing client; 0: no pushes (the floor).
        docs = {}
        for v in ("new", "old"):
            probe = load(f"{out}/readers_probe_{v}_s{streams}.json")
            push = load(f"{out}/readers_push_{v}_s{streams}.json")
            docs[v] = (probe, push)
            if not probe and not any(os.path.exists(f"{out}/readers_probe_{w}_s{streams}.log")
                                     for w in ("new", "old")):
                continue  # Not measured in this run (PARTS without readers, or no floor).
            if not probe:
                rows.append(f"| {v} | {streams} | failed |")
                continue
            g, p = probe["probe"]["get_info_ms"], probe["probe"]["pull_ms"]
            gbps = f"{push['gbps']:.2f}" if push else "-"
            rows.append(f"| {v} | {streams} | {gbps} | {g['p50']:.3f} | {g['p99']:.3f} | "
                        f"{g['max']:.3f} | {p['p50']:.3f} | {p['p99']:.3f} | {g['count']} |")
        (np_, npush), (op, opush) = docs["new"], docs["old"]
        if np_ and op:
            ng, og = np_["probe"]["get_info_ms"], op["probe"]["get_info_ms"]
            npl, opl = np_["probe"]["pull_ms"], op["probe"]["pull_ms"]
            rows.append(f"| new/old | {streams} | "
                        f"{ratio(npush and npush['gbps'], opush and opush['gbps'])} | "
                        f"{ratio(ng['p50'], og['p50'])} | {ratio(ng['p99'], og['p99'])} | | "
                        f"{ratio(npl['p50'], opl['p50'])} | {ratio(npl['p99'], opl['p99'])} | |")
    table(["server", "streams", "push GB/s", "GetInfo p50 ms", "GetInfo p99 ms", "GetInfo max ms",
           "1 MB pull p50 ms", "1 MB pull p99 ms", "probe rounds"], rows)


def small(out):
    rows = []
    for c in (1, 4):
        n, o = load(f"{out}/small_new_c{c}.json"), load(f"{out}/small_old_c{c}.json")
        if not (n or o):
            continue
        ns = f"{n['pushes_per_s']:.1f}" if n else "failed"
        os_ = f"{o['pushes_per_s']:.1f}" if o else "failed"
        nl = f"{n['latency_ms']['p50']:.2f}" if n else "-"
        ol = f"{o['latency_ms']['p50']:.2f}" if o else "-"
        rows.append(f"| {c} | {ns} | {os_} | "
                    f"{ratio(n and n['pushes_per_s'], o and o['pushes_per_s'])} | {nl} | {ol} |")
    table(["clients", "new pushes/s", "old pushes/s", "new/old", "new p50 ms", "old p50 ms"],
          rows, left=0)


def main(out):
    gpu = open(os.path.join(out, "gpu.txt")).read().strip() if os.path.exists(
        os.path.join(out, "gpu.txt")) else "?"
    print(f"device: {gpu.splitlines()[-1] if gpu else '?'}")
    kernel(out)
    readers(out)
    small(out)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else ".")
