"""fusedps._overlap_staging's deferred copies to the host (RemoteAdamW(overlap=True, delay=1) on
a GPU), on the CPU with stand-ins for the device parts: a deferred bucket is marked copied
whatever happens, so that a copy that cannot be queued fails its step on the worker instead of
leaving the worker (and close()) waiting for ever; and a forked child that inherited the
global forward pre-hook (a DataLoader worker calling a transform that is a Module) queues
nothing, since the copies and CUDA are the parent's.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

from fusedps._overlap_staging import Staging
from fusedps._overlap_step import _Bucket, _Step
from fusedps._overlap_worker import StepWorker


class Stream:
    """A side stream's stand-in: its events are names."""

    def __init__(self):
        self.events = 0

    def record_event(self):
        self.events += 1
        return f"event {self.events}"


@pytest.fixture(autouse=True)
def no_device_streams(monkeypatch):
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())


class Engine(Staging, StepWorker):
    """The parts of OverlapEngine that _release_copies and the worker's _write use."""

    def __init__(self, buckets: int):
        self._lock = threading.Lock()
        self._owner_pid = os.getpid()
        self._stream = Stream()
        self._wire_dev = None
        self._sent = torch.arange(8 * buckets, dtype=torch.float32)
        self._hosts = [torch.zeros(8 * buckets), None]
        self._deferred = []
        for b in range(buckets):
            bucket = _Bucket([b], 8 * b, 8 * b + 8, copied=threading.Event())
            self._deferred.append((0, bucket))

    def buckets(self):
        return [bucket for _, bucket in self._deferred]


def test_a_copy_that_cannot_be_queued_marks_every_bucket_and_fails_the_step():
    engine = Engine(3)
    buckets = engine.buckets()
    engine._hosts[0] = None  # The second bucket on: no host buffer to copy into.
    calls = []
    real = Engine._copy_to_host

    def copy_once_then_fail(self, buffer, bucket):
        calls.append(bucket.begin)
        if len(calls) == 1:
            self._hosts[0] = torch.zeros(24)
            try:
                return real(self, buffer, bucket)
            finally:
                self._hosts[0] = None
        return real(self, buffer, bucket)

    engine._copy_to_host = copy_once_then_fail.__get__(engine)
    with pytest.raises(TypeError):  # The second bucket's copy (host buffer None).
        engine._release_copies()
    assert calls == [0, 8]  # The third was not tried...
    assert all(b.copied.is_set() for b in buckets)  # ...but no bucket is left waiting.
    assert buckets[0].copy_error is None and buckets[0].event == "event 1"
    assert isinstance(buckets[1].copy_error, TypeError)
    assert "not queued" in str(buckets[2].copy_error)
    assert engine._deferred == []
    # The worker's write of a failed bucket fails the step (reported at its commit), at once.
    step = _Step()
    step.transactions = []
    engine._write(step, buckets[2])
    assert "not queued" in str(step.error)


def test_a_forked_child_queues_nothing():
    engine = Engine(2)
    buckets = engine.buckets()
    engine._owner_pid = os.getpid() + 1  # As the child sees the parent's engine.
    engine._release_copies()
    assert len(engine._deferred) == 2 and not any(b.copied.is_set() for b in buckets)
    engine._owner_pid = os.getpid()  # The parent: both copied, in order.
    engine._release_copies()
    assert engine._deferred == [] and torch.equal(engine._hosts[0], engine._sent)
    assert [b.event for b in buckets] == ["event 1", "event 2"]
    assert all(b.copied.is_set() and b.copy_error is None for b in buckets)
