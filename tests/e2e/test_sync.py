"""End-to-end tests of sync mode (issue 12): sync rounds against PyTorch, RemoteAdamW trainers
in sync mode, refusals and skips, and shards of another plan. K of N with a trainer killed
mid-run and bounded staleness are in test_quorum_and_staleness.py.

Servers are child processes on the CPU backend (server_fixture.running_server), each with its
/metrics on a free port. The oracle of the sync tests is one torch.optim.AdamW (foreach=False)
stepping on the mean of the trainers' gradients, computed here from the same data; tolerances
are test_parity.py's.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Sequence

import grpc
import pytest
import torch

import fusedps
from fusedps.torch import RemoteAdamW
from server_fixture import running_server
from sync_helpers import (ATOL, GROUP, LR, RTOL, SLICE_ELEMENTS, WEIGHT_DECAY, make_mlp,
                          running_shards, scrape, trainer_loss)

# Seconds; the partial round of the parity test waits this long. Long enough that a full round
# (its pushes start together) never times out on a loaded machine.
ROUND_TIMEOUT = 2.0


# -- the oracle and the trainers ---------------------------------------------------------------

def oracle_step(model: torch.nn.Module, opt, step: int, ranks: Sequence[int]) -> None:
    """One AdamW step on the mean of the gradients of trainers `ranks` at `step`."""
    grads = []
    for rank in ranks:
        model.zero_grad(set_to_none=True)
        trainer_loss(model, step, rank).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for i, p in enumerate(model.parameters()):
        p.grad = torch.stack([g[i] for g in grads]).mean(0)
    opt.step()


def assert_params_close(model: torch.nn.Module, oracle: torch.nn.Module, msg: str) -> None:
    for (name, p), q in zip(model.named_parameters(), oracle.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{msg} {name}: {m}")


class Trainer:
    """One trainer of the parity test: its model, its ShardedClient, the versions it pulled."""

    def __init__(self, targets: Sequence[str], plan, rank: int):
        self.rank = rank
        self.model = make_mlp()
        self.ps = fusedps.ShardedClient(targets, plan, client_id=f"trainer-{rank}")
        self.pull()

    def push(self, step: int, barrier: threading.Barrier) -> fusedps.ShardedPushResult:
        """Computes the gradient at the pulled params, then pushes it once every trainer of
        the round is ready (so that only a round meant to time out does)."""
        self.model.zero_grad(set_to_none=True)
        trainer_loss(self.model, step, self.rank).backward()
        barrier.wait(timeout=30)
        return self.ps.push_gradients(self.model, grad_dtype="float32",
                                      sequence_number=step + 1, base_versions=self.versions)

    def pull(self) -> None:
        self.versions = self.ps.pull_parameters(self.model).versions


# -- a: sync rounds are one AdamW step on the mean gradient ------------------------------------

@pytest.mark.parametrize("trainers,shards", [(2, 2), (2, 3), (4, 2), (4, 3)])
def test_sync_rounds_match_torch_adamw_on_the_mean_gradient(trainers, shards):
    """N trainer threads, each with its own ShardedClient and data, push every step with the
    versions they pulled; each round must be torch's AdamW step on the mean of their gradients,
    with an lr change at lr_step and, at partial_step, a round of N - 1 that closes by timeout.
    Every trainer's params are compared with the oracle's after every step."""
    steps, lr_step, new_lr, partial_step = 20, 8, 0.003, 13
    args = ["--mode=sync", f"--total-replicas={trainers}",
            f"--round-timeout-seconds={ROUND_TIMEOUT}"]
    with running_shards(shards, args) as servers, contextlib.ExitStack() as stack:
        targets = [s.target for s in servers]
        admin = stack.enter_context(fusedps.ShardedClient(targets))
        admin.wait_ready()
        assert {(i.consistency.mode, i.consistency.total_replicas,
                 i.consistency.replicas_to_aggregate) for i in admin.info()} == {
            ("sync", trainers, trainers)}
        admin.register_param_group(GROUP, lr=LR, weight_decay=WEIGHT_DECAY)
        oracle = make_mlp()
        admin.register_model(oracle, param_group=GROUP, slice_elements=SLICE_ELEMENTS)
        assert len(admin.plan.tensor_slices("0.weight")) == 3
        assert all(admin.plan.shard_slices(i) for i in range(shards))
        opt = torch.optim.AdamW(oracle.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                foreach=False)
        team = [Trainer(targets, admin.plan, rank) for rank in range(trainers)]
        for t in team:
            stack.callback(t.ps.close)
        pool = stack.enter_context(ThreadPoolExecutor(trainers))
        version = team[0].versions[0]
        assert all(t.versions == [version] * shards for t in team)

        for step in range(steps):
            if step == lr_step:
                admin.set_hyperparameters(GROUP, lr=new_lr)
                opt.param_groups[0]["lr"] = new_lr
            # At partial_step the last trainer skips: the round closes by timeout without it.
            ranks = list(range(trainers - 1 if step == partial_step else trainers))
            barrier = threading.Barrier(len(ranks))
            started = time.monotonic()
            results = list(pool.map(lambda r: team[r].push(step, barrier), ranks))
            if step == partial_step:
                assert time.monotonic() - started >= ROUND_TIMEOUT, "answered before timeout"
            version += 1
            for rank, result in zip(ranks, results):
                where = f"step {step} trainer {rank}"
                assert result.versions == [version] * shards, where
                assert [r.round_workers for r in result.results] == [len(ranks)] * shards, where
                assert not result.step_skipped, where
            oracle_step(oracle, opt, step, ranks)
            for t in team:
                t.pull()
                assert t.versions == [version] * shards
                assert_params_close(t.model, oracle, f"step {step} trainer {t.rank}")

        for server in servers:
            m = scrape(server)
            assert m.value("fusedps_rounds_total", model="default", closed_by="timeout") == 1
            assert m.value("fusedps_rounds_total", model="default",
                           closed_by="quorum") == steps - 1
            assert m.value("fusedps_round_workers_count", model="default") == steps
            assert m.value("fusedps_round_workers_sum", model="default") == trainers * steps - 1
            assert m.value("fusedps_push_staleness_count", model="default") == trainers * steps - 1
            assert m.value("fusedps_push_staleness_sum", model="default") == 0


def sync_trainers(models, target: str, prefix: str, overlap: bool):
    """One RemoteAdamW per model: trainer RANK, client_id trainer-RANK, joining the sync job
    (on_existing="resume")."""
    return [RemoteAdamW(m.named_parameters(), targets=target, prefix=prefix, lr=LR,
                        weight_decay=WEIGHT_DECAY, overlap=overlap, on_existing="resume",
                        client_options={"client_id": f"trainer-{rank}"})
            for rank, m in enumerate(models)]


def sync_step(opt, model, loss, step: int, rank: int, overlap: bool) -> None:
    """One trainer's step; returns once the round of all N pushes is applied."""
    opt.zero_grad(set_to_none=True)
    loss(model, step, rank).backward()
    opt.step()
    if overlap:
        opt.wait_parameters()


