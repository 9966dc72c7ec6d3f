"""End-to-end LoadState: a torch.optim.AdamW state_dict loaded into a fresh fusedps-server.

torch is the oracle: a small model trains a few steps under torch.optim.AdamW; its params and
state_dict (exp_avg, exp_avg_sq, max_exp_avg_sq with amsgrad, step) are loaded into a fresh
server through Client.load_state; then torch and the server take the same further steps and
must agree within test_parity.py's tolerances (PyTorch's own fused-vs-for-loop ones). Also: a
load reads back exactly, bad loads leave the shard as it was, and ShardedClient.load_state
splits whole tensors over two servers.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import grpc
import pytest
import torch

import fusedps
from server_fixture import running_server
from test_parity import ATOL, RTOL

HYPER = dict(lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _batches(count: int, seed: int) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(count)]


def _grads(model: torch.nn.Module, batch) -> Dict[str, torch.Tensor]:
    """Computes the batch's gradients into the model's .grad; returns them by name."""
    model.zero_grad(set_to_none=True)
    x, y = batch
    torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _trained(amsgrad: bool):
    """A model and its AdamW after 3 steps, and the state_dict as load_state's arguments."""
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), amsgrad=amsgrad, foreach=False, **HYPER)
    for batch in _batches(3, 2):
        _grads(model, batch)
        opt.step()
    names = [n for n, _ in model.named_parameters()]
    params = dict(model.named_parameters())
    sd = opt.state_dict()
    states, steps = {}, {}
    for index, name in zip(sd["param_groups"][0]["params"], names):
        s = sd["state"][index]
        states[name] = {"param": params[name].detach().clone(), "exp_avg": s["exp_avg"],
                        "exp_avg_sq": s["exp_avg_sq"]}
        if amsgrad:
            states[name]["max_exp_avg_sq"] = s["max_exp_avg_sq"]
        steps[name] = s["step"]  # A 0-dim tensor, as torch keeps it.
    return model, opt, states, steps


def _assert_matches(client, model, opt, amsgrad, msg):
    names = [n for n, _ in model.named_parameters()]
    pulled = client.pull_parameters(names)
    for n, p in model.named_parameters():
        torch.testing.assert_close(pulled[n], p.detach(), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"{msg} param {n}: {m}")
        assert pulled.steps[n] == int(opt.state[p]["step"].item()), (msg, n)
    for field in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []):
        state, _, _ = client.pull_state(field, names)
        for n, p in model.named_parameters():
            torch.testing.assert_close(state[n], opt.state[p][field], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"{msg} {field} {n}: {m}")


@pytest.mark.parametrize("amsgrad", [False, True], ids=["adamw", "amsgrad"])
def test_a_torch_state_dict_loads_and_training_goes_on_as_in_torch(amsgrad):
    model, opt, states, steps = _trained(amsgrad)
    with running_server() as target, fusedps.Client(target) as client:
        client.wait_ready(timeout=10)
        client.register_param_group("g", amsgrad=amsgrad, **HYPER)
        client.register_model(_model(99), param_group="g")  # Other values: the load sets them.
        version = client.load_state(states, steps)
        assert version == 1

        # Read back exactly: every field loaded, and the steps.
        pulled = client.pull_parameters(list(states))
        assert pulled.version == 1
        for name, fields in states.items():
            assert torch.equal(pulled[name], fields["param"]), name
            assert pulled.steps[name] == 3
        for field in ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if amsgrad else []):
            values, _, _ = client.pull_state(field, list(states))
            for name, fields in states.items():
                assert torch.equal(values[name], fields[field]), (field, name)

        # Three more steps, the same in torch and on the server.
        for i, batch in enumerate(_batches(3, 3)):
            grads = _grads(model, batch)
            opt.step()
            result = client.push_gradients(grads, grad_dtype="float32")
            assert result.version == version + 1 + i and not result.step_skipped
            _assert_matches(client, model, opt, amsgrad, f"step {4 + i}")


