"""Device workspaces (proto OpenWorkspaceRequest.memory = WORKSPACE_MEMORY_DEVICE;
fusedps._workspace, fusedps._cuda_ipc): the server's GPU memory, mapped in the trainer through
CUDA IPC, that pushes and pulls name places in, as in a host workspace.

Everywhere: a server without a GPU (the CPU backend) refuses one with FAILED_PRECONDITION,
open_workspace(memory="device") then returns the reason, and RemoteAdamW(data_plane="device")
raises RuntimeError naming it, as it does for a pull dtype that is not the stored one.
With FUSEDPS_TEST_DEVICE=cuda (a GPU machine; skipped otherwise): one push and one pull through
device memory against torch.optim.AdamW and against the same pull over gRPC, over either
transport, a 16-bit pull into it refused, and "auto" choosing it. RemoteAdamW's recipes and the
delayed update through it are in test_overlap.py (DEVICE_PLANE).
"""

from __future__ import annotations

import grpc
import pytest
import torch

import fusedps
from fusedps import _dtypes, _workspace, errors
from fusedps.torch import RemoteAdamW
from fusedps.v1 import parameter_service_pb2 as pb
from grad_scalers import DEVICE
from server_fixture import running_server

NUMEL = 1000
HYPER = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05)
ON_GPU = pytest.mark.skipif(DEVICE.type != "cuda",
                            reason="a device workspace needs FUSEDPS_TEST_DEVICE=cuda and CUDA")


@pytest.fixture(scope="module")
def cpu_target():
    """A server on its CPU backend, whatever FUSEDPS_TEST_DEVICE says."""
    with running_server(device="cpu") as target:
        yield target


def small_model(seed: int = 0, device=torch.device("cpu")):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 2)).to(device)


def train_steps(model, opt, steps: int) -> None:
    """``steps`` steps of small_model on DEVICE, then waits for the last pull."""
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        model(x.to(DEVICE)).square().sum().backward()
        opt.step()
    opt.wait_parameters()


def test_a_server_without_a_gpu_refuses_a_device_workspace(cpu_target):
    with fusedps.Client(cpu_target) as client:
        client.wait_ready(timeout=10)
        call = client._stub.OpenWorkspace(pb.OpenWorkspaceRequest(
            bytes=4096, memory=pb.WORKSPACE_MEMORY_DEVICE))
        with pytest.raises(grpc.RpcError) as caught:
            next(call)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION, (
            caught.value.code(), caught.value.details())
        # Asked for before anything is opened here: the reason is the server's, also on a
        # machine without CUDA.
        workspace, why = _workspace.open_workspace(client, 4096, pin=False, memory="device",
                                                   device=torch.device("cuda", 0))
        assert workspace is None
        assert why.startswith("FAILED_PRECONDITION: "), why
        # The host kind is still there.
        workspace, why = _workspace.open_workspace(client, 4096, pin=False)
        assert workspace is not None, why
        assert workspace.memory == "host" and not workspace.on_device
        workspace.close()


def test_data_plane_device_raises_naming_the_reason(cpu_target):
    with pytest.raises(RuntimeError, match="data_plane='device'") as caught:
        RemoteAdamW(small_model().named_parameters(), targets=cpu_target, overlap=True,
                    prefix="dev-refused/", data_plane="device")
    assert "FAILED_PRECONDITION" in str(caught.value), str(caught.value)
    # The pull dtype must be the stored one (fp32 here): refused before the server is asked.
    with pytest.raises(RuntimeError, match="data_plane='device'") as caught:
        RemoteAdamW(small_model().named_parameters(), targets=cpu_target, overlap=True,
                    prefix="dev-bf16/", data_plane="device", pull_dtype="bfloat16")
    assert "reads the server's param copy, and this server keeps none" in str(caught.value), (
        str(caught.value))
    # "auto" on the CPU never asks for one: a host workspace, no reason.
    opt = RemoteAdamW(small_model().named_parameters(), targets=cpu_target, overlap=True,
                      prefix="dev-auto-cpu/")
    try:
        assert opt.data_plane_in_use == "workspace" and opt.data_plane_reason == ""
    finally:
        opt.close()


# -- on a GPU ----------------------------------------------------------------------------------

