#!/usr/bin/python3
"""The table of scripts/device_shards.sh: push throughput on 1 against 2 shards (each round's
pair measured back to back), and the sync rounds' time split from the servers' own metrics.

Usage: shard_report.py OUT_DIR   (the folder the device script wrote)
"""
import glob
import json
import os
import re
import sys

STAGES = ("receive", "accumulate", "apply", "ack")


def samples(path):
    """{(name, labels text): value} of a Prometheus text scrape ({} when missing)."""
    out = {}
    if not os.path.exists(path):
        return out
    for line in open(path):
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line.strip())
        if m:
            out[(m.group(1), m.group(2) or "")] = float(m.group(3))
    return out


def delta(before, after, name, labels=""):
    return after.get((name, labels), 0.0) - before.get((name, labels), 0.0)


def main(out):
    runs = {}
    for path in sorted(glob.glob(os.path.join(out, "async_s*_r*.json"))):
        m = re.search(r"async_s(\d)_r(\d+)\.json$", path)
        try:
            runs[(int(m.group(2)), int(m.group(1)))] = json.load(open(path))
        except ValueError:
            print(f"unreadable: {path}")
    print("## Push throughput, GPT-2 small bf16, async, through fusedps-bench --targets")
    print("| round | shards | clients | pushes/s | GB/s | p50 ms | p99 ms | vs 1 shard |")
    print("|---|---|---|---|---|---|---|---|")
    for (r, shards), j in sorted(runs.items()):
        base = runs.get((r, 1))
        ratio = f"{j['gbps'] / base['gbps']:.2f}x" if base and base["gbps"] > 0 else "-"
        print(f"| {r} | {shards} | {j['clients']} | {j['pushes_per_s']:.1f} | {j['gbps']:.2f} | "
              f"{j['latency_ms']['p50']:.1f} | {j['latency_ms']['p99']:.1f} | {ratio} |")

    print("\n## Sync rounds (K = N = clients) on 2 shards: time per round, from the servers")
    sync = os.path.join(out, "sync_s2.json")
    if os.path.exists(sync):
        j = json.load(open(sync))
        print(f"bench: {j['pushes_per_s']:.1f} pushes/s, {j['gbps']:.2f} GB/s, push p50 "
              f"{j['latency_ms']['p50']:.1f} ms, versions {j['version_before']} -> "
              f"{j['version_after']}")
    print("| shard | rounds | workers/round | round ms | "
          + " | ".join(f"{s} ms" for s in STAGES) + " | timeouts |")
    print("|---|---|---|---|" + "---|" * len(STAGES) + "---|")
    for shard in ("a", "b"):
        before = samples(os.path.join(out, f"sync_{shard}.before.txt"))
        after = samples(os.path.join(out, f"sync_{shard}.after.txt"))
        rounds = delta(before, after, "fusedps_round_duration_seconds_count")
        if rounds <= 0:
            print(f"| {shard} | 0 | | | | | | | |")
            continue
        per = lambda name, labels="": 1e3 * delta(before, after, name, labels) / rounds
        stages = [per("fusedps_round_stage_duration_seconds_sum", f'{{stage="{s}"}}')
                  for s in STAGES]
        workers = delta(before, after, "fusedps_round_workers_sum") / rounds
        timeouts = delta(before, after, "fusedps_rounds_total",
                         '{closed_by="timeout",model="default"}')
        print(f"| {shard} | {rounds:.0f} | {workers:.2f} | "
              f"{per('fusedps_round_duration_seconds_sum'):.2f} | "
              + " | ".join(f"{s:.2f}" for s in stages) + f" | {timeouts:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp/fusedps-out")
