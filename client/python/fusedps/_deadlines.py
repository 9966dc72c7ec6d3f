"""Call deadlines and channel keepalive of the fusedps Python client.

Internal module: the public API is in fusedps.client, whose Client docstring states the
defaults and why they were chosen.

A call's deadline is ``timeout`` plus its payload (the tensor data it moves) at
``min_bytes_per_second``, counted from its start. gRPC fixes a call's deadline when the call
starts, but a pull learns its size only from the reply; GrowingDeadline cancels such a call
itself once its deadline, grown as the reply announces its tensors, has passed.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, List, Optional, Sequence, Tuple, cast

from fusedps import errors

DEFAULT_TIMEOUT = 30.0
DEFAULT_MIN_BYTES_PER_SECOND = 10e6
KEEPALIVE_TIME_MS = 30_000
KEEPALIVE_TIMEOUT_MS = 10_000


def call_timeout(timeout: Optional[float], min_bytes_per_second: float,
                 payload_bytes: int) -> Optional[float]:
    """Seconds a call moving ``payload_bytes`` may take; None (no deadline) when timeout is."""
    if timeout is None:
        return None
    if not min_bytes_per_second:
        return float(timeout)
    return float(timeout) + payload_bytes / float(min_bytes_per_second)


def channel_options(extra: Sequence[Tuple[str, object]] = ()) -> List[Tuple[str, object]]:
    """The options of a channel the client makes: no message size limits, and keepalive
    pings every 30 s while calls are in flight (a peer that does not answer one within 10 s is
    dropped, failing its calls with UNAVAILABLE), none while idle. ``extra`` overrides."""
    options: Dict[str, object] = {
        "grpc.max_receive_message_length": -1,
        "grpc.max_send_message_length": -1,
        "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
        "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
        "grpc.keepalive_permit_without_calls": 0,
        # gRPC otherwise stops pinging after 2 pings without data: while a call waits on the
        # server (a push being applied), a dead peer would go unnoticed from the third on.
        "grpc.http2.max_pings_without_data": 0,
    }
    options.update(dict(extra))
    return list(options.items())


class GrowingDeadline:
    """Cancels ``call`` (anything with cancel()) once call_timeout(timeout, rate, payload) has
    passed since this was made; set_payload() moves the deadline as the payload grows. Does
    nothing when timeout is None. Use as a context manager (or call close()).
    """

    def __init__(self, call, timeout: Optional[float], min_bytes_per_second: float):
        self._call = call
        self._timeout = timeout
        self._rate = min_bytes_per_second
        self._start = time.monotonic()
        self._payload = 0
        self._done = False
        self.expired = False
        self._changed = threading.Condition()
        self._thread = None
        if timeout is not None:
            self._thread = threading.Thread(target=self._watch, name="fusedps-deadline",
                                            daemon=True)
            self._thread.start()

    def set_payload(self, payload_bytes: int) -> None:
        with self._changed:
            if payload_bytes != self._payload:
                self._payload = payload_bytes
                self._changed.notify()

    def error(self) -> errors.DeadlineExceeded:
        seconds = call_timeout(self._timeout, self._rate, self._payload)
        return errors.DeadlineExceeded(
            f"call exceeded its deadline of {seconds:.3f} s ({self._timeout} s plus "
            f"{self._payload} bytes at {self._rate:g} bytes/s)")

    def close(self) -> None:
        with self._changed:
            self._done = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> "GrowingDeadline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _watch(self) -> None:
        with self._changed:
            while not self._done:
                # Not None: the watcher runs only with a timeout.
                seconds = cast(float, call_timeout(self._timeout, self._rate, self._payload))
                deadline = self._start + seconds
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self.expired = True
                    break
                self._changed.wait(remaining)
        if self.expired:
            self._call.cancel()
