#!/usr/bin/env python3
"""What do Python hooks cost a CPU-bound training loop, with no fusedps in it?

Trains the GPT of fusedps.bench.gpt locally with torch.optim.AdamW and times the step under
each set of do-nothing hooks, in rounds (each configuration once per round, the median of each
over the rounds), in one process and one run:

  none       no hooks
  grad       a gradient-accumulation hook per parameter (fusedps._grad_hooks, as
             RemoteAdamW(overlap=True) installs), whose callback takes a lock and returns
  global     one global forward pre-hook that returns at once (torch then takes the slow path
             of Module.__call__ for every module)
  module     a forward pre-hook on each module that owns parameters, returning at once
  grad+global

    python3 bench/hook_overhead.py [--preset gpt2] [--device cuda] [--rounds 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import threading
import time

import torch

from fusedps._grad_hooks import GradReadyHooks
from fusedps.bench.e2e import PRESETS
from fusedps.bench.gpt import GPT, GPTConfig


def steps(model, opt, n, batch, device, gen):
    cfg = model.cfg
    times = []
    for _ in range(n):
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen,
                               device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(device_type="cuda", dtype=torch.bfloat16)
              if device.type == "cuda" else contextlib.nullcontext()):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def install(kind, model):
    """Installs the hooks of ``kind``; returns a function that removes them."""
    removers = []
    lock = threading.Lock()
    if "grad" in kind:
        def on_ready(_i):
            with lock:
                pass
        hooks = GradReadyHooks(list(model.parameters()), on_ready)
        removers.append(hooks.remove)
    if "global" in kind:
        handle = torch.nn.modules.module.register_module_forward_pre_hook(lambda m, i: None)
        removers.append(handle.remove)
    if "module" in kind:
        for m in model.modules():
            if any(True for _ in m.parameters(recurse=False)):
                removers.append(m.register_forward_pre_hook(lambda m, i: None).remove)
    return lambda: [r() for r in removers]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="gpt2", choices=sorted(PRESETS))
    p.add_argument("--device", default="cuda")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--kinds", default="none grad global module grad+global")
    args = p.parse_args()
    device = torch.device(args.device)
    preset = dict(PRESETS[args.preset])
    batch = preset.pop("batch_size")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**preset)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    kinds = args.kinds.split()
    steps(model, opt, 5, batch, device, gen)  # Warm-up: allocator, autotuning.
    times = {k: [] for k in kinds}
    for _ in range(args.rounds):
        for kind in kinds:
            remove = install(kind, model)
            times[kind].extend(steps(model, opt, args.steps, batch, device, gen)[2:])
            remove()
    base = statistics.median(times[kinds[0]])
    print(f"hook overhead, {args.preset} preset, {device}, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'hooks':<14} {'ms/step':>8} {'vs ' + kinds[0]:>9}")
    for kind in kinds:
        t = statistics.median(times[kind])
        print(f"{kind:<14} {t * 1e3:8.2f} {t / base:8.3f}x")


if __name__ == "__main__":
    main()
