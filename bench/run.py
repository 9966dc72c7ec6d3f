#!/usr/bin/env python3
"""The benchmark driver: runs one suite of bench/suites.py and writes one results file.

    bench/run.py --list
    bench/run.py SUITE [--build DIR | --pack DIR] [--out results.json] [--set NAME=V1,V2 ...]
                 [--certs DIR] [--dry-run]
    bench/report.py results.json

From the repository root of a normal build (`--build build`, the default), or, on a machine
without the build's libraries, from the binary pack that scripts/pack_device.sh makes
(`--pack .device-pack`: each binary runs as `.device-pack/run NAME`). --dry-run prints every
command (servers and steps) without running any. --set replaces a param's list of values for
every step that has it (e.g. `--set workload=gpt2 --set iters=20`).

The results file, the one format that bench/report.py reads:

    {"suite": "kernel",
     "about": "one GPU: ...",
     "device": "NVIDIA H200, 1980 MHz, ...",     # nvidia-smi's line per GPU, else the CPU model
     "date": "2026-11-29T01:00:00Z",
     "git": "0123abc (dirty)",
     "binaries": "build" | "pack",
     "results": [
       {"step": "kernel",                          # the step kind: one table per kind
        "params": {"workload": "gpt2", ...},        # the step's params for this run
        "command": "build/bench/fusedps-kernel-bench --backend=cuda ...",
        "metrics": {"device_ms_median": 0.41, "latency_ms": {"p50": 1.2}, ...},
        "error": "exit 1: ..."}                     # only when the command failed
     ]}

A step whose parser yields several rows (one per workload, say) records one result per row,
the row's own keys (workload, variant, path...) among its metrics. Servers' /metrics scraped
around a step add "server_ms" (Δsum / Δcount of each histogram, in ms) to its metrics, keyed by
server name. Logs of every command go to the scratch folder named on stderr.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any, Dict, List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suites import SUITES  # noqa: E402  bench/suites.py, beside this file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER = re.compile(r"\{([a-z_]+(?::[A-Za-z0-9_.-]+)?)\}")


class Binaries:
    """Resolves {bin:NAME} to a command: a build's executable, or the pack's `run NAME`."""

    def __init__(self, build: Optional[str], pack: Optional[str]):
        self.build, self.pack = build, pack
        self._found: Dict[str, str] = {}

    def command(self, name: str) -> str:
        if self.pack:
            return f"{self.pack}/run {name}"
        if name not in self._found:
            self._found[name] = self._find(name)
        return self._found[name]

    def _find(self, name: str) -> str:
        assert self.build is not None
        for folder, dirs, files in os.walk(self.build):
            dirs[:] = sorted(d for d in dirs if d != "CMakeFiles")
            if name in files and os.access(os.path.join(folder, name), os.X_OK):
                return os.path.join(folder, name)
        return os.path.join(self.build, "<missing>", name)

    def env(self) -> Dict[str, str]:
        """The environment of every command: the Python package and, from a pack, its libraries."""
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        if self.pack:
            pack = os.path.abspath(self.pack)
            env["PYTHONPATH"] = os.path.join(pack, "python")
            env["FUSEDPS_NATIVE_LIB"] = os.path.join(pack, "bin", "libfusedps_c.so")
            env["LD_LIBRARY_PATH"] = os.path.join(pack, "lib") + (
                ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        else:
            assert self.build is not None
            env["PYTHONPATH"] = os.path.join(os.path.abspath(self.build), "python")
        return env


def fill(template: str, values: Dict[str, Any], bins: Binaries) -> str:
    """The template with every {name} replaced, values that are templates themselves included.
    REQUIRES: every name is in values (or is bin:NAME)."""
    def one(m: "re.Match[str]") -> str:
        key = m.group(1)
        if key.startswith("bin:"):
            return bins.command(key[4:])
        if key not in values:
            raise KeyError(f"no value for {{{key}}} in {template!r}")
        return str(values[key])
    for _ in range(4):
        filled = PLACEHOLDER.sub(one, template)
        if filled == template:
            break
        template = filled
    return template


def runs_of(suite: Dict[str, Any], step: Dict[str, Any],
            overrides: Dict[str, List[str]]) -> List[Dict[str, Any]]:
    """Every combination of the step's params, over the suite's defaults and lookups. An
    override of several values that the step lacks (--set round=1,2) becomes its outermost."""
    own = step.get("params", {})
    params = {k: v for k, v in overrides.items() if k not in own and len(v) > 1}
    params.update({k: overrides.get(k, v) for k, v in own.items()})
    out = []
    for combo in itertools.product(*params.values()):
        values = dict(suite.get("defaults", {}))
        values.update({k: v[0] for k, v in overrides.items() if k not in params})
        values.update(zip(params, combo))
        for name, lookup in suite.get("lookups", {}).items():
            values[name] = lookup["values"][values[lookup["key"]]]
        out.append(values)
    return out


# Parsers: a command's stdout to a list of metrics dicts (one per row).
def parse_json(text: str, _: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [json.loads(text)]


def parse_json_rows(key: str):
    def parse(text: str, _: Dict[str, Any]) -> List[Dict[str, Any]]:
        doc = json.loads(text)
        shared = {k: v for k, v in doc.items()
                  if k != key and isinstance(v, (str, int, float, bool))}
        return [dict(shared, **row) for row in doc[key]]
    return parse


def parse_transport(text: str, _: Dict[str, Any]) -> List[Dict[str, Any]]:
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


PARSERS = {"json": parse_json, "json-rows:results": parse_json_rows("results"),
           "json-rows:rows": parse_json_rows("rows"), "transport": parse_transport, "wall": None}


def scrape(port_file: str) -> Dict[str, float]:
    """{sample name with labels: value} of a server's /metrics ({} when unreachable)."""
    try:
        port = open(port_file).read().strip()
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    except (OSError, ValueError):
        return {}
    samples = {}
    for line in text.decode().splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)$", line.strip())
        if m:
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples


