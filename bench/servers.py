"""The servers of a bench/run.py run: processes started on demand on 127.0.0.1 port 0, each
once, ready when they have written their port; their /metrics scraped around each step."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import time
import urllib.request
from typing import Callable, Dict, List, Optional


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
    """Servers by name. Each one's port file, metrics port file and log (server_NAME.log) are in
    the scratch folder; its command must write the first two (files() names them)."""

    def __init__(self, scratch: str, env: Callable[[], Dict[str, str]], cwd: str, dry: bool):
        self.scratch, self.env, self.cwd, self.dry = scratch, env, cwd, dry
        self.running: Dict[str, subprocess.Popen] = {}
        self.printed: Dict[str, str] = {}

    def files(self, name: str):
        """(port file, metrics port file) of the server NAME."""
        return (os.path.join(self.scratch, f"{name}.port"),
                os.path.join(self.scratch, f"{name}.metrics-port"))

    def start(self, name: str, cmd: str) -> str:
        """The server's address, "127.0.0.1:PORT", once it has written its port (started with
        cmd unless it runs). Raises RuntimeError when it does not start within 60 s."""
        port_file, _ = self.files(name)
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
                                                  env=self.env(), cwd=self.cwd)
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
        return {n: scrape(self.files(n)[1]) for n in names if os.path.exists(self.files(n)[1])}

    def stop(self, names: Optional[List[str]] = None) -> None:
        """SIGTERM, then SIGKILL after 30 s: the servers named, or all."""
        for name in list(self.running) if names is None else names:
            proc = self.running.pop(name, None)
            if proc:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