@pytest.mark.parametrize("overlap", [False, True])
def test_remote_adamw_trains_in_sync_mode_as_docs_python_md_shows(overlap):
    """docs/python.md's sync recipe: N trainers, each a RemoteAdamW with its own client_id,
    against a --mode=sync server; after every round each trainer's params are torch's AdamW on
    the mean of the N gradients (issue 35, item 6: the docs never said how). With overlap, each
    trainer pushes and pulls through a same-host workspace of its own."""
    trainers, steps = 2, 8
    with running_server(["--mode=sync", f"--total-replicas={trainers}",
                         "--round-timeout-seconds=30"]) as target, \
            ThreadPoolExecutor(trainers) as pool:
        models = [make_mlp() for _ in range(trainers)]
        opts = sync_trainers(models, target, "sync-mlp/", overlap)
        assert {o.data_plane_in_use for o in opts} == {"workspace" if overlap else "grpc"}
        oracle = make_mlp()
        opt = torch.optim.AdamW(oracle.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                foreach=False)

        def train_step(rank: int, step: int) -> None:
            sync_step(opts[rank], models[rank], trainer_loss, step, rank, overlap)

        try:
            for step in range(steps):
                list(pool.map(lambda r: train_step(r, step), range(trainers)))
                oracle_step(oracle, opt, step, range(trainers))
                for rank, m in enumerate(models):
                    assert_params_close(m, oracle, f"step {step} trainer {rank}")
        finally:
            for o in opts:
                o.close()


