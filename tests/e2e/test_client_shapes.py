"""fusedps.Client and fusedps.ShardedClient in one shape (fusedps.ParameterServiceClient),
against real servers: server_infos, register_model with a param group per tensor, and
ShardedClient.pull_state, which gathers what Client.pull_state reads from one server."""

from __future__ import annotations

import contextlib

import pytest
import torch

import fusedps
from fusedps import ParameterServiceClient
from fusedps.plan import make_plan
from server_fixture import running_server


def test_server_infos_is_a_list_of_one_for_a_client(client):
    infos = client.server_infos()
    assert isinstance(infos, list) and len(infos) == 1
    assert infos[0] == client.info()


def test_register_model_takes_a_group_per_tensor(client):
    client.register_param_group("shapes-a", lr=0.5)
    client.register_param_group("shapes-b", lr=0.25)
    tensors = {"shapes/w": torch.ones(3), "shapes/v": torch.ones(2), "shapes/u": torch.ones(4)}
    groups = {"shapes/w": "shapes-b", "shapes/u": "shapes-a"}  # v: "default".
    r = client.register_model(tensors, param_group=groups)
    assert (r.tensors_created, r.tensors_existing) == (3, 0)
    listed = {t.name: t.param_group for t in client.list_tensors() if t.name in tensors}
    assert listed == {"shapes/w": "shapes-b", "shapes/v": "default", "shapes/u": "shapes-a"}
    # A prefix comes before the mapping's look-up, as the names it names are the server's.
    r = client.register_model({"x": torch.ones(2)}, param_group={"shapes/x": "shapes-a"},
                              prefix="shapes/")
    assert r.tensors_created == 1
    assert {t.name: t.param_group for t in client.list_tensors()}["shapes/x"] == "shapes-a"


def _pushed(ps, model, steps: int) -> None:
    gen = torch.Generator().manual_seed(5)
    for _ in range(steps):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in model.items()}
        ps.push_gradients(grads, grad_dtype="float32")


def test_sharded_pull_state_gathers_what_one_server_holds():
    """The same pushes on one server and on two shards that cut the tensors: the gathered
    state, steps and params are the one server's, bit for bit."""
    gen = torch.Generator().manual_seed(4)
    model = {"w": torch.randn(10, 12, generator=gen), "b": torch.randn(7, generator=gen),
             "s": torch.randn((), generator=gen)}
    plan = make_plan([(n, tuple(t.shape), "default") for n, t in model.items()], 2,
                     slice_elements=32)
    assert any(s.server_tensor != s.tensor for s in plan.slices)
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(running_server()) for _ in range(3)]
        one = stack.enter_context(fusedps.Client(targets[0]))
        two = stack.enter_context(fusedps.ShardedClient(targets[1:], plan=plan))
        clients = [one, two]
        for ps in clients:
            ps.wait_ready()
            ps.register_model(model)
            _pushed(ps, model, 3)
        # The step of "b" only, after the others: steps differ between tensors.
        for ps in clients:
            ps.push_gradients({"b": torch.full((7,), 0.5)}, grad_dtype="float32")

        def read(ps: ParameterServiceClient, field: str):
            return ps.pull_state(field, ["s", "w", "b"])

        for field in ("exp_avg", "exp_avg_sq", "param"):
            (want, version, want_steps), (got, versions, got_steps) = (read(c, field)
                                                                        for c in clients)
            assert list(got) == ["s", "w", "b"]
            for n in want:
                assert torch.equal(got[n], want[n]), (field, n)
                assert got[n].shape == model[n].shape
            assert got_steps == want_steps == {"s": 3, "w": 3, "b": 4}
            assert version == 4 and versions == two.versions()  # "b" is on one shard.
        every, versions, _ = two.pull_state("exp_avg")  # None: every tensor of the plan.
        assert list(every) == [t.name for t in plan.tensors]
        assert [i.version for i in two.server_infos()] == versions == two.versions()
        with pytest.raises(KeyError, match="nope"):
            two.pull_state("exp_avg", ["nope"])
        with pytest.raises(ValueError, match="field"):
            two.pull_state("momentum", ["w"])
