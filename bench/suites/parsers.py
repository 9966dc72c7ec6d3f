"""Parsers of bench/run.py: a command's output (its stdout, or the file a step `reads`) to a list
of metrics dicts, one per row. A step names its parser with `parse` (bench/suites/__init__.py).
Each raises ValueError when the output holds no result."""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Dict, List, Optional

Rows = List[Dict[str, Any]]


def parse_json(text: str, _: Dict[str, Any]) -> Rows:
    return [json.loads(text)]


def parse_json_rows(key: str) -> Callable[[str, Dict[str, Any]], Rows]:
    """One row per element of the object's `key` list, with the object's scalars in each."""
    def parse(text: str, _: Dict[str, Any]) -> Rows:
        doc = json.loads(text)
        shared = {k: v for k, v in doc.items()
                  if k != key and isinstance(v, (str, int, float, bool))}
        return [dict(shared, **row) for row in doc[key]]
    return parse


def parse_transport(text: str, _: Dict[str, Any]) -> Rows:
    """fusedps-transport-bench's lines: path (words), streams, GB/s median, GB/s best."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"^(\S.*?)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s*$", line)
        if m:
            rows.append({"path": m.group(1), "streams": int(m.group(2)),
                         "gbps_median": float(m.group(3)), "gbps_best": float(m.group(4))})
    if not rows:
        raise ValueError("no result lines")
    return rows


def parse_result_line(text: str, _: Dict[str, Any]) -> Rows:
    """The examples' last `RESULT {json}` line (examples/train_digits.py, train_gpt.py)."""
    found: Optional[Dict[str, Any]] = None
    for line in text.splitlines():
        if line.startswith("RESULT "):
            found = json.loads(line[len("RESULT "):])
    if found is None:
        raise ValueError("no RESULT line")
    return [found]


def parse_train_log(text: str, _: Dict[str, Any]) -> Rows:
    """examples/train_gpt.py --log-json: the summary record, the model's size and device from
    the config record, and every step's loss (`losses`, for the report's curve gaps)."""
    summary: Optional[Dict[str, Any]] = None
    config: Dict[str, Any] = {}
    losses: List[float] = []
    for line in text.splitlines():
        record = json.loads(line)
        if record["kind"] == "step":
            losses.append(record["loss"])
        elif record["kind"] == "summary":
            summary = record
        elif record["kind"] == "config":
            config = record
    if summary is None:
        raise ValueError(f"no summary record after {len(losses)} steps")
    row = {k: v for k, v in summary.items() if k != "kind"}
    row.update(n_params=config.get("n_params"), device_name=config.get("device_name"),
               transport=config.get("transport"), losses=losses)
    return [row]


def parse_dd(text: str, _: Dict[str, Any]) -> Rows:
    """Lines "LABEL N bytes (...) copied, S s, ...": the label that a suite's script printed
    before each dd summary line."""
    rows = []
    for line in text.splitlines():
        m = re.match(r"^(\S+)\s+(\d+) bytes .*copied, ([\d.e+-]+) s", line)
        if m:
            size, seconds = int(m.group(2)), float(m.group(3))
            rows.append({"mode": m.group(1), "bytes": size, "seconds": seconds,
                         "gbps": size / seconds / 1e9 if seconds > 0 else None})
    if not rows:
        raise ValueError("no dd lines")
    return rows


def parse_checkpoint_log(text: str, _: Dict[str, Any]) -> Rows:
    """fusedps-server's log lines of each checkpoint written (server/checkpoint/checkpointer.cc)
    and of a restore (server/models/model_files.cc)."""
    rows: Rows = []
    for line in text.splitlines():
        m = re.search(r"checkpoint: version (\d+) in \S+, (\d+) bytes; snapshot ([\d.e+-]+) ms"
                      r"( \(fenced\))?, write ([\d.e+-]+) s", line)
        if m:
            rows.append({"event": "checkpoint", "version": int(m.group(1)),
                         "bytes": int(m.group(2)), "snapshot_ms": float(m.group(3)),
                         "fenced": bool(m.group(4)), "seconds": float(m.group(5))})
        m = re.search(r"restored version (\d+) from \S+: (\d+) bytes in ([\d.e+-]+) s", line)
        if m:
            rows.append({"event": "restore", "version": int(m.group(1)),
                         "bytes": int(m.group(2)), "seconds": float(m.group(3))})
    for row in rows:
        row["gbps"] = row["bytes"] / row["seconds"] / 1e9 if row["seconds"] > 0 else None
    if not rows:
        raise ValueError("no checkpoint or restore lines in the server's log")
    return rows


def parse_ncu(text: str, _: Dict[str, Any]) -> Rows:
    """Nsight Compute's text report of one kernel launch: one row, {"Name (unit)": value}."""
    metrics: Dict[str, Any] = {}
    for line in text.splitlines():
        m = re.match(r"^\s{2,}(\S.*?\S)\s{2,}(?:(\S+)\s+)?(-?[\d,]+(?:\.\d+)?)\s*$", line)
        if m and not m.group(1).startswith("-"):
            name = m.group(1) + (f" ({m.group(2)})" if m.group(2) else "")
            metrics.setdefault(name, float(m.group(3).replace(",", "")))
    if not metrics:
        raise ValueError("no metrics: did ncu profile a kernel?")
    return [{"ncu": metrics}]


def parse_probe(text: str, _: Dict[str, Any]) -> Rows:
    """bench/contention_probe.py's last table: load, ms/step, ratio to idle, background rate."""
    rows = []
    for line in text.split("\n\n")[-1].splitlines():
        m = re.match(r"^(\S.*?)\s+([\d.]+)\s+([\d.]+)x\s*(.*)$", line)
        if m:
            rows.append({"load": m.group(1), "ms_per_step": float(m.group(2)),
                         "vs_idle": float(m.group(3)), "rate": m.group(4).strip()})
    if not rows:
        raise ValueError("no probe table")
    return rows


# None: the command's wall time (bench/run.py measures it).
PARSERS: Dict[str, Optional[Callable[[str, Dict[str, Any]], Rows]]] = {
    "json": parse_json, "json-rows:results": parse_json_rows("results"),
    "json-rows:rows": parse_json_rows("rows"), "transport": parse_transport,
    "result-line": parse_result_line, "train-log": parse_train_log, "dd": parse_dd,
    "checkpoint-log": parse_checkpoint_log, "ncu": parse_ncu, "probe": parse_probe,
    "wall": None,
}
