"""Same-host workspaces (proto OpenWorkspace; fusedps._workspace) against real CPU servers.

A push whose pieces lie in the workspace carries only their places, and the server applies
what the shared memory holds: one AdamW step checked against torch.optim.AdamW, and a pull
into the workspace against the same pull over gRPC, bit for bit. Bad workspace input gets
INVALID_ARGUMENT or NOT_FOUND naming the field and leaves the shard bit-identical. The
workspace's file goes when its holder closes it, and when its holder's process is killed.
A server without workspaces, a file that is not on the caller's host, and a caller that is not
on the server's host all leave the trainer on gRPC. RemoteAdamW's recipes over the workspace
are in test_overlap.py.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import time

import grpc
import pytest
import torch

import fusedps
from fusedps import _push_transaction, _transport, _workspace, errors
from fusedps.torch import RemoteAdamW
from fusedps.v1 import parameter_service_pb2 as pb
from server_fixture import running_server

NUMEL = 1000
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)


@pytest.fixture()
def ws_client(server_target):
    with fusedps.Client(server_target) as client:
        yield client


def open_or_fail(client, nbytes=1 << 20):
    workspace, why = _workspace.open_workspace(client, nbytes, pin=False)
    assert workspace is not None, why
    return workspace


def wait_gone(path: str, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not os.path.exists(path)


def test_a_push_and_a_pull_move_through_the_workspace(ws_client, monkeypatch):
    client = ws_client
    init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
    client.register_param_group("ws.group", **HYPER)
    client.register_model({"ws.w": init}, param_group="ws.group")
    workspace = open_or_fail(client)
    try:
        grad = workspace.carve(NUMEL, torch.float32)
        grad.copy_(torch.randn(NUMEL, generator=torch.Generator().manual_seed(2)))
        sizes = []
        send = _push_transaction.GrpcioTransactionImpl._send
        monkeypatch.setattr(_push_transaction.GrpcioTransactionImpl, "_send",
                            lambda self, m: (sizes.append(len(m)), send(self, m)))
        with client.begin_push([("ws.w", NUMEL)], workspace=workspace) as txn:
            txn.write([(0, 0, NUMEL, grad.data_ptr())])
            result = txn.commit()
        assert result.tensors_updated == 1 and result.grad_bytes == 4 * NUMEL
        # Only places travelled: no message came near the gradient's 4000 bytes.
        assert sizes and max(sizes) < 200, sizes

        ref_param = init.clone().requires_grad_(True)
        ref = torch.optim.AdamW([ref_param], foreach=False, **HYPER)
        ref_param.grad = grad.clone()
        ref.step()
        into = workspace.carve(NUMEL, torch.float32)
        version = _workspace.pull_into_workspace(client, workspace, [("ws.w", into)],
                                                 "float32")
        assert version == result.version
        over_grpc = client.pull_parameters(["ws.w"])["ws.w"]
        assert torch.equal(into, over_grpc)  # The same bytes, whichever way they came.
        torch.testing.assert_close(into, ref_param.detach(), rtol=1.3e-6, atol=1e-5)
        # 16 bits, rounded by the server (it keeps no bf16 copy) into the workspace.
        half = workspace.carve(NUMEL, torch.bfloat16)
        _workspace.pull_into_workspace(client, workspace, [("ws.w", half)], "bfloat16")
        assert torch.equal(half, over_grpc.to(torch.bfloat16))
    finally:
        workspace.close()


def raw_push(client, header, chunks, commit=True):
    """A PushGradients call of one message: header, chunks and the commit."""
    call = _transport.raw_stream_unary(client._channel, "PushGradients",
                                       pb.PushGradientsResponse)
    message = pb.PushGradientsRequest(header=header, chunks=chunks)
    if commit:
        message.commit.SetInParent()
    try:
        return call(iter([message.SerializeToString()]), timeout=20)
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None


def test_bad_workspace_input_names_the_field_and_changes_nothing(ws_client):
    client = ws_client
    client.register_model({"bad.w": torch.randn(NUMEL)})
    workspace = open_or_fail(client, nbytes=8192)
    before = client.pull_parameters(["bad.w"])
    try:
        def header(**kw):
            return pb.PushHeader(tensors=["bad.w"], grad_dtype=pb.DTYPE_FLOAT32,
                                 commit_at_end=True, **kw)

        chunk = dict(tensor="bad.w", workspace_bytes=4 * NUMEL)
        cases = [
            (header(workspace=workspace.id), [pb.TensorChunk(workspace_offset_bytes=8000,
                                                             **chunk)],
             errors.InvalidArgument, "pass the end of the workspace (8192 bytes)"),
            (header(), [pb.TensorChunk(**chunk)],
             errors.InvalidArgument, "names no workspace"),
            (header(workspace="0" * 32), [pb.TensorChunk(**chunk)],
             errors.NotFound, "is not open"),
            (header(workspace=workspace.id),
             [pb.TensorChunk(data=b"\0" * 8, **chunk)],
             errors.InvalidArgument, "both data and workspace_bytes"),
        ]
        for h, chunks, error, words in cases:
            with pytest.raises(error, match=None) as caught:
                raw_push(client, h, chunks)
            assert words in str(caught.value), str(caught.value)

        def pull(offsets, names=("bad.w",)):
            request = pb.PullParametersRequest(tensors=list(names), workspace=workspace.id,
                                               workspace_offsets_bytes=offsets)
            try:
                return list(client._stub.PullParameters(request, timeout=20))
            except grpc.RpcError as e:
                raise errors.from_rpc_error(e) from None

        client.register_model({"bad.v": torch.randn(4)})
        for offsets, names, words in [
                ([2], ("bad.w",), "workspace_offsets_bytes[0] = 2 must be a multiple"),
                ([6000], ("bad.w",), "pass the end of the workspace"),
                ([], ("bad.w",), "workspace_offsets_bytes has 0 entries"),
                ([0, 3984], ("bad.w", "bad.v"), "workspace_offsets_bytes[1] overlaps"),
        ]:
            with pytest.raises(errors.InvalidArgument) as caught:
                pull(offsets, names)
            assert words in str(caught.value), str(caught.value)
        # Disjoint regions are fine.
        assert pull([0, 4000], ("bad.w", "bad.v"))
    finally:
        workspace.close()
    after = client.pull_parameters(["bad.w"])
    assert after.version == before.version
    assert torch.equal(after["bad.w"], before["bad.w"])


def test_closing_the_workspace_removes_it_and_its_name_no_longer_works(ws_client):
    client = ws_client
    client.register_model({"close.w": torch.zeros(8)})
    workspace = open_or_fail(client)
    assert os.path.exists(workspace.path)
    workspace.close()
    assert wait_gone(workspace.path)
    with pytest.raises(errors.NotFound):
        raw_push(client, pb.PushHeader(tensors=["close.w"], grad_dtype=pb.DTYPE_FLOAT32,
                                       workspace=workspace.id),
                 [pb.TensorChunk(tensor="close.w", workspace_bytes=32)], commit=False)


def test_a_killed_trainer_leaves_no_workspace_behind(server_target):
    script = textwrap.dedent(f"""
        import sys, time, fusedps
        from fusedps import _workspace
        client = fusedps.Client({server_target!r})
        workspace, why = _workspace.open_workspace(client, 1 << 20, pin=False)
        print(workspace.path if workspace else "none: " + why, flush=True)
        time.sleep(600)
    """)
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ))
    try:
        path = child.stdout.readline().strip()
        assert path.startswith("/"), path
        assert os.path.exists(path)
        child.kill()  # No close(): the process just ends.
        child.wait(timeout=30)
        assert wait_gone(path), f"{path} is still there"
    finally:
        if child.poll() is None:
            child.kill()
        child.stdout.close()


def small_model(seed: int = 0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def test_a_server_without_workspaces_leaves_the_trainer_on_grpc():
    with running_server(["--workspace-dir="]) as target:
        model = small_model()
        opt = RemoteAdamW(model.named_parameters(), targets=target, overlap=True)
        try:
            assert opt.data_plane_in_use == "grpc"
            assert "--workspace-dir is empty" in opt._overlap.data_plane_reason
        finally:
            opt.close()
        with pytest.raises(RuntimeError, match="data_plane='workspace'"):
            RemoteAdamW(small_model().named_parameters(), targets=target, overlap=True,
                        prefix="again/", data_plane="workspace")


def test_a_file_that_is_not_here_is_not_used(ws_client, monkeypatch):
    """The caller reached the server through a tunnel: the path names nothing here, or another
    file. It goes on over gRPC, and the server closes the workspace it made."""
    made = []
    real_stat = os.stat

    def elsewhere(path, *a, **kw):
        made.append(path)
        raise FileNotFoundError(path)

    monkeypatch.setattr(_workspace.os, "stat", elsewhere)
    workspace, why = _workspace.open_workspace(ws_client, 4096, pin=False)
    assert workspace is None and "not on this host" in why
    monkeypatch.setattr(_workspace.os, "stat", real_stat)
    assert wait_gone(made[0])

    monkeypatch.setattr(_workspace.os, "stat",
                        lambda path, *a, **kw: os.stat_result((0o600, 1, 2, 1, 0, 0, 0, 0, 0, 0)))
    workspace, why = _workspace.open_workspace(ws_client, 4096, pin=False)
    assert workspace is None and "another host" in why


def non_loopback_address():
    """This machine's address on its default route, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: nothing is sent.
            address = s.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def test_a_caller_from_another_address_gets_no_workspace():
    address = non_loopback_address()
    if address is None:
        pytest.skip("no non-loopback address to call from")
    with running_server(["--listen=0.0.0.0:0"]) as target:
        port = target.rsplit(":", 1)[1]
        with fusedps.Client(f"{address}:{port}") as client:
            workspace, why = _workspace.open_workspace(client, 4096, pin=False)
            assert workspace is None
            assert why.startswith("PERMISSION_DENIED") and "server's host" in why, why
        with fusedps.Client(target) as local:  # The control: from loopback it works.
            workspace = open_or_fail(local, 4096)
            workspace.close()


