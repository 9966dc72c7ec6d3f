"""End-to-end tests of the Python client's API against a real fusedps-server: chunking,
round trips, pulls into models, retries, errors."""

from __future__ import annotations

import threading

import grpc
import pytest
import torch

import os

import fusedps
from fusedps import _chunks
from fusedps.v1 import parameter_service_pb2 as pb


def test_info_and_default_group(client):
    info = client.info()
    # The suite runs on the CPU backend by default, on CUDA with FUSEDPS_TEST_DEVICE=cuda.
    want = "cuda" if os.environ.get("FUSEDPS_TEST_DEVICE", "cpu").startswith("cuda") else "cpu"
    assert info.backend == want
    assert info.max_message_bytes >= 4 << 20
    default = {g.name: g for g in info.param_groups}["default"]
    assert default.lr == pytest.approx(1e-3)
    assert default.betas == (pytest.approx(0.9), pytest.approx(0.999))
    assert default.eps == pytest.approx(1e-8)
    assert default.weight_decay == pytest.approx(1e-2)
    assert default.amsgrad is False and default.maximize is False
    assert default.decoupled_weight_decay is True
    # "default" exists from start (proto/fusedps/v1), so it can be changed before any tensor
    # uses it (to its current lr here, leaving the other tests unaffected).
    assert client.set_hyperparameters("default", lr=1e-3).lr == pytest.approx(1e-3)


def test_register_group_fills_defaults_and_is_idempotent(client):
    g = client.register_param_group("api-group", lr=0.5, weight_decay=0.0)
    assert g.lr == pytest.approx(0.5) and g.weight_decay == 0.0
    assert g.eps == pytest.approx(1e-8) and g.betas[1] == pytest.approx(0.999)
    again = client.register_param_group("api-group", lr=0.5, weight_decay=0.0)
    assert again == g
    with pytest.raises(grpc.RpcError) as e:
        client.register_param_group("api-group", lr=0.25)
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    changed = client.set_hyperparameters("api-group", lr=0.125, betas=(0.5, 0.75))
    assert changed.lr == pytest.approx(0.125) and changed.betas == (0.5, 0.75)
    assert changed.weight_decay == 0.0


def test_small_chunks_round_trip_bit_exact(server_target):
    """A 4 KiB message bound splits tensors into many chunks; values survive exactly."""
    gen = torch.Generator().manual_seed(7)
    tensors = {"chunky/a": torch.randn(10_001, generator=gen),
               "chunky/b": torch.randn(3, 700, generator=gen),
               "chunky/c": torch.randn((), generator=gen),
               "chunky/" + "n" * 200: torch.randn(2000, generator=gen)}
    with fusedps.Client(server_target, max_chunk_bytes=4096) as c:
        r = c.register_model(tensors)
        assert r.tensors_created == 4
        pulled = c.pull_parameters(list(tensors))
        assert set(pulled) == set(tensors)
        for n, t in tensors.items():
            assert pulled[n].shape == t.shape
            assert torch.equal(pulled[n], t), n
        assert pulled.steps == {n: 0 for n in tensors}
        grads = {n: torch.randn(t.shape, generator=gen) for n, t in tensors.items()}
        res = c.push_gradients(grads, grad_dtype="bfloat16")
        assert res.tensors_updated == 4 and res.grad_bytes == 2 * sum(
            t.numel() for t in tensors.values())
        assert c.pull_parameters(list(tensors)).steps == {n: 1 for n in tensors}


def test_pull_into_model_in_place_and_bf16(client):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))
    r = client.register_model(model, prefix="inplace.")
    assert r.tensors_created == 4
    names = ["inplace." + n for n, _ in model.named_parameters()]
    listed = {t.name: t for t in client.list_tensors()}
    for n, p in model.named_parameters():
        info = listed["inplace." + n]
        assert info.shape == tuple(p.shape) and info.numel == p.numel() and info.step == 0
        assert info.param_group == "default"

    model(torch.randn(5, 20)).sum().backward()
    result = client.push_gradients(model, prefix="inplace.")
    assert result.tensors_updated == 4
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    data_ptrs = {n: p.data_ptr() for n, p in model.named_parameters()}
    pulled = client.pull_parameters(model, prefix="inplace.")
    assert pulled.version == result.version == client.last_pulled_version
    for n, p in model.named_parameters():
        assert p.data_ptr() == data_ptrs[n]  # in place
        assert torch.equal(p.detach(), pulled["inplace." + n])
        assert not torch.equal(p.detach(), before[n])  # the step changed it

    bf16 = client.pull_parameters(names, dtype="bfloat16")
    assert bf16.dtype == "bfloat16"
    for n, p in model.named_parameters():
        t = bf16["inplace." + n]
        assert t.dtype == torch.bfloat16
        assert torch.equal(t, p.detach().to(torch.bfloat16)), n

    # Re-registering the same model is a no-op that keeps the server's (stepped) values.
    fresh = torch.nn.Sequential(torch.nn.Linear(20, 30), torch.nn.ReLU(), torch.nn.Linear(30, 4))
    r = client.register_model(fresh, prefix="inplace.")
    assert (r.tensors_created, r.tensors_existing) == (0, 4)
    client.pull_parameters(fresh, prefix="inplace.")
    for (n, p), (_, q) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(p, q), n


