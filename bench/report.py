#!/usr/bin/env python3
"""Prints results files of bench/run.py as markdown: per file its device, date and commit, then
one table per step kind (one row per result: the params that vary, then the kind's metrics).

    bench/report.py results.json [more.json ...] [--ratio NAME=VALUE]

Several files (e.g. the same suite from two builds) share the tables, with a "run" column.
--ratio server=plain adds a column: each row's first metric over the row's that differs only
in having that param value (a baseline in the same file); --ratio run=2 divides by the same row
of the second file (this build against the base commit's, say). Some kinds have tables of their
own: train (ratios to the local runs of the same call, loss-curve gaps; with --set
round=1,2,... in the run, each configuration's medians over the rounds), quality (seeds
aggregated, against fp32 storage), ncu (one column per profiled launch).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple, Union


def pct_copy(m: Dict[str, Any]) -> Optional[float]:
    if m.get("copy_gbps") and m.get("device_gbps") is not None:
        return 100 * m["device_gbps"] / m["copy_gbps"]
    return m.get("pct_copy")


def get(*path: str) -> Callable[[Dict[str, Any]], Any]:
    """A getter of a nested metric: get("latency_ms", "p50")."""
    def getter(m: Dict[str, Any]) -> Any:
        for key in path:
            m = m.get(key) if isinstance(m, dict) else None
        return m
    return getter


def overlap(total: Any, hidden: Any, exposed: Any) -> Optional[str]:
    """"total (hidden / exposed)" ms; None for a run that pushed nothing."""
    if not total:
        return None
    if not (hidden or exposed):
        return f"{total:.2f}"
    return f"{total:.2f} ({hidden or 0:.2f} / {exposed or 0:.2f})"


# The histograms of fusedps-server's /metrics that the stage column shows, with their names
# there: the push stages, the push's ingest (thread time, within receive), the sync rounds, the
# checkpoints' phases.
STAGE_FAMILIES = {"fusedps_stage_duration": "", "fusedps_push_ingest": "ingest",
                  "fusedps_round_duration": "round", "fusedps_round_stage_duration": "round ",
                  "fusedps_checkpoint_duration": "checkpoint "}


def stages(m: Dict[str, Any]) -> Optional[str]:
    """The servers' stage means, compactly: "a: receive 1.20, apply 0.41; b: ..."."""
    parts = []
    for server, means in sorted(m.get("server_ms", {}).items()):
        cells = []
        for key, value in means.items():
            family, stage = key.split("{")[0], re.search(r'(?:stage|phase)="(\w+)"', key)
            if family in STAGE_FAMILIES:
                label = STAGE_FAMILIES[family] + (stage.group(1) if stage else "")
                cells.append(f"{label} {value:.2f}")
        if cells:
            parts.append(f"{server}: " + ", ".join(cells))
    return "; ".join(parts) or None


Getter = Union[str, Callable[[Dict[str, Any]], Any]]
# The columns of each step kind: (header, metric key or function, format). Kinds not listed
# show their numeric metrics.
PUSH: List[Tuple[str, Getter, str]] = [
        ("GB/s", "gbps", ".3f"), ("pushes/s", "pushes_per_s", ".2f"),
        ("p50 ms", get("latency_ms", "p50"), ".2f"), ("p90 ms", get("latency_ms", "p90"), ".2f"),
        ("p99 ms", get("latency_ms", "p99"), ".2f"), ("server stages, mean ms", stages, "")]
