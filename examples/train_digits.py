#!/usr/bin/env python3
"""Trains a small MLP on scikit-learn's digits through a fusedps server.

Every step computes gradients locally, pushes them to the server (which applies AdamW to its
fp32 master copy) and pulls the new parameters back into the model. The same training is done
locally with torch.optim.AdamW (same initial weights, same batches, and the same gradient
rounding when --grad-dtype is narrower than float32), and the script prints how far apart the
two end up.

    PYTHONPATH=build/python /usr/bin/python3 examples/train_digits.py --target 127.0.0.1:50051

--state-dtype bf16|int8 and --params-dtype bf16 register the server's param group with that
storage (docs/python.md, "Low-precision optimizer state"); the local torch.optim.AdamW stays
fp32, so the difference printed then measures what the storage costs.

Data: sklearn.datasets.load_digits (1,797 8x8 images, 10 classes; ships with scikit-learn, no
download), 80/20 train/test split, pixels scaled to [0, 1].
Output: a line per epoch, a summary, and last a line "RESULT {json}" with final_train_loss (the
last epoch's mean), final_val_loss (null: no validation split), test_loss, test_accuracy,
reference_test_accuracy (the local AdamW's), max_relative_difference, steps, state_dtype,
params_dtype, grad_dtype and seed.
Exit status: 0 when the test accuracy is >= --min-accuracy (default 0.9), 1 otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time

import torch
from sklearn.datasets import load_digits

import fusedps


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="127.0.0.1:50051", help="fusedps server host:port")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--grad-dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--state-dtype", default="fp32", choices=["fp32", "bf16", "int8"],
                   help="how the server stores exp_avg and exp_avg_sq")
    p.add_argument("--params-dtype", default="fp32", choices=["fp32", "bf16"],
                   help="the server's params: fp32 master, or bf16 with stochastic rounding")
    p.add_argument("--seed", type=int, default=0,
                   help="data split, initial weights, batches, and the bf16 rounding's seed")
    p.add_argument("--prefix", default="digits.", help="tensor name prefix on the server")
    p.add_argument("--min-accuracy", type=float, default=0.9)
    return p.parse_args(argv)


def load_data(seed: int):
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target, dtype=torch.long)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(seed))
    n_train = int(0.8 * len(x))
    tr, te = perm[:n_train], perm[n_train:]
    return x[tr], y[tr], x[te], y[te]


def make_model(hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def round_grads(model: torch.nn.Module, grad_dtype: str) -> None:
    """Rounds .grad to the wire dtype (as the server receives it), kept as fp32."""
    if grad_dtype == "float32":
        return
    dt = getattr(torch, grad_dtype)
    for p in model.parameters():
        if p.grad is not None:
            p.grad = p.grad.to(dt).to(torch.float32)


def accuracy(model, x, y) -> float:
    with torch.no_grad():
        return (model(x).argmax(1) == y).float().mean().item()


def max_relative_difference(a: torch.nn.Module, b: torch.nn.Module) -> float:
    """max over tensors of max|a - b| / max|b|."""
    worst = 0.0
    for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        scale = pb.detach().abs().max().item()
        diff = (pa.detach() - pb.detach()).abs().max().item()
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    x_train, y_train, x_test, y_test = load_data(args.seed)
    model = make_model(args.hidden)
    reference = copy.deepcopy(model)  # trained locally with torch.optim.AdamW
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr,
                                weight_decay=args.weight_decay, foreach=False)
    loss_fn = torch.nn.CrossEntropyLoss()

    with fusedps.Client(args.target) as ps:
        ps.wait_ready(timeout=30)
        info = ps.info()
        print(f"server {args.target}: backend={info.backend} device={info.device!r} "
              f"version={info.server_version}")
        group = f"{args.prefix}group"
        ps.register_param_group(group, lr=args.lr, weight_decay=args.weight_decay,
                                state_dtype=args.state_dtype, params_dtype=args.params_dtype,
                                rounding_seed=args.seed)
        reg = ps.register_model(model, param_group=group, prefix=args.prefix)
        if reg.tensors_existing:
            print(f"error: {reg.tensors_existing} tensors named {args.prefix}* already exist on "
                  "the server; use a fresh server or another --prefix", file=sys.stderr)
            return 2
        n_params = sum(p.numel() for p in model.parameters())
        print(f"registered {reg.tensors_created} tensors, {n_params} parameters; "
              f"grad dtype {args.grad_dtype}, state {args.state_dtype}, params "
              f"{args.params_dtype}")

        shuffle = torch.Generator().manual_seed(args.seed + 1)
        steps = 0
        start = time.perf_counter()
        train_loss = float("nan")
        for epoch in range(1, args.epochs + 1):
            perm = torch.randperm(len(x_train), generator=shuffle)
            total_loss, seen = 0.0, 0
            for i in range(0, len(perm), args.batch_size):
                idx = perm[i:i + args.batch_size]
                xb, yb = x_train[idx], y_train[idx]

                # Through the server.
                model.zero_grad(set_to_none=True)
                loss = loss_fn(model(xb), yb)
                loss.backward()
                result = ps.push_gradients(model, grad_dtype=args.grad_dtype,
                                           prefix=args.prefix)
                if result.step_skipped:
                    print(f"step skipped: {result.skip_reason}", file=sys.stderr)
                ps.pull_parameters(model, prefix=args.prefix)

                # The same step locally.
                ref_opt.zero_grad(set_to_none=True)
                loss_fn(reference(xb), yb).backward()
                round_grads(reference, args.grad_dtype)
                ref_opt.step()

                total_loss += loss.item() * len(idx)
                seen += len(idx)
                steps += 1
            train_loss = total_loss / seen
            print(f"epoch {epoch:3d}  loss {train_loss:.4f}  "
                  f"test accuracy {accuracy(model, x_test, y_test):.4f}")
        elapsed = time.perf_counter() - start
        final_version = ps.info().version

    acc = accuracy(model, x_test, y_test)
    ref_acc = accuracy(reference, x_test, y_test)
    rel = max_relative_difference(model, reference)
    print(f"{steps} steps in {elapsed:.2f} s ({1e3 * elapsed / max(steps, 1):.2f} ms per "
          f"push + pull), server version {final_version}")
    print(f"final test accuracy {acc:.4f} (local torch.optim.AdamW: {ref_acc:.4f})")
    print(f"max relative difference server vs local AdamW params: {rel:.3e}")
    with torch.no_grad():
        test_loss = loss_fn(model(x_test), y_test).item()
    print("RESULT " + json.dumps(dict(
        final_train_loss=train_loss, final_val_loss=None, test_loss=test_loss,
        test_accuracy=acc, reference_test_accuracy=ref_acc, max_relative_difference=rel,
        steps=steps, state_dtype=args.state_dtype, params_dtype=args.params_dtype,
        grad_dtype=args.grad_dtype, seed=args.seed)), flush=True)
    if acc < args.min_accuracy:
        print(f"FAIL: accuracy {acc:.4f} < {args.min_accuracy}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
