"""A model's buffers (issue 35, item 5): BatchNorm's running statistics travel with the model.

A CNN with BatchNorm trained through RemoteAdamW(buffers=model), checkpointed by the server,
restored with fusedps.checkpoint.to_torch and a strict load_state_dict, evaluates exactly as
the live model did (the same logits, so the same accuracy), where the params alone (the
buffers at their initial values) evaluate differently. Buffers come back on a restart and on
resume, with overlap too; bad writes are refused naming the buffer and change nothing.
"""

from __future__ import annotations

import grpc
import pytest
import torch

import fusedps
from fusedps import checkpoint
from fusedps.torch import RemoteAdamW
from fusedps.v1 import parameter_service_pb2 as pb
from fusedps.v1 import parameter_service_pb2_grpc as pb_grpc

from checkpoint_server import ServerProcess


def _data(seed: int, n: int):
    """Two classes of 1x8x8 images: a bright upper or lower half, on a large random offset
    (which BatchNorm's running mean must learn)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, 1, 8, 8, generator=g) + 3.0
    for i in range(n):
        rows = slice(0, 4) if labels[i] == 0 else slice(4, 8)
        x[i, 0, rows] += 1.5
    return x, labels


def _cnn(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.BatchNorm2d(4), torch.nn.ReLU(),
        torch.nn.Flatten(), torch.nn.Linear(4 * 64, 8), torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _train(model, opt, steps: int = 30, batch: int = 32) -> None:
    x, y = _data(1, steps * batch)
    model.train()
    for s in range(steps):
        xb, yb = x[s * batch:(s + 1) * batch], y[s * batch:(s + 1) * batch]
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(xb), yb).backward()
        opt.step()


def _eval(model):
    """(logits, accuracy) on a held-out set, in eval mode (running statistics)."""
    x, y = _data(2, 256)
    model.eval()
    with torch.no_grad():
        logits = model(x)
    return logits, (logits.argmax(1) == y).float().mean().item()


def _buffers(model):
    params = {n for n, _ in model.named_parameters()}
    return {n: t.clone() for n, t in model.state_dict().items() if n not in params}


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_bn_cnn_restored_from_the_server_checkpoint_evaluates_as_the_live_model(
        tmp_path, overlap):
    root = tmp_path / "ckpt"
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        model = _cnn(0)
        opt = RemoteAdamW(model.named_parameters(), lr=0.01, targets=server.target,
                          buffers=model, overlap=overlap)
        _train(model, opt)
        if overlap:
            opt.wait_parameters()
        live_logits, live_accuracy = _eval(model)
        assert live_accuracy > 0.9  # It learned: the statistics below matter.
        assert opt.last_step_timings["buffers_seconds"] > 0
        info = opt.client.info()
        assert info.buffer_count == 6  # 2 BatchNorms: running_mean, running_var, batches.
        assert info.buffer_bytes == 4 * (4 + 4 + 8 + 8) + 2 * 8
        version, path = opt.client.checkpoint()
        opt.close()

    model_state, _ = checkpoint.to_torch(path)
    restored = _cnn(7)
    restored.load_state_dict(model_state, strict=True)
    assert model_state["1.num_batches_tracked"].dtype == torch.int64
    assert model_state["1.num_batches_tracked"].item() == 30
    logits, accuracy = _eval(restored)
    assert torch.equal(logits, live_logits)
    assert accuracy == live_accuracy

    # The params alone, with fresh running statistics: not the live model.
    params_only = _cnn(7)
    params_only.load_state_dict({n: t for n, t in model_state.items()
                                 if n in dict(params_only.named_parameters())}, strict=False)
    stale_logits, _ = _eval(params_only)
    assert not torch.allclose(stale_logits, live_logits, atol=1e-3)


def test_buffers_survive_a_restart_and_a_resumed_run_continues_with_them(tmp_path):
    root = tmp_path / "ckpt"
    with ServerProcess([f"--checkpoint-dir={root}"]) as server:
        model = _cnn(0)
        opt = RemoteAdamW(model.named_parameters(), lr=0.01, targets=server.target,
                          buffers=model)
        _train(model, opt, steps=5)
        expected = _buffers(model)
        opt.client.checkpoint()
        opt.close()
    with ServerProcess([f"--checkpoint-dir={root}"]) as restarted:
        with fusedps.Client(restarted.target) as c:
            pulled = c.pull_buffers()
        assert set(pulled) == set(expected)
        for name, t in expected.items():
            assert pulled[name].dtype == t.dtype and torch.equal(pulled[name], t), name
        resumed = _cnn(3)
        opt = RemoteAdamW(resumed.named_parameters(), lr=0.01, targets=restarted.target,
                          buffers=resumed, on_existing="resume")
        for name, t in _buffers(resumed).items():
            assert torch.equal(t, expected[name]), name
        opt.close()


def test_a_new_model_writes_its_initial_buffers_at_construction(client):
    model = _cnn(0)
    with torch.no_grad():
        model[1].running_mean.fill_(0.25)
    opt = RemoteAdamW(model.named_parameters(), client=client, buffers=model,
                      prefix="init.")
    pulled = client.pull_buffers(["init.1.running_mean", "init.5.num_batches_tracked"])
    assert torch.equal(pulled["init.1.running_mean"], torch.full((4,), 0.25))
    assert pulled["init.5.num_batches_tracked"].item() == 0
    opt.close()


def test_bad_buffer_writes_are_refused_naming_the_buffer_and_change_nothing(client):
    client.write_buffers({"bad.ok": torch.arange(3, dtype=torch.int32)})
    before = client.pull_buffers()
    stub = pb_grpc.ParameterServiceStub(grpc.insecure_channel(client.target))
    cases = [
        (pb.Buffer(name="bad.x", dtype="F12", shape=[1], data=b"\0" * 4), "'bad.x'"),
        (pb.Buffer(name="bad.x", dtype="F32", shape=[2], data=b"\0" * 4), "needs 8"),
        (pb.Buffer(name="", dtype="F32", shape=[], data=b"\0" * 4), "buffer name"),
    ]
    for bad, says in cases:
        with pytest.raises(grpc.RpcError) as e:
            # One good buffer with each bad one: nothing of the request is applied.
            stub.WriteBuffers(pb.WriteBuffersRequest(buffers=[
                pb.Buffer(name="bad.ok", dtype="I32", shape=[1], data=b"\1\0\0\0"), bad]))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert says in e.value.details()
    after = client.pull_buffers()
    assert set(after) == set(before)
    for name in before:
        assert torch.equal(after[name], before[name]), name
    with pytest.raises(fusedps.errors.NotFound, match="no_such"):
        client.pull_buffers(["no_such"])


def test_a_server_restores_the_buffers_of_a_from_torch_checkpoint(tmp_path):
    model = _cnn(0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, steps=3)
    params = [n for n, _ in model.named_parameters()]
    checkpoint.from_torch(model.state_dict(), opt.state_dict(), str(tmp_path),
                          param_names=params)
    with ServerProcess([f"--checkpoint-dir={tmp_path}"]) as server:
        with fusedps.Client(server.target) as c:
            pulled = c.pull_buffers()
            assert c.info().buffer_count == len(_buffers(model))
    for name, t in _buffers(model).items():
        assert pulled[name].dtype == t.dtype and torch.equal(pulled[name], t), name