COLUMNS: Dict[str, List[Tuple[str, Getter, str]]] = {
    "kernel": [("workload", "workload", ""), ("grads", "grad_dtype", ""),
               ("state", "state_dtype", ""), ("params", "params_dtype", ""),
               ("copy", "param_copy", ""), ("ms/step", "device_ms_median", ".3f"),
               ("GB/s", "device_gbps", ".1f"), ("% copy", pct_copy, ".1f"),
               ("bytes/param", "bytes_per_param", ".2f"),
               ("device bytes/param", "device_bytes_per_param", ".3f"),
               ("launches/step", "launches_per_step", ".0f"),
               ("CUPTI kernels", "cupti_kernels_per_step", ".0f")],
    "torch-kernel": [("workload", "workload", ""), ("variant", "variant", ""),
                     ("ms/step", "ms", ".3f"), ("% copy", "pct_copy", ".1f"),
                     ("kernels", "kernels", "")],
    "push": PUSH, "push-latency": PUSH, "shards": PUSH,
    "pull": [("median s", "seconds_median", ".3f"), ("MB/s of payload", "payload_mb_per_s", ".0f")],
    "transport": [("path", "path", ""), ("streams", "streams", ""),
                  ("GB/s median", "gbps_median", ".2f"), ("GB/s best", "gbps_best", ".2f")],
    "checkpoint-push": PUSH[:2] + [("p50 ms", get("latency_ms", "p50"), ".1f"),
                                   ("p99 ms", get("latency_ms", "p99"), ".1f"),
                                   ("max ms", get("latency_ms", "max"), ".1f"), PUSH[-1]],
    "disk": [("mode", "mode", ""), ("GB/s", "gbps", ".2f"), ("bytes", "bytes", ""),
             ("s", "seconds", ".2f"), ("load GB/s", get("push", "gbps"), ".3f")],
    "checkpoint-log": [("event", "event", ""), ("version", "version", ""),
                       ("bytes", "bytes", ""), ("snapshot ms", "snapshot_ms", ".1f"),
                       ("s", "seconds", ".2f"), ("GB/s", "gbps", ".2f")],
    "readers": [("push GB/s", get("push", "gbps"), ".2f"),
                ("GetInfo p50 ms", get("probe", "get_info_ms", "p50"), ".3f"),
                ("GetInfo p99 ms", get("probe", "get_info_ms", "p99"), ".3f"),
                ("GetInfo max ms", get("probe", "get_info_ms", "max"), ".3f"),
                ("pull p50 ms", get("probe", "pull_ms", "p50"), ".3f"),
                ("pull p99 ms", get("probe", "pull_ms", "p99"), ".3f"),
                ("probe rounds", get("probe", "get_info_ms", "count"), ".0f")],
    "python-push": [("GB/s", "gbps", ".3f"), ("p50 ms", get("latency_ms", "p50"), ".1f"),
                    ("pull GB/s", "pull_gbps", ".3f")],
    "selfcheck": [("preset", "preset", ""), ("local ms", "local_ms", ".2f"),
                  ("remote ms", "remote_ms", ".2f"), ("vs local", "ratio", ".2f"),
                  ("fwd+bwd", get("split_ms", "fwd_bwd"), ".2f"),
                  ("push (hidden / exposed)", lambda m: overlap(*(get("split_ms", k)(m) for k in (
                      "push", "push_hidden", "push_exposed"))), ""),
                  ("pull (hidden / exposed)", lambda m: overlap(*(get("split_ms", k)(m) for k in (
                      "pull", "pull_hidden", "pull_exposed"))), ""),
                  ("push GB/s", "push_gb_s", ".2f"), ("pull GB/s", "pull_gb_s", ".2f"),
                  ("data plane", "data_plane", ""), ("limit", "limit", "")],
    "probe": [("load", "load", ""), ("ms/step", "ms_per_step", ".2f"),
              ("vs idle", "vs_idle", ".2f"), ("background rate", "rate", "")],
}
# Params that only spell another param's effect (a flag list) stay out of the tables.
HIDDEN = {"config", "mode_flags"}


def cell(value: Any, fmt: str) -> str:
    if value is None or value == "":
        return "-"
    if fmt and isinstance(value, (int, float)):
        return format(value, fmt)
    return str(value)


def columns_of(kind: str, rows: List[Dict[str, Any]]) -> List[Tuple[str, Getter, str]]:
    if kind in COLUMNS:
        return COLUMNS[kind]
    keys: List[str] = []
    for r in rows:
        keys += [k for k, v in r["metrics"].items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in keys]
    return [(k, k, ".4g") for k in keys]


def value_of(getter: Getter, metrics: Dict[str, Any]) -> Any:
    return getter(metrics) if callable(getter) else metrics.get(getter)


