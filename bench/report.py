#!/usr/bin/env python3
"""Prints results files of bench/run.py as markdown: per file its device, date and commit, then
one table per step kind (one row per result: the params that vary, then the kind's metrics).

    bench/report.py results.json [more.json ...] [--ratio NAME=VALUE]

Several files (e.g. the same suite from two builds) share the tables, with a "run" column.
--ratio server=plain adds a column: each row's first metric over the row's that differs only
in having that param value (a baseline in the same file).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any, Callable, Dict, List, Optional, Tuple, Union


def pct_copy(m: Dict[str, Any]) -> Optional[float]:
    if m.get("copy_gbps") and m.get("device_gbps") is not None:
        return 100 * m["device_gbps"] / m["copy_gbps"]
    return m.get("pct_copy")


# The histograms of fusedps-server's /metrics that the stage column shows, with their names
# there: the push stages, the push's ingest (thread time, within receive), the sync rounds.
STAGE_FAMILIES = {"fusedps_stage_duration": "", "fusedps_push_ingest": "ingest",
                  "fusedps_round_duration": "round", "fusedps_round_stage_duration": "round "}


def stages(m: Dict[str, Any]) -> Optional[str]:
    """The servers' stage means, compactly: "a: receive 1.20, apply 0.41; b: ..."."""
    parts = []
    for server, means in sorted(m.get("server_ms", {}).items()):
        cells = []
        for key, value in means.items():
            family, stage = key.split("{")[0], re.search(r'stage="(\w+)"', key)
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
        ("p50 ms", lambda m: m.get("latency_ms", {}).get("p50"), ".2f"),
        ("p90 ms", lambda m: m.get("latency_ms", {}).get("p90"), ".2f"),
        ("p99 ms", lambda m: m.get("latency_ms", {}).get("p99"), ".2f"),
        ("server stages, mean ms", stages, "")]
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
    """Each row's metric over its baseline's: the row alike but for param name == base."""
    def key(r: Dict[str, Any]) -> str:
        params = {k: v for k, v in r["params"].items() if k != name}
        ident = {k: r["metrics"].get(k) for k in ("workload", "variant", "path", "streams")}
        return json.dumps([r["run"], params, ident], sort_keys=True, default=str)
    baselines = {key(r): value_of(getter, r["metrics"]) for r in rows
                 if str(r["params"].get(name)) == base}
    out = []
    for r in rows:
        value, of = value_of(getter, r["metrics"]), baselines.get(key(r))
        out.append(f"{value / of:.2f}" if isinstance(value, (int, float)) and of else "-")
    return out


def table(kind: str, rows: List[Dict[str, Any]], many_runs: bool,
          ratio: Optional[Tuple[str, str]]) -> List[str]:
    params: List[str] = []
    for r in rows:
        params += [k for k in r["params"] if k not in params and k not in HIDDEN]
    params = [p for p in params if len({json.dumps(r["params"].get(p)) for r in rows}) > 1]
    columns = columns_of(kind, rows)
    header = (["run"] if many_runs else []) + params + [c[0] for c in columns]
    body = []
    for r in rows:
        cells = ([r["run"]] if many_runs else []) + [cell(r["params"].get(p), "") for p in params]
        cells += [cell(value_of(get, r["metrics"]), fmt) for _, get, fmt in columns]
        if "error" in r:
            cells[-1] += f" (failed: {r['error']})"
        body.append(cells)
    if ratio and any(ratio[0] in r["params"] for r in rows):
        first = next((c for c in columns if c[2]), None)
        if first:
            header.append(f"{first[0]} / {ratio[0]}={ratio[1]}")
            for cells, value in zip(body, ratio_column(rows, first[1], *ratio)):
                cells.append(value)
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in body]
    return lines


def render(docs: List[Dict[str, Any]], ratio: Optional[Tuple[str, str]] = None) -> str:
    lines: List[str] = []
    kinds: Dict[str, List[Dict[str, Any]]] = {}
    for i, doc in enumerate(docs):
        run = f"run {i + 1}:" if len(docs) > 1 else ""
        lines.append(f"{run} suite `{doc['suite']}` on {doc['device']}, "
                     f"{doc['date']}, commit {doc['git']} ({doc.get('binaries', '?')})".strip())
        for r in doc["results"]:
            kinds.setdefault(r["step"], []).append(dict(r, run=str(i + 1)))
    for kind, rows in kinds.items():
        lines += ["", f"### {kind}", ""] + table(kind, rows, len(docs) > 1, ratio)
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
