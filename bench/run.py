#!/usr/bin/env python3
"""The benchmark driver: runs one suite of bench/suites/ and writes one results file.

    bench/run.py --list
    bench/run.py SUITE [--build DIR | --pack DIR] [--out results.json] [--set NAME=V1,V2 ...]
                 [--certs DIR] [--dry-run]
    bench/report.py results.json

From a normal build (`--build build`, the default) or from the binary pack that
scripts/pack_device.sh makes (`--pack .device-pack`: each binary runs as `PACK/run NAME`).
--dry-run prints every command without running any. --set replaces a value for every step that
has it (`--set iters=20`; a list, `--set round=1,2`, runs each; a comma inside a value is `\\,`);
`--set parts=a,b` picks a suite's parts (bench/suites/__init__.py says what a suite is).

The results file, the one format that bench/report.py reads:

    {"suite": "kernel",
     "about": "one GPU: ...",
     "device": "NVIDIA H200, 1980 MHz, ...",     # nvidia-smi's line per GPU, else the CPU model
     "date": "2026-11-29T01:00:00Z",
     "git": "0123abc (dirty)",
     "binaries": "build" | "pack",
     "settings": {"iters": 30},                   # the run's --set values
     "results": [
       {"step": "kernel",                          # the step kind: one table per kind
        "params": {"workload": "gpt2", ...},        # the step's params for this run
        "command": "build/bench/fusedps-kernel-bench --backend=cuda ...",
        "metrics": {"device_ms_median": 0.41, "latency_ms": {"p50": 1.2}, ...},
        "error": "exit 1: ..."}                     # only when the command failed
     ]}

A parser's rows (one per workload, say) are one result each. Servers' /metrics scraped around
a step add "server_ms" (Δsum / Δcount of each histogram, in ms, by server). A failed setup
command is a result of step "setup". The file is rewritten after each step (a run cut short
keeps what it finished). Every command's log is in the scratch folder named on stderr.
"""

from __future__ import annotations

import argparse
import concurrent.futures
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
from typing import Any, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suites import SUITES  # noqa: E402  bench/suites/, beside this file
from suites.parsers import PARSERS  # noqa: E402
from servers import Servers, histogram_means  # noqa: E402  bench/servers.py

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDER = re.compile(r"\{([a-z_][a-z0-9_]*(?::[A-Za-z0-9_.-]+)?)\}")
# Values of --set that the driver reads itself, not the templates.
RESERVED = {"parts"}
CORPUS = "/usr/share/doc/jargon-text/jargon.txt.gz"  # Debian's jargon-text, as for ctest.
FAILURES = (RuntimeError, ValueError, KeyError, OSError, subprocess.TimeoutExpired)


class Binaries:
    """Resolves {bin:NAME} to a command: a build's executable, or the pack's `run NAME`; and
    the environment of every command."""

    def __init__(self, build: Optional[str], pack: Optional[str]):
        self.build, self.pack = build, pack
        self._found: Dict[str, str] = {}
        self.extra: Dict[str, str] = {}  # Set by the suite's setup, and by tools().

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

    def tools(self, scratch: str) -> None:
        """FUSEDPS_SERVER and FUSEDPS_CLI, for scripts that start servers themselves
        (tests/e2e/server_fixture.py): a build's executables, or wrappers of the pack's."""
        for var, name in (("FUSEDPS_SERVER", "fusedps-server"), ("FUSEDPS_CLI", "fusedps")):
            if self.pack:
                path = os.path.join(scratch, name)
                with open(path, "w") as f:
                    f.write(f'#!/bin/sh\nexec "{os.path.abspath(self.pack)}/run" {name} "$@"\n')
                os.chmod(path, 0o755)
            else:
                path = os.path.abspath(self.command(name))
            self.extra[var] = path

    def env(self) -> Dict[str, str]:
        """The environment of every command: the Python package and, from a pack, its libraries."""
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", **self.extra)
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
    """The template with every {name} replaced, values that are templates themselves included,
    and each {{name}} left as {name}. REQUIRES: every name is in values (or is bin:NAME)."""
    def one(m: "re.Match[str]") -> str:
        key = m.group(1)
        if key.startswith("bin:"):
            return bins.command(key[4:])
        if key not in values:
            raise KeyError(f"no value for {{{key}}} in {template!r}")
        return str(values[key])
    for _ in range(4):
        template = template.replace("{{", "\x00").replace("}}", "\x01")
        filled = PLACEHOLDER.sub(one, template)
        if filled == template:
            break
        template = filled
    return template.replace("\x00", "{").replace("\x01", "}")