def ratio_column(rows: List[Dict[str, Any]], getter: Getter, name: str, base: str) -> List[str]:
    """Each row's metric over its baseline's: the row alike but for param name == base (or,
    for name "run", the same row of run number base)."""
    def key(r: Dict[str, Any]) -> str:
        params = {k: v for k, v in r["params"].items() if k != name}
        ident = {k: r["metrics"].get(k) for k in ("workload", "variant", "path", "streams")}
        return json.dumps([None if name == "run" else r["run"], params, ident], sort_keys=True,
                          default=str)

    def value(r: Dict[str, Any]) -> str:
        return r["run"] if name == "run" else str(r["params"].get(name))
    baselines = {key(r): value_of(getter, r["metrics"]) for r in rows if value(r) == base}
    out = []
    for r in rows:
        got, of = value_of(getter, r["metrics"]), baselines.get(key(r))
        out.append(f"{got / of:.2f}" if isinstance(got, (int, float)) and of else "-")
    return out


def varying(rows: List[Dict[str, Any]], hidden=HIDDEN) -> List[str]:
    """The params whose value differs between the rows, in their first order."""
    params: List[str] = []
    for r in rows:
        params += [k for k in r["params"] if k not in params and k not in hidden]
    return [p for p in params if len({json.dumps(r["params"].get(p)) for r in rows}) > 1]


def markdown(header: List[str], body: List[List[str]]) -> List[str]:
    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] +
            ["| " + " | ".join(cells) + " |" for cells in body])


def table(kind: str, rows: List[Dict[str, Any]], many_runs: bool,
          ratio: Optional[Tuple[str, str]]) -> List[str]:
    params = varying(rows)
    columns = columns_of(kind, rows)
    header = (["run"] if many_runs else []) + params + [c[0] for c in columns]
    body = []
    for r in rows:
        cells = ([r["run"]] if many_runs else []) + [cell(r["params"].get(p), "") for p in params]
        cells += [cell(value_of(getter, r["metrics"]), fmt) for _, getter, fmt in columns]
        if "error" in r:
            cells[-1] += f" (failed: {r['error']})"
        body.append(cells)
    if ratio and (ratio[0] == "run" or any(ratio[0] in r["params"] for r in rows)):
        first = next((c for c in columns if c[2]), None)
        if first:
            header.append(f"{first[0]} / {ratio[0]}={ratio[1]}")
            for cells, value in zip(body, ratio_column(rows, first[1], *ratio)):
                cells.append(value)
    return markdown(header, body)


WINDOW = 20  # Steps per mean of a loss curve, and the steps skipped before comparing curves.


def curve_gap(a: List[float], b: List[float]) -> Optional[float]:
    """The largest distance between two loss curves, each averaged over windows of WINDOW
    steps, from step WINDOW on; None when the runs are too short."""
    def smooth(losses: List[float]) -> List[float]:
        return [sum(losses[i:i + WINDOW]) / WINDOW for i in range(len(losses) - WINDOW + 1)]
    sa, sb = smooth(a), smooth(b)
    return max((abs(x - y) for x, y in zip(sa[WINDOW:], sb[WINDOW:])), default=None)


