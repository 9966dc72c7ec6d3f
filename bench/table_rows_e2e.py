#!/usr/bin/env python3
"""Row pushes and lookups of an embedding table end to end (issue 38), against the raw gRPC
ceiling on the same load, in one run.

Row pushes: Client.push_rows of --rows unique random keys with [rows, dim] fp32 gradients, to
a fusedps-server (a hashed table of --capacity slots, so the first pushes create rows and the
later ones update them) and to fusedps-grpc-sink (bench/peers: the same service and message
limits, no optimizer: it scans the messages' framing and skips the payload). Lookups: the same
keys through Client.lookup_rows from the server, against PullParameters of a dense tensor of
the same bytes from the sink (a server-streaming read of the same payload; the sink has no
LookupRows). One client, one call at a time; the median of --repeats calls after --warmup.

    python3 bench/table_rows_e2e.py --server .device-pack/fusedps-server-wrapper \\
        --sink '.device-pack/run fusedps-grpc-sink' --device cuda

Prints a markdown table: per operation, ms per call, rows/s and payload GB/s for each target,
and fusedps / sink.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))

import fusedps  # noqa: E402
from server_fixture import wait_for_port  # noqa: E402


def start(command: list, tmp: str, name: str) -> tuple:
    port_file = os.path.join(tmp, f"{name}.port")
    log = open(os.path.join(tmp, f"{name}.log"), "wb")
    proc = subprocess.Popen(command + ["--listen=127.0.0.1:0", f"--port-file={port_file}"],
                            stdout=log, stderr=subprocess.STDOUT)
    port = wait_for_port(proc, port_file, 120, lambda: open(log.name, "rb").read()[-4000:])
    return proc, f"127.0.0.1:{port}"


def timed(call, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        call()
    seconds = []
    for _ in range(repeats):
        begin = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - begin)
    return statistics.median(seconds)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--server", required=True, help="the fusedps-server command")
    p.add_argument("--sink", required=True, help="the fusedps-grpc-sink command")
    p.add_argument("--device", default="cuda")
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--capacity", type=int, default=1 << 20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=15)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(0)
    keys = torch.randperm(args.capacity, generator=gen)[:args.rows] * 7919 + 13
    grads = torch.randn(args.rows, args.dim, generator=gen)
    push_bytes = keys.numel() * 8 + grads.numel() * 4
    read_bytes = grads.numel() * 4
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        server, server_target = start(
            shlex.split(args.server) + [f"--device={args.device}", "--metrics-listen=127.0.0.1:0"],
            tmp, "server")
        sink, sink_target = start(shlex.split(args.sink), tmp, "sink")
        try:
            for name, target in (("fusedps", server_target), ("sink", sink_target)):
                with fusedps.Client(target, max_chunk_bytes=4 << 20) as c:
                    c.register_param_group("tables", lr=1e-3, weight_decay=0.0)
                    c.register_hashed_table("t", args.capacity, args.dim, seed=1, init_std=0.01,
                                            param_group="tables")
                    results[(name, "push_rows")] = timed(
                        lambda: c.push_rows({"t": (keys, grads)}), args.warmup, args.repeats)
                    if name == "fusedps":
                        results[(name, "lookup")] = timed(
                            lambda: c.lookup_rows("t", keys), args.warmup, args.repeats)
                    else:
                        c.register_model({"same_bytes": torch.zeros(args.rows, args.dim)})
                        results[(name, "lookup")] = timed(
                            lambda: c.pull_parameters(["same_bytes"]), args.warmup,
                            args.repeats)
        finally:
            for proc in (server, sink):
                proc.terminate()
                proc.wait(60)
    print(f"rows {args.rows} x dim {args.dim} fp32, capacity {args.capacity}, device "
          f"{args.device}; median of {args.repeats} calls after {args.warmup}")
    print("| operation | target | ms/call | rows/s | GB/s | fusedps / sink time |")
    print("|---|---|---:|---:|---:|---:|")
    for op, nbytes in (("push_rows", push_bytes), ("lookup", read_bytes)):
        for name in ("fusedps", "sink"):
            s = results[(name, op)]
            ratio = s / results[("sink", op)]
            label = op if name == "fusedps" or op == "push_rows" else "pull (same bytes)"
            print(f"| {label} | {name} | {s * 1e3:.2f} | {args.rows / s:,.0f} | "
                  f"{nbytes / s / 1e9:.2f} | {ratio:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