def histogram_means(before: Dict[str, float], after: Dict[str, float]) -> Dict[str, float]:
    """{histogram{labels}: mean ms} over what was observed between two scrapes."""
    means = {}
    for name, total in after.items():
        m = re.match(r"^(\w+)_sum(\{.*\})?$", name)
        if not m:
            continue
        count_name = f"{m.group(1)}_count{m.group(2) or ''}"
        count = after.get(count_name, 0.0) - before.get(count_name, 0.0)
        if count > 0 and m.group(1).endswith("_seconds"):
            means[m.group(1)[:-len("_seconds")] + (m.group(2) or "")] = round(
                1e3 * (total - before.get(name, 0.0)) / count, 4)
    return means


class Servers:
    """The servers of a run: started on demand, on 127.0.0.1 port 0, each once."""

    def __init__(self, suite: Dict[str, Any], bins: Binaries, scratch: str, dry: bool):
        self.suite, self.bins, self.scratch, self.dry = suite, bins, scratch, dry
        self.running: Dict[str, subprocess.Popen] = {}
        self.printed: Dict[str, str] = {}

    def _files(self, name: str):
        return (os.path.join(self.scratch, f"{name}.port"),
                os.path.join(self.scratch, f"{name}.metrics-port"))

    def command(self, name: str, values: Dict[str, Any]) -> str:
        port_file, metrics_file = self._files(name)
        values = dict(values, metrics_flags=f"--metrics-listen=127.0.0.1:0 "
                                            f"--metrics-port-file={metrics_file}")
        return (fill(self.suite["servers"][name], values, self.bins) +
                f" --listen=127.0.0.1:0 --port-file={port_file}")

    def start(self, name: str, values: Dict[str, Any]) -> str:
        """The server's address, "127.0.0.1:PORT", once it has written its port."""
        port_file, _ = self._files(name)
        cmd = self.command(name, values)
        if self.dry:
            if self.printed.get(name) != cmd:
                print(f"  server {name}: {cmd}")
                self.printed[name] = cmd
            return f"127.0.0.1:<{name}>"
        if name not in self.running:
            if os.path.exists(port_file):
                os.remove(port_file)
            log = open(os.path.join(self.scratch, f"server_{name}.log"), "w")
            self.running[name] = subprocess.Popen(shlex.split(cmd), stdout=log, stderr=log,
                                                  env=self.bins.env(), cwd=ROOT)
            for _ in range(240):
                if os.path.exists(port_file) and open(port_file).read().strip():
                    break
                if self.running[name].poll() is not None:
                    break
                time.sleep(0.25)
            if not (os.path.exists(port_file) and open(port_file).read().strip()):
                raise RuntimeError(f"server {name} did not start: see its log in {log.name}")
        return "127.0.0.1:" + open(port_file).read().strip()

    def scrape_all(self, names: List[str]) -> Dict[str, Dict[str, float]]:
        if self.dry:
            return {}
        return {n: scrape(self._files(n)[1]) for n in names
                if os.path.exists(self._files(n)[1])}

    def stop(self, names: Optional[List[str]] = None) -> None:
        for name in list(self.running) if names is None else names:
            proc = self.running.pop(name, None)
            if proc:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def run_command(cmd: str, env: Dict[str, str], timeout: float, log: str):
    with open(log, "a") as err:
        err.write(f"+ {cmd}\n")
        err.flush()
        return subprocess.run(shlex.split(cmd), stdout=subprocess.PIPE, stderr=err, text=True,
                              env=env, cwd=ROOT, timeout=timeout)


