"""A timeline of RemoteAdamW(overlap=True), for finding what a step waits for.

With FUSEDPS_OVERLAP_TRACE=PATH in the environment, the overlap engine and its pull pipeline
record (seconds, thread, event, detail) tuples while they run, and write them to PATH as JSON
lines when the optimizer closes. Off (no cost beyond one check) otherwise.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import List, Tuple

_PATH = os.environ.get("FUSEDPS_OVERLAP_TRACE")
_events: List[Tuple[float, str, str, object]] = []
_lock = threading.Lock()
enabled = bool(_PATH)


def mark(event: str, detail: object = None) -> None:
    if enabled:
        entry = (time.perf_counter(), threading.current_thread().name, event, detail)
        with _lock:
            _events.append(entry)


def dump() -> None:
    """Writes the events so far to FUSEDPS_OVERLAP_TRACE (appending) and forgets them."""
    if not enabled or _PATH is None:
        return
    with _lock:
        events, _events[:] = list(_events), []
    with open(_PATH, "a") as f:
        for t, thread, event, detail in events:
            f.write(json.dumps([t, thread, event, detail]) + "\n")
