#!/usr/bin/env python3
"""Prints the push table of one scripts/device_push_bench.sh run: fusedps, the gRPC sink and the
torch peer under the same fusedps-bench load, with the ratios ours/sink and ours/peer.

  python3 bench/push_report.py OUT_DIR
"""
import json
import os
import sys


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def main(out):
    servers = ["fusedps", "sink", "peer"]
    print("| load | server | GB/s | pushes/s | p50 ms | p90 ms | p99 ms | p99/p50 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for load_name in ["gpt2_c1", "gpt2_c4", "gpt2_c16", "1m"]:
        got = {s: load(os.path.join(out, f"{s}_{load_name}.json")) for s in servers}
        for s in servers:
            r = got[s]
            if r is None:
                print(f"| {load_name} | {s} | - | - | - | - | - | - |")
                continue
            lat = r["latency_ms"]
            print(f"| {load_name} | {s} | {r['gbps']:.3f} | {r['pushes_per_s']:.2f} | "
                  f"{lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | "
                  f"{lat['p99'] / lat['p50']:.2f} |")
        if got["fusedps"] and got["sink"] and got["peer"]:
            ratios.append((load_name, got["fusedps"]["gbps"] / got["sink"]["gbps"],
                           got["fusedps"]["gbps"] / got["peer"]["gbps"]))
    print()
    print("| load | ours/sink (throughput) | ours/peer (throughput) |")
    print("|---|---:|---:|")
    for name, sink, peer in ratios:
        print(f"| {name} | {sink:.2f} | {peer:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
