#!/usr/bin/env python3
"""The table of scripts/device_training.sh: examples/train_gpt.py through fusedps against local
torch.optim.AdamW, from the run's logs.

    python3 bench/training_report.py OUT_DIR

Reads OUT_DIR/train_<preset>_<variant>.jsonl (train_gpt.py --log-json): each run's summary
(mean ms per step after the timing warm-up, and the overlap split) and its per-step losses.
Prints, per preset, one row per variant with its ratio to the local run of the same call, and
the loss curves' gaps: each remote curve's largest distance from the local one (losses averaged
over windows of 20 steps, after 20 steps) against the same distance between the two local runs
of different seeds (the run-to-run spread).
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Dict, List

WINDOW = 20


def load(path: str):
    summary, losses = None, []
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            if record["kind"] == "step":
                losses.append(record["loss"])
            elif record["kind"] == "summary":
                summary = record
    return summary, losses


def smooth(losses: List[float]) -> List[float]:
    return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(0, len(losses) - WINDOW + 1)]


def gap(a: List[float], b: List[float], start: int) -> float:
    sa, sb = smooth(a), smooth(b)
    n = min(len(sa), len(sb))
    return max((abs(sa[i] - sb[i]) for i in range(start, n)), default=float("nan"))


def main(out: str) -> int:
    runs: Dict[str, Dict[str, tuple]] = {}
    for path in sorted(glob.glob(os.path.join(out, "train_*_*.jsonl"))):
        preset, variant = os.path.basename(path)[6:-6].split("_", 1)
        try:
            runs.setdefault(preset, {})[variant] = load(path)
        except (OSError, ValueError, KeyError) as e:
            print(f"{path}: unreadable ({e})")
    for preset, variants in runs.items():
        local = variants.get("local")
        print(f"\n{preset}: ms/step (mean after the timing warm-up); push and pull: total "
              f"(hidden / exposed) ms")
        print("| run | ms/step | vs local | fwd+bwd | push | pull | check | final loss | "
              "curve gap |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for variant, (summary, losses) in variants.items():
            if summary is None:
                print(f"| {variant} | no summary (failed) |")
                continue
            ratio = summary["step_ms"] / local[0]["step_ms"] if local and local[0] else 0.0
            push = (f"{summary.get('push_total_ms', 0):.2f} ({summary.get('push_hidden_ms', 0):.2f}"
                    f" / {summary.get('push_exposed_ms', 0):.2f})")
            pull = (f"{summary.get('pull_total_ms', 0):.2f} ({summary.get('pull_hidden_ms', 0):.2f}"
                    f" / {summary.get('pull_exposed_ms', 0):.2f})")
            curve = (f"{gap(losses, local[1], WINDOW):.4f}" if local and variant != "local"
                     else "-")
            print(f"| {variant} | {summary['step_ms']:.2f} | {ratio:.3f}x | "
                  f"{summary['fwd_bwd_ms']:.2f} | {push} | {pull} | "
                  f"{summary.get('check_ms', 0):.2f} | {summary['train_loss_last5']:.4f} | "
                  f"{curve} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
