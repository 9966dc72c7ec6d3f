#!/usr/bin/env python3
"""How close a device-to-device copy of a step's bytes comes to a large copy's bandwidth.

A step of W bytes in all (reads + writes) cannot beat a plain copy that moves the same W bytes:
both pay the launch, the ramp-up and the drain, which a 512 MiB copy hides. This times
torch's copy_ (one kernel) of W / 2 bytes for each W given, and of 512 MiB, median of --iters
with CUDA events (each copy alone, then copies queued back to back), and prints each size's
GB/s and its share of the large copy's timed the same way.

  python3 bench/copy_size_ceiling.py --step-bytes=280e6,1.6e9 --iters=50
"""
import argparse
import json
import statistics

import torch


def copy_gbps(moved_bytes, warmup, iters, queued):
    n = int(moved_bytes // 2 // 4)
    src = torch.randn(n, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    if queued:  # Back to back: each copy timed from the previous one's end.
        events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 2)]
        events[0].record()
        for i in range(iters + 1):
            dst.copy_(src)
            events[i + 1].record()
        events[-1].synchronize()
        times = [events[i].elapsed_time(events[i + 1]) for i in range(1, iters + 1)]
    else:
        times = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    return ms, 2 * n * 4 / (ms * 1e-3) / 1e9


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-bytes", default="280e6",
                        help="comma-separated bytes moved (read + written) per step")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args()
    rows = []
    for queued in (False, True):
        _, large = copy_gbps(2 * (512 << 20), args.warmup, args.iters, queued)
        for moved in (float(x) for x in args.step_bytes.split(",")):
            ms, gbps = copy_gbps(moved, args.warmup, args.iters, queued)
            rows.append({"queued": queued, "moved_bytes": moved, "ms": ms, "gbps": gbps,
                         "large_gbps": large, "pct_of_large": 100 * gbps / large})
    print(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}))


if __name__ == "__main__":
    main()