def loops_of(suite: Dict[str, Any], step: Dict[str, Any],
             overrides: Dict[str, List[Any]]) -> Dict[str, List[Any]]:
    """The step's params with their values, outermost first: a list given for a name that no
    step of the suite has as a param (--set round=1,2), then the step's own."""
    everyone = {k for s in suite["steps"] for k in s.get("params", {})}
    params = {k: v for k, v in overrides.items()
              if k not in everyone and k not in RESERVED and len(v) > 1}
    params.update({k: overrides.get(k, v) for k, v in step.get("params", {}).items()})
    return params


def runs_of(suite: Dict[str, Any], step: Dict[str, Any],
            overrides: Dict[str, List[Any]]) -> List[Dict[str, Any]]:
    """Every combination of the step's params (loops_of), over the suite's defaults and
    lookups. Raises KeyError when a lookup has no entry for its key."""
    params = loops_of(suite, step, overrides)
    combos = list(itertools.product(*params.values()))
    if step.get("alternate") and params:
        width = len(list(params.values())[-1])
        groups = [combos[i:i + width] for i in range(0, len(combos), width)]
        combos = [c for i, g in enumerate(groups) for c in (g[::-1] if i % 2 else g)]
    out = []
    for combo in combos:
        values = dict(suite.get("defaults", {}))
        values.update({k: v[0] for k, v in overrides.items()
                       if k not in params and k not in RESERVED})
        values.update(zip(params, combo))
        for name, lookup in suite.get("lookups", {}).items():
            if name in overrides or lookup["key"] not in values:
                continue
            table, key = lookup["values"], values[lookup["key"]]
            if key not in table:
                raise KeyError(f"{name}: no value for {lookup['key']}={key!r} (one of "
                               f"{', '.join(map(str, table))})")
            values[name] = table[key]
        out.append(values)
    return out


def selected(suite: Dict[str, Any], step: Dict[str, Any],
             overrides: Dict[str, List[Any]]) -> bool:
    """Whether the step runs: it has no part, or its part is among those chosen."""
    parts = overrides.get("parts", suite.get("parts"))
    return "part" not in step or parts is None or step["part"] in parts


def truthy(value: Any) -> bool:
    return str(value).lower() not in ("", "0", "false", "no", "off", "none")


def run_command(cmd: str, env: Dict[str, str], timeout: float, log: str):
    with open(log, "a") as err:
        err.write(f"+ {cmd}\n")
        err.flush()
        return subprocess.run(shlex.split(cmd), stdout=subprocess.PIPE, stderr=err, text=True,
                              env=env, cwd=ROOT, timeout=timeout)


def evaluate(expression: str, values: Dict[str, Any]) -> Any:
    return eval(expression, {"__builtins__": {}}, values)


def background_command(step: Dict[str, Any], values: Dict[str, Any],
                       bins: Binaries) -> Optional[str]:
    """The step's background command for these values, or None when it has none that runs."""
    bg = step.get("background")
    if not bg or (bg.get("when") and not evaluate(bg["when"], values)):
        return None
    return fill(bg["run"], values, bins)


