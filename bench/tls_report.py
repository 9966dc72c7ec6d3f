#!/usr/bin/env python3
"""Prints the table of one scripts/device_tls_bench.sh run: push throughput and latency over
plaintext, TLS and mTLS, each as a ratio to plaintext in the same round, with the client's CPU
per push and the server's mean receive and apply stages per push.

  python3 bench/tls_report.py OUT_DIR

Files: OUT_DIR/r<round>_<mode>_<load>_c<clients>_s<streams>.json (fusedps-bench --json), and
the server's /metrics before and after it (.before.txt, .after.txt).
"""
import glob
import json
import os
import re
import sys

from push_report import stage_means

MODES = ["plain", "tls", "mtls"]


def main(out):
    runs = {}
    stages = {}
    for path in glob.glob(os.path.join(out, "r*_*_c*_s*.json")):
        name = os.path.basename(path)
        m = re.match(r"r(\d+)_(plain|tls|mtls)_(gpt2|1m)_c(\d+)_s(\d+)\.json$", name)
        if not m:
            continue
        key = (int(m.group(1)), m.group(2), m.group(3), int(m.group(4)), int(m.group(5)))
        try:
            with open(path) as f:
                runs[key] = json.load(f)
        except (OSError, ValueError):
            continue
        stages[key] = stage_means(out, name[:-len(".json")]) or {}
    loads = sorted({(k[2], k[4], k[3]) for k in runs}, key=lambda k: (k[0] != "gpt2", k[1], k[2]))
    rounds = sorted({k[0] for k in runs})
    print("| load | clients x streams | round | mode | GB/s | / plain | p50 ms | / plain | "
          "p99 ms | / plain | client CPU ms/push | server receive / apply ms |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for load, streams, clients in loads:
        for r in rounds:
            base = runs.get((r, "plain", load, clients, streams))
            for mode in MODES:
                key = (r, mode, load, clients, streams)
                run = runs.get(key)
                if run is None:
                    continue
                st = stages.get(key, {})
                server = (f"{st['receive']:.1f} / {st['apply']:.1f}"
                          if "receive" in st and "apply" in st else "-")
                lat = run["latency_ms"]
                cpu = 1e3 * run["client_cpu_s"] / max(run["timed_pushes"], 1)

                def ratio(key):
                    if base is None:
                        return "-"
                    value, of = (run[key], base[key]) if key == "gbps" else (
                        run["latency_ms"][key], base["latency_ms"][key])
                    return f"{value / of:.2f}" if of > 0 else "-"
                print(f"| {load} | {clients} x {streams} | {r} | {mode} | {run['gbps']:.3f} | "
                      f"{ratio('gbps')} | {lat['p50']:.2f} | {ratio('p50')} | "
                      f"{lat['p99']:.2f} | {ratio('p99')} | {cpu:.1f} | {server} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fusedps-out")
