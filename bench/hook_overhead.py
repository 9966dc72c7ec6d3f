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
import statistics
import threading

import torch

from contention_probe import train  # bench/, beside this script.
from fusedps._grad_hooks import GradReadyHooks
from fusedps.bench.e2e import PRESETS
from fusedps.bench.gpt import GPT, GPTConfig


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
    kinds = args.kinds.split()
    train(model, opt, 3, 2, batch, device)  # Warm-up: allocator, autotuning.
    times = {k: [] for k in kinds}  # Each round's median ms, per kind.
    for _ in range(args.rounds):
        for kind in kinds:
            remove = install(kind, model)
            times[kind].append(train(model, opt, args.steps, 2, batch, device))
            remove()
    base = statistics.median(times[kinds[0]])
    print(f"hook overhead, {args.preset} preset, {device}, torch {torch.__version__}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"{'hooks':<14} {'ms/step':>8} {'vs ' + kinds[0]:>9}")
    for kind in kinds:
        t = statistics.median(times[kind])
        print(f"{kind:<14} {t:8.2f} {t / base:8.3f}x")


if __name__ == "__main__":
    main()