def measure(step: Dict[str, Any], values: Dict[str, Any], cmd: str, bins: Binaries,
            log: str) -> List[Dict[str, Any]]:
    """Runs one command of a step (and its background command); its metrics rows. Raises one
    of FAILURES when it fails."""
    timeout = step.get("timeout", 600)
    bg_cmd = background_command(step, values, bins)
    bg, bg_out = None, tempfile.TemporaryFile("w+") if bg_cmd else None
    reads = fill(step["reads"], values, bins) if "reads" in step else None
    if reads and os.path.exists(reads):
        os.remove(reads)
    try:
        if bg_cmd:
            with open(log, "a") as err:
                err.write(f"+ (background) {bg_cmd}\n")
                err.flush()
                bg = subprocess.Popen(shlex.split(bg_cmd), stdout=bg_out, stderr=err, text=True,
                                      env=bins.env(), cwd=ROOT)
            time.sleep(float(fill(str(step["background"].get("lead", 0)), values, bins)))
        rows = run_parsed(step, values, cmd, bins, log, timeout, reads)
        if bg:
            if bg.wait(timeout=timeout) != 0:
                raise RuntimeError(f"background: exit {bg.returncode}")
            assert bg_out is not None
            bg_out.seek(0)
            parse = PARSERS[step["background"]["parse"]]
            assert parse is not None
            found = parse(bg_out.read(), values)[0]
            for row in rows:
                row[step["background"]["key"]] = found
    finally:
        if bg and bg.poll() is None:
            bg.kill()
            bg.wait()
        if bg_out:
            bg_out.close()
    for row in rows:
        for name, expression in step.get("derive", {}).items():
            row[name] = evaluate(expression, dict(values, **row))
    return rows


def run_parsed(step: Dict[str, Any], values: Dict[str, Any], cmd: str, bins: Binaries, log: str,
               timeout: float, reads: Optional[str]) -> List[Dict[str, Any]]:
    """The command's rows: its wall time ("wall"), or what its parser reads in its output."""
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
        return [metrics]
    proc = run_command(cmd, bins.env(), timeout, log)
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}")
    parse = PARSERS[step["parse"]]
    assert parse is not None
    if reads:
        with open(reads) as f:
            return parse(f.read(), values)
    return parse(proc.stdout, values)


def attempt(step: Dict[str, Any], values: Dict[str, Any], cmd: str, bins: Binaries,
            log: str) -> Tuple[List[Dict[str, Any]], Optional[str]]:
    """measure(), its failure as a message: (rows, None) or ([{}], error)."""
    try:
        return measure(step, values, cmd, bins, log), None
    except FAILURES as e:
        error = str(e)[-300:] or type(e).__name__
        print(f"  failed: {error}", file=sys.stderr)
        return [{}], error