def train_table(kind: str, rows: List[Dict[str, Any]], many_runs: bool,
                ratio: Optional[Tuple[str, str]]) -> List[str]:
    """One row per train_gpt.py run: its step time against the local runs' of the same call
    (same run, preset and other params), its push and pull split, its loss-curve gap."""
    def group(r: Dict[str, Any]) -> str:
        params = {k: v for k, v in r["params"].items() if k != "variant"}
        return json.dumps([r["run"], params], sort_keys=True, default=str)
    local = {(group(r), r["params"].get("variant")): r["metrics"] for r in rows
             if r["params"].get("variant") in ("local", "local2") and "error" not in r}
    bases = [b for b in ("local", "local2") if any(v == b for _, v in local)]
    params = varying(rows, HIDDEN | {"variant"}) + ["variant"]
    header = ((["run"] if many_runs else []) + params + ["ms/step"] +
              [f"vs {b}" for b in bases] + ["fwd+bwd", "push (hidden / exposed)",
                                            "pull (hidden / exposed)", "check", "final loss",
                                            "curve gap"])
    body = []
    for r in rows:
        m = r["metrics"]
        cells = ([r["run"]] if many_runs else []) + [cell(r["params"].get(p), "") for p in params]
        if "error" in r:
            body.append(cells + [f"failed: {r['error']}"] + ["-"] * (len(header) - len(cells) - 1))
            continue
        cells.append(cell(m.get("step_ms"), ".2f"))
        for b in bases:
            of = local.get((group(r), b), {}).get("step_ms")
            cells.append(f"{m['step_ms'] / of:.3f}x" if of and m.get("step_ms") else "-")
        cells += [cell(m.get("fwd_bwd_ms"), ".2f"),
                  cell(overlap(m.get("push_total_ms"), m.get("push_hidden_ms"),
                               m.get("push_exposed_ms")), ""),
                  cell(overlap(m.get("pull_total_ms"), m.get("pull_hidden_ms"),
                               m.get("pull_exposed_ms")), ""),
                  cell(m.get("check_ms") or None, ".2f"), cell(m.get("train_loss_last5"), ".4f")]
        base = local.get((group(r), "local"))
        gap = (curve_gap(m.get("losses", []), base.get("losses", []))
               if base and r["params"].get("variant") != "local" else None)
        body.append(cells + [cell(gap, ".4f")])
    lines = markdown(header, body)
    if "round" in params:
        lines += [""] + rounds_table(rows, params, many_runs,
                                     lambda r, b: local.get((group(r), b), {}).get("step_ms"))
    return lines


def rounds_table(rows: List[Dict[str, Any]], params: List[str], many_runs: bool,
                 local_ms: Callable[[Dict[str, Any], str], Optional[float]]) -> List[str]:
    """With --set round=1,2,...: each configuration's median over the rounds, of its ms/step
    and of its ratio to the local run of the same round (local_ms(row, "local"))."""
    shown = [p for p in params if p != "round"]
    groups: Dict[str, List[Dict[str, Any]]] = {}
    for r in rows:
        if "error" not in r and r["metrics"].get("step_ms"):
            key = json.dumps([r["run"]] + [r["params"].get(p) for p in shown], default=str)
            groups.setdefault(key, []).append(r)
    header = ((["run"] if many_runs else []) + shown +
              ["rounds", "ms/step (median)", "vs local (median)", "ms/step of each round"])
    body = []
    for members in groups.values():
        first = members[0]
        times = [r["metrics"]["step_ms"] for r in members]
        ratios = [r["metrics"]["step_ms"] / of for r in members
                  if (of := local_ms(r, "local"))]
        body.append(([first["run"]] if many_runs else []) +
                    [cell(first["params"].get(p), "") for p in shown] +
                    [str(len(members)), f"{statistics.median(times):.2f}",
                     f"{statistics.median(ratios):.3f}x" if ratios else "-",
                     ", ".join(f"{t:.2f}" for t in times)])
    return ["medians over the rounds:", ""] + markdown(header, body)


QUALITY_METRICS = ("final_train_loss", "final_val_loss", "test_loss", "test_accuracy")


