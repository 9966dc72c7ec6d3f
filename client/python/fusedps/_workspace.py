"""Same-host workspaces: pushes and pulls whose bytes move through shared memory, not gRPC.

Internal module; fusedps.torch.RemoteAdamW(overlap=True) uses it (``data_plane``). A trainer on
the server's host opens a workspace (proto OpenWorkspace): a file of shared memory that the
server maps too. The trainer maps it, carves its host buffers out of it (the gradients it
stages for a push, the values a pull lands), and page-locks it on a GPU, so that its copies
to and from the device are DMA. A push then names where each piece lies in the workspace
instead of carrying it (TensorChunk.workspace_offset_bytes / workspace_bytes), and a pull asks
the server to write the values there (PullParametersRequest.workspace): the gRPC messages carry
only names and offsets, and the bytes pass through neither gRPC nor the trainer's CPU.

Device workspaces (memory="device"; proto WORKSPACE_MEMORY_DEVICE): the workspace is memory of
the server's GPU, which the server shares through CUDA IPC and this process maps on the same GPU
(fusedps._cuda_ipc): ``buffer`` is then a uint8 CUDA tensor, and what is carved from it are
CUDA tensors. The trainer's copies into and out of it are device-to-device, and so are the
server's: no pinned host memory, no host DMA. Pushes and pulls name places in it as in a host
workspace (the same fields); a pull into it must be of fp32 params, in fp32 or in the dtype
of the server's --param-copy-dtype copy. Nothing here, nor in the C++ client (client/push_transaction.cc and
client/pull_into.cc compare addresses, and a pull's reader claims the very bytes the server
wrote), reads or writes its bytes from the CPU.

Who may: the server gives a workspace only to a trainer-role caller on a loopback or
unix-socket peer, and the file is the server's user's, mode 0600. A trainer that reaches the
server through a tunnel or a port forward looks local to the server but is not: the file is
not on its host (or another file is at that path), which open() detects from the file's device
and inode numbers, and the caller then goes on over gRPC. A device workspace's handle opens
only on the server's host and GPU (cuIpcOpenMemHandle fails elsewhere; another GPU is refused).

With the native transport (fusedps._native) the client's C++ side is told of the workspace
when it opens (Client::SetWorkspace): its pushes and pulls of memory inside it then go by place
on the C++ client's threads, with no Python thread involved; over grpcio, the transaction and
the pulls here do the same in Python.

Lifetimes: the workspace lives while its OpenWorkspace call is open. close() tells the native
client to stop using it, cancels the call (the server then closes it once the pushes and pulls
using it are done) and unpins the mapping; the mapping itself goes when the last tensor carved
from it is freed. A device workspace's close() unmaps it (cuIpcCloseMemHandle) before it
cancels the call: the tensors carved from it must not be used after close(), nor any device
work reading or writing them be still queued (its owner, fusedps._overlap's engine, closes it
last, after a device synchronize). A process that dies closes its connection, and the server
reclaims the workspace the same way.
Thread safety: carve() and close() from one thread; offset_of() and the pulls from any.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import List, Optional, Sequence, Tuple

import grpc
import torch

from fusedps import _cuda_ipc, _dtypes, errors
from fusedps.v1 import parameter_service_pb2 as pb

__all__ = ["Workspace", "open_workspace", "pull_into_workspace"]

_ALIGN = 64  # Bytes; every carved buffer starts at a multiple.
MEMORY_KINDS = ("host", "device")  # open_workspace's memory.


class Workspace:
    """An open workspace of ``size`` bytes, mapped as the uint8 tensor ``buffer``: on the CPU
    (``memory`` "host"), or on the trainer's GPU (``memory`` "device", ``on_device``)."""

    def __init__(self, client, call, reply: "pb.OpenWorkspaceResponse", buffer: torch.Tensor,
                 pinned: bool, memory: str = "host"):
        self._client = client
        self._call = call
        self.id = reply.workspace_id
        self.path = reply.path  # Empty for a device workspace.
        self.size = int(reply.bytes)
        self.memory = memory
        self.on_device = memory == "device"
        self.device = buffer.device
        self.buffer = buffer
        self.address = buffer.data_ptr()
        self._pinned = pinned
        self._cursor = 0
        self._lock = threading.Lock()
        self.closed = False

    def carve(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A 1-D tensor of ``numel`` elements of ``dtype`` in the workspace, 64-byte aligned.
        Raises ValueError when the workspace has no room left."""
        begin = _aligned(self._cursor)
        end = begin + int(numel) * _itemsize(dtype)
        if end > self.size:
            raise ValueError(f"the workspace ({self.size} bytes) has no room for {numel} "
                             f"elements of {dtype} at byte {begin}")
        self._cursor = end
        return self.buffer[begin:end].view(dtype)

    def offset_of(self, address: int, nbytes: int) -> Optional[int]:
        """The byte offset of [address, address + nbytes) in the workspace, or None when it is
        not inside."""
        offset = address - self.address
        if 0 <= offset and offset + nbytes <= self.size:
            return offset
        return None

    def close(self) -> None:
        """Ends the workspace (see the module docstring). Idempotent. A device workspace's
        memory is unmapped here: nothing may use the tensors carved from it afterwards."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
        try:
            native = getattr(self._client, "_native", None)
            if native is not None:
                native.set_workspace(None)
            if self.on_device:
                try:
                    _cuda_ipc.close_handle(self.address, self.device)
                except (_cuda_ipc.IpcError, RuntimeError) as e:  # The process keeps a mapping.
                    warnings.warn(f"the device workspace could not be unmapped: {e}",
                                  RuntimeWarning, stacklevel=2)
            elif self._pinned:
                torch.cuda.cudart().cudaHostUnregister(self.address)
        finally:
            self._call.cancel()


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()  # torch 1.13 has no dtype.itemsize.


def _aligned(nbytes: int) -> int:
    return -(-int(nbytes) // _ALIGN) * _ALIGN


def needed_bytes(buffers: Sequence[Tuple[int, torch.dtype]]) -> int:
    """The size of a workspace that holds buffers of (numel, dtype), carved in any order."""
    return max(1, sum(_aligned(int(numel) * _itemsize(dtype)) for numel, dtype in buffers))


def open_workspace(client, nbytes: int, *, pin: bool, memory: str = "host",
                   device: Optional[torch.device] = None) -> Tuple[Optional[Workspace], str]:
    """Opens a workspace of ``nbytes`` on ``client``'s server, mapped here. memory "host": a
    shared-memory file, page-locked for CUDA with ``pin``; "device": the server GPU's memory,
    mapped on ``device`` (the trainer's CUDA device; ``pin`` is unused). Returns (workspace,
    "") or (None, why not): a server without workspaces (an older one, or
    --workspace-dir=""), a caller that is not on its host or not a trainer, no room
    (RESOURCE_EXHAUSTED: the budget, a full /dev/shm or GPU), a file that is not here; for
    "device" also a server without a GPU (FAILED_PRECONDITION), a server that answers with
    another kind, and a handle this process cannot open (fusedps._cuda_ipc: no CUDA here,
    another host or GPU, MPS). The server is asked first, then the handle is opened. Raises
    FusedPSError for other failures (the server unreachable, say), ValueError for an unknown
    ``memory``."""
    if memory not in MEMORY_KINDS:
        raise ValueError(f"memory must be one of {MEMORY_KINDS}, got {memory!r}")
    kind = pb.WORKSPACE_MEMORY_DEVICE if memory == "device" else pb.WORKSPACE_MEMORY_HOST
    call = client._stub.OpenWorkspace(pb.OpenWorkspaceRequest(bytes=int(nbytes), memory=kind))
    try:
        reply = next(call)
    except grpc.RpcError as e:
        code = e.code()
        if code in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.PERMISSION_DENIED,
                    grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED):
            return None, f"{code.name}: {e.details()}"
        raise errors.from_rpc_error(e) from None
    if reply.memory != kind:  # An older server, which knows one kind: the host's.
        call.cancel()
        return None, (f"the server answered with a {_kind_name(reply.memory)} workspace for a "
                      f"{memory} one: it has no device workspaces (an older server)")
    if memory == "device":
        return _map_device(client, call, reply, device)
    try:
        st = os.stat(reply.path)
    except OSError as e:
        call.cancel()
        return None, f"the workspace's file is not on this host ({e})"
    if (st.st_dev, st.st_ino) != (reply.file_device, reply.file_inode):
        call.cancel()
        return None, f"{reply.path} here is not the server's file: another host"
    try:
        buffer = torch.from_file(reply.path, shared=True, size=int(reply.bytes),
                                 dtype=torch.uint8)
    except (OSError, RuntimeError) as e:
        call.cancel()
        return None, f"cannot map {reply.path}: {e}"
    pinned = False
    if pin:
        code = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), int(reply.bytes), 0)
        if int(code) != 0:
            call.cancel()
            return None, f"cannot page-lock the workspace (cudaHostRegister: {int(code)})"
        pinned = True
    return _opened(client, Workspace(client, call, reply, buffer, pinned)), ""