def _shard_state(client, names):
    pulled = client.pull_parameters(names)
    fields = {f: client.pull_state(f, names)[0] for f in ("exp_avg", "exp_avg_sq")}
    return pulled.version, dict(pulled.steps), dict(pulled), fields


def _assert_unchanged(before, after):
    assert after[0] == before[0], "version changed"
    assert after[1] == before[1], "steps changed"
    for name, value in before[2].items():
        assert torch.equal(after[2][name], value), f"param {name} changed"
    for field, values in before[3].items():
        for name, value in values.items():
            assert torch.equal(after[3][field][name], value), f"{field} {name} changed"


BAD_LOADS = {
    "unknown_tensor": (lambda w, b: ({"e.nope": {"param": torch.zeros(3)}}, {"e.nope": 1}),
                       grpc.StatusCode.NOT_FOUND, "'e.nope'"),
    "wrong_size": (lambda w, b: ({"e.w": {"param": w}, "e.b": {"exp_avg": torch.zeros(4)}},
                                {"e.w": 5, "e.b": 5}),
                   grpc.StatusCode.INVALID_ARGUMENT, "'e.b'"),
    "max_exp_avg_sq_without_amsgrad": (
        lambda w, b: ({"e.w": {"param": w, "max_exp_avg_sq": w.abs()}}, {"e.w": 5}),
        grpc.StatusCode.FAILED_PRECONDITION, "amsgrad"),
}


@pytest.mark.parametrize("case", list(BAD_LOADS))
def test_a_bad_load_is_refused_and_changes_nothing(client, case):
    make, code, text = BAD_LOADS[case]
    group = f"plain-{case}"
    client.register_param_group(group)
    names = ["e.w", "e.b"]
    if client.info().tensor_count == 0:
        client.register_model({"e.w": torch.randn(4, 3), "e.b": torch.randn(3)},
                              param_group=group)
        client.push_gradients({"e.w": torch.randn(4, 3), "e.b": torch.randn(3)})
    before = _shard_state(client, names)
    with pytest.raises(grpc.RpcError) as raised:
        client.load_state(*make(torch.full((4, 3), 7.0), torch.full((3,), 7.0)))
    assert raised.value.code() == code, raised.value
    assert text in raised.value.details()
    _assert_unchanged(before, _shard_state(client, names))


def test_mistakes_the_client_sees_are_raised_before_calling(client):
    w = torch.zeros(2)
    with pytest.raises(ValueError, match="same tensors"):
        client.load_state({"a": {"param": w}}, {"b": 1})
    with pytest.raises(ValueError, match="field"):
        client.load_state({"a": {"momentum": w}}, {"a": 1})
    with pytest.raises(ValueError, match="step"):
        client.load_state({"a": {"param": w}}, {"a": -1})
    with pytest.raises(TypeError):
        client.load_state({"a": {"param": torch.zeros(2, dtype=torch.int32)}}, {"a": 1})
    with pytest.raises(ValueError, match="no tensors"):
        client.load_state({}, {})


def test_a_sharded_load_splits_whole_tensors_over_two_servers():
    model, opt, states, steps = _trained(amsgrad=False)
    with running_server() as t0, running_server() as t1, \
            fusedps.ShardedClient([t0, t1]) as sharded:
        sharded.wait_ready(timeout=10)
        sharded.register_param_group("g", **HYPER)
        # Slices of at most 8 elements: the 5x6 weight is cut over both shards.
        sharded.register_model(_model(99), param_group="g", slice_elements=8)
        assert len({s.shard for s in sharded.plan.slices if s.tensor == "0.weight"}) == 2
        versions = sharded.load_state(states, steps)
        assert versions == [1, 1]
        pulled = sharded.pull_parameters()
        for name, fields in states.items():
            assert torch.equal(pulled[name], fields["param"]), name

        for batch in _batches(2, 3):
            grads = _grads(model, batch)
            opt.step()
            result = sharded.push_gradients(grads, grad_dtype="float32")
            assert not result.step_skipped
        pulled = sharded.pull_parameters()
        for n, p in model.named_parameters():
            torch.testing.assert_close(pulled[n], p.detach(), rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"param {n}: {m}")