def measure(step: Dict[str, Any], values: Dict[str, Any], cmd: str, bins: Binaries,
            log: str) -> List[Dict[str, Any]]:
    """Runs one command of a step; its metrics rows. Raises RuntimeError when it fails."""
    timeout = step.get("timeout", 600)
    if step["parse"] == "wall":
        times = []
        for _ in range(int(values.get("reps", 1))):
            start = time.perf_counter()
            proc = run_command(cmd, bins.env(), timeout, log)
            times.append(time.perf_counter() - start)
            if proc.returncode != 0:
                raise RuntimeError(f"exit {proc.returncode}")
        metrics: Dict[str, Any] = {"seconds_median": statistics.median(times),
                                   "seconds_min": min(times), "reps": len(times)}
        if "size_of" in step:
            metrics["file_bytes"] = os.path.getsize(fill(step["size_of"], values, bins))
        rows = [metrics]
    else:
        proc = run_command(cmd, bins.env(), timeout, log)
        if proc.returncode != 0:
            raise RuntimeError(f"exit {proc.returncode}")
        rows = PARSERS[step["parse"]](proc.stdout, values)
    for row in rows:
        for name, expression in step.get("derive", {}).items():
            row[name] = eval(expression, {"__builtins__": {}}, dict(values, **row))
    return rows


def run_suite(name: str, bins: Binaries, overrides: Dict[str, List[str]], certs: str,
              dry: bool, out: Optional[str] = None) -> Dict[str, Any]:
    """Runs the suite and returns its results document; with ``out``, also writes the document
    there after each step, so that a run cut short (a timeout) keeps the steps it finished."""
    suite = SUITES[name]
    scratch = "<out>" if dry else tempfile.mkdtemp(prefix=f"fusedps-bench-{name}-")
    print(f"{name}: logs in {scratch}", file=sys.stderr)
    # Debian's, which has torch and grpcio (as for ctest), unless told otherwise.
    # From a pack, the GPU machine's python3 (as its scripts always had).
    python = os.environ.get("FUSEDPS_PYTHON") or (
        "/usr/bin/python3" if os.path.exists("/usr/bin/python3") and not bins.pack else "python3")
    base = {"python": python, "out": scratch, "certs": certs}
    servers = Servers(suite, bins, scratch, dry)
    shared = dict(suite.get("defaults", {}), **base)
    shared.update({k: v[0] for k, v in overrides.items()})
    results: List[Dict[str, Any]] = []

    # The run's facts, asked once (nvidia-smi and git are processes): document() is called
    # after every step.
    facts = {"suite": name, "about": suite["about"], "device": device_line(),
             "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
             "git": git_line(), "binaries": "pack" if bins.pack else "build"}

    def document() -> Dict[str, Any]:
        return dict(facts, results=results)

    try:
        for step in suite["steps"]:
            for values in runs_of(suite, step, overrides):
                values.update(base)
                names = fill(" ".join(step.get("servers", [])), values, bins).split()
                shown = {k: values[k] for k in step.get("params", {})}
                shown.update({k: values[k] for k, v in overrides.items() if len(v) > 1})
                shown = {k: fill(v, values, bins) if isinstance(v, str) else v
                         for k, v in shown.items()}
                try:
                    addresses = [servers.start(n, values if step.get("fresh") else shared)
                                 for n in names]
                except RuntimeError as e:
                    print(f"{step['kind']} {json.dumps(shown)}: {e}", file=sys.stderr)
                    results.append({"step": step["kind"], "params": shown, "metrics": {},
                                    "error": str(e)})
                    servers.stop(names)
                    continue
                values["target"] = addresses[0] if addresses else ""
                values["targets"] = ",".join(addresses)
                cmd = fill(step["run"], values, bins)
                if dry:
                    print(f"  {step['kind']} {json.dumps(shown)}: {cmd}")
                    continue
                print(f"{step['kind']} {json.dumps(shown)}", file=sys.stderr)
                before = servers.scrape_all(names)
                result: Dict[str, Any] = {"step": step["kind"], "params": shown, "command": cmd}
                try:
                    rows = measure(step, values, cmd, bins,
                                   os.path.join(scratch, f"{step['kind']}.log"))
                except (RuntimeError, ValueError, KeyError, OSError,
                        subprocess.TimeoutExpired) as e:
                    rows, result["error"] = [{}], str(e)[-300:]
                    print(f"  failed: {result['error']}", file=sys.stderr)
                stages = {n: histogram_means(before[n], after)
                          for n, after in servers.scrape_all(names).items() if n in before}
                if step.get("fresh"):
                    servers.stop(names)
                if step.get("record", True):
                    for row in rows:
                        metrics = dict(row, server_ms=stages) if any(stages.values()) else row
                        results.append(dict(result, metrics=metrics))
                    if out:
                        write_document(out, document())
    finally:
        servers.stop()
    return document()