class Branchy(torch.nn.Module):
    """A model whose trainers differ in the parameters they use: ``branch`` only on rank 0,
    ``unused`` never, ``frozen`` has requires_grad=False."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.body = torch.nn.Linear(6, 5)
        self.branch = torch.nn.Linear(5, 5)
        self.unused = torch.nn.Linear(5, 5)
        self.head = torch.nn.Linear(5, 2)
        self.frozen = torch.nn.Parameter(torch.linspace(0.5, 1.5, 5), requires_grad=False)

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.body(x)) * self.frozen
        if rank == 0:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


def branchy_loss(model: Branchy, step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7000 + 10 * step + rank)
    return model(torch.randn(8, 6, generator=gen), rank).square().mean()


@pytest.mark.parametrize("overlap", [False, True])
def test_sync_mode_with_unused_and_frozen_parameters_averages_as_ddp(overlap):
    """Issue 35, item 6: a model with a frozen parameter, an unused one and a branch only some
    trainers take trains in sync mode. Each round is torch.optim.AdamW on DDP's mean: a
    parameter a trainer did not use counts as a zero gradient from it, one no trainer used has
    grad None and is not stepped. Before, every sync push of such a model failed
    (INVALID_ARGUMENT: a sync push had to name every tensor of the shard)."""
    trainers, steps = 2, 5
    with running_server(["--mode=sync", f"--total-replicas={trainers}",
                         "--round-timeout-seconds=30"]) as target, \
            ThreadPoolExecutor(trainers) as pool:
        models = [Branchy() for _ in range(trainers)]
        opts = sync_trainers(models, target, "branchy/", overlap)
        oracle = Branchy()
        opt = torch.optim.AdamW(oracle.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                foreach=False)

        def train_step(rank: int, step: int) -> None:
            sync_step(opts[rank], models[rank], branchy_loss, step, rank, overlap)

        try:
            for step in range(steps):
                list(pool.map(lambda r: train_step(r, step), range(trainers)))
                sums: Dict[str, torch.Tensor] = {}
                for rank in range(trainers):
                    oracle.zero_grad(set_to_none=True)
                    branchy_loss(oracle, step, rank).backward()
                    for name, p in oracle.named_parameters():
                        if p.grad is not None:
                            sums[name] = sums.get(name, 0) + p.grad
                for name, p in oracle.named_parameters():
                    p.grad = sums[name] / trainers if name in sums else None
                opt.step()
                for rank, m in enumerate(models):
                    for (name, p), (_, q) in zip(m.named_parameters(),
                                                 oracle.named_parameters()):
                        torch.testing.assert_close(p.detach(), q.detach(), rtol=RTOL,
                                                   atol=ATOL,
                                                   msg=f"step {step} trainer {rank} {name}")
            initial = Branchy()
            for m in models:
                assert torch.equal(m.unused.weight, initial.unused.weight)
                assert torch.equal(m.frozen, initial.frozen)
                assert not torch.equal(m.branch.weight, initial.branch.weight)
        finally:
            for o in opts:
                o.close()


def test_a_dead_trainer_is_named_in_a_warning_when_its_rounds_time_out(caplog):
    """Issue 35, item 6: a trainer that dies slows every round to the round timeout; the live
    trainers are told, by name. Before, nothing on the trainers' side said so."""
    trainers = 2
    with running_server(["--mode=sync", f"--total-replicas={trainers}",
                         "--round-timeout-seconds=1"]) as target, \
            ThreadPoolExecutor(trainers) as pool:
        models = [make_mlp() for _ in range(trainers)]
        opts = sync_trainers(models, target, "dead/", overlap=False)
        try:
            list(pool.map(lambda r: sync_step(opts[r], models[r], trainer_loss, 0, r, False),
                          range(trainers)))
            assert not opts[0].last_push_result.round_timed_out
            opts[1].close()  # trainer-1 dies.
            with caplog.at_level(logging.WARNING, logger="fusedps.torch"):
                sync_step(opts[0], models[0], trainer_loss, 1, 0, False)
            result = opts[0].last_push_result
            assert result.round_timed_out and result.round_workers == 1
            assert result.missing_replicas == ("trainer-1",)
            warnings = [r.getMessage() for r in caplog.records
                        if r.levelno == logging.WARNING and r.name == "fusedps.torch"]
            assert len(warnings) == 1, warnings
            assert "closed by its timeout" in warnings[0] and "trainer-1" in warnings[0]
        finally:
            opts[0].close()


