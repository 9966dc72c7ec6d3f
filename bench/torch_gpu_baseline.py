#!/usr/bin/env python3
"""The GPU baselines fusedps's CUDA kernel is compared with, on the same workloads.

For each workload of bench/torch_baseline.py (DESIGN.md "Numbers to beat") it times one
optimizer step, median of --iters after --warmup, with CUDA events on the current stream, each
step alone and queued back to back (time_ms):
  - torch.optim.AdamW(fused=True): fp32 params, grads and state;
  - a torch.compile'd step of torch.optim.AdamW(foreach=True) (skipped with --no-compile);
  - "bf16 path": what a user writes for bf16 grads with an fp32 master and a bf16 copy:
    upcast the grads, the fused step, then torch._foreach_copy_ into bf16 params.
It counts CUDA kernels per step with torch.profiler, and measures a large device-to-device
copy in the same run. Prints one JSON object (a list of rows) on stdout.

  python3 bench/torch_gpu_baseline.py --workload=all --iters=20 > torch.json
"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from torch_baseline import WORKLOAD_NAMES, make_workload  # noqa: E402

BYTES_PER_PARAM = 28


def time_ms(fn, warmup, iters):
    """Median ms of fn, each call timed alone (the device idle before it, so the host's launch
    latency and Python's time are in it), and queued back to back (each call's events follow
    the previous call's, as fusedps-kernel-bench's queued steps): (idle_ms, queued_ms)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    events = [torch.cuda.Event(enable_timing=True) for _ in range(iters + 2)]
    events[0].record()
    for i in range(iters + 1):
        fn()
        events[i + 1].record()
    events[-1].synchronize()
    # The first call starts on an idle device: not counted.
    queued = [events[i].elapsed_time(events[i + 1]) for i in range(1, iters + 1)]
    return statistics.median(times), statistics.median(queued)


def count_kernels(fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and "memcpy" not in e.name.lower() and "memset" not in e.name.lower())


def copy_gbps(warmup, iters, numel=1 << 30):
    """GB/s of a 512 MiB device copy (bytes read + bytes written): (idle, queued)."""
    src = torch.randn(numel // 4, device="cuda")
    dst = torch.empty_like(src)
    return tuple(2 * src.numel() * 4 / (ms * 1e-3) / 1e9
                 for ms in time_ms(lambda: dst.copy_(src), warmup, iters))


def make_state(numels, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    params = [torch.randn(n, device="cuda", generator=g).requires_grad_() for n in numels]
    grads = [torch.randn(n, device="cuda", generator=g) for n in numels]
    for p, grad in zip(params, grads):
        p.grad = grad
    return params, grads


def run(workload, args, copy):
    numels = workload["numels"]
    total = sum(numels)
    rows = []

    def row(variant, times, kernels):
        ms, queued_ms = times
        gbps = total * BYTES_PER_PARAM / (ms * 1e-3) / 1e9
        queued_gbps = total * BYTES_PER_PARAM / (queued_ms * 1e-3) / 1e9
        rows.append({"workload": workload["name"], "variant": variant, "ms": ms,
                     "kernels": kernels, "gbps": gbps, "pct_copy": 100 * gbps / copy[0],
                     "queued_ms": queued_ms, "queued_gbps": queued_gbps,
                     "queued_pct_copy": 100 * queued_gbps / copy[1],
                     "tensors": len(numels), "params": total})

    params, grads = make_state(numels, args.seed)
    opt = torch.optim.AdamW(params, lr=1e-3, fused=True)
    row("torch_fused", time_ms(opt.step, args.warmup, args.iters), count_kernels(opt.step))

    grads_bf16 = [g.to(torch.bfloat16) for g in grads]
    params_bf16 = [p.detach().to(torch.bfloat16) for p in params]

    def bf16_step():
        for p, g in zip(params, grads_bf16):
            p.grad = g.float()
        opt.step()
        torch._foreach_copy_(params_bf16, [p.detach() for p in params])
    row("torch_fused_bf16_path", time_ms(bf16_step, args.warmup, args.iters),
        count_kernels(bf16_step))
    for p, g in zip(params, grads):
        p.grad = g
    del opt

    if workload["name"] in args.compile_workloads.split(","):
        opt_c = torch.optim.AdamW(params, lr=1e-3, foreach=True)

        @torch.compile(fullgraph=False)
        def compiled_step():
            opt_c.step()
        try:
            row("torch_compile", time_ms(compiled_step, args.warmup, args.iters),
                count_kernels(compiled_step))
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"torch.compile failed on {workload['name']}: {e}", file=sys.stderr)
    del params, grads
    torch.cuda.empty_cache()
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="all")
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--compile-workloads", default="one_large,gpt2,t1000x100k",
                        help="workloads that also time a torch.compile'd step (it compiles for "
                             "minutes on 10000 tensors)")
    args = parser.parse_args()
    names = WORKLOAD_NAMES if args.workload == "all" else [args.workload]
    copy = copy_gbps(args.warmup, args.iters)
    rows = []
    for name in names:
        workload = make_workload(name, args.scale)
        print(f"torch: {name}", file=sys.stderr, flush=True)
        rows += run(workload, args, copy)
    print(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                      "copy_gbps": copy[0], "queued_copy_gbps": copy[1], "rows": rows}))


if __name__ == "__main__":
    main()