def quality_table(kind: str, rows: List[Dict[str, Any]], many_runs: bool,
                  ratio: Optional[Tuple[str, str]]) -> List[str]:
    """Per example and storage option, each final metric over the seeds: every seed's, their
    mean and standard deviation, and the mean's distance from fp32 storage's (fp32:fp32), also
    in units of fp32's standard deviation over its seeds."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        key = (r["run"], str(r["params"].get("example")), str(r["params"].get("storage")))
        groups.setdefault(key, []).append(r)

    def values(group: List[Dict[str, Any]], metric: str) -> List[float]:
        done = sorted((r for r in group if "error" not in r), key=lambda r: r["params"]["seed"])
        return [r["metrics"][metric] for r in done if r["metrics"].get(metric) is not None]
    header = (["run"] if many_runs else []) + [
        "example", "state", "params", "metric", "per seed", "mean", "std", "mean - fp32 mean",
        "in fp32 std units"]
    body = []
    for (run, example, storage), group in sorted(groups.items()):
        state, _, params = storage.partition(":")
        base = groups.get((run, example, "fp32:fp32"), [])
        failed = sum(1 for r in group if "error" in r)
        for metric in QUALITY_METRICS:
            got = values(group, metric)
            if not got:
                continue
            mean = statistics.fmean(got)
            std = statistics.stdev(got) if len(got) > 1 else math.nan
            delta, units = "-", "-"
            base_values = values(base, metric)
            if base_values and storage != "fp32:fp32":
                base_mean = statistics.fmean(base_values)
                base_std = statistics.stdev(base_values) if len(base_values) > 1 else 0.0
                delta = f"{mean - base_mean:+.4f}"
                units = f"{(mean - base_mean) / base_std:+.2f}" if base_std > 0 else "-"
            seeds = ", ".join(f"{v:.4f}" for v in got) + (f" ({failed} failed)" if failed else "")
            body.append(([run] if many_runs else []) + [
                example, state, params, metric, seeds, f"{mean:.4f}", f"{std:.4f}", delta, units])
        if failed == len(group):
            body.append(([run] if many_runs else []) + [example, state, params, "-",
                                                        f"{failed} failed", "-", "-", "-", "-"])
    return markdown(header, body)


# The Nsight Compute metrics the ncu table shows (every one is in the results file).
NCU_KEEP = re.compile(
    r"Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical "
    r"Occupancy|Block Limit Registers|Stall|Warp Cycles Per Issued|Issued Warp|Eligible|Issue "
    r"Slots Busy|Executed Ipc|L2 Hit|Mem Busy|Max Bandwidth|Bank Conflict|Executed "
    r"Instructions|Dynamic Shared|issue_stalled")


def ncu_table(kind: str, rows: List[Dict[str, Any]], many_runs: bool,
              ratio: Optional[Tuple[str, str]]) -> List[str]:
    """One row per Nsight Compute metric (those NCU_KEEP matches), one column per launch."""
    params = varying(rows, set()) or [k for k in rows[0]["params"]][:1]
    labels = [(f"{r['run']}: " if many_runs else "") +
              " ".join(str(r["params"].get(p)) or "-" for p in params) for r in rows]
    names: List[str] = []
    for r in rows:
        names += [n for n in r["metrics"].get("ncu", {}) if NCU_KEEP.search(n) and n not in names]
    body = [[name] + [cell(r["metrics"].get("ncu", {}).get(name), ".4g") for r in rows]
            for name in names]
    body += [["failed"] + [r.get("error", "") for r in rows]] if any("error" in r for r in rows) \
        else []
    return markdown(["metric (" + ", ".join(params) + ")"] + labels, body)


TABLES = {"train": train_table, "quality": quality_table, "ncu": ncu_table}


def render(docs: List[Dict[str, Any]], ratio: Optional[Tuple[str, str]] = None) -> str:
    lines: List[str] = []
    kinds: Dict[str, List[Dict[str, Any]]] = {}
    for i, doc in enumerate(docs):
        run = f"run {i + 1}:" if len(docs) > 1 else ""
        settings = " ".join(f"{k}={','.join(map(str, v)) if isinstance(v, list) else v}"
                            for k, v in doc.get("settings", {}).items())
        lines.append(f"{run} suite `{doc['suite']}` on {doc['device']}, "
                     f"{doc['date']}, commit {doc['git']} ({doc.get('binaries', '?')})".strip() +
                     (f"; settings: {settings}" if settings else ""))
        for r in doc["results"]:
            kinds.setdefault(r["step"], []).append(dict(r, run=str(i + 1)))
    for kind, rows in kinds.items():
        lines += ["", f"### {kind}", ""] + TABLES.get(kind, table)(kind, rows, len(docs) > 1,
                                                                  ratio)
    return "\n".join(lines) + "\n"


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results files of bench/run.py")
    parser.add_argument("--ratio", metavar="NAME=VALUE", help="add a column: over the baseline")
    args = parser.parse_args(argv)
    ratio = None
    if args.ratio:
        name, _, value = args.ratio.partition("=")
        ratio = (name, value)
    docs = []
    for path in args.results:
        with open(path) as f:
            docs.append(json.load(f))
    sys.stdout.write(render(docs, ratio))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