def test_sync_round_refusals_skips_and_grad_scale():
    """One shard, N = 2: what a round refuses, that its pushers wait for its step, that each
    push is divided by its own grad_scale, and that a non-finite gradient skips the round."""
    gen = torch.Generator().manual_seed(7)
    init = {"w": torch.randn(10, generator=gen), "v": torch.randn(2, 3, generator=gen)}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = torch.optim.AdamW(params.values(), lr=LR, weight_decay=WEIGHT_DECAY, foreach=False)
    args = ["--mode=sync", "--total-replicas=2", "--round-timeout-seconds=0"]
    with running_shards(1, args) as (server,), contextlib.ExitStack() as stack:
        a, a_again, b = (stack.enter_context(fusedps.Client(server.target, client_id=cid))
                         for cid in ("a", "a", "b"))
        pool = stack.enter_context(ThreadPoolExecutor(2))
        a.register_param_group(GROUP, lr=LR, weight_decay=WEIGHT_DECAY)
        a.register_model(init, param_group=GROUP)

        def grads():
            return {n: torch.randn(t.shape, generator=gen) for n, t in init.items()}

        def refused(client, code, grads_, **kw):
            with pytest.raises(grpc.RpcError) as e:
                client.push_gradients(grads_, "float32", **kw)
            assert e.value.code() == code, e.value.details()
            return e.value.details()

        g = grads()
        refused(a, grpc.StatusCode.INVALID_ARGUMENT, g, client_id="", base_version=0)
        # (A push of some of the tensors joins the round: test_sync_mode_with_unused_...)

        # a joins the round at version 0, with its gradient sent 4x and grad_scale=4.
        ga, gb = grads(), grads()
        pending = pool.submit(a.push_gradients, {n: 4 * t for n, t in ga.items()}, "float32",
                              grad_scale=4.0, sequence_number=1, base_version=0)
        deadline = time.monotonic() + 10
        while scrape(server).value("fusedps_push_staleness_count", model="default") < 1:
            assert time.monotonic() < deadline, "a's push never joined the round"
            time.sleep(0.02)
        refused(a_again, grpc.StatusCode.ABORTED, ga, sequence_number=2, base_version=0)
        # A retry of a's push (its reply lost, say) waits for the same round.
        retried = pool.submit(a_again.push_gradients, {n: 4 * t for n, t in ga.items()},
                              "float32", grad_scale=4.0, sequence_number=1, base_version=0)
        details = refused(b, grpc.StatusCode.ABORTED, gb, sequence_number=1, base_version=5)
        assert "shard version 0" in details, details
        assert not pending.done(), "a was answered before its round's step ran"
        result = b.push_gradients(gb, "float32", sequence_number=2, base_version=0)
        assert (result.version, result.round_workers, result.step_skipped) == (1, 2, False)
        assert pending.result(timeout=10) == result
        again = retried.result(timeout=10)
        assert again.duplicate and (again.version, again.round_workers) == (1, 2), again
        # So does a retry of b's after the round closed: its reply, not a stale refusal.
        again = b.push_gradients(gb, "float32", sequence_number=2, base_version=0)
        assert again.duplicate and (again.version, again.round_workers) == (1, 2), again
        for n, p in params.items():
            p.grad = (ga[n] + gb[n]) / 2
        opt.step()
        details = refused(b, grpc.StatusCode.ABORTED, gb, sequence_number=3, base_version=0)
        assert "shard version 1" in details, details

        # A NaN in a's push skips the whole round: both are answered, version unchanged.
        bad = grads()
        bad["v"][1, 2] = math.nan
        pending = pool.submit(a.push_gradients, bad, "float32", sequence_number=4,
                              base_version=1)
        result = b.push_gradients(grads(), "float32", sequence_number=4, base_version=1)
        assert (result.version, result.round_workers, result.step_skipped) == (1, 2, True)
        assert pending.result(timeout=10).step_skipped

        # The next round, at the same version, is the second step.
        ga, gb = grads(), grads()
        pending = pool.submit(a.push_gradients, ga, "float32", sequence_number=5,
                              base_version=1)
        result = b.push_gradients(gb, "float32", sequence_number=5, base_version=1)
        assert (result.version, result.round_workers, result.step_skipped) == (2, 2, False)
        assert pending.result(timeout=10).version == 2
        for n, p in params.items():
            p.grad = (ga[n] + gb[n]) / 2
        opt.step()
        pulled = a.pull_parameters(list(params))
        assert pulled.version == 2 and pulled.steps == {n: 2 for n in params}
        for n, p in params.items():
            torch.testing.assert_close(pulled[n], p.detach(), rtol=RTOL, atol=ATOL)

        m = scrape(server)
        assert m.value("fusedps_pushes_dropped_total", model="default",
                       reason="client_in_round") == 1
        assert m.value("fusedps_pushes_dropped_total", model="default",
                       reason="stale_version") == 2
        assert m.value("fusedps_rounds_total", model="default", closed_by="quorum") == 3

