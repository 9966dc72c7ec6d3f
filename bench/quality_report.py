#!/usr/bin/env python3
"""Prints the training-quality table of one device run (scripts/device_quality.sh): for each
example and storage option, the final metrics of every seed, their mean and standard deviation,
and how far the mean is from fp32 state's (fp32 params) in fp32's own seed-to-seed spread.

Each log is named <example>-<state>-<params>-<seed>.log and ends with the example's
`RESULT {json}` line (examples/train_digits.py, examples/train_gpt.py).

  python3 bench/quality_report.py quality/*.log
"""
import json
import os
import statistics
import sys

METRICS = ("final_train_loss", "final_val_loss", "test_loss", "test_accuracy")


def load(paths):
    runs = {}
    for path in paths:
        name = os.path.basename(path)[:-len(".log")]
        example, state, params, seed = name.rsplit("-", 3)
        result = None
        with open(path, errors="replace") as f:
            for line in f:
                if line.startswith("RESULT "):
                    result = json.loads(line[len("RESULT "):])
        runs.setdefault((example, state, params), {})[int(seed)] = result
    return runs


def main(paths):
    runs = load(paths)
    print("| example | state | params | metric | per seed | mean | std | mean - fp32 mean | "
          "in fp32 std units |")
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    for (example, state, params), by_seed in sorted(runs.items()):
        base = runs.get((example, "fp32", "fp32"), {})
        for metric in METRICS:
            values = [r[metric] for _, r in sorted(by_seed.items())
                      if r is not None and r.get(metric) is not None]
            if not values:
                continue
            failed = sum(1 for r in by_seed.values() if r is None)
            base_values = [r[metric] for r in base.values()
                           if r is not None and r.get(metric) is not None]
            mean = statistics.fmean(values)
            std = statistics.stdev(values) if len(values) > 1 else float("nan")
            delta, units = "-", "-"
            if base_values and (state, params) != ("fp32", "fp32"):
                base_mean = statistics.fmean(base_values)
                base_std = statistics.stdev(base_values) if len(base_values) > 1 else 0
                delta = f"{mean - base_mean:+.4f}"
                units = f"{(mean - base_mean) / base_std:+.2f}" if base_std > 0 else "-"
            seeds = ", ".join(f"{v:.4f}" for v in values)
            if failed:
                seeds += f" ({failed} failed)"
            print(f"| {example} | {state} | {params} | {metric} | {seeds} | {mean:.4f} | "
                  f"{std:.4f} | {delta} | {units} |")


if __name__ == "__main__":
    main(sys.argv[1:])
