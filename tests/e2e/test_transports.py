"""Both transports of the Python client (the native C++ client, and grpcio), with 1 and 4
streams, against a real server: pushes in parts give torch.optim.AdamW's step, pulls land in
the model's tensors, and errors keep their status."""

from __future__ import annotations

import grpc
import pytest
import torch

import fusedps
from fusedps import _native

TRANSPORTS = ["grpcio", pytest.param("native", marks=pytest.mark.skipif(
    _native.library() is None, reason=f"no native library: {_native.load_error()}"))]


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(96, 700), torch.nn.Linear(700, 5))


@pytest.mark.parametrize("streams", [1, 4])
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_push_in_parts_and_pull_match_torch(server_target, transport, streams, grad_dtype):
    prefix = f"{transport}.{streams}.{grad_dtype}."
    model, reference = _model(0), _model(0)
    with fusedps.Client(server_target, transport=transport, streams=streams,
                        max_chunk_bytes=1 << 16) as client:
        assert client.transport_in_use == transport
        client.register_model(model, prefix=prefix)
        optimizer = torch.optim.AdamW(reference.parameters())
        for step in range(1, 4):
            x = torch.randn(8, 96, generator=torch.Generator().manual_seed(step))
            model.zero_grad()
            model(x).square().mean().backward()
            # torch steps on the very grads the server gets (rounded to bf16 on that wire).
            for p, q in zip(model.parameters(), reference.parameters()):
                q.grad = p.grad.to(getattr(torch, grad_dtype)).float()
            result = client.push_gradients(model, grad_dtype=grad_dtype, prefix=prefix)
            assert not result.step_skipped and result.tensors_updated == 4
            optimizer.step()
            client.pull_parameters(model, prefix=prefix)  # into the model's own tensors
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
        # A bf16 copy of the model gets the same values, rounded once: from an fp32 pull (the
        # returned tensors hold the fp32 values) and from a bf16 one (the wire's bytes).
        for wire in ("float32", "bfloat16"):
            half = _model(1).to(torch.bfloat16)
            pulled = client.pull_parameters(half, dtype=wire, prefix=prefix)
            for (name, p), q in zip(half.named_parameters(), model.parameters()):
                assert torch.equal(p, q.detach().bfloat16()), name
                want = q.detach() if wire == "float32" else p.detach()
                assert torch.equal(pulled[prefix + name], want), name


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_a_pull_writes_straight_into_a_float32_cpu_tensor(server_target, transport):
    with fusedps.Client(server_target, transport=transport) as client:
        client.register_model({"direct.w": torch.arange(12.0).reshape(3, 4)})
        target = torch.zeros(3, 4)
        pulled = client.pull_parameters({"direct.w": target})
        assert torch.equal(target, torch.arange(12.0).reshape(3, 4))
        assert pulled["direct.w"].data_ptr() == target.data_ptr()  # no copy of its own


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_pull_into_writes_raw_elements_into_flat_views(server_target, transport, wire):
    """pull_into: each tensor's elements, whatever its shape, into a flat view of one buffer
    (as RemoteAdamW(overlap=True) lands its pulls); a view of another element count is a
    ValueError naming the tensor."""
    with fusedps.Client(server_target, transport=transport, streams=2) as client:
        values = {f"into.{transport}.{wire}.a": torch.randn(3, 4),
                  f"into.{transport}.{wire}.b": torch.randn(5)}
        client.register_model(values)
        dtype = getattr(torch, wire)
        buffer = torch.full((17,), -1.0, dtype=dtype)
        (a, va), (b, vb) = values.items()
        version, steps = client.pull_into([(a, buffer[:12]), (b, buffer[12:])], wire, stream=1)
        assert version == client.info().version and steps == {a: 0, b: 0}
        assert torch.equal(buffer, torch.cat([va.flatten(), vb]).to(dtype))
        with pytest.raises(ValueError, match=b.replace(".", r"\.")):
            client.pull_into([(b, buffer[:4])], wire)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_errors_keep_their_status_on_both_transports(server_target, transport):
    with fusedps.Client(server_target, transport=transport) as client:
        client.register_model({f"err.{transport}": torch.zeros(6)})
        with pytest.raises(fusedps.errors.NotFound, match="no_such"):
            client.push_gradients({"no_such": torch.zeros(3)})
        with pytest.raises(fusedps.errors.InvalidArgument) as info:
            client.push_gradients({f"err.{transport}": torch.zeros(5)})
        assert info.value.code().name == "INVALID_ARGUMENT"
        with pytest.raises(ValueError, match="server shape"):
            client.pull_parameters({f"err.{transport}": torch.zeros(2, 3)})


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_wait_ready_connects_every_stream(server_target, transport):
    """wait_ready connects every stream's connection (grpcio's and the native client's), and
    times out against a port nobody listens on."""
    import socket

    with fusedps.Client(server_target, streams=3, transport=transport) as c:
        c.wait_ready(timeout=10)
        c.pull_parameters(None)  # Every connection is up: no call meets one being made.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    with fusedps.Client(dead, streams=2, transport=transport) as c:
        with pytest.raises(fusedps.errors.Unavailable, match=f"{dead}.*refused"):
            c.wait_ready(timeout=0.3)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_prepared_pieces_are_written_as_pieces_are(server_target, transport):
    """PushTransaction.prepare checks and lays out pieces once; write_prepared queues them on
    later pushes of the same tensors (as RemoteAdamW(overlap=True)'s worker does every step).
    Three pushes of new values in the same host memory give torch.optim.AdamW's steps; pieces
    outside their tensors, and pieces prepared for other tensors, are refused."""
    hyper = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
    names = [f"prep.{transport}.a", f"prep.{transport}.b"]
    init = {names[0]: torch.randn(700), names[1]: torch.randn(300)}
    grads = torch.empty(1000)  # The host memory every push reads: a's then b's elements.
    base, f32 = grads.data_ptr(), 4
    pieces = [(0, 0, 350, base), (0, 350, 350, base + 350 * f32), (1, 0, 300, base + 700 * f32)]
    with fusedps.Client(server_target, transport=transport) as client:
        client.register_param_group(f"prep.{transport}", **hyper)
        client.register_model(init, param_group=f"prep.{transport}")
        reference = [t.clone().requires_grad_(True) for t in init.values()]
        optimizer = torch.optim.AdamW(reference, foreach=False, **hyper)
        tensors = [(names[0], 700), (names[1], 300)]
        prepared = None
        for step in range(3):
            grads.copy_(torch.randn(1000, generator=torch.Generator().manual_seed(step)))
            with client.begin_push(tensors) as txn:
                if prepared is None:
                    prepared = txn.prepare(pieces)
                txn.write_prepared(prepared)
                result = txn.commit()
                with pytest.raises(RuntimeError, match="committed or cancelled"):
                    txn.write_prepared(prepared)
            assert result.tensors_updated == 2 and result.grad_bytes == 1000 * f32
            reference[0].grad, reference[1].grad = grads[:700].clone(), grads[700:].clone()
            optimizer.step()
            pulled = client.pull_parameters(names)
            for name, want in zip(names, reference):
                torch.testing.assert_close(pulled[name], want.detach(), rtol=1.3e-6, atol=1e-5)

        with client.begin_push(tensors) as txn:
            with pytest.raises(ValueError, match="tensor number 2; the push has 2"):
                txn.prepare([(2, 0, 1, base)])
            with pytest.raises(ValueError, match=rf"\[600, 800\) of tensor '{names[0]}'"):
                txn.prepare([(0, 600, 200, base)])
        with client.begin_push([(names[1], 300), (names[0], 700)]) as other:
            with pytest.raises(ValueError, match="prepared for a push of other tensors"):
                other.write_prepared(prepared)
        # Nothing of the refused pushes was applied.
        pulled = client.pull_parameters(names)
        for name, want in zip(names, reference):
            torch.testing.assert_close(pulled[name], want.detach(), rtol=1.3e-6, atol=1e-5)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pull_into_reads_the_clients_own_model(server_target, transport):
    """pull_into reads the model its client names (over grpcio it read "default" before)."""
    import fusedps

    with fusedps.Client(server_target) as admin:
        admin.create_model("pull-into-model")
    with fusedps.Client(server_target, transport=transport, model="pull-into-model") as client:
        client.register_model({f"only.here.{transport}": torch.arange(6.0)})
        into = torch.zeros(6)
        client.pull_into([(f"only.here.{transport}", into)])
        assert torch.equal(into, torch.arange(6.0))