class Run:
    """One run of a suite: its servers, setup and results document."""

    def __init__(self, name: str, bins: Binaries, overrides: Dict[str, List[Any]], certs: str,
                 dry: bool, out: Optional[str]):
        suite = SUITES[name]
        corpus = os.path.join(bins.pack, "jargon.txt.gz") if bins.pack else CORPUS
        self.suite = dict(suite, defaults=dict({"corpus": corpus}, **suite.get("defaults", {})))
        self.bins, self.overrides, self.dry, self.out = bins, overrides, dry, out
        self.scratch = "<out>" if dry else tempfile.mkdtemp(prefix=f"fusedps-bench-{name}-")
        print(f"{name}: logs in {self.scratch}", file=sys.stderr)
        if not dry:
            bins.tools(self.scratch)
        # Debian's, which has torch and grpcio (as for ctest), unless told otherwise.
        # From a pack, the GPU machine's python3 (as its scripts always had).
        python = os.environ.get("FUSEDPS_PYTHON") or (
            "/usr/bin/python3" if os.path.exists("/usr/bin/python3") and not bins.pack
            else "python3")
        self.base = {"python": python, "out": self.scratch, "certs": certs}
        self.servers = Servers(self.scratch, bins.env, ROOT, dry)
        self.shared = dict(self.suite["defaults"], **self.base)
        self.shared.update({k: v[0] for k, v in overrides.items() if k not in RESERVED})
        self.results: List[Dict[str, Any]] = []
        self.undo: List[Dict[str, Any]] = []
        # The run's facts, asked once (nvidia-smi and git are processes): document() is
        # called after every step.
        self.facts = {
            "suite": name, "about": suite["about"], "device": device_line(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "git": git_line(), "binaries": "pack" if bins.pack else "build",
            "settings": {k: v[0] if len(v) == 1 else v for k, v in overrides.items()}}

    def document(self) -> Dict[str, Any]:
        return dict(self.facts, results=self.results)

    def record(self, step: Dict[str, Any], result: Dict[str, Any], rows: List[Dict[str, Any]],
               stages: Dict[str, Dict[str, float]]) -> None:
        if not step.get("record", True) and "error" not in result:
            return
        for row in rows:
            metrics = dict(row, server_ms=stages) if any(stages.values()) else row
            self.results.append(dict(result, metrics=metrics))
        if self.out:
            write_document(self.out, self.document())

    def setup(self) -> None:
        """Runs the suite's setup commands whose `when` holds; a failed one is a result."""
        for entry in self.suite.get("setup", []):
            if entry.get("when") and not truthy(self.shared.get(entry["when"])):
                continue
            env = {k: fill(v, self.shared, self.bins) for k, v in entry.get("env", {}).items()}
            cmd = fill(entry["run"], self.shared, self.bins)
            if self.dry:
                print(f"  setup {entry['name']}: {cmd}")
                if "undo" in entry:
                    print(f"  undo {entry['name']}: {fill(entry['undo'], self.shared, self.bins)}")
                continue
            self.bins.extra.update(env)
            try:
                proc = run_command(cmd, self.bins.env(), 120,
                                   os.path.join(self.scratch, "setup.log"))
                error = f"exit {proc.returncode}" if proc.returncode else None
            except FAILURES as e:
                error = str(e)
            if error:
                print(f"setup {entry['name']} failed: {error}", file=sys.stderr)
                for key in env:
                    self.bins.extra.pop(key, None)
                self.record({}, {"step": "setup", "params": {"name": entry["name"]},
                                 "command": cmd, "error": error}, [{}], {})
            else:
                self.undo.append(entry)

    def teardown(self) -> None:
        self.servers.stop()
        for entry in reversed(self.undo):
            if "undo" in entry:
                try:
                    run_command(fill(entry["undo"], self.shared, self.bins), self.bins.env(), 60,
                                os.path.join(self.scratch, "setup.log"))
                except FAILURES as e:
                    print(f"undo {entry['name']} failed: {e}", file=sys.stderr)

    def server_command(self, name: str, values: Dict[str, Any]) -> str:
        port_file, metrics_file = self.servers.files(name)
        values = dict(values, metrics_flags=f"--metrics-listen=127.0.0.1:0 "
                                            f"--metrics-port-file={metrics_file}")
        return (fill(self.suite["servers"][name], values, self.bins) +
                f" --listen=127.0.0.1:0 --port-file={port_file}")

    def prepare(self, step: Dict[str, Any],
                values: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        """The params a result shows, and the step's server names, for one run's values."""
        values.update(self.base)
        names = fill(" ".join(step.get("servers", [])), values, self.bins).split()
        shown = {k: fill(values[k], values, self.bins) if isinstance(values[k], str)
                 else values[k] for k in loops_of(self.suite, step, self.overrides)}
        return shown, names

    def step(self, step: Dict[str, Any]) -> None:
        if step.get("stop") and not self.dry:
            self.servers.stop(step["stop"])
        runs = runs_of(self.suite, step, self.overrides)
        width = int(fill(str(step.get("parallel", 1)), self.shared, self.bins))
        if width > 1 and not self.dry:
            self.parallel(step, runs, width)
            return
        for values in runs:
            self.one(step, values)

    def one(self, step: Dict[str, Any], values: Dict[str, Any]) -> None:
        """One run of a step: its servers, its command, its result."""
        kind = step["kind"]
        shown, names = self.prepare(step, values)
        try:
            addresses = [self.servers.start(n, self.server_command(
                n, values if step.get("fresh") else self.shared)) for n in names]
        except RuntimeError as e:
            print(f"{kind} {json.dumps(shown)}: {e}", file=sys.stderr)
            self.record(step, {"step": kind, "params": shown, "error": str(e)}, [{}], {})
            self.servers.stop(names)
            return
        values["target"] = addresses[0] if addresses else ""
        values["targets"] = ",".join(addresses)
        cmd = fill(step["run"], values, self.bins)
        if self.dry:
            print(f"  {kind} {json.dumps(shown)}: {cmd}")
            bg_cmd = background_command(step, values, self.bins)
            if bg_cmd:
                print(f"    background: {bg_cmd}")
            return
        print(f"{kind} {json.dumps(shown)}", file=sys.stderr)
        before = self.servers.scrape_all(names)
        result: Dict[str, Any] = {"step": kind, "params": shown, "command": cmd}
        rows, error = attempt(step, values, cmd, self.bins,
                              os.path.join(self.scratch, f"{kind}.log"))
        if error:
            result["error"] = error
        stages = {n: histogram_means(before[n], after)
                  for n, after in self.servers.scrape_all(names).items() if n in before}
        if step.get("fresh"):
            self.servers.stop(names)
        self.record(step, result, rows, stages)

    def parallel(self, step: Dict[str, Any], runs: List[Dict[str, Any]], width: int) -> None:
        """The step's runs, `width` at a time (commands that need no driver servers); each
        result recorded as its run ends."""
        assert not step.get("servers"), f"{step['kind']}: a parallel step starts no servers"
        with concurrent.futures.ThreadPoolExecutor(width) as pool:
            futures = {}
            for i, values in enumerate(runs):
                shown, _ = self.prepare(step, values)
                cmd = fill(step["run"], values, self.bins)
                print(f"{step['kind']} {json.dumps(shown)}", file=sys.stderr)
                log = os.path.join(self.scratch, f"{step['kind']}.{i}.log")
                futures[pool.submit(attempt, step, values, cmd, self.bins, log)] = (shown, cmd)
            for future in concurrent.futures.as_completed(futures):
                (shown, cmd), (rows, error) = futures[future], future.result()
                result = {"step": step["kind"], "params": shown, "command": cmd}
                if error:
                    result["error"] = error
                self.record(step, result, rows, {})


def run_suite(name: str, bins: Binaries, overrides: Dict[str, List[Any]], certs: str,
              dry: bool, out: Optional[str] = None) -> Dict[str, Any]:
    """Runs the suite and returns its results document; with ``out``, also writes the document
    there after each step, so that a run cut short (a timeout) keeps the steps it finished."""
    run = Run(name, bins, overrides, certs, dry, out)
    try:
        run.setup()
        for step in run.suite["steps"]:
            if selected(run.suite, step, overrides):
                run.step(step)
    finally:
        run.teardown()
    return run.document()


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


def parse_sets(items: List[str]) -> Dict[str, List[Any]]:
    """--set NAME=V1,V2 ... as {NAME: [V1, V2]} ("\\," is a comma inside a value). Raises
    ValueError on an item without "="."""
    overrides = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item}: want NAME=V1,V2")
        overrides[key] = [scalar(v.replace("\\,", ","))
                          for v in re.split(r"(?<!\\),", value)] if value else [""]
    return overrides


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
    try:
        overrides = parse_sets(args.set)
        for step in SUITES[args.suite]["steps"]:
            runs_of(SUITES[args.suite], step, overrides)  # Every lookup has its entry.
    except (ValueError, KeyError) as e:
        parser.error(str(e).strip("'\""))
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
