"""End-to-end tests of the consistency modes (issue 12): K of N with a trainer killed mid-run,
and bounded staleness and its metrics. Sync rounds against PyTorch are in test_sync.py.

Servers are child processes on the CPU backend (server_fixture.running_server), each with its
/metrics on a free port.

Run as a script, this file is one trainer process of test_k_of_n_survives_a_killed_trainer:

    test_quorum_and_staleness.py TARGET[,TARGET...] CLIENT_ID SEED
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from typing import Dict, List, Sequence

import grpc
import pytest
import torch

import fusedps
from prometheus_text import Samples
from sync_helpers import (ATOL, GROUP, LR, RTOL, SLICE_ELEMENTS, WEIGHT_DECAY, make_mlp,
                          running_shards, scrape, trainer_loss)

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128, math.inf)


def staleness_buckets(samples: Samples) -> Dict[float, float]:
    """le -> cumulative count of fusedps_push_staleness."""
    return {float(dict(labels)["le"]): v for (name, labels), v in samples.items()
            if name == "fusedps_push_staleness_bucket"}


# -- b: K of N with a backup, one trainer killed ------------------------------------------------

def trainer_main(argv: Sequence[str]) -> int:
    """A trainer process of the K-of-N test: pull, gradient, push with the pulled versions;
    ABORTED (its round closed without it): pull and go on. Runs until killed (at most 120 s)."""
    targets, client_id, seed = argv[0].split(","), argv[1], int(argv[2])
    model = make_mlp()
    deadline = time.monotonic() + 120
    with fusedps.ShardedClient(targets, client_id=client_id) as ps:
        ps.wait_ready(timeout=30)
        ps.register_model(model, param_group=GROUP, slice_elements=SLICE_ELEMENTS)
        step = 0
        while time.monotonic() < deadline:
            step += 1
            versions = ps.pull_parameters(model).versions
            model.zero_grad(set_to_none=True)
            trainer_loss(model, step, seed).backward()
            try:
                ps.push_gradients(model, grad_dtype="float32", sequence_number=step,
                                  base_versions=versions)
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.ABORTED:
                    raise
            if step == 1:
                print("pushed", flush=True)  # The test waits for this from every trainer.
    return 1  # Not killed in time.


def test_k_of_n_survives_a_killed_trainer(tmp_path):
    """K = 3 of N = 4 trainer processes over 2 shards: one is SIGKILLed once rounds run, and
    the other three keep closing rounds by quorum."""
    args = ["--mode=sync", "--total-replicas=4", "--replicas-to-aggregate=3",
            "--round-timeout-seconds=2"]
    with running_shards(2, args) as servers, fusedps.ShardedClient(
            [s.target for s in servers]) as admin:
        admin.register_param_group(GROUP, lr=LR, weight_decay=WEIGHT_DECAY)
        admin.register_model(make_mlp(), param_group=GROUP, slice_elements=SLICE_ELEMENTS)
        procs: List[subprocess.Popen] = []
        logs = [tmp_path / f"trainer-{rank}.log" for rank in range(4)]

        def wait_until(what: str, predicate, timeout: float = 60):
            deadline = time.monotonic() + timeout
            while not predicate():
                for log, p in zip(logs, procs):
                    if p.poll() is not None and p.returncode != -9:
                        pytest.fail(f"{log.name}: exit {p.returncode}\n{log.read_text()[-3000:]}")
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.05)

        def backups_dropped() -> bool:
            return all(scrape(s).value("fusedps_pushes_dropped_total", model="default",
                                       reason="stale_version")
                       for s in servers)

        try:
            for rank, path in enumerate(logs):
                with open(path, "wb") as log:
                    procs.append(subprocess.Popen(
                        [sys.executable, os.path.abspath(__file__),
                         ",".join(s.target for s in servers), f"trainer-{rank}", str(rank)],
                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))
            # Every trainer pushed (process start-up, torch's import, is most of the wait), the
            # backups' late pushes were dropped, and a few rounds ran.
            wait_until("every trainer's first push",
                       lambda: all("pushed" in log.read_text() for log in logs))
            wait_until("a dropped backup push on every shard", backups_dropped)
            wait_until("5 rounds", lambda: min(admin.versions()) >= 5)
            procs[3].kill()
            assert procs[3].wait(timeout=10) == -9
            at_kill = [scrape(s) for s in servers]
            target = max(30, max(admin.versions()) + 10)
            wait_until(f"version {target}", lambda: min(admin.versions()) >= target)
            assert all(p.poll() is None for p in procs[:3]), "a trainer exited"
        finally:
            for p in procs:
                p.kill()
                p.wait()

        for server, before in zip(servers, at_kill):
            after = scrape(server)
            quorum = [m.value("fusedps_rounds_total", model="default", closed_by="quorum")
                      for m in (before, after)]
            assert quorum[1] >= quorum[0] + 5, quorum
            assert after.value("fusedps_pushes_dropped_total", model="default",
                               reason="stale_version") > 0
            # Every round took at least K = 3 pushes, but for timed-out ones.
            timeouts = after.value("fusedps_rounds_total", model="default", closed_by="timeout")
            rounds = after.value("fusedps_round_workers_count", model="default")
            assert rounds == quorum[1] + timeouts
            assert after.value("fusedps_round_workers_sum", model="default") >= 3 * quorum[1]


# -- c: bounded staleness ----------------------------------------------------------------------

def test_bounded_staleness_is_enforced_and_measured():
    """--max-staleness=2: pushes with tau = 0, 1, 2 are steps, tau = 3 and 5 are ABORTED, and
    fusedps_push_staleness holds exactly those taus."""
    with running_shards(1, ["--mode=bounded", "--max-staleness=2"]) as (server,), \
            fusedps.Client(server.target, client_id="bounded") as ps:
        ps.register_model({"w": torch.zeros(16)})
        # (base_version, tau): the shard's version before each push is base_version + tau.
        schedule = [(0, 0), (0, 1), (0, 2), (0, 3), (3, 0), (4, 0), (0, 5)]
        version = 0
        for seq, (base, tau) in enumerate(schedule, start=1):
            assert version == base + tau
            push = dict(grad_dtype="float32", sequence_number=seq, base_version=base)
            if tau <= 2:
                result = ps.push_gradients({"w": torch.ones(16)}, **push)
                version += 1
                assert (result.version, result.step_skipped) == (version, False)
                continue
            with pytest.raises(grpc.RpcError) as e:
                ps.push_gradients({"w": torch.ones(16)}, **push)
            assert e.value.code() == grpc.StatusCode.ABORTED, e.value.details()
            assert f"shard version {version}" in e.value.details(), e.value.details()
        assert ps.info().version == version == 5

        m = scrape(server)
        taus = [tau for _, tau in schedule]
        expected = {le: sum(t <= le for t in taus) for le in STALENESS_BUCKETS}
        assert staleness_buckets(m) == expected
        assert m.value("fusedps_push_staleness_count", model="default") == len(taus)
        assert m.value("fusedps_push_staleness_sum", model="default") == sum(taus)
        assert m.value("fusedps_pushes_dropped_total", model="default",
                       reason="staleness_exceeded") == 2
        assert m.value("fusedps_pushes_dropped_total", model="default",
                       reason="stale_version") == 0


def test_bounded_staleness_lr_scaling_matches_torch():
    """--staleness-lr-scaling: a push with staleness tau is torch's AdamW step with
    lr / (1 + tau)."""
    gen = torch.Generator().manual_seed(3)
    init = {"w": torch.randn(33, generator=gen), "m": torch.randn(4, 5, generator=gen)}
    params = {n: torch.nn.Parameter(t.clone()) for n, t in init.items()}
    opt = torch.optim.AdamW(params.values(), lr=0.05, weight_decay=WEIGHT_DECAY, foreach=False)
    args = ["--mode=bounded", "--max-staleness=2", "--staleness-lr-scaling"]
    with running_shards(1, args) as (server,), fusedps.Client(server.target) as ps:
        ps.register_param_group("scaled", lr=0.05, weight_decay=WEIGHT_DECAY)
        ps.register_model(init, param_group="scaled")
        for version, (base, tau) in enumerate([(0, 0), (0, 1), (1, 1), (1, 2)]):
            grads = {n: torch.randn(t.shape, generator=gen) for n, t in init.items()}
            result = ps.push_gradients(grads, "float32", base_version=base)
            assert (result.version, result.step_skipped) == (version + 1, False)
            opt.param_groups[0]["lr"] = 0.05 / (1 + tau)
            for n, p in params.items():
                p.grad = grads[n]
            opt.step()
            pulled = ps.pull_parameters(list(params))
            for n, p in params.items():
                torch.testing.assert_close(pulled[n], p.detach(), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"push {version} (tau {tau}) {n}: {m}")
        for field in ("exp_avg", "exp_avg_sq"):
            state, _, _ = ps.pull_state(field, list(params))
            for n, p in params.items():
                torch.testing.assert_close(state[n], opt.state[p][field], rtol=RTOL, atol=ATOL)


if __name__ == "__main__":
    sys.exit(trainer_main(sys.argv[1:]))