def test_push_only_params_with_grad(client):
    model = torch.nn.Linear(4, 3)
    client.register_model(model, prefix="partial.")
    model.weight.grad = torch.ones_like(model.weight)
    r = client.push_gradients(model, prefix="partial.")
    assert r.tensors_updated == 1
    steps = client.pull_parameters(model, prefix="partial.").steps
    assert steps == {"partial.weight": 1, "partial.bias": 0}
    with pytest.raises(ValueError):
        client.push_gradients(model, prefix="partial.", tensors=["partial.bias"])
    model.weight.grad = None
    with pytest.raises(ValueError):
        client.push_gradients(model, prefix="partial.")


def test_retry_is_applied_once(client):
    client.register_model({"retry/w": torch.zeros(8)})
    grads = {"retry/w": torch.ones(8)}
    first = client.push_gradients(grads, client_id="trainer-7", sequence_number=1)
    assert not first.duplicate and first.tensors_updated == 1
    again = client.push_gradients(grads, client_id="trainer-7", sequence_number=1)
    assert again.duplicate and again.version == first.version
    assert client.pull_parameters(["retry/w"]).steps == {"retry/w": 1}
    nxt = client.push_gradients(grads, client_id="trainer-7", sequence_number=2)
    assert not nxt.duplicate and nxt.version == first.version + 1
    assert client.pull_parameters(["retry/w"]).steps == {"retry/w": 2}


def test_empty_tensor(client):
    t = {"empty/a": torch.zeros(0), "empty/b": torch.zeros(4, 0), "empty/c": torch.ones(3)}
    assert client.register_model(t).tensors_created == 3
    r = client.push_gradients({n: torch.ones(x.shape) for n, x in t.items()})
    assert r.tensors_updated == 3 and not r.step_skipped
    pulled = client.pull_parameters(list(t))
    assert pulled["empty/a"].shape == (0,) and pulled["empty/b"].shape == (4, 0)
    assert pulled.steps == {"empty/a": 1, "empty/b": 1, "empty/c": 1}


def test_errors(client):
    client.register_model({"errors/w": torch.zeros(10)})
    with pytest.raises(grpc.RpcError) as e:
        client.push_gradients({"errors/nope": torch.zeros(10)})
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.push_gradients({"errors/w": torch.zeros(11)})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        client.pull_parameters(["errors/nope"])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.register_model({"errors/w": torch.zeros(11)})
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as e:
        client.register_model({"errors/x": torch.zeros(3)}, param_group="no-such-group")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.set_hyperparameters("no-such-group", lr=0.1)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as e:
        client.register_param_group("errors-bad-lr", lr=-1.0)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The failed push changed nothing.
    assert client.pull_parameters(["errors/w"]).steps == {"errors/w": 0}
    with pytest.raises(ValueError):
        client.push_gradients({"errors/w": torch.zeros(10)}, grad_scale=0.0)
    with pytest.raises(ValueError):
        client.push_gradients({"errors/w": torch.zeros(10)}, grad_dtype="int8")
    with pytest.raises(TypeError):
        client.push_gradients({"errors/w": torch.zeros(10, dtype=torch.int32)})


def test_concurrent_pushes_are_serialized(server_target, client):
    """4 trainers push to the same tensor at once: every push is one step, versions unique."""
    client.register_model({"concurrent/w": torch.zeros(1000)})
    versions, errors = [], []

    def trainer(i):
        try:
            with fusedps.Client(server_target) as c:
                for _ in range(10):
                    versions.append(c.push_gradients({"concurrent/w": torch.ones(1000)}).version)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=trainer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(versions) == list(range(min(versions), min(versions) + 40))
    assert client.pull_parameters(["concurrent/w"]).steps == {"concurrent/w": 40}


def test_pull_nothing_is_an_error(client):
    with pytest.raises(ValueError):
        client.pull_parameters([])
    with pytest.raises(ValueError):
        client.pull_parameters(torch.nn.ReLU())


# -- client-side chunk planning (no server needed) ----------------------------------------------

@pytest.mark.parametrize("bound", [2048, 4096, 1 << 20])
@pytest.mark.parametrize("itemsize", [2, 4])
def test_plan_messages_respects_bound_and_covers(bound, itemsize):
    tensors = [("a", 0), ("b" * 256, 5000), ("c", 1), ("d", 300_000), ("e", 17), ("f", 1023)]
    covered = {n: 0 for n, _ in tensors}
    for plan in _chunks.plan_messages(tensors, itemsize, bound):
        msg = pb.PushGradientsRequest()
        for name, start, stop in plan:
            assert start == covered[name] and stop > start
            covered[name] = stop
            msg.chunks.add(tensor=name, offset=start, data=b"\0" * ((stop - start) * itemsize))
        assert msg.ByteSize() <= bound
    assert covered == dict(tensors)