def write_document(path: str, doc: Dict[str, Any]) -> None:
    """Writes a results document whole (through a temporary file, renamed)."""
    with open(path + ".tmp", "w") as f:
        f.write(json.dumps(doc, indent=1) + "\n")
    os.replace(path + ".tmp", path)


def device_line() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version,"
                              "clocks.sm,clocks.mem", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.strip():
            return "; ".join(out.stdout.strip().splitlines())
    except (OSError, subprocess.TimeoutExpired):
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} ({os.cpu_count()} cores)"
    except OSError:
        pass
    return "unknown"


def git_line() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                                  timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""
    head = git("rev-parse", "--short=12", "HEAD") or "unknown"
    return head + (" (dirty)" if git("status", "--porcelain", "--untracked-files=no") else "")


def scalar(text: str) -> Any:
    """A --set value: a number when it reads as one, else the text."""
    try:
        return json.loads(text) if re.match(r"^-?[\d.]+(e-?\d+)?$", text) else text
    except ValueError:
        return text


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", help="the suite to run (see --list)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--build", help="a build folder (default: build)")
    where.add_argument("--pack", help="a binary pack (scripts/pack_device.sh's .device-pack)")
    parser.add_argument("--out", help="the results file (default: stdout)")
    parser.add_argument("--set", action="append", default=[], metavar="NAME=V1,V2",
                        help="replace a param's values")
    parser.add_argument("--certs", help="TLS test certificates (default: PACK/certs, else made "
                        "by tests/integration/make_test_certs.sh)")
    parser.add_argument("--list", action="store_true", help="list the suites")
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    if args.list or not args.suite:
        for name, suite in SUITES.items():
            print(f"{name:10} {suite['about']}")
        return 0 if args.list else 2
    if args.suite not in SUITES:
        parser.error(f"no suite {args.suite!r}; --list names them")
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--set {item}: want NAME=V1,V2")
        overrides[key] = [scalar(v) for v in value.split(",")] if value else [""]
    bins = Binaries(None if args.pack else (args.build or "build"), args.pack)
    certs = args.certs or (os.path.join(args.pack, "certs") if args.pack else "")
    if not certs and "{certs}" in json.dumps(SUITES[args.suite]) and not args.dry_run:
        certs = tempfile.mkdtemp(prefix="fusedps-certs-")
        subprocess.run(["bash", "tests/integration/make_test_certs.sh", certs], check=True,
                       cwd=ROOT, stdout=subprocess.DEVNULL)
    doc = run_suite(args.suite, bins, overrides, certs or "<certs>", args.dry_run, args.out)
    if args.dry_run:
        return 0
    if args.out:
        write_document(args.out, doc)
    else:
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    return 1 if any("error" in r for r in doc["results"]) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
