"""Unit tests of fusedps._deadlines (no server)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from fusedps import _deadlines


def test_call_timeout_is_a_floor_plus_bytes_at_the_minimum_rate():
    assert _deadlines.call_timeout(30.0, 10e6, 0) == 30.0
    assert _deadlines.call_timeout(30.0, 10e6, 248_000_000) == pytest.approx(54.8)
    assert _deadlines.call_timeout(30.0, 0, 248_000_000) == 30.0
    assert _deadlines.call_timeout(None, 10e6, 1 << 40) is None


def test_channel_options_keepalive_and_overrides():
    options = dict(_deadlines.channel_options())
    assert options["grpc.keepalive_time_ms"] == 30_000
    assert options["grpc.keepalive_timeout_ms"] == 10_000
    assert options["grpc.keepalive_permit_without_calls"] == 0
    assert options["grpc.http2.max_pings_without_data"] == 0
    assert options["grpc.max_receive_message_length"] == -1
    overridden = _deadlines.channel_options([("grpc.keepalive_time_ms", 60_000), ("x", 1)])
    assert [k for k, _ in overridden].count("grpc.keepalive_time_ms") == 1
    assert dict(overridden)["grpc.keepalive_time_ms"] == 60_000 and dict(overridden)["x"] == 1


class FakeCall:
    def __init__(self):
        self.cancelled = threading.Event()

    def cancel(self):
        self.cancelled.set()


def test_growing_deadline_cancels_after_timeout_plus_payload():
    call = FakeCall()
    start = time.monotonic()
    with _deadlines.GrowingDeadline(call, 0.1, 1000) as deadline:
        deadline.set_payload(200)  # + 0.2 s
        assert call.cancelled.wait(2.0)
        elapsed = time.monotonic() - start
        assert deadline.expired
    assert 0.29 <= elapsed < 1.5
    error = deadline.error()
    assert isinstance(error, grpc.RpcError)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "200 bytes" in error.details()


def test_growing_deadline_leaves_a_call_that_finishes_in_time():
    call = FakeCall()
    with _deadlines.GrowingDeadline(call, 0.2, 1000) as deadline:
        pass
    time.sleep(0.3)
    assert not call.cancelled.is_set() and not deadline.expired


def test_no_timeout_means_no_watchdog():
    call = FakeCall()
    with _deadlines.GrowingDeadline(call, None, 1000) as deadline:
        time.sleep(0.05)
    assert deadline._thread is None and not call.cancelled.is_set()