def _kind_name(memory: int) -> str:
    return "device" if memory == pb.WORKSPACE_MEMORY_DEVICE else "host"


def _map_device(client, call, reply: "pb.OpenWorkspaceResponse",
                device: Optional[torch.device]) -> Tuple[Optional[Workspace], str]:
    """open_workspace's device half: maps the server's reply here, or cancels the call."""
    try:
        if device is None:
            raise _cuda_ipc.IpcError("no trainer device was given")
        _, buffer = _cuda_ipc.open_handle(bytes(reply.cuda_ipc_handle), int(reply.bytes),
                                          torch.device(device), reply.device_uuid)
    except (_cuda_ipc.IpcError, RuntimeError, OSError) as e:
        call.cancel()
        return None, f"cannot open the server's device memory here: {e}"
    return _opened(client, Workspace(client, call, reply, buffer, False, memory="device")), ""


def _opened(client, workspace: Workspace) -> Workspace:
    """Tells the native client of a workspace just opened; returns it."""
    if client._native is not None:  # Its pushes and pulls go through it from now on.
        # Address arithmetic only on the C++ side (the module docstring): a device address too.
        client._native.set_workspace(workspace.id, workspace.address, workspace.size)
    return workspace


def pull_into_workspace(client, workspace: Workspace, targets: Sequence[Tuple[str, torch.Tensor]],
                        wire: str) -> int:
    """Pulls the params of ``targets`` ((name, tensor of the wire dtype inside the workspace:
    CPU, or CUDA for a device workspace, where the server writes no rounded dtype)) at one
    version: the server writes them into the workspace; nothing here touches their bytes.
    Returns the version. Raises FusedPSError as Client.pull_into, ValueError for a target
    outside the workspace, and DataLoss when the reply does not account for every target."""
    names: List[str] = []
    offsets: List[int] = []
    expected = {}
    total = 0
    for name, t in targets:
        nbytes = t.numel() * t.element_size()
        offset = workspace.offset_of(t.data_ptr(), nbytes)
        if offset is None:
            raise ValueError(f"{name}: its target is not in the workspace")
        names.append(name)
        offsets.append(offset)
        expected[name] = (offset, nbytes)
        total += nbytes
    request = pb.PullParametersRequest(tensors=names, dtype=_dtypes.WIRE_CODES[wire],
                                       model=client.model, workspace=workspace.id,
                                       workspace_offsets_bytes=offsets)
    version = None
    try:
        for reply in client._stub.PullParameters(request, timeout=client._timeout(total)):
            if reply.HasField("header"):
                version = reply.header.version
            for chunk in reply.chunks:
                want = expected.pop(chunk.tensor, None)
                if want != (chunk.workspace_offset_bytes, chunk.workspace_bytes):
                    raise errors.error_for(grpc.StatusCode.DATA_LOSS, (
                        f"the pull into the workspace answered for {chunk.tensor!r} at "
                        f"{chunk.workspace_offset_bytes} ({chunk.workspace_bytes} bytes); "
                        f"expected {want}"))
    except grpc.RpcError as e:
        raise errors.from_rpc_error(e) from None
    if version is None or expected:
        raise errors.error_for(grpc.StatusCode.DATA_LOSS, (
            f"the pull into the workspace ended without {sorted(expected)[:4]}"))
    client._observe_version(version)
    return version