def test_the_data_plane_is_still_told_after_close(server_target):
    """Scripts print it at the end, after closing the optimizer (train_gpt.py does)."""
    opt = RemoteAdamW(small_model().named_parameters(), targets=server_target, overlap=True,
                      prefix="told/")
    assert opt.data_plane_in_use == "workspace" and opt.data_plane_reason == ""
    opt.close()
    assert opt.data_plane_in_use == "workspace" and opt.data_plane_reason == ""
    opt = RemoteAdamW(small_model().named_parameters(), targets=server_target, overlap=True,
                      prefix="told-grpc/", data_plane="grpc")
    opt.close()
    assert opt.data_plane_in_use == "grpc" and opt.data_plane_reason == "data_plane='grpc'"


def test_open_workspaces_show_in_the_metrics():
    from checkpoint_server import ServerProcess

    server = ServerProcess([])
    try:
        with fusedps.Client(server.target) as client:
            assert server.metrics().value("fusedps_workspaces") == 0
            workspace = open_or_fail(client, 12345)
            m = server.metrics()
            assert m.value("fusedps_workspaces") == 1
            assert m.value("fusedps_workspace_bytes") == 12345
            workspace.close()
            assert wait_gone(workspace.path)
            assert server.metrics().value("fusedps_workspace_bytes") == 0
    finally:
        server.close()


