"""Two jobs on one fleet (issue 35, models as namespaces), with torch.optim.AdamW as the oracle.

Two models with different sharding plans live on the same two servers, each trained by its own
RemoteAdamW and matching its own torch.optim.AdamW step for step. One is deleted while the other
trains: the survivor is unaffected, and the freed device memory shows in GetInfo and in the
metrics. A restart of both servers from their --checkpoint-dir brings back the survivor only,
exactly as it was.
"""

from __future__ import annotations

import threading

import pytest
import torch

import fusedps
from fusedps import errors
from fusedps.plan import make_plan
from fusedps.torch import RemoteAdamW
from checkpoint_server import ServerProcess

STEPS = 6
LR = 0.02


def _mlp(seed: int, widths) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers = []
    for i in range(len(widths) - 1):
        layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


class Job:
    """A model trained through fusedps under its own server model, beside the same model
    trained by torch.optim.AdamW."""

    def __init__(self, name: str, seed: int, widths, targets, slice_elements: int):
        self.name = name
        self.widths = widths
        self.model = _mlp(seed, widths)
        self.reference = _mlp(seed, widths)
        plan = make_plan(self.model, len(targets), slice_elements, param_group="group0")
        self.client = fusedps.ShardedClient(targets, plan, client_id=f"{name}-0", model=name)
        self.opt = RemoteAdamW(self.model.named_parameters(), lr=LR, client=self.client)
        self.torch_opt = torch.optim.AdamW(self.reference.parameters(), lr=LR)
        self.plan_hash = plan.hash
        self.steps = 0

    def step(self) -> None:
        gen = torch.Generator().manual_seed(1000 * len(self.name) + self.steps)
        x = torch.randn(16, self.widths[0], generator=gen)
        for model, opt in ((self.model, self.opt), (self.reference, self.torch_opt)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        self.steps += 1

    def assert_matches_torch(self) -> None:
        for (name, p), (_, q) in zip(self.model.named_parameters(),
                                     self.reference.named_parameters()):
            torch.testing.assert_close(p, q, rtol=2e-6, atol=2e-7, msg=f"{self.name} {name}")

    def close(self) -> None:
        self.opt.close()
        self.client.close()


def _memory(target: str, model: str = ""):
    with fusedps.Client(target, model=model) as c:
        info = c.info()
    return info.memory_bytes, info.server_memory_bytes, info.model_count


def test_two_jobs_side_by_side_one_deleted_the_survivor_restored(tmp_path):
    roots = [str(tmp_path / f"ckpt{i}") for i in range(2)]
    servers = [ServerProcess([f"--checkpoint-dir={r}"]) for r in roots]
    try:
        targets = [s.target for s in servers]
        # Other architectures and other plans: a's tensors are cut into slices of 64
        # elements, b's are whole.
        a = Job("job-a", 1, [24, 32, 8], targets, slice_elements=64)
        b = Job("job-b", 2, [10, 48, 48, 3], targets, slice_elements=1 << 20)
        assert a.plan_hash != b.plan_hash
        for _ in range(STEPS):
            a.step()
            b.step()
        a.assert_matches_torch()
        b.assert_matches_torch()
        for target in targets:
            with fusedps.Client(target, model="job-a") as ca, \
                    fusedps.Client(target, model="job-b") as cb:
                assert ca.info().version == STEPS and cb.info().version == STEPS
                assert ca.info().plan_hash == a.plan_hash
                assert cb.info().plan_hash == b.plan_hash

        a_bytes = [_memory(t, "job-a")[0] for t in targets]
        before = [_memory(t)[1] for t in targets]
        assert all(n > 0 for n in a_bytes)
        assert all(m.value("fusedps_model_memory_bytes", model="job-a") == n
                   for m, n in zip((s.metrics() for s in servers), a_bytes))

        # b trains on while a is deleted from both servers.
        a.close()
        deleted = []
        failures = []

        def train_b():
            try:
                for _ in range(STEPS):
                    b.step()
            except BaseException as e:  # Raised again below.
                failures.append(e)

        trainer = threading.Thread(target=train_b)
        trainer.start()
        with fusedps.ShardedClient(targets) as admin:
            deleted = admin.delete_model("job-a")
        trainer.join()
        assert not failures, failures
        b.assert_matches_torch()
        assert [d.freed_bytes for d in deleted] == a_bytes
        assert all(d.memory_freed for d in deleted)
        for target, server, was, freed in zip(targets, servers, before, a_bytes):
            _, now, count = _memory(target)
            assert now == was - freed
            assert count == 2  # default, job-b
            samples = server.metrics()
            assert samples.value("fusedps_models") == 2
            assert [labels["model"] for labels, _ in
                    samples.series("fusedps_model_memory_bytes")] in (["default", "job-b"],
                                                                      ["job-b", "default"])
            with fusedps.Client(target, model="job-a") as gone:
                with pytest.raises(errors.NotFound, match="job-a"):
                    gone.info()

        b_values = {n: p.detach().clone() for n, p in b.model.named_parameters()}
        b.close()
        for server in servers:
            assert server.terminate() == 0  # SIGTERM checkpoints every model.
            assert "of model 'job-b'" in server.log()
    finally:
        for server in servers:
            server.close()

    servers = [ServerProcess([f"--checkpoint-dir={r}"]) for r in roots]
    try:
        targets = [s.target for s in servers]
        for target in targets:
            with fusedps.Client(target) as c:
                assert sorted(m.name for m in c.list_models()) == ["default", "job-b"]
        with fusedps.ShardedClient(targets, make_plan(_mlp(2, [10, 48, 48, 3]), 2, 1 << 20,
                                                      param_group="group0"),
                                   model="job-b") as client:
            pulled = client.pull_parameters(list(b_values))
            for name, value in b_values.items():
                assert torch.equal(pulled[name], value), name
            assert client.versions() == [2 * STEPS, 2 * STEPS]
    finally:
        for server in servers:
            server.close()


def test_per_model_metrics_carry_the_model_and_leave_with_it(tmp_path):
    """A model's steps, staleness and checkpoints are its own, so their metrics carry its name:
    one model whose checkpoints stop is not hidden behind another's fresh timestamp (the stale
    alert's rule test, deploy/prometheus/tests, shows the alert side). A deleted model's series
    go."""
    with ServerProcess([f"--checkpoint-dir={tmp_path}"]) as server:
        with fusedps.Client(server.target) as admin:
            admin.create_model("ckpt-a")
            admin.create_model("ckpt-b")
        with fusedps.Client(server.target, model="ckpt-a") as a:
            a.register_model({"w": torch.ones(4)})
            a.push_gradients({"w": torch.ones(4)}, grad_dtype="float32")
            a.push_gradients({"w": torch.ones(4)}, grad_dtype="float32")
            a.checkpoint()
        m = server.metrics()
        assert m.value("fusedps_optimizer_steps_total", model="ckpt-a") == 2
        assert m.value("fusedps_optimizer_steps_total", model="ckpt-b") == 0
        assert m.value("fusedps_push_staleness_count", model="ckpt-a") == 2
        assert m.value("fusedps_push_staleness_count", model="ckpt-b") == 0
        assert m.value("fusedps_checkpoint_last_success_timestamp_seconds", model="ckpt-a") > 0
        assert m.value("fusedps_checkpoint_written_bytes_total", model="ckpt-a") > 0
        assert m.value("fusedps_checkpoint_written_bytes_total", model="ckpt-b") == 0
        assert m.value("fusedps_checkpoint_failures_total", model="ckpt-b", reason="io") == 0
        with fusedps.Client(server.target) as admin:
            admin.delete_model("ckpt-a")
        gone = server.metrics()
        for name in ("fusedps_checkpoint_last_success_timestamp_seconds",
                     "fusedps_checkpoint_written_bytes_total",
                     "fusedps_checkpoint_failures_total", "fusedps_optimizer_steps_total",
                     "fusedps_push_staleness_count", "fusedps_rounds_total"):
            assert not [labels for labels, _ in gone.series(name)
                        if labels.get("model") == "ckpt-a"], name
        assert gone.value("fusedps_checkpoint_failures_total", model="ckpt-b", reason="io") == 0
        assert gone.value("fusedps_rounds_total", model="ckpt-b", closed_by="timeout") == 0
