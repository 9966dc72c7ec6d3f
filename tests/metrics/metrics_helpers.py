"""Helpers of the metrics tests: a fusedps-server with /metrics on a free port, scraping and
parsing Prometheus's text format, and a real Prometheus server (Debian's package) on loopback.

    with metrics_server() as server:                 # server.target, server.metrics_url
        samples = parse_metrics(scrape(server.metrics_url))
        samples.value("fusedps_push_requests_total", code="OK")

    with running_prometheus(config) as prom:         # prom.url; stopped (SIGTERM) on exit
        prom.query('up{job="fusedps"}')

Binaries: $PROMETHEUS and $PROMTOOL (default /usr/bin/prometheus, /usr/bin/promtool), and
fusedps-server as tests/e2e/server_fixture.py finds it ($FUSEDPS_SERVER).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Iterator, List, Optional, Sequence

import yaml

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO_ROOT, "tests", "e2e"))

from prometheus_text import Samples, parse_metrics  # noqa: E402,F401
from server_fixture import running_server  # noqa: E402

PROMETHEUS = os.environ.get("PROMETHEUS") or "/usr/bin/prometheus"
PROMTOOL = os.environ.get("PROMTOOL") or "/usr/bin/promtool"
DASHBOARD = os.path.join(REPO_ROOT, "deploy", "grafana", "fusedps.json")
PROMETHEUS_DIR = os.path.join(REPO_ROOT, "deploy", "prometheus")


@dataclasses.dataclass
class MetricsServer:
    target: str        # gRPC, "127.0.0.1:<port>"
    metrics_port: int

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    @property
    def metrics_address(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"


@contextlib.contextmanager
def metrics_server(extra_args: Sequence[str] = ()) -> Iterator[MetricsServer]:
    """A fusedps-server (CPU backend) serving /metrics on a free loopback port."""
    with tempfile.TemporaryDirectory(prefix="fusedps-metrics-") as tmp:
        port_file = os.path.join(tmp, "metrics_port")
        # server_fixture passes --metrics-listen=127.0.0.1:0; the server writes this file before
        # its gRPC port file, so it is there once running_server yields.
        with running_server([f"--metrics-port-file={port_file}", *extra_args]) as target:
            with open(port_file) as f:
                yield MetricsServer(target, int(f.read()))


def scrape(url: str, timeout: float = 10.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        assert response.status == 200, response.status
        content_type = response.headers.get("Content-Type", "")
        assert content_type.startswith("text/plain"), content_type
        return response.read().decode("utf-8")


def promtool(*args: str, stdin: Optional[str] = None) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], input=stdin, capture_output=True, text=True,
                          timeout=60)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusError(RuntimeError):
    pass


class Prometheus:
    """A running Prometheus server's HTTP API."""

    def __init__(self, url: str, log_tail):
        self.url = url
        self.log_tail = log_tail

    def api(self, path: str, **params: str) -> dict:
        query = urllib.parse.urlencode(params)
        with urllib.request.urlopen(f"{self.url}{path}?{query}", timeout=30) as response:
            body = json.load(response)
        if body.get("status") != "success":
            raise PrometheusError(f"{path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> List[dict]:
        """An instant query, now; the result vector (or a scalar as one sample)."""
        data = self.api("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        return data["result"]

    def wait_for(self, what: str, predicate, timeout: float = 30.0):
        """Polls predicate() until it returns a true value; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            result = predicate()
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"timed out after {timeout} s waiting for {what}; log:\n"
                                      f"{self.log_tail()}")
            time.sleep(0.25)


def finite_values(result: List[dict]) -> List[float]:
    values = []
    for sample in result:
        for _, v in ([sample["value"]] if "value" in sample else sample.get("values", [])):
            if math.isfinite(float(v)):
                values.append(float(v))
    return values


@contextlib.contextmanager
def running_prometheus(config: dict, start_timeout: float = 60.0) -> Iterator[Prometheus]:
    """Runs Debian's prometheus on 127.0.0.1:<free port> with `config` (a prometheus.yml as a
    dict) and a temporary TSDB; SIGTERM (then SIGKILL) on exit."""
    if not os.access(PROMETHEUS, os.X_OK):
        raise PrometheusError(f"no prometheus at {PROMETHEUS}: install Debian's package "
                              f"'prometheus' (scripts/setup.sh does)")
    with tempfile.TemporaryDirectory(prefix="fusedps-prometheus-") as tmp:
        config_path = os.path.join(tmp, "prometheus.yml")
        with open(config_path, "w") as f:
            yaml.safe_dump(config, f)
        log_path = os.path.join(tmp, "prometheus.log")

        def log_tail(n: int = 4000) -> str:
            with open(log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]

        for attempt in range(5):  # Another process may take the free port before we bind it.
            port = free_port()
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    [PROMETHEUS, f"--config.file={config_path}",
                     f"--storage.tsdb.path={os.path.join(tmp, 'data')}",
                     f"--web.listen-address=127.0.0.1:{port}", "--log.level=info"],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, cwd=tmp)
            prom = Prometheus(f"http://127.0.0.1:{port}", log_tail)
            try:
                if _wait_ready(proc, prom, start_timeout):
                    break
            except BaseException:
                _stop(proc)
                raise
        else:
            raise PrometheusError(f"prometheus did not start; log:\n{log_tail()}")
        try:
            yield prom
        finally:
            _stop(proc)


def _wait_ready(proc: subprocess.Popen, prom: Prometheus, timeout: float) -> bool:
    """True once /-/ready answers 200; False when the process exited (e.g. port taken)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(f"{prom.url}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        time.sleep(0.2)
    raise PrometheusError(f"prometheus not ready within {timeout} s; log:\n{prom.log_tail()}")


def _stop(proc: subprocess.Popen, timeout: float = 30.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