# -- d: a shard of another plan ----------------------------------------------------------------

def test_a_shard_of_another_plan_is_refused():
    with running_shards(2, []) as servers, contextlib.ExitStack() as stack:
        targets = [s.target for s in servers]
        ps = stack.enter_context(fusedps.ShardedClient(targets))
        model = make_mlp()
        ps.register_model(model, slice_elements=SLICE_ELEMENTS)
        on_shard_0 = {s.server_tensor: torch.zeros(s.shape_on_server)
                      for s in ps.plan.shard_slices(0)}
        shard_0 = stack.enter_context(fusedps.Client(targets[0]))
        other_hash = "0" * 32
        assert ps.plan.hash != other_hash
        for call in (lambda: shard_0.push_gradients(on_shard_0, "float32", plan_hash=other_hash),
                     lambda: shard_0.register_model({"extra": torch.zeros(3)},
                                                    plan_hash=other_hash)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
        # Another plan of the same model (another slice size) is refused as a whole.
        with fusedps.ShardedClient(targets) as other:
            with pytest.raises(grpc.RpcError) as e:
                other.register_model(model, slice_elements=2 * SLICE_ELEMENTS)
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION, e.value.details()
            assert other.plan.hash != ps.plan.hash
        # The shard's own plan still works.
        model(torch.randn(2, 6)).sum().backward()
        assert ps.push_gradients(model, grad_dtype="float32").versions == [1, 1]
        assert shard_0.info().plan_hash == ps.plan.hash
