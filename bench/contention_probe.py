#!/usr/bin/env python3
"""Where does local compute lose time while fusedps's transfers run beside it?

Trains the GPT of fusedps.bench.gpt locally with torch.optim.AdamW (no fusedps in the loop)
while one kind of background load runs, and prints ms/step for each, against no load, in one
process and one run:

  idle       nothing else runs
  external   fusedps-transport-bench in another process, pushing and pulling the model's size
             over 8 streams to the same server: the host's cores, memory and TCP busy, the
             trainer's interpreter not
  pull_py    in this process, 8 Python threads pulling 8 MiB groups of the model's params with
             Client.pull_into into pinned memory and copying each to the device (as
             fusedps._pull_pipeline does), in a loop
  pull_nocopy the same without the device copies
  push_py    in this process, one thread writing the model's bytes from pinned memory as
             PushTransactions of 8 MiB writes, committed, in a loop
  gil        in this process, a Python thread that holds the interpreter 100 us out of every
             600 us (no I/O at all)
  dma:DIR:MIB:MS   another process copying MIB MiB between pinned host memory and the same GPU
             (DIR: d2h, h2d or both, on a stream of its own) every MS ms (0: back to back):
             the bytes a step of RemoteAdamW moves, without its Python or its server
  dmat:DIR:MIB:MS  the same from a thread of this process

    python3 bench/contention_probe.py --target 127.0.0.1:PORT --bench CMD... [--preset gpt2]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import threading
import time

import torch

from fusedps.bench.e2e import PRESETS
from fusedps.bench.gpt import GPT, GPTConfig


# The dma loads' copier: direction, MiB, period in ms; as a thread of this process (copies) or
# as a process of its own (python3 -c DMA ...).
def copies(direction: str, mib: int, period_ms: float, stop=None):
    n = mib << 18  # fp32 elements
    host = torch.empty(n, pin_memory=True)
    dev = torch.empty(n, device="cuda")
    stream = torch.cuda.Stream()
    while stop is None or not stop.is_set():
        start = time.perf_counter()
        with torch.cuda.stream(stream):
            if direction in ("d2h", "both"):
                host.copy_(dev, non_blocking=True)
            if direction in ("h2d", "both"):
                dev.copy_(host, non_blocking=True)
        stream.synchronize()
        rest = period_ms / 1e3 - (time.perf_counter() - start)
        if rest > 0:
            time.sleep(rest)


DMA = ("import sys; sys.path.insert(0, {here!r}); import contention_probe as c; "
       "c.copies(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))")


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, opt, steps, warmup, batch, device):
    cfg = model.cfg
    gen = torch.Generator(device=device).manual_seed(1)
    times = []
    for step in range(warmup + steps):
        tokens = torch.randint(0, cfg.vocab_size, (batch, cfg.context + 1), generator=gen,
                               device=device)
        sync(device)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with (torch.autocast(device_type="cuda", dtype=torch.bfloat16)
              if device.type == "cuda" else contextlib.nullcontext()):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                 tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        sync(device)
        if step >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


class Load:
    def __init__(self):
        self.stop = threading.Event()
        self.threads = []
        self.rounds = 0

    def spawn(self, fn, n=1):
        for _ in range(n):
            t = threading.Thread(target=self._loop, args=(fn,), daemon=True)
            t.start()
            self.threads.append(t)

    def _loop(self, fn):
        while not self.stop.is_set():
            fn()
            self.rounds += 1

    def close(self):
        self.stop.set()
        for t in self.threads:
            t.join()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--bench", required=True, help="the transport bench's command line")
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=8)
    p.add_argument("--device", default="cuda")
    p.add_argument("--loads", default="idle external pull_py pull_nocopy push_py gil idle")
    args = p.parse_args()
    from fusedps import Client
    from fusedps.torch import RemoteAdamW

    device = torch.device(args.device)
    cuda = device.type == "cuda"
    preset = dict(PRESETS[args.preset])
    batch = preset.pop("batch_size")
    torch.manual_seed(0)
    model = GPT(GPTConfig(**preset)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # The model's tensors on the server, registered by a RemoteAdamW of a copy.
    shadow = GPT(GPTConfig(**preset))
    remote = RemoteAdamW(shadow.named_parameters(), targets=args.target, prefix="probe/",
                         on_existing="resume")  # a probe run again reuses them
    names = [("probe/" + n, p.numel()) for n, p in shadow.named_parameters()]
    client = Client(args.target, streams=8, max_chunk_bytes=1 << 20)
    client.wait_ready()
    total = sum(k for _, k in names)
    host = torch.zeros(total, dtype=torch.float32, pin_memory=cuda)
    dev = torch.empty(total, dtype=torch.float32, device=device)
    groups, cur, size, at = [], [], 0, 0
    for n, k in names:
        cur.append((n, host[at:at + k], dev[at:at + k]))
        at += k
        size += 4 * k
        if size >= 8 << 20:
            groups.append(cur)
            cur, size = [], 0
    if cur:
        groups.append(cur)
    side = torch.cuda.Stream(device) if cuda else None
    counter = iter(range(1 << 62))
    lock = threading.Lock()

    def pull(copy):
        def fn():
            with lock:
                g = next(counter) % len(groups)
            client.pull_into([(n, h) for n, h, _ in groups[g]], stream=g)
            if copy and cuda:
                with torch.cuda.stream(side):
                    for _, h, d in groups[g]:
                        d.copy_(h, non_blocking=True)
                side.synchronize()
        return fn

    def push():
        txn = client.begin_push(names)
        base = host.data_ptr()
        pieces, at = [], 0
        for idx, (n, k) in enumerate(names):
            pieces.append((idx, 0, k, base + 4 * at))
            at += k
            if sum(p[2] for p in pieces) * 4 >= 8 << 20:
                txn.write(pieces)
                pieces = []
        if pieces:
            txn.write(pieces)
        txn.commit(None)
        txn.close()

    def gil():
        end = time.perf_counter() + 100e-6
        while time.perf_counter() < end:
            pass
        time.sleep(500e-6)

    rows = []
    for load in args.loads.split():
        proc, bg = None, Load()
        if load == "external":
            proc = subprocess.Popen(shlex.split(args.bench), stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL)
            time.sleep(3)
        elif load == "pull_py":
            bg.spawn(pull(True), 8)
        elif load == "pull_nocopy":
            bg.spawn(pull(False), 8)
        elif load == "push_py":
            bg.spawn(push, 1)
        elif load == "gil":
            bg.spawn(gil, 1)
        elif load.startswith("dma:"):
            _, direction, mib, period = load.split(":")
            here = os.path.dirname(os.path.abspath(__file__))
            proc = subprocess.Popen([sys.executable, "-c", DMA.format(here=here), direction,
                                     mib, period])
            time.sleep(3)
        elif load.startswith("dmat:"):
            _, direction, mib, period = load.split(":")
            t = threading.Thread(target=copies, args=(direction, int(mib), float(period),
                                                       bg.stop), daemon=True)
            t.start()
            bg.threads.append(t)
            time.sleep(1)
        start = time.perf_counter()
        ms = train(model, opt, args.steps, args.warmup, batch, device)
        wall = time.perf_counter() - start
        bg.close()
        if proc is not None:
            alive = proc.poll() is None
            proc.kill()
            proc.wait()
            load += "" if alive else " (bench exited early)"
        rate = ""
        if load.startswith("pull"):
            rate = f"{bg.rounds * 4 * total / len(groups) / wall / 1e9:.2f} GB/s"
        elif load == "push_py":
            rate = f"{bg.rounds * 4 * total / wall / 1e9:.2f} GB/s"
        rows.append((load, ms, rate))
        print(f"{load:14} {ms:8.2f} ms/step  {rate}", flush=True)
    base = rows[0][1]
    print(f"\n{'load':14} {'ms/step':>8} {'vs idle':>8}  background rate")
    for load, ms, rate in rows:
        print(f"{load:14} {ms:8.2f} {ms / base:7.2f}x  {rate}")
    remote.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
