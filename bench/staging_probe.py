#!/usr/bin/env python3
"""What does RemoteAdamW(overlap=True)'s staging during backward cost a local training loop?

Trains the GPT of fusedps.bench.gpt locally with torch.optim.AdamW (no fusedps, no server, no
worker thread) with gradient hooks that do part of what fusedps's do (fusedps/_overlap.py,
_overlap_staging.py), and prints ms/step (forward, backward and step, median) for each mode,
in rounds, in one process:

  none      no hooks
  hooks     a hook on every param that only counts (one Python call per param)
  gather    hooks that, at each planned bucket's last param, gather its gradients into a flat
            fp32 buffer on a side stream (after an event of backward's stream), as fusedps does
  cast      gather, then the bucket cast to bf16 (fusedps's bf16 wire)
  copy      cast, then the bucket copied to pinned host memory on the side stream
  query     copy, then every hook polls the last bucket's copy event (fusedps's writes do)
  nowait    copy, but nothing waits for the side stream: the loop's stream does not wait for
            the last bucket's copy (what the copies cost the loop beside it, not after it;
            the gradients the side stream reads may be reused meanwhile: timing only)

Each step is timed to the end of the loop's own stream (not the side stream's work).

Buckets: the step's gradients in backward's order cut into --buckets about equal parts.

    python3 bench/staging_probe.py [--preset small] [--rounds 2] [--modes "none hooks ..."]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

from fusedps.bench.e2e import PRESETS
from fusedps.bench.gpt import GPT, GPTConfig

MODES = ("none", "hooks", "gather", "cast", "copy", "query", "nowait")


class Stager:
    def __init__(self, params, buckets: int, mode: str):
        self.params, self.mode = params, mode
        self.order, self.ready = [], 0
        self.ends = set()
        self.stream = torch.cuda.Stream()
        total = sum(p.numel() for p in params)
        self.flat = torch.empty(total, dtype=torch.float32, device="cuda")
        self.wire = torch.empty(total, dtype=torch.bfloat16, device="cuda")
        self.host = torch.empty(total, dtype=torch.bfloat16, pin_memory=True)
        self.buckets, self.events = buckets, []
        self.handles = [p.register_post_accumulate_grad_hook(
            lambda _p, i=i: self.on_ready(i)) for i, p in enumerate(params)]
        self.begin = 0
        self.views = {}

    def plan(self):
        """From the first step's order: the params after which a bucket closes."""
        sizes = [self.params[i].numel() for i in self.order]
        share, held = sum(sizes) / self.buckets, 0
        for i, n in zip(self.order, sizes):
            held += n
            if held >= share:
                self.ends.add(i)
                held = 0
        self.ends.add(self.order[-1])

    def on_ready(self, i: int) -> None:
        if not self.ends:
            self.order.append(i)
            return
        if self.mode == "query" and self.events:
            self.events[-1].query()
        if self.mode == "hooks" or i not in self.ends:
            return
        at = self.order.index(i) + 1
        members = self.order[self.begin:at]
        self.begin = at % len(self.order)
        key = tuple(members)
        if key not in self.views:
            start = sum(self.params[j].numel() for j in self.order[:at - len(members)])
            views, cur = [], start
            for j in members:
                views.append(self.flat[cur:cur + self.params[j].numel()].view(
                    self.params[j].shape))
                cur += self.params[j].numel()
            self.views[key] = (views, slice(start, cur))
        views, r = self.views[key]
        ready = torch.cuda.current_stream().record_event()
        with torch.no_grad(), torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            torch._foreach_copy_(views, [self.params[j].grad for j in members])
            if self.mode != "gather":
                self.wire[r].copy_(self.flat[r])
            if self.mode in ("copy", "query", "nowait"):
                self.host[r].copy_(self.wire[r], non_blocking=True)
            self.events.append(self.stream.record_event())

    def end_step(self):
        if self.mode != "nowait":
            torch.cuda.current_stream().wait_stream(self.stream)
        self.events = []
        if not self.ends and self.order:
            self.plan()

    def remove(self):
        for h in self.handles:
            h.remove()


def train(model, opt, stager, steps, warmup, batch):
    cfg = model.cfg
    gen = torch.Generator(device="cuda").manual_seed(1)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen,
                               device="cuda")
        torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        if stager is not None:
            stager.end_step()
        opt.step()
        torch.cuda.current_stream().synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--buckets", type=int, default=4)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--modes", default=" ".join(MODES))
    args = p.parse_args()
    preset = dict(PRESETS[args.preset])
    batch = preset.pop("batch_size")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**preset)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    params = [q for q in model.parameters() if q.requires_grad]
    rows = {m: [] for m in args.modes.split()}
    for r in range(args.rounds):
        for mode in rows:
            stager = None if mode == "none" else Stager(params, args.buckets, mode)
            ms = train(model, opt, stager, args.steps, args.warmup, batch)
            if stager is not None:
                stager.remove()
            rows[mode].append(ms)
            print(f"round {r + 1} {mode:8} {ms:8.2f} ms/step", flush=True)
    base = statistics.median(rows[next(iter(rows))])
    print(f"\n{'mode':8} {'median':>8} {'vs first':>8}  runs ({len(params)} params, "
          f"{args.buckets} buckets)")
    for mode, runs in rows.items():
        ms = statistics.median(runs)
        print(f"{mode:8} {ms:8.2f} {ms / base:7.2f}x  {' '.join(f'{x:.2f}' for x in runs)}")


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