def open_device_or_fail(client, nbytes=1 << 20):
    workspace, why = _workspace.open_workspace(client, nbytes, pin=False, memory="device",
                                               device=DEVICE)
    assert workspace is not None, why
    return workspace


def pull_through(client, workspace, name: str, into: torch.Tensor, wire: str) -> int:
    """A pull into ``into`` (inside the workspace) the way the client's transport does it: the
    C++ client (PullInto, as PipelinedPull) or Python (pull_into_workspace)."""
    if client._native is not None:
        version, _ = client._native.pull_raw([name], [into.data_ptr()], [into.numel()],
                                             dtype=_dtypes.WIRE_CODES[wire],
                                             field=_dtypes.TENSOR_FIELDS["param"])
        return version
    return _workspace.pull_into_workspace(client, workspace, [(name, into)], wire)


@ON_GPU
@pytest.mark.parametrize("transport", ["auto", "grpcio"])
def test_a_push_and_a_pull_move_through_device_memory(server_target, transport):
    name = f"dev-{transport}.w"
    with fusedps.Client(server_target, transport=transport) as client:
        init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(1))
        client.register_param_group(f"dev-{transport}.group", **HYPER)
        client.register_model({name: init}, param_group=f"dev-{transport}.group")
        workspace = open_device_or_fail(client)
        try:
            assert workspace.memory == "device" and workspace.on_device
            assert workspace.path == "" and workspace.buffer.device.type == "cuda"
            grad_values = torch.randn(NUMEL, generator=torch.Generator().manual_seed(2))
            grad = workspace.carve(NUMEL, torch.float32)
            assert grad.is_cuda and workspace.offset_of(grad.data_ptr(), 4 * NUMEL) == 0
            grad.copy_(grad_values.to(grad.device))
            torch.cuda.synchronize(grad.device)  # The server reads it after the write.
            with client.begin_push([(name, NUMEL)], workspace=workspace) as txn:
                txn.write([(0, 0, NUMEL, grad.data_ptr())])
                result = txn.commit()
            assert result.tensors_updated == 1

            ref_param = init.clone().requires_grad_(True)
            ref = torch.optim.AdamW([ref_param], foreach=False, **HYPER)
            ref_param.grad = grad_values.clone()
            ref.step()
            into = workspace.carve(NUMEL, torch.float32)
            into.fill_(float("nan"))
            torch.cuda.synchronize(into.device)
            assert pull_through(client, workspace, name, into, "float32") == result.version
            over_grpc = client.pull_parameters([name])[name]
            assert torch.equal(into.cpu(), over_grpc)  # The same bytes, whichever way.
            torch.testing.assert_close(into.cpu(), ref_param.detach(), rtol=1.3e-6, atol=1e-5)
            # Into device memory only in the stored dtype (fp32 here).
            half = workspace.carve(NUMEL, torch.bfloat16)
            with pytest.raises(errors.FailedPrecondition):
                pull_through(client, workspace, name, half, "bfloat16")
        finally:
            workspace.close()
        assert workspace.closed


@ON_GPU
def test_auto_takes_a_device_workspace_on_the_servers_gpu(server_target):
    """On the trainer's GPU, "auto" takes a device workspace; with a pull dtype the server
    neither stores nor keeps a copy in, a host one, saying why."""
    opt = RemoteAdamW(small_model(device=DEVICE).named_parameters(), targets=server_target,
                      overlap=True, prefix="dev-auto/")
    try:
        assert opt.data_plane_in_use == "device" and opt.data_plane_reason == ""
        assert opt._overlap.workspace.on_device
        # There the whole push takes well under a millisecond: at step(), no gradient hooks.
        assert not opt.push_during_backward_in_use and opt._overlap._hooks is None
    finally:
        opt.close()
    assert opt.data_plane_in_use == "device" and not opt.push_during_backward_in_use
    opt = RemoteAdamW(small_model(device=DEVICE).named_parameters(), targets=server_target,
                      overlap=True, prefix="dev-auto-bf16/", pull_dtype="bfloat16")
    try:
        assert opt.data_plane_in_use == "workspace"
        assert "reads the server's param copy" in opt.data_plane_reason, opt.data_plane_reason
        assert opt.push_during_backward_in_use  # Through host memory: during backward.
    finally:
        opt.close()


