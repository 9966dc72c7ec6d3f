#!/usr/bin/env python3
"""Puts two examples/train_gpt.py --log-json runs side by side, as markdown for docs/benchmarks.md.

    python3 bench/compare_gpt_curves.py torch.jsonl remote.jsonl --every 100

Prints (1) what each run was (optimizer, device, model size, torch version) and any setting in
which they differ besides the optimizer and its transport, (2) a table of the train loss (nats
per byte) of both every --every steps and at the last common step, with the val losses at the
eval steps, (3) the max absolute and max relative difference of the train-loss curves over all
common steps (relative: |a - b| / |a|, with a the first run), and (4) each run's mean
milliseconds per step split into forward+backward, push, pull and the rest (from its summary
record: the steps after train_gpt.py's --timing-warmup), with the batch's sampling and copy
("data", part of the rest) and the whole optimizer.step() beside them.

Exit status: 0; 2 when a file is missing or holds no step records.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Settings that may differ between the two runs without changing the math.
TRANSPORT_ARGS = {"optimizer", "target", "targets", "streams", "prefix", "log_json", "log_every",
                  "data", "timing_warmup", "sample_bytes", "expect_loss_below",
                  "expect_loss_drop"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("first", help="--log-json file of the reference run (e.g. --optimizer torch)")
    p.add_argument("second", help="--log-json file of the other run (e.g. --optimizer remote)")
    p.add_argument("--every", type=int, default=100, help="table row every N steps")
    p.add_argument("--labels", help="two comma-separated column names (default: the optimizers)")
    return p.parse_args(argv)


def read_log(path: str) -> dict:
    """{"config": dict, "steps": {step: record}, "evals": {step: val_loss}, "summary": dict}."""
    run = {"config": {}, "steps": {}, "evals": {}, "summary": {}}
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            rec = json.loads(line)
            kind = rec.pop("kind", "step")
            if kind == "config":
                run["config"] = rec
            elif kind == "step":
                run["steps"][rec["step"]] = rec
            elif kind == "eval":
                run["evals"][rec["step"]] = rec["val_loss"]
            elif kind == "summary":
                run["summary"] = rec
    if not run["steps"]:
        raise ValueError(f"{path} has no step records")
    return run


def describe(label: str, run: dict) -> str:
    cfg = run["config"]
    args = cfg.get("args", {})
    where = ""
    if args.get("optimizer") == "remote":
        where = f" ({','.join(args.get('targets', []))}, grad {args.get('grad_dtype')})"
    return (f"- **{label}**: optimizer {args.get('optimizer')}{where}, device "
            f"{cfg.get('device_name')}, amp {args.get('amp')}, preset {args.get('preset')} "
            f"({cfg.get('n_params', 0) / 1e6:.2f}M parameters), torch {cfg.get('torch_version')},"
            f" {len(run['steps'])} steps")


def setting_differences(a: dict, b: dict) -> list:
    """Settings (other than the transport's) in which the two runs differ, as strings; a flag
    that only one log records (an older train_gpt.py) is not compared."""
    args_a, args_b = a["config"].get("args", {}), b["config"].get("args", {})
    out = [f"{key}: {args_a.get(key)!r} vs {args_b.get(key)!r}"
           for key in sorted((set(args_a) & set(args_b)) - TRANSPORT_ARGS)
           if args_a.get(key) != args_b.get(key)]
    sha_a, sha_b = a["config"].get("corpus_sha256"), b["config"].get("corpus_sha256")
    if sha_a != sha_b:
        out.append(f"corpus sha256: {sha_a} vs {sha_b}")
    return out


def loss_table(a: dict, b: dict, labels, every: int) -> list:
    common = sorted(set(a["steps"]) & set(b["steps"]))
    rows = [s for s in common if s == 1 or s % every == 0]
    if common[-1] not in rows:
        rows.append(common[-1])
    la, lb = labels
    lines = [f"| step | {la} loss | {lb} loss | difference | {la} val | {lb} val |",
             "|---:|---:|---:|---:|---:|---:|"]
    for s in rows:
        x, y = a["steps"][s]["loss"], b["steps"][s]["loss"]
        va, vb = a["evals"].get(s), b["evals"].get(s)
        lines.append(f"| {s} | {x:.4f} | {y:.4f} | {y - x:+.2e} | "
                     f"{'' if va is None else f'{va:.4f}'} | {'' if vb is None else f'{vb:.4f}'} |")
    return lines


def curve_differences(a: dict, b: dict) -> str:
    common = sorted(set(a["steps"]) & set(b["steps"]))
    abs_diff = [(abs(a["steps"][s]["loss"] - b["steps"][s]["loss"]), s) for s in common]
    rel_diff = [(d / abs(a["steps"][s]["loss"]), s) for d, s in abs_diff
                if a["steps"][s]["loss"] != 0]
    max_abs, at_abs = max(abs_diff)
    max_rel, at_rel = max(rel_diff) if rel_diff else (0.0, common[0])
    evals = sorted(set(a["evals"]) & set(b["evals"]))
    val = ""
    if evals:
        worst = max(abs(a["evals"][s] - b["evals"][s]) for s in evals)
        val = f"; val loss: max abs difference {worst:.3e} over {len(evals)} evals"
    return (f"Train loss over {len(common)} common steps: max abs difference {max_abs:.3e} "
            f"(step {at_abs}), max relative difference {max_rel:.3e} (step {at_rel}){val}.")


def mean_ms(run: dict) -> dict:
    """The summary's mean ms per step; recomputed over all steps when there is no summary."""
    if run["summary"]:
        return run["summary"]
    recs = list(run["steps"].values())

    def ms(key):
        return 1e3 * sum(r.get(key, 0.0) for r in recs) / len(recs)

    out = dict(step_ms=ms("step_seconds"), fwd_bwd_ms=ms("fwd_bwd_seconds"),
               data_ms=ms("data_seconds"),
               push_ms=ms("push_seconds"), pull_ms=ms("pull_seconds"),
               optimizer_ms=ms("optimizer_seconds"), timed_steps=len(recs))
    out["other_ms"] = out["step_ms"] - out["fwd_bwd_ms"] - out["push_ms"] - out["pull_ms"]
    return out


def timing_table(runs, labels) -> list:
    lines = ["| run | ms/step | fwd+bwd | push | pull | other | of which data | optimizer.step() "
             "| steps timed |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for label, run in zip(labels, runs):
        t = mean_ms(run)
        lines.append(f"| {label} | {t['step_ms']:.2f} | {t['fwd_bwd_ms']:.2f} | "
                     f"{t['push_ms']:.2f} | {t['pull_ms']:.2f} | {t['other_ms']:.2f} | "
                     f"{t.get('data_ms', 0.0):.2f} | {t.get('optimizer_ms', 0.0):.2f} | "
                     f"{t.get('timed_steps', '')} |")
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        runs = [read_log(args.first), read_log(args.second)]
    except (OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.labels:
        labels = [s.strip() for s in args.labels.split(",")]
        if len(labels) != 2:
            print("error: --labels needs two names", file=sys.stderr)
            return 2
    else:
        labels = [r["config"].get("args", {}).get("optimizer") or os.path.basename(p)
                  for r, p in zip(runs, (args.first, args.second))]
        if labels[0] == labels[1]:
            labels = [os.path.basename(args.first), os.path.basename(args.second)]
    print("\n".join(describe(label, run) for label, run in zip(labels, runs)))
    diffs = setting_differences(*runs)
    print("\nThe runs differ in: " + "; ".join(diffs) + "." if diffs else
          "\nSame settings apart from the optimizer and its transport.")
    print()
    print("\n".join(loss_table(*runs, labels, args.every)))
    print()
    print(curve_differences(*runs))
    print()
    print("\n".join(timing_table(runs, labels)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
