"""Prometheus's text format, parsed for the tests (tests/e2e and tests/metrics): each sample by
its name and label pairs."""

from __future__ import annotations

import re
import urllib.request
from typing import Dict, List, Tuple

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


class Samples(dict):
    """(name, frozenset of label pairs) -> value, from Prometheus's text format."""

    def value(self, name: str, **labels: str) -> float:
        """The value of the one series with exactly these labels; KeyError when absent."""
        key = (name, frozenset(labels.items()))
        if key not in self:
            have = sorted((dict(k[1]) for k in self if k[0] == name), key=lambda d: sorted(d.items()))
            raise KeyError(f"no sample {name}{labels}; series of {name}: {have}")
        return self[key]

    def series(self, name: str) -> List[Tuple[Dict[str, str], float]]:
        return [(dict(k[1]), v) for k, v in self.items() if k[0] == name]


def parse_metrics(text: str) -> Samples:
    samples = Samples()
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        pairs = frozenset(_LABEL.findall(labels or ""))
        samples[(name, pairs)] = float(value)
    return samples


def scrape_samples(metrics_port: int, timeout: float = 10.0) -> Samples:
    """Every sample of the /metrics of a server on 127.0.0.1:metrics_port."""
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_metrics(response.read().decode("utf-8"))
