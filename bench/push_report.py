#!/usr/bin/env python3
"""Prints the push table of one scripts/device_push_bench.sh run: fusedps, the gRPC sink and the
torch peer under the same fusedps-bench load, with the ratios ours/sink and ours/peer, and the
means of fusedps's own stage durations (fusedps_metrics.txt, scraped at the end of the run).

  python3 bench/push_report.py OUT_DIR

Files: OUT_DIR/{fusedps,sink,peer}_{gpt2,1m}_c<clients>_s<streams>.json (fusedps-bench --json).
"""
import glob
import json
import os
import re
import sys

# "old": the base commit's fusedps-server, when the run packed one (fusedps-server-old).
SERVERS = ["fusedps", "old", "sink", "peer"]


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def loads(out):
    """The loads present, ordered: model, then streams, then clients."""
    keys = set()
    for path in glob.glob(os.path.join(out, "*_c*_s*.json")):
        m = re.match(r"(fusedps|old|sink|peer)_(\w+?)_c(\d+)_s(\d+)\.json$",
                     os.path.basename(path))
        if m:
            keys.add((m.group(2), int(m.group(4)), int(m.group(3))))
    return sorted(keys, key=lambda k: (k[0] != "gpt2", k[1], k[2]))


def stage_totals(path):
    """{stage: (sum seconds, count)} of fusedps_stage_duration_seconds in a /metrics scrape."""
    totals = {}
    try:
        text = open(path).read()
    except OSError:
        return None
    for line in text.splitlines():
        m = re.match(r'fusedps_stage_duration_seconds_(sum|count)\{.*stage="(\w+)".*\} (\S+)', line)
        if not m:  # fusedps_push_ingest_seconds, reported beside the stages as "ingest".
            m = re.match(r'fusedps_push_(ingest)_seconds_(sum|count) (\S+)', line)
            m = m and re.match(r'(\w+) (\w+) (\S+)', f"{m.group(2)} ingest {m.group(3)}")
        if m:
            s, c = totals.get(m.group(2), (0.0, 0.0))
            totals[m.group(2)] = (s + float(m.group(3)), c) if m.group(1) == "sum" else (s, float(m.group(3)))
    return totals


def stage_means(out, stem):
    """Mean ms per stage over one load: the scrapes after minus before it."""
    before = stage_totals(os.path.join(out, stem + ".before.txt"))
    after = stage_totals(os.path.join(out, stem + ".after.txt"))
    if not before or not after:
        return None
    means = {}
    for stage, (s1, c1) in after.items():
        s0, c0 = before.get(stage, (0.0, 0.0))
        if c1 > c0:
            means[stage] = 1e3 * (s1 - s0) / (c1 - c0)
    return means


def main(out):
    print("| load | server | GB/s | pushes/s | p50 ms | p90 ms | p99 ms | p99/p50 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    ratios = []
    for model, streams, clients in loads(out):
        name = f"{model}, {clients} client{'s' if clients > 1 else ''} x {streams} stream{'s' if streams > 1 else ''}"
        got = {s: load(os.path.join(out, f"{s}_{model}_c{clients}_s{streams}.json")) for s in SERVERS}
        for s in SERVERS:
            r = got[s]
            if r is None and s == "old":
                continue
            if r is None:
                print(f"| {name} | {s} | - | - | - | - | - | - |")
                continue
            lat = r["latency_ms"]
            print(f"| {name} | {s} | {r['gbps']:.3f} | {r['pushes_per_s']:.2f} | "
                  f"{lat['p50']:.2f} | {lat['p90']:.2f} | {lat['p99']:.2f} | "
                  f"{lat['p99'] / lat['p50']:.2f} |")
        ours = got["fusedps"]
        ratios.append((name, ours and got["sink"] and ours["gbps"] / got["sink"]["gbps"],
                       ours and got["peer"] and ours["gbps"] / got["peer"]["gbps"],
                       ours and got["old"] and ours["gbps"] / got["old"]["gbps"]))
    print()
    print("| load | ours/sink (throughput) | ours/peer (throughput) | ours/old (throughput) |")
    print("|---|---:|---:|---:|")
    for name, sink, peer, old in ratios:
        fmt = lambda x: "-" if x is None else f"{x:.2f}"
        print(f"| {name} | {fmt(sink)} | {fmt(peer)} | {fmt(old)} |")
    print()
    print("fusedps stage means per push (ms; server side, warmup pushes included):")
    print()
    print("| load | receive | h2d | apply | ack | ingest (thread time, within receive) |")
    print("|---|---:|---:|---:|---:|---:|")
    for model, streams, clients in loads(out):
        means = stage_means(out, f"fusedps_{model}_c{clients}_s{streams}")
        if means:
            print(f"| {model}, {clients} x {streams} | " + " | ".join(
                f"{means.get(s, float('nan')):.3f}" for s in ["receive", "h2d", "apply", "ack", "ingest"]) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