@ON_GPU
def test_a_bf16_pull_goes_through_device_memory_from_the_servers_bf16_copy():
    """fp32 params, pull_dtype="bfloat16" and a server with --param-copy-dtype=bf16: the server
    writes its bf16 copy into the device workspace as it is; the model holds what a bf16 pull
    over gRPC gets, bit for bit."""
    with running_server(["--param-copy-dtype=bf16"]) as target:
        model = small_model(device=DEVICE)
        opt = RemoteAdamW(model.named_parameters(), targets=target, overlap=True,
                          prefix="dev-copy/", pull_dtype="bfloat16", **HYPER)
        try:
            assert opt.data_plane_in_use == "device", opt.data_plane_reason
            train_steps(model, opt, 3)
            over_grpc = opt.client.pull_parameters(
                [f"dev-copy/{n}" for n, _ in model.named_parameters()], dtype="bfloat16")
            for name, p in model.named_parameters():
                want = over_grpc[f"dev-copy/{name}"].float()
                assert torch.equal(p.detach().cpu(), want), name
        finally:
            opt.close()


@ON_GPU
def test_device_chunks_are_checked_before_anything_changes(server_target):
    """A gradient through device memory is checked there: a non-finite one skips the step, and
    a misaligned place is INVALID_ARGUMENT naming the field (a misaligned read would be a
    device fault, which takes the server's GPU down). Neither changes the param, and the
    server goes on serving pushes after both."""
    name = "dev-checked.w"
    with fusedps.Client(server_target) as client:
        init = torch.randn(NUMEL, generator=torch.Generator().manual_seed(3))
        client.register_param_group("dev-checked.group", **HYPER)
        client.register_model({name: init}, param_group="dev-checked.group")
        workspace = open_device_or_fail(client)
        try:
            grad = workspace.carve(NUMEL + 1, torch.float32)
            values = torch.randn(NUMEL + 1, generator=torch.Generator().manual_seed(4))
            values[NUMEL // 2] = float("inf")
            grad.copy_(values.to(grad.device))
            torch.cuda.synchronize(grad.device)
            with client.begin_push([(name, NUMEL)], workspace=workspace) as txn:
                txn.write([(0, 0, NUMEL, grad.data_ptr())])
                result = txn.commit()
            assert result.step_skipped and result.tensors_updated == 0
            with pytest.raises(errors.InvalidArgument, match="workspace_offset_bytes = 2 must"):
                with client.begin_push([(name, NUMEL)], workspace=workspace) as txn:
                    txn.write([(0, 0, NUMEL, grad.data_ptr() + 2)])
                    txn.commit()
            assert torch.equal(client.pull_parameters([name])[name], init)
            grad.copy_(torch.ones(NUMEL + 1, device=grad.device))
            torch.cuda.synchronize(grad.device)
            with client.begin_push([(name, NUMEL)], workspace=workspace) as txn:
                txn.write([(0, 0, NUMEL, grad.data_ptr())])
                result = txn.commit()
            assert result.tensors_updated == 1 and not result.step_skipped
            assert not torch.equal(client.pull_parameters([name])[name], init)
        finally:
            workspace.close()


@ON_GPU
def test_a_device_workspace_push_is_one_call_per_step():
    """Through a device workspace a step's push carries only places, so RemoteAdamW sends it as
    one call (begin_push's max_parts=1), not one per stream: the server counts one OK
    PushGradients call per step (fusedps_push_requests_total), with the client's 8 streams."""
    from checkpoint_server import ServerProcess

    server = ServerProcess([])
    try:
        model = small_model(device=DEVICE)
        opt = RemoteAdamW(model.named_parameters(), targets=server.target, overlap=True,
                          prefix="dev-parts/", client_options=dict(streams=8), **HYPER)
        try:
            assert opt.data_plane_in_use == "device", opt.data_plane_reason
            before = server.metrics().value("fusedps_push_requests_total", code="OK")
            train_steps(model, opt, 4)
            after = server.metrics().value("fusedps_push_requests_total", code="OK")
            assert after - before == 4
        finally:
            opt.close()
    finally:
        server.close()
