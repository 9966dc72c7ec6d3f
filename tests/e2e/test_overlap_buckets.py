"""How RemoteAdamW(overlap=True) cuts a step into push buckets and pull groups
(fusedps._bucket_plan), over a real CPU server: the exposed ends small, the results exact.

A deep stack of small layers makes the plan visible: from the second step on, the last bucket
of a backward holds about edge_bucket_bytes and the ones before it double up to
bucket_bytes; the first pull group of a forward is small too. Each size check has its control:
with edge_bucket_bytes=0 (every bucket full size) the same check fails. Once delayed, step()
stages every gradient as one bucket, and on a GPU its copy to the host waits for the next
forward. torch.optim.AdamW is the oracle for the values throughout.
"""

from __future__ import annotations

from typing import List

import pytest
import torch

from fusedps import _native, _overlap
from fusedps._bucket_plan import plan_ends
from fusedps.torch import RemoteAdamW
from grad_scalers import DEVICE
from test_overlap import stale_reference_step

RTOL, ATOL = 1.3e-6, 1e-5  # test_parity.py's.
HYPER = dict(lr=0.01, betas=(0.9, 0.99), weight_decay=0.05)
CAP, EDGE = 8192, 1024  # Bytes: bucket_bytes, edge_bucket_bytes.
WIDTH, DEPTH = 16, 12  # Each layer: a 1024-byte weight and a 64-byte bias.
LARGEST = WIDTH * WIDTH * 4


def test_plan_ends_cuts_with_the_small_group_at_the_exposed_end():
    assert plan_ends([1] * 10, cap=4, edge=1, small_end="head") == [1, 3, 7, 10]
    assert plan_ends([1] * 10, cap=4, edge=1, small_end="tail") == [3, 7, 9, 10]
    # Groups hold at least their target, the far end what is left.
    assert plan_ends([3, 1, 1, 1, 1], cap=4, edge=1, small_end="tail") == [2, 4, 5]
    # edge 0 or >= cap: every group cap, counted from the head.
    assert plan_ends([1] * 10, cap=4, edge=0, small_end="tail") == [4, 8, 10]
    assert plan_ends([1] * 10, cap=4, edge=4, small_end="head") == [4, 8, 10]
    assert plan_ends([], cap=4, edge=1, small_end="tail") == []
    assert plan_ends([9], cap=4, edge=1, small_end="tail") == [1]
    with pytest.raises(ValueError, match="small_end"):
        plan_ends([1], cap=4, edge=1, small_end="middle")


class Deep(torch.nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH)
                                            for _ in range(DEPTH)])
        self.to(DEVICE)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def loss_of(model: Deep, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(8, WIDTH, generator=gen), torch.randn(8, WIDTH, generator=gen)
    return torch.nn.functional.mse_loss(model(x.to(DEVICE)), y.to(DEVICE))


class Buckets:
    """Per step, in order, the wire bytes of each bucket staged, in staging order."""

    def __init__(self):
        self.steps: List[object] = []  # Each step's record, kept alive (ids are reused).
        self.sizes: List[List[int]] = []

    def add(self, step, size: int) -> None:
        if not self.steps or self.steps[-1] is not step:
            self.steps.append(step)
            self.sizes.append([])
        self.sizes[-1].append(size)


def record_buckets(monkeypatch) -> Buckets:
    buckets = Buckets()
    stage = _overlap.OverlapEngine._stage

    def recording(self, step, bucket, grads, ready, **kwargs):
        buckets.add(step, (bucket.end - bucket.begin) * self._itemsize)
        return stage(self, step, bucket, grads, ready, **kwargs)

    monkeypatch.setattr(_overlap.OverlapEngine, "_stage", recording)
    return buckets


def train(server_target: str, prefix: str, edge: int, steps: int = 6, **options):
    """Trains Deep with RemoteAdamW(overlap=True) and torch.optim.AdamW on the same batches,
    checks the values, and returns the optimizer's pull groups' wire bytes (closed). The
    gradients leave during backward unless options say (on a GPU the default through a device
    workspace is at step()), since the buckets' cuts are what is checked."""
    options.setdefault("push_during_backward", True)
    model, ref_model = Deep(7), Deep(7)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix=prefix,
                      overlap=True, bucket_bytes=CAP, edge_bucket_bytes=edge, **HYPER, **options)
    try:
        for step in range(steps):
            for m, o in ((model, opt), (ref_model, ref)):
                o.zero_grad(set_to_none=True)
                loss_of(m, step).backward()
                o.step()
        opt.wait_parameters()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}: {m}")
        assert opt.overlap_fallbacks == 0
        pulls = opt._overlap.pulls
        return [sum(pulls._numel[i] * 4 for i in g.params) for g in pulls._groups]
    finally:
        opt.close()


