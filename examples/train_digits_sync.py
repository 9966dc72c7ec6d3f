#!/usr/bin/env python3
"""Trains the digits MLP with synchronous data-parallel workers through sharded fusedps servers.

The servers run in sync mode with N = K = --workers (``fusedps-server --mode=sync
--total-replicas=4``): a round takes one push from each worker and applies their mean as one
AdamW step. This script registers the model over the servers (fusedps.ShardedClient), starts
--workers worker processes, each pulling, computing the gradient of its own batch (step s uses
batches W*s .. W*s + W - 1 of the epoch's shuffle; worker w takes batch W*s + w), pushing it and
pulling again. Meanwhile this process trains a copy of the model with one torch.optim.AdamW on
the mean of the same W gradients, computed from the same batches at its own params, and at the
end prints the test accuracy of the servers' params and how far they are from that copy.

    PYTHONPATH=build/python /usr/bin/python3 examples/train_digits_sync.py \\
        --targets 127.0.0.1:50051,127.0.0.1:50052

scripts/demo_sync.sh (`make demo-sync`) starts the servers and runs it. Data and model are
examples/train_digits.py's. Exit status: 0 when the test accuracy is >= --min-accuracy and the
params are within --max-difference of the local AdamW run, 1 otherwise, 2 for a server not
set up for it.
"""

from __future__ import annotations

import argparse
import copy
import multiprocessing
import sys
import time

import torch

import fusedps
from train_digits import accuracy, load_data, make_model

GROUP = "digits-sync"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--targets", required=True, help="the servers' host:port, comma-separated")
    p.add_argument("--workers", type=int, default=4, help="N = K of the servers' sync mode")
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--slice-elements", type=int, default=4096,
                   help="the sharding plan's largest slice (small, so that tensors are cut)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--min-accuracy", type=float, default=0.9)
    p.add_argument("--max-difference", type=float, default=1e-4,
                   help="the largest max |server param - local AdamW param| that passes")
    return p.parse_args(argv)


def step_batches(n_train: int, args):
    """(epoch, [the index tensor of each worker's batch]) for every step; every process gets
    the same. The epoch's tail that does not fill a step is left out."""
    shuffle = torch.Generator().manual_seed(args.seed + 1)
    per_step = args.workers * args.batch_size
    for epoch in range(1, args.epochs + 1):
        perm = torch.randperm(n_train, generator=shuffle)
        for i in range(0, n_train - per_step + 1, per_step):
            yield epoch, [perm[i + w * args.batch_size:i + (w + 1) * args.batch_size]
                          for w in range(args.workers)]


def run_worker(rank: int, args, plan: fusedps.ShardPlan, start) -> None:
    """One worker process: pull, the gradient of its batch, push, until the last step."""
    x_train, y_train, _, _ = load_data(args.seed)
    model = make_model(args.hidden)
    loss_fn = torch.nn.CrossEntropyLoss()
    with fusedps.ShardedClient(args.targets.split(","), plan,
                               client_id=f"digits-worker-{rank}") as ps:
        ps.wait_ready(timeout=30)
        versions = ps.pull_parameters(model).versions
        start.wait(timeout=120)  # Every worker is connected: the first round fills at once.
        epoch_loss, seen, last_epoch = 0.0, 0, 1
        for step, (epoch, batches) in enumerate(step_batches(len(x_train), args), start=1):
            if rank == 0 and epoch != last_epoch:
                print(f"epoch {last_epoch:3d}  worker 0 loss {epoch_loss / seen:.4f}  "
                      f"version {versions[0]}", flush=True)
                epoch_loss, seen, last_epoch = 0.0, 0, epoch
            idx = batches[rank]
            model.zero_grad(set_to_none=True)
            loss = loss_fn(model(x_train[idx]), y_train[idx])
            loss.backward()
            result = ps.push_gradients(model, grad_dtype="float32", sequence_number=step,
                                       base_versions=versions)
            workers = {r.round_workers for r in result.results}
            if workers != {args.workers} or result.step_skipped:
                raise RuntimeError(f"worker {rank} step {step}: rounds of {workers} workers, "
                                   f"skipped {result.step_skipped}; expected {args.workers}")
            versions = ps.pull_parameters(model).versions
            epoch_loss, seen = epoch_loss + loss.item(), seen + 1
        if rank == 0:
            print(f"epoch {last_epoch:3d}  worker 0 loss {epoch_loss / seen:.4f}  "
                  f"version {versions[0]}", flush=True)


