#!/usr/bin/env python3
"""The one-step-delayed update's own loss curve, without fusedps: examples/train_gpt.py's model,
data and schedule, trained with torch.optim.AdamW where each gradient is computed on the
parameters of two steps back and applied to those of the step before (ZeRO-Offload's delayed
parameter update, the rule RemoteAdamW(overlap=True, delay=1) follows), after --warmup steps
without delay. With --predict, the delayed steps compute their gradients on a prediction of
the current parameters instead, the last ones plus their last change (2 p[t-1] - p[t-2]), as
SpecTrain and PipeMare predict weights for pipelined training.

It tells whether a gap between RemoteAdamW(delay=1) and local training comes from the rule or
from fusedps: tests/e2e/test_overlap.py checks that fusedps follows the rule exactly.

    python3 bench/delayed_update_curves.py --preset small --steps 600 --warmup 100 \\
        --device cuda --amp bf16 --log-json delayed.jsonl [--predict] [--no-delay]

Writes train_gpt.py's --log-json format (step records and a summary with train_loss_last5).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import train_gpt as tg  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=100, help="steps without delay first")
    p.add_argument("--predict", action="store_true", help="gradients at predicted parameters")
    p.add_argument("--no-delay", action="store_true", help="plain training (the reference)")
    p.add_argument("--log-json", required=True)
    ours, rest = p.parse_known_args()
    args = tg.parse_args(rest + ["--optimizer", "torch"])
    device = tg.check_device(args)
    data = tg.load_corpus(args.data)
    train, _ = tg.split_corpus(data, args.val_fraction, args.context)
    torch.manual_seed(args.seed)
    model = tg.GPT(tg.GPTConfig(n_layer=args.n_layer, d_model=args.d_model, n_head=args.n_head,
                                context=args.context)).to(device)
    forward = copy.deepcopy(model)  # The parameters the forward and backward run on.
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(args.beta1, args.beta2),
                            eps=args.eps, weight_decay=args.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, tg.lr_lambda(args.warmup_steps, args.steps, args.min_lr_ratio))
    gen = torch.Generator().manual_seed(args.seed + 1)
    previous = [q.detach().clone() for q in model.parameters()]
    losses = []
    with open(ours.log_json, "w") as log:
        for step in range(1, args.steps + 1):
            x, y = tg.sample_batch(train, args.batch_size, args.context, gen)
            forward.zero_grad(set_to_none=True)
            loss = tg.loss_of(forward, x.to(device), y.to(device), args)
            loss.backward()
            before = [q.detach().clone() for q in model.parameters()]
            for q, f in zip(model.parameters(), forward.parameters()):
                q.grad = f.grad
            opt.step()
            sched.step()
            delayed = not ours.no_delay and step > ours.warmup
            with torch.no_grad():
                for f, q, b, prev in zip(forward.parameters(), model.parameters(), before,
                                         previous):
                    if not delayed:
                        f.copy_(q)
                    elif ours.predict:
                        f.copy_(2 * b - prev)
                    else:
                        f.copy_(b)
            previous = before
            losses.append(loss.item())
            log.write(json.dumps({"kind": "step", "step": step, "loss": losses[-1]}) + "\n")
        last5 = sum(losses[-5:]) / 5
        log.write(json.dumps({"kind": "summary", "train_loss_last5": last5, "step_ms": 0.0,
                              "fwd_bwd_ms": 0.0}) + "\n")
    print(f"delayed_update_curves: {'no delay' if ours.no_delay else 'delay'}"
          f"{' + prediction' if ours.predict else ''}, warmup {ours.warmup}: last 5 steps "
          f"{last5:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