def assert_small_ends(buckets: Buckets, groups: List[int]) -> None:
    steps = buckets.sizes
    assert len(steps) >= 4
    for sizes in steps[1:]:  # The first step has no order to plan on yet.
        assert sizes[-1] <= EDGE + LARGEST, f"the last bucket is not small: {sizes}"
        # Doubling towards the start: each bucket at least the one after it.
        assert all(a >= b for a, b in zip(sizes[1:-1], sizes[2:])), sizes
    assert groups[0] <= EDGE + LARGEST, f"the first pull group is not small: {groups}"
    assert sum(groups) == DEPTH * (LARGEST + WIDTH * 4)


@pytest.mark.parametrize("edge", [EDGE, 0])
def test_the_exposed_ends_are_small_and_the_values_exact(server_target, monkeypatch, edge):
    """edge 0 is the control: every bucket and group full size, so the size checks fail."""
    buckets = record_buckets(monkeypatch)
    groups = train(server_target, f"edge-{edge}/", edge)
    if edge:
        assert_small_ends(buckets, groups)
    else:
        with pytest.raises(AssertionError, match="is not small"):
            assert_small_ends(buckets, groups)


def test_a_delayed_step_stages_one_bucket(server_target, monkeypatch):
    buckets = record_buckets(monkeypatch)
    model = Deep(8)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="edge-delay/",
                      overlap=True, bucket_bytes=CAP, edge_bucket_bytes=EDGE, delay=1,
                      delay_warmup=2, push_during_backward=True, **HYPER)
    try:
        for step in range(5):
            opt.zero_grad(set_to_none=True)
            loss_of(model, step).backward()
            opt.step()
        opt.wait_parameters()
    finally:
        opt.close()
    counts = [len(sizes) for sizes in buckets.sizes]
    assert len(counts) == 5
    # Steps 0-1 (the warm-up) and 2 (the first delayed one, whose step() removes the hooks)
    # stage during backward; then step() stages all.
    assert all(n > 1 for n in counts[:3]), counts
    assert counts[3:] == [1, 1], counts


@pytest.mark.skipif(DEVICE.type != "cuda", reason="on the CPU a bucket is copied as it is staged")
def test_a_delayed_steps_copy_to_the_host_waits_for_the_next_forward(server_target):
    """Once delayed, step() gathers the gradients on the device and leaves their copy to the
    host for the next forward's first module: a copy engine runs copies in the order they
    were queued, so the loop's loss.item() right after step() would wait behind it. The
    values are still those of torch's one-step-stale reference."""
    warmup, steps = 2, 8
    model, ref_model, stale = Deep(9), Deep(9), Deep(9)
    ref = torch.optim.AdamW(ref_model.parameters(), foreach=False, **HYPER)
    opt = RemoteAdamW(model.named_parameters(), targets=server_target, prefix="delay-copy/",
                      overlap=True, bucket_bytes=CAP, delay=1, delay_warmup=warmup, **HYPER)
    engine = opt._overlap
    deferred = []
    try:
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(model, step)
            assert not engine._deferred, f"step {step}: the forward left a copy unqueued"
            loss.backward()
            opt.step()
            deferred.append(len(engine._deferred))
            loss.item()
            stale.zero_grad(set_to_none=True)
            loss_of(stale, step).backward()
            stale_reference_step(ref, ref_model, stale, step >= warmup)
        opt.wait_parameters()
        assert not engine._deferred
        # The warm-up's buckets are copied as they are staged; from the step after the first
        # delayed one (which removes the gradient hooks), the one bucket's copy waits.
        assert deferred[:warmup] == [0] * warmup, deferred
        assert deferred[warmup + 1:] == [1] * (steps - warmup - 1), deferred
        for (name, p), s in zip(model.named_parameters(), stale.parameters()):
            torch.testing.assert_close(p.detach(), s.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{name}: {m}")
        assert opt.overlap_fallbacks == 0
    finally:
        opt.close()


@pytest.mark.skipif(_native.library() is None, reason="no native library")
@pytest.mark.parametrize("data_plane", ["workspace", "grpc"])
def test_pull_groups_through_a_workspace_go_one_at_a_time(server_target, monkeypatch,
                                                          data_plane):
    """Through a workspace the server reads the groups one after another, so groups requested
    together land together, the small first one behind the rest: one in flight, in order.
    Over gRPC several go at once (each group's bytes on its own stream's socket)."""
    threads = []

    class Recording(_native.PipelinedPull):
        def __init__(self, *args, **kwargs):
            threads.append(kwargs["threads"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(_native, "PipelinedPull", Recording)
    train(server_target, f"pull-order-{data_plane}/", EDGE, steps=3, data_plane=data_plane,
          client_options={"streams": 4})
    assert threads and set(threads) == ({1} if data_plane == "workspace" else {4}), threads
