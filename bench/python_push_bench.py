"""Push throughput of the Python client (fusedps.Client), for the comparison with the C++ client
(fusedps-bench) on the same server: GPT-2 small's tensors (tests/data/gpt2_small_tensors.json),
fp32 gradients in host memory sent as bf16 (or another --dtype), one client, --streams parts per
push, pushes back to back for --duration seconds after --warmup-steps.

    python3 bench/python_push_bench.py --target HOST:PORT --transport native --streams 8

Prints one JSON object: transport, streams, pushes, seconds, gbps (GB = 1e9 bytes of gradient
payload as the server counts it, PushResult.grad_bytes), pushes_per_second, latency_ms (p50,
p90, max of the pushes), and the same for --pulls pulls (fp32 into the tensors) when > 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

import fusedps

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--transport", choices=("native", "grpcio"), default="native")
    parser.add_argument("--streams", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds of pushes")
    parser.add_argument("--warmup-steps", type=int, default=2)
    parser.add_argument("--pulls", type=int, default=0, help="timed pulls after the pushes")
    parser.add_argument("--prefix", default="py.")
    parser.add_argument("--tensors", default=os.path.join(REPO, "tests", "data",
                                                          "gpt2_small_tensors.json"))
    args = parser.parse_args()

    with open(args.tensors) as f:
        specs = json.load(f)
    generator = torch.Generator().manual_seed(1)
    params = {args.prefix + s["name"]: torch.randn(s["shape"], generator=generator) * 0.02
              for s in specs}
    grads = {name: torch.randn(p.shape, generator=generator) * 1e-3
             for name, p in params.items()}
    client = fusedps.Client(args.target, transport=args.transport, streams=args.streams,
                            timeout=120)
    client.register_model(params)
    for _ in range(args.warmup_steps):
        client.push_gradients(grads, grad_dtype=args.dtype)
    latencies, payload = [], 0
    start = time.perf_counter()
    while time.perf_counter() - start < args.duration:
        t0 = time.perf_counter()
        result = client.push_gradients(grads, grad_dtype=args.dtype)
        latencies.append(time.perf_counter() - t0)
        payload += result.grad_bytes
    seconds = time.perf_counter() - start
    report = {
        "client": f"python-{args.transport}", "transport": client.transport_in_use,
        "streams": args.streams, "dtype": args.dtype, "pushes": len(latencies),
        "seconds": seconds, "gbps": payload / seconds / 1e9,
        "pushes_per_second": len(latencies) / seconds,
        "latency_ms": {"p50": 1e3 * statistics.median(latencies),
                       "p90": 1e3 * statistics.quantiles(latencies, n=10, method="inclusive")[-1]
                       if len(latencies) > 1 else 1e3 * latencies[0],
                       "max": 1e3 * max(latencies)},
    }
    if args.pulls:
        pull_times = []
        for _ in range(args.pulls):
            t0 = time.perf_counter()
            client.pull_parameters(params)
            pull_times.append(time.perf_counter() - t0)
        nbytes = 4 * sum(p.numel() for p in params.values())
        report["pull_gbps"] = nbytes / statistics.median(pull_times) / 1e9
    client.close()
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
