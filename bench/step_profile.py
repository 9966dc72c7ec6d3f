#!/usr/bin/env python3
"""Where a training step's time goes, local against RemoteAdamW(overlap=True), by torch.profiler.

Trains the GPT of fusedps.bench.gpt (the e2e self-check's presets) with torch.optim.AdamW, then
with RemoteAdamW(overlap=True, ...) against --target, profiles a few steps of each (CPU and
CUDA activities), and prints for each: ms per step; the GPU's busy time per step (the union of
its kernels and copies, per stream kind); the CPU time per step of each thread (the training
loop, autograd's, fusedps's) in the ops torch records; and the ops that grew most from local
to remote. With --trace DIR it also writes Chrome traces there. With --cprofile N it first
runs N steps with Python's cProfile on around optimizer.step() alone, and prints where that
call's time goes (the functions with the most time of their own, and the most in all).

    python3 bench/step_profile.py --target 127.0.0.1:PORT --preset gpt2 --grad-dtype bfloat16 \
        --delay 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from fusedps.bench.e2e import PRESETS
from fusedps.bench.gpt import GPT, GPTConfig


def step(model, opt, tokens, amp, profiler=None):
    opt.zero_grad(set_to_none=True)
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16) if amp else \
            contextlib.nullcontext():
        logits = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                             tokens[:, 1:].flatten())
    loss.backward()
    if profiler is not None:
        profiler.enable()
    opt.step()
    if profiler is not None:
        profiler.disable()


def print_cprofile(name, profiler, steps):
    import io
    import pstats
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(key).print_stats(18)
        print(f"== {name}: optimizer.step() under cProfile, {steps} steps, by {key}")
        print("\n".join(line for line in text.getvalue().splitlines()[4:] if line.strip()))


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def union_ms(intervals):
    """Total length of the union of (start, end) intervals, in ms (profiler times are us)."""
    total, end = 0.0, None
    for s, e in sorted(intervals):
        if end is None or s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total / 1e3


def summarize(name, prof, steps, wall_ms):
    events = prof.events()
    gpu = collections.defaultdict(list)
    cpu = collections.defaultdict(float)
    ops = collections.defaultdict(float)
    for e in events:
        start = e.time_range.start
        end = e.time_range.end
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            kind = "copy" if "Memcpy" in e.name or "memcpy" in e.name else "kernel"
            gpu[kind].append((start, end))
            gpu["any"].append((start, end))
        elif e.cpu_parent is None:  # Top-level CPU ops only: no double counting.
            cpu[e.thread] += (end - start) / 1e3
            ops[e.name] += (end - start) / 1e3
    print(f"== {name}: {wall_ms:.2f} ms/step over {steps} profiled steps")
    for kind in ("any", "kernel", "copy"):
        print(f"  GPU busy ({kind}): {union_ms(gpu[kind]) / steps:8.2f} ms/step")
    for thread, ms in sorted(cpu.items(), key=lambda kv: -kv[1])[:6]:
        print(f"  CPU thread {thread}: {ms / steps:8.2f} ms/step in top-level ops")
    return {k: v / steps for k, v in ops.items()}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--steps", type=int, default=4, help="profiled steps")
    p.add_argument("--warmup", type=int, default=15)
    p.add_argument("--grad-dtype", default="bfloat16")
    p.add_argument("--pull-dtype", default="bfloat16")
    p.add_argument("--delay", type=int, default=1)
    p.add_argument("--trace", help="write Chrome traces to this folder")
    p.add_argument("--device", default="cuda")
    p.add_argument("--cprofile", type=int, default=0,
                   help="steps with cProfile on around optimizer.step(), before the profiler")
    args = p.parse_args()
    from fusedps.torch import RemoteAdamW

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    preset = dict(PRESETS[args.preset])
    batch = preset.pop("batch_size")
    torch.manual_seed(0)
    gen = torch.Generator(device=device).manual_seed(1)
    results = {}
    for name in ("local", "remote"):
        model = GPT(GPTConfig(**preset)).to(device)
        if name == "local":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            opt = RemoteAdamW(model.named_parameters(), lr=1e-4, targets=args.target,
                              prefix=f"profile/{args.preset}/", overlap=True,
                              grad_dtype=args.grad_dtype, pull_dtype=args.pull_dtype,
                              delay=args.delay, delay_warmup=3,
                              on_existing="resume")  # a run again: timings need no fresh values
        cfg = model.cfg
        batches = [torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen,
                                 device=device) for _ in range(4)]
        for i in range(args.warmup):
            step(model, opt, batches[i % 4], cuda)
        if args.cprofile:
            import cProfile
            profiler = cProfile.Profile()
            for i in range(args.cprofile):
                step(model, opt, batches[i % 4], cuda, profiler)
            print_cprofile(name, profiler, args.cprofile)
        sync(device)
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            for i in range(args.steps):
                step(model, opt, batches[i % 4], cuda)
            sync(device)
            wall = (time.perf_counter() - start) / args.steps * 1e3
        results[name] = summarize(name, prof, args.steps, wall)
        if args.trace:
            os.makedirs(args.trace, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace, f"{name}.json"))
        if name == "remote":
            opt.close()
        del model, opt
    grew = sorted(((results["remote"].get(k, 0) - results["local"].get(k, 0), k)
                   for k in set(results["remote"]) | set(results["local"])), reverse=True)
    print("\nCPU ops that grew most, ms/step (remote - local):")
    for d, k in grew[:15]:
        print(f"  {d:8.2f}  {k}  (local {results['local'].get(k, 0):.2f}, remote "
              f"{results['remote'].get(k, 0):.2f})")


if __name__ == "__main__":
    main()