@pytest.mark.parametrize("transport", ["native", "grpcio"])
def test_max_parts_caps_the_calls_a_push_travels_as(transport):
    """begin_push(max_parts=N) sends the push as at most N calls (one per stream by default):
    the server counts each call (fusedps_push_requests_total), and the step is the same one
    step, against torch.optim.AdamW. Through the workspace and without it."""
    from checkpoint_server import ServerProcess

    server = ServerProcess([])
    try:
        with fusedps.Client(server.target, streams=3, transport=transport) as client:
            init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
            client.register_param_group("parts.group", **HYPER)
            client.register_model({"parts.w": init}, param_group="parts.group")
            ref_param = init.clone().requires_grad_(True)
            ref = torch.optim.AdamW([ref_param], foreach=False, **HYPER)
            workspace = open_or_fail(client)
            try:
                grad = workspace.carve(NUMEL, torch.float32)
                for step, (max_parts, via, calls) in enumerate(
                        [(None, workspace, 3), (1, workspace, 1), (2, None, 2), (1, None, 1),
                         (5, workspace, 3)]):
                    grad.copy_(torch.randn(NUMEL, generator=torch.Generator().manual_seed(step)))
                    ok_before = server.metrics().value("fusedps_push_requests_total", code="OK")
                    with client.begin_push([("parts.w", NUMEL)], workspace=via,
                                           max_parts=max_parts) as txn:
                        txn.write([(0, 0, NUMEL, grad.data_ptr())])
                        result = txn.commit()
                    assert result.tensors_updated == 1 and result.grad_bytes == 4 * NUMEL
                    ok_after = server.metrics().value("fusedps_push_requests_total", code="OK")
                    assert ok_after - ok_before == calls, (max_parts, via is not None)
                    ref_param.grad = grad.clone()
                    ref.step()
                with pytest.raises(ValueError, match="max_parts must be at least 1"):
                    client.begin_push([("parts.w", NUMEL)], max_parts=0)
            finally:
                workspace.close()
            pulled = client.pull_parameters(["parts.w"])["parts.w"]
            torch.testing.assert_close(pulled, ref_param.detach(), rtol=1.3e-6, atol=1e-5)
    finally:
        server.close()
