#!/usr/bin/python3
"""The baseline fusedps's CPU backend is compared with: torch.optim.AdamW(foreach=True) on CPU.

Steps the same workloads as fusedps-kernel-bench (bench/workloads.cc; same --scale rule, same
tensor lists) with fp32 params, gradients and state, torch's default hyperparameters, random
normal params and gradients, and reports the median time of one optimizer.step() with the same
bytes-per-parameter count (28 for fp32).

Usage:
  /usr/bin/python3 bench/torch_baseline.py --workload=all --scale=0.1 --iters=10 [--json]
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch

BYTES_PER_PARAM = 28  # params, exp_avg, exp_avg_sq read and written (24) + fp32 grad read (4)
WORKLOAD_NAMES = ["one_large", "gpt2", "t1000x100k", "t10000x1k"]


def gpt2_small_numels():
    vocab, context, embed, layers = 50257, 1024, 768, 12
    numels = [vocab * embed, context * embed]
    for _ in range(layers):
        numels += [
            embed, embed,                  # ln_1 weight, bias
            embed * 3 * embed, 3 * embed,  # attn.c_attn weight, bias
            embed * embed, embed,          # attn.c_proj weight, bias
            embed, embed,                  # ln_2 weight, bias
            embed * 4 * embed, 4 * embed,  # mlp.c_fc weight, bias
            4 * embed * embed, embed,      # mlp.c_proj weight, bias
        ]
    return numels + [embed, embed]  # ln_f weight, bias


def scaled_numel(numel, scale):
    """bench/workloads.cc's ScaledNumel: max(1, floor(numel * scale + 0.5))."""
    return max(1, int(math.floor(float(numel) * scale + 0.5)))


def make_workload(name, scale):
    description, numels = {
        "one_large": ("1 tensor x 100M", [100_000_000]),
        "gpt2": ("GPT-2 small, 148 tensors, 124M", gpt2_small_numels()),
        "t1000x100k": ("1000 tensors x 100K", [100_000] * 1000),
        "t10000x1k": ("10000 tensors x 1K", [1_000] * 10000),
    }[name]
    return {"name": name, "description": description,
            "numels": [scaled_numel(n, scale) for n in numels]}


def time_workload(workload, args):
    generator = torch.Generator().manual_seed(args.seed)
    params = []
    for numel in workload["numels"]:
        param = torch.nn.Parameter(torch.randn(numel, generator=generator))
        param.grad = torch.randn(numel, generator=generator)
        params.append(param)
    optimizer = torch.optim.AdamW(params, foreach=True)
    for _ in range(args.warmup):
        optimizer.step()
    ms = []
    for _ in range(args.iters):
        start = time.perf_counter()
        optimizer.step()
        ms.append((time.perf_counter() - start) * 1e3)
    total = sum(workload["numels"])
    median = statistics.median(ms)
    return {
        "workload": workload["name"],
        "description": workload["description"],
        "tensors": len(workload["numels"]),
        "params": total,
        "ms_median": median,
        "ms_min": min(ms),
        "ms_max": max(ms),
        "gbps": BYTES_PER_PARAM * total / (median * 1e-3) / 1e9,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="all", choices=["all"] + WORKLOAD_NAMES)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiplies every tensor's element count (tensor counts stay)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads; 0 means one per CPU this process may use")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if not 0 < args.scale <= 1e3 or args.iters < 1 or args.warmup < 0 or args.threads < 0:
        parser.error("need 0 < --scale <= 1000, --iters >= 1, --warmup >= 0, --threads >= 0")

    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    names = WORKLOAD_NAMES if args.workload == "all" else [args.workload]
    results = []
    for name in names:
        workload = make_workload(name, args.scale)
        print(f"torch_baseline: {name} ({len(workload['numels'])} tensors, "
              f"{sum(workload['numels'])} params): timing {args.iters} steps",
              file=sys.stderr, flush=True)
        results.append(time_workload(workload, args))

    config = {"tool": "torch_baseline", "optimizer": "torch.optim.AdamW(foreach=True)",
              "torch": torch.__version__, "threads": threads, "scale": args.scale,
              "warmup": args.warmup, "iters": args.iters, "bytes_per_param": BYTES_PER_PARAM}
    if args.json:
        print(json.dumps(dict(config, results=results), indent=1))
        return
    print(f"torch_baseline: torch.optim.AdamW(foreach=True) torch={torch.__version__} "
          f"threads={threads} scale={args.scale:g} warmup={args.warmup} iters={args.iters} "
          f"bytes/param={BYTES_PER_PARAM}")
    print(f"{'workload':<11} {'tensors':>8} {'params':>12} {'ms/step':>10} {'min ms':>10} "
          f"{'GB/s':>8}")
    for r in results:
        print(f"{r['workload']:<11} {r['tensors']:>8} {r['params']:>12} {r['ms_median']:>10.3f} "
              f"{r['ms_min']:>10.3f} {r['gbps']:>8.2f}")


if __name__ == "__main__":
    main()
