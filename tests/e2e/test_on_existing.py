"""Running a training script twice against one server (issue 35, item 2).

The second run's RemoteAdamW finds the first run's tensors on the server. With the default
on_existing="error" it raises fusedps.errors.AlreadyExists before writing anything, naming the
server, its version, how many of the model's tensors it holds and what each choice does; with
on_existing="resume" it continues from the server's values (pulled into the model) and logs
the version it resumed from; with on_existing="replace" it deletes the server's model and starts
over. On one server and on a sharded pair, whole tensors or cut ones. Runs under models of their
own (model=) never meet.
"""

from __future__ import annotations

import contextlib
import logging

import pytest
import torch

import fusedps
from fusedps import errors
from fusedps.plan import make_plan
from fusedps.torch import RemoteAdamW
from server_fixture import running_server

STEPS = 3


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 12), torch.nn.Tanh(), torch.nn.Linear(12, 3))


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(32, 16, generator=gen), torch.randint(0, 3, (32,), generator=gen)
    return torch.nn.functional.cross_entropy(model(x), y)


def run_script(seed: int, **options):
    """The training script: a model (initialized by ``seed``), a RemoteAdamW with ``options``
    (targets= or client=, prefix=, ...), STEPS steps. Returns (model, losses, state_dict)."""
    model = _model(seed)
    losses = []
    with RemoteAdamW(model.named_parameters(), lr=0.05, **options) as opt:
        for step in range(STEPS):
            opt.zero_grad()
            loss = _loss(model, step)
            loss.backward()
            opt.step()
            losses.append(float(loss))
        return model, losses, opt.state_dict()


def _server_values(client, names):
    return {n: t.clone() for n, t in client.pull_parameters(list(names)).items()}


def test_the_second_run_raises_by_default_and_writes_nothing(server_target):
    first, _, _ = run_script(1, targets=server_target, prefix="twice/")
    with fusedps.Client(server_target) as client:
        names = [f"twice/{n}" for n, _ in first.named_parameters()]
        before, version = _server_values(client, names), client.info().version
        groups_before = client.info().param_groups
        with pytest.raises(errors.AlreadyExists) as info:
            run_script(2, targets=server_target, prefix="twice/", weight_decay=0.5)
        message = str(info.value)
        for part in (server_target, f"version {version}", "4 of this model's 4 tensors",
                     "'twice/0.weight'", "'error'", "'resume'", "'replace'", "delete"):
            assert part in message, (part, message)
        after = _server_values(client, names)
        assert all(torch.equal(before[n], after[n]) for n in names)
        assert client.info().version == version
        assert client.info().param_groups == groups_before  # weight_decay=0.5 not sent


def test_resume_continues_from_the_servers_values_and_logs_the_version(server_target,
                                                                        caplog):
    first, first_losses, first_state = run_script(1, targets=server_target, prefix="resume/")
    with fusedps.Client(server_target) as client:
        version = client.info().version
    model = _model(2)
    with caplog.at_level(logging.INFO, logger="fusedps.torch"):
        opt = RemoteAdamW(model.named_parameters(), lr=0.05, targets=server_target,
                          prefix="resume/", on_existing="resume")
    with opt:
        for p, q in zip(model.parameters(), first.parameters()):
            assert torch.equal(p, q)  # the first run's values, not seed 2's
        # The loss the second run starts at is where the first one ended, not a fresh start.
        assert float(_loss(model, 0)) == float(_loss(first, 0)) < first_losses[0]
        steps = {int(e["step"].item()) for e in opt.state_dict()["state"].values()}
        assert steps == {STEPS}
    logged = " ".join(r.getMessage() for r in caplog.records if r.name == "fusedps.torch")
    assert f"version {version}" in logged and "4 of this model's 4 tensors" in logged, logged


def test_a_grown_model_counts_the_tensors_found(server_target):
    """The first run's four tensors and a new layer's two: 4 of 6 found."""
    run_script(1, targets=server_target, prefix="grown/")
    grown = list(_model(3).named_parameters()) + [
        (f"4.{n}", p) for n, p in torch.nn.Linear(3, 3).named_parameters()]
    with pytest.raises(errors.AlreadyExists, match="4 of this model's 6 tensors"):
        RemoteAdamW(grown, targets=server_target, prefix="grown/")


def _cut_client(targets, stack, prefix):
    """A ShardedClient whose plan cuts the model's tensors into slices of 50 elements."""
    plan = make_plan([(prefix + n, tuple(p.shape), f"{prefix}group0")
                      for n, p in _model(0).named_parameters()], len(targets), slice_elements=50)
    client = fusedps.ShardedClient(targets, plan=plan)
    stack.callback(client.close)
    return client


@pytest.mark.parametrize("cut", [False, True], ids=["whole", "cut"])
def test_a_sharded_second_run_raises_naming_every_server_or_resumes(cut):
    with contextlib.ExitStack() as stack:
        targets = [stack.enter_context(running_server()) for _ in range(2)]

        def options(**more):
            where = (dict(client=_cut_client(targets, stack, "sharded/")) if cut
                     else dict(targets=targets))
            return dict(where, prefix="sharded/", **more)

        first, _, first_state = run_script(1, **options())
        with pytest.raises(errors.AlreadyExists) as info:
            run_script(2, **options())
        message = str(info.value)
        assert "the servers at" in message and "4 of this model's 4 tensors" in message
        assert all(t in message for t in targets), message
        model = _model(2)
        with RemoteAdamW(model.named_parameters(), lr=0.05, on_existing="resume",
                         **options()) as opt:
            for p, q in zip(model.parameters(), first.parameters()):
                assert torch.equal(p, q)
            assert set(opt.state_dict()["state"]) == set(first_state["state"])


def test_a_fresh_server_is_no_concern_of_on_existing(server_target):
    for choice in ("error", "resume"):
        run_script(1, targets=server_target, prefix=f"fresh-{choice}/", on_existing=choice)


@pytest.mark.parametrize("value", ["Replace", "Error", None, True])
def test_an_unknown_on_existing_is_a_value_error_naming_the_choices(value):
    with pytest.raises(ValueError,
                       match="on_existing must be one of 'error', 'resume', 'replace'"):
        RemoteAdamW(_model(0).named_parameters(), targets="127.0.0.1:1", connect_timeout=None,
                    on_existing=value)


def _torch_run(seed: int):
    """The script with torch.optim.AdamW: what a fresh run through fusedps must match."""
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, step).backward()
        opt.step()
    return model


def test_replace_deletes_the_servers_model_and_starts_over(server_target, caplog):
    run_script(1, targets=server_target, model="job-replace")
    with caplog.at_level(logging.INFO, logger="fusedps.torch"):
        model, _, state = run_script(2, targets=server_target, model="job-replace",
                                     on_existing="replace")
    assert "deleted and starts over" in caplog.text
    reference = _torch_run(2)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    assert all(s["step"] == STEPS for s in state["state"].values())
    with fusedps.Client(server_target, model="job-replace") as client:
        assert client.info().version == STEPS  # The first run's steps are gone.


def test_runs_under_models_of_their_own_never_meet(server_target):
    """The same script twice, each run in a model of its own: no AlreadyExists, and each
    matches a fresh torch run."""
    run_script(1, targets=server_target, model="job-one")
    model, _, _ = run_script(2, targets=server_target, model="job-two")
    reference = _torch_run(2)
    for (name, p), (_, q) in zip(model.named_parameters(), reference.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7, msg=name)
    with fusedps.Client(server_target) as client:
        names = {m.name for m in client.list_models()}
        assert {"default", "job-one", "job-two"} <= names
