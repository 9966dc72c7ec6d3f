"""Unit tests of RemoteAdamW(overlap=True)'s choice of data plane (OverlapEngine._open_workspace)
and of open_workspace's device half against made-up server replies. No server, no GPU: the
real ones are tests/e2e/test_device_workspace.py and test_workspace.py."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import List, Optional

import grpc
import pytest
import torch

from fusedps import _cuda_ipc, _overlap, _workspace
from fusedps.v1 import parameter_service_pb2 as pb


def engine(cuda: bool, clients: int = 1, delay: int = 0,
           param_copy: Optional[str] = None) -> _overlap.OverlapEngine:
    """An engine with only what _open_workspace reads; its server keeps ``param_copy``."""
    e = object.__new__(_overlap.OverlapEngine)
    client = SimpleNamespace(info=lambda: SimpleNamespace(param_copy_dtype=param_copy))
    e._route = SimpleNamespace(clients=[client] * clients)
    e._numel = [10, 20]
    e._delay = delay
    e._wire_dtype = torch.float32
    e._cuda = cuda
    e.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    return e


class FakeOpen:
    """open_workspace, answering per memory kind: a workspace, or the reason none."""

    def __init__(self, device: Optional[str] = None, host: Optional[str] = None):
        self.answers = {"device": device, "host": host}
        self.calls: List[dict] = []

    def __call__(self, client, nbytes, *, pin, memory="host", device=None):
        self.calls.append(dict(memory=memory, pin=pin, device=device, nbytes=nbytes))
        why = self.answers[memory]
        if why is None:
            return SimpleNamespace(on_device=memory == "device"), ""
        return None, why


def choose(monkeypatch, e, data_plane, fake, pull="float32", stored="float32"):
    monkeypatch.setattr(_workspace, "open_workspace", fake)
    workspace = e._open_workspace(data_plane, pull, stored)
    kinds = [c["memory"] for c in fake.calls]
    return workspace, kinds


def test_auto_on_a_gpu_takes_a_device_workspace_first(monkeypatch):
    e = engine(cuda=True, delay=1)
    fake = FakeOpen()
    workspace, kinds = choose(monkeypatch, e, "auto", fake)
    assert workspace.on_device and kinds == ["device"] and e.data_plane_reason == ""
    # Two push buffers (delay=1) and the pull's: 3 x 30 fp32 elements, each 64-byte aligned.
    assert fake.calls[0]["nbytes"] == 3 * 128 and fake.calls[0]["device"] == e.device


def test_auto_falls_back_to_a_host_workspace_then_grpc(monkeypatch):
    e = engine(cuda=True)
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(device="FAILED_PRECONDITION: x"))
    assert not workspace.on_device and kinds == ["device", "host"]
    assert e.data_plane_reason == "no device workspace: FAILED_PRECONDITION: x"
    e = engine(cuda=True)
    fake = FakeOpen(device="no GPU", host="--workspace-dir is empty")
    workspace, kinds = choose(monkeypatch, e, "auto", fake)
    assert workspace is None and kinds == ["device", "host"]
    assert fake.calls[1]["pin"] is True  # A host workspace on a GPU is page-locked.
    assert e.data_plane_reason == ("no device workspace: no GPU; no workspace: "
                                   "--workspace-dir is empty")


def test_auto_asks_for_no_device_workspace_on_the_cpu_or_in_another_dtype(monkeypatch):
    e = engine(cuda=False)
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen())
    assert kinds == ["host"] and e.data_plane_reason == ""
    e = engine(cuda=True)
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(), pull="bfloat16")
    assert kinds == ["host"] and not workspace.on_device
    assert e.data_plane_reason == (
        "no device workspace: a bfloat16 pull into a device workspace reads the server's param "
        "copy, and this server keeps none (--param-copy-dtype)")
    e = engine(cuda=True)
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(), stored=None)
    assert kinds == ["host"] and "more than one dtype" in e.data_plane_reason
    # bf16 params stored: the server reads them as fp32 and rounds a bf16 pull on the host
    # (pull_reactor.cc), which it refuses into device memory; RemoteAdamW's default pull of
    # bf16 params is bf16, so that pull would fail at the first step. Whatever the pull dtype
    # and the copy, a host workspace.
    for pull in ("bfloat16", "float32"):
        e = engine(cuda=True, param_copy="bfloat16")
        workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(), pull=pull,
                                  stored="bfloat16")
        assert kinds == ["host"] and "stores the params in bfloat16" in e.data_plane_reason


def test_a_bf16_pull_of_fp32_params_goes_to_the_device_from_the_servers_copy(monkeypatch):
    e = engine(cuda=True, param_copy="bfloat16")
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(), pull="bfloat16")
    assert kinds == ["device"] and workspace.on_device and e.data_plane_reason == ""
    e = engine(cuda=True, param_copy="float16")  # Another copy: no.
    workspace, kinds = choose(monkeypatch, e, "auto", FakeOpen(), pull="bfloat16")
    assert kinds == ["host"]


def test_workspace_and_grpc_keep_their_meaning(monkeypatch):
    e = engine(cuda=True)
    workspace, kinds = choose(monkeypatch, e, "workspace", FakeOpen())
    assert kinds == ["host"] and not workspace.on_device and e.data_plane_reason == ""
    e = engine(cuda=True)
    workspace, kinds = choose(monkeypatch, e, "grpc", FakeOpen())
    assert workspace is None and kinds == [] and e.data_plane_reason == "data_plane='grpc'"
    with pytest.raises(RuntimeError, match="data_plane='workspace': no workspace \\(full\\)"):
        choose(monkeypatch, engine(cuda=True), "workspace", FakeOpen(host="full"))


def test_data_plane_device_raises_with_the_reason(monkeypatch):
    fake = FakeOpen(device="FAILED_PRECONDITION: no GPU")
    with pytest.raises(RuntimeError) as caught:
        choose(monkeypatch, engine(cuda=True), "device", fake)
    assert str(caught.value) == ("data_plane='device': no device workspace: "
                                 "FAILED_PRECONDITION: no GPU")
    assert [c["memory"] for c in fake.calls] == ["device"]  # No host one instead.
    with pytest.raises(RuntimeError, match="param copy"):
        choose(monkeypatch, engine(cuda=True), "device", FakeOpen(), pull="bfloat16")
    with pytest.raises(RuntimeError, match="data_plane='device'.*one server only"):
        choose(monkeypatch, engine(cuda=True, clients=2), "device", FakeOpen())


# -- open_workspace against made-up replies -----------------------------------------------------

class FakeCall:
    def __init__(self, reply):
        self._replies = iter([reply])
        self.cancelled = False

    def __next__(self):
        return next(self._replies)

    def cancel(self):
        self.cancelled = True


class FakeClient:
    def __init__(self, reply):
        self.requests: list = []
        self.call = FakeCall(reply)
        self._native = None
        self._stub = SimpleNamespace(OpenWorkspace=self._open)

    def _open(self, request):
        self.requests.append(request)
        return self.call


def test_an_older_server_answers_a_host_workspace_for_a_device_one():
    client = FakeClient(pb.OpenWorkspaceResponse(workspace_id="a" * 32, path="/dev/shm/x",
                                                 bytes=4096))
    workspace, why = _workspace.open_workspace(client, 4096, pin=False, memory="device",
                                               device=torch.device("cuda", 0))
    assert workspace is None and "older server" in why
    assert client.requests[0].memory == pb.WORKSPACE_MEMORY_DEVICE
    assert client.call.cancelled


def test_a_device_handle_that_cannot_be_opened_here_cancels_the_call():
    reply = pb.OpenWorkspaceResponse(workspace_id="b" * 32, bytes=4096,
                                     memory=pb.WORKSPACE_MEMORY_DEVICE,
                                     cuda_ipc_handle=b"\1" * 64, device_uuid="GPU-" + "0" * 36)
    for device, words in [(torch.device("cpu"), "not a CUDA device"),
                          (None, "no trainer device")]:
        client = FakeClient(reply)
        workspace, why = _workspace.open_workspace(client, 4096, pin=False, memory="device",
                                                   device=device)
        assert workspace is None and why.startswith("cannot open the server's device memory")
        assert words in why and client.call.cancelled
    with pytest.raises(ValueError, match="memory must be one of"):
        _workspace.open_workspace(FakeClient(reply), 4096, pin=False, memory="gpu")


def test_a_refusal_is_returned_with_its_code():
    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.FAILED_PRECONDITION

        def details(self):
            return "the server has no GPU"

    class RefusingCall(FakeCall):
        def __next__(self):
            raise Refused()

    client = FakeClient(None)
    client.call = RefusingCall(None)
    workspace, why = _workspace.open_workspace(client, 4096, pin=False, memory="device",
                                               device=torch.device("cuda", 0))
    assert workspace is None and why == "FAILED_PRECONDITION: the server has no GPU"


def test_the_array_interface_is_numbas_version_2():
    face = _cuda_ipc._Array(0x7F0000000000, 4096).__cuda_array_interface__
    assert face == {"version": 2, "typestr": "|u1", "shape": (4096,), "strides": None,
                    "data": (0x7F0000000000, False)}


def test_the_handle_is_passed_as_its_64_raw_bytes():
    raw = bytes(range(64))
    assert bytes(_cuda_ipc._Handle.from_buffer_copy(raw)) == raw
    assert ctypes.sizeof(_cuda_ipc._Handle) == 64