def train_reference(model: torch.nn.Module, x_train, y_train, args) -> int:
    """The parity run: torch.optim.AdamW on the mean of the workers' W gradients of each step,
    each computed here. Returns the number of steps."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            foreach=False)
    loss_fn = torch.nn.CrossEntropyLoss()
    steps = 0
    for _, batches in step_batches(len(x_train), args):
        grads = []
        for idx in batches:
            model.zero_grad(set_to_none=True)
            loss_fn(model(x_train[idx]), y_train[idx]).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        for i, p in enumerate(model.parameters()):
            p.grad = torch.stack([g[i] for g in grads]).mean(0)
        opt.step()
        steps += 1
    return steps


def wait_for_workers(procs) -> bool:
    """Waits for every worker; once one fails, stops the others. True when all exited 0."""
    while any(p.is_alive() for p in procs):
        if any(p.exitcode not in (None, 0) for p in procs):
            for p in procs:
                if p.is_alive():
                    p.terminate()
        time.sleep(0.1)
    for p in procs:
        p.join()
    return all(p.exitcode == 0 for p in procs)


def max_abs_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((pa.detach() - pb.detach()).abs().max().item()
               for pa, pb in zip(a.parameters(), b.parameters()))


def main(argv=None) -> int:
    args = parse_args(argv)
    targets = args.targets.split(",")
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = make_model(args.hidden)
    reference = copy.deepcopy(model)

    with fusedps.ShardedClient(targets) as ps:
        ps.wait_ready(timeout=30)
        for target, info in zip(targets, ps.info()):
            c = info.consistency
            if c is None or (c.mode, c.total_replicas, c.replicas_to_aggregate) != (
                    "sync", args.workers, args.workers):
                print(f"error: {target} is not in sync mode with {args.workers} of "
                      f"{args.workers} replicas: {c}", file=sys.stderr)
                return 2
        ps.register_param_group(GROUP, lr=args.lr, weight_decay=args.weight_decay)
        registered = ps.register_model(model, param_group=GROUP,
                                       slice_elements=args.slice_elements)
        if any(r is not None and r.tensors_existing for r in registered):
            print("error: the model's tensors already exist on the servers; use fresh ones",
                  file=sys.stderr)
            return 2
        print(f"{len(targets)} shards, {len(ps.plan.slices)} slices of "
              f"{len(ps.plan.tensors)} tensors (plan {ps.plan.hash[:12]}), "
              f"{args.workers} workers, sync rounds of {args.workers}")

        context = multiprocessing.get_context("spawn")
        start = context.Barrier(args.workers)
        procs = [context.Process(target=run_worker, args=(rank, args, ps.plan, start),
                                 name=f"digits-worker-{rank}") for rank in range(args.workers)]
        started = time.perf_counter()
        for p in procs:
            p.start()
        steps = train_reference(reference, x_train, y_train, args)
        if not wait_for_workers(procs):
            print(f"FAIL: worker exit codes {[p.exitcode for p in procs]}", file=sys.stderr)
            return 1
        elapsed = time.perf_counter() - started
        versions = ps.pull_parameters(model).versions

    acc = accuracy(model, x_test, y_test)
    ref_acc = accuracy(reference, x_test, y_test)
    difference = max_abs_difference(model, reference)
    print(f"{steps} rounds of {args.workers} pushes in {elapsed:.2f} s; shard versions "
          f"{versions}")
    print(f"final test accuracy {acc:.4f} (local torch.optim.AdamW on the mean: {ref_acc:.4f})")
    print(f"max abs difference server vs local AdamW params: {difference:.3e} "
          f"(tolerance {args.max_difference:g})")
    ok = True
    if versions != [steps] * len(targets):
        print(f"FAIL: shard versions {versions}, expected {steps} each", file=sys.stderr)
        ok = False
    if acc < args.min_accuracy:
        print(f"FAIL: accuracy {acc:.4f} < {args.min_accuracy}", file=sys.stderr)
        ok = False
    if not difference <= args.max_difference:
        print(f"FAIL: difference {difference:.3e} > {args.max_difference:g}", file=sys.stderr)
        ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
